"""What becomes of a plan's unfinished steps when an operator decides it (a reject, or a release of its node).

A decided plan never runs again, so none of its steps may stay ``pending``, ``waiting`` or ``running``: a step
waiting on the node agent (a GPU reset, a checkpoint search, a GPU report) would otherwise leave its request open,
and the agent could still reset a GPU of a plan the operator rejected. Each unfinished step ends, naming the decision;
the requests the plan's steps opened are withdrawn by the caller (``request_ids``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from healer.gpu_report import SUFFIX as GPU_REPORT_SUFFIX
from healer.records import ActionStep, Plan, PlanState, StepState

REQUEST_SUFFIXES = ("", "-find", GPU_REPORT_SUFFIX)
"""A step's requests' ids are its own id and these: a repair, a checkpoint search, the evidence's GPU report."""


def decision(plan: Plan) -> str:
    """Who decided and how (the last part of the plan's reason: "rejected by alice", "node released by bob")."""
    return plan.reason.rsplit(" | ", 1)[-1]


def _how(plan: Plan) -> str:
    """How the plan ended, in words: "the plan was rejected (rejected by alice)", "the plan failed (step drain …)"."""
    ended_as = "failed" if plan.state is PlanState.FAILED else f"was {plan.state.value}"
    return f"the plan {ended_as} ({decision(plan)})"


def ended(step: ActionStep, plan: Plan) -> ActionStep:
    """The step as the ended ``plan`` (decided by an operator, cancelled by a hand uncordon, failed) leaves it: a
    pending step is skipped (it never ran), a waiting one cancelled (what it had done is kept in its result); the
    others as they are (a running one is ended by whoever runs it)."""
    if step.state is StepState.PENDING:
        return replace(step, state=StepState.SKIPPED, result=f"not run: {_how(plan)}")
    if step.state is StepState.WAITING:
        return replace(step, state=StepState.CANCELLED,
                       result=f"cancelled: {_how(plan)}; it was waiting: {step.result}"[:2000])
    return step


def request_ids(steps: Iterable[ActionStep]) -> list[str]:
    """Ids of the requests these steps may have opened for the node agent or the platform."""
    return [s.id + suffix for s in steps for suffix in REQUEST_SUFFIXES]
