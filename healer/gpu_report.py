"""The faulty GPU's ``nvidia-smi -q`` report, asked of the node's agent and kept with the plan's evidence.

Asked once the plan has quarantined its node (a request never delays a cordon); the agent answers with the whole
report, which joins the evidence step's outputs: ECC counters, retired pages, row remapping, clocks and throttle
reasons as the node saw them before a reset or a replacement makes them unreadable. A node without ``nvidia-smi``
answers why, and that is kept instead.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from healer.records import ActionStep, Mode, Plan, StepKind
from healer.steps.base import RepairRequest

GPU_REPORT = "gpu_query"
"""Node request kind: the agent's ``nvidia-smi -q -i <GPU>`` for the GPU a plan's incident names."""
SUFFIX = "-smi"
"""A GPU report request's id: its plan's evidence step id and this."""


def report_request(plan: Plan) -> RepairRequest | None:
    """The request for the GPU the plan's incident names, or None (no GPU named, no node, a dry run)."""
    ev = next((s for s in plan.steps if s.kind is StepKind.EVIDENCE), None)
    if ev is None or not plan.node or plan.mode is Mode.DRY_RUN or not (ev.params.get("gpu") or ev.params.get("pci")):
        return None
    return RepairRequest(ev.id + SUFFIX, plan.node, GPU_REPORT,
                         {"gpu": ev.params.get("gpu", ""), "pci": ev.params.get("pci", "")})


def plan_of(request_id: str) -> str:
    """The id of the plan a GPU report request belongs to."""
    return request_id.removesuffix(SUFFIX).rsplit("-", 1)[0]


def with_report(plan: Plan, request_id: str, state: str, result: str) -> ActionStep | None:
    """The plan's evidence step with the agent's answer in its outputs (``nvidia_smi_q``, or why not)."""
    step = next((s for s in plan.steps if s.id == request_id.removesuffix(SUFFIX)), None)
    if step is None:
        return None
    return replace(step, outputs={**step.outputs, _key(state): result})


def _key(state: str) -> str:
    """The evidence output that keeps an answer in ``state``."""
    return "nvidia_smi_q" if state == "done" else "nvidia_smi_q_error"


class PlanJournal(Protocol):
    """Where plans are read and a step's state saved (the service's store)."""

    def get_plan(self, plan_id: str) -> Plan | None:
        """One plan with its journaled step states."""
        ...

    def save_step(self, plan_id: str, step: ActionStep) -> None:
        """Durably record one step's state."""
        ...


def keep(journal: PlanJournal, request_id: str, state: str, result: str) -> tuple[str, dict[str, str]] | None:
    """Save the agent's answer into its plan's evidence step: the step's id and the outputs added (None when the plan
    or step is gone)."""
    plan = journal.get_plan(plan_of(request_id))
    if plan is None or (step := with_report(plan, request_id, state, result)) is None:
        return None
    journal.save_step(plan.id, step)
    return step.id, {_key(state): result}
