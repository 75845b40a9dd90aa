"""Acceptance before work: a new node, or one back from repair, runs the health-check Job before it takes pods.

The node carries ``kmend.io/unvalidated:NoSchedule`` until the Job passes; the check is journaled as a plan
(taint, validate, accept), so each node's results are kept with every other plan for it. A node whose check
failed stays tainted until an operator releases it again. Pure: nodes and plans in, plans out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from healer.cluster import NodeInfo
from healer.keys import FAULT_TAINT_KEY, UNVALIDATED_TAINT_KEY
from healer.policy_file import PolicyFile
from healer.records import FINAL_PLAN_STATES, ActionStep, Mode, Plan, PlanState, StepKind, unique_plan_id

POLICY_PREFIX = "acceptance/"
"""Policy name prefix of acceptance plans."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """A node that must pass the health check, and why."""

    node: str
    """Node name."""
    why: str
    """``new`` (appeared or registered tainted) or ``repaired`` (released after repair)."""


def is_acceptance(plan: Plan) -> bool:
    """Whether a plan is a node's acceptance check."""
    return plan.policy.startswith(POLICY_PREFIX)


def candidates(nodes: Sequence[NodeInfo], known: set[str] | None, plans: Iterable[Plan],
               policy: PolicyFile) -> list[Candidate]:
    """Nodes that need a check now: tainted unvalidated (or newly appeared) with no check running or failed.

    `known` is the node set seen before (None on the first look: the fleet that already runs is trusted).
    """
    latest: dict[str, Plan] = {}
    for p in plans:
        if is_acceptance(p) and p.node and (p.node not in latest or p.created_at >= latest[p.node].created_at):
            latest[p.node] = p
    out = []
    for n in nodes:
        taint = n.taint(UNVALIDATED_TAINT_KEY)
        new = known is not None and n.name not in known and policy.validation.new_nodes
        if taint is None and not new:
            continue
        if n.taint(FAULT_TAINT_KEY) is not None:
            continue  # a quarantined node is validated by its own plan
        last = latest.get(n.name)
        if last is not None and (last.state not in FINAL_PLAN_STATES or last.state is PlanState.FAILED):
            continue  # running, or failed: it stays out until an operator releases it
        if last is not None and last.state is PlanState.SUCCEEDED and taint is None:
            continue
        out.append(Candidate(n.name, taint.value if taint is not None and taint.value else "new"))
    return out


def acceptance_plan(c: Candidate, policy: PolicyFile, now: float) -> Plan:
    """Taint, run the health-check Job with the policy's checks, then lift the taint."""
    pid = unique_plan_id("plan-accept-")
    v, d = policy.validation, policy.defaults
    steps = (
        ActionStep(f"{pid}-0", StepKind.TAINT, c.node, {"key": UNVALIDATED_TAINT_KEY, "value": c.why,
                                                        "effect": "NoSchedule"}),
        ActionStep(f"{pid}-1", StepKind.VALIDATE, c.node, {
            "image": d.health_check_image, "timeout_s": str(v.timeout_s), "dcgm_level": str(v.dcgm_level),
            "nccl_min_busbw_gbps": f"{v.nccl_min_busbw_gbps:g}", "ib_loopback": str(v.ib_loopback).lower()}),
        ActionStep(f"{pid}-2", StepKind.ACCEPT, c.node, {"why": c.why}),
    )
    return Plan(id=pid, incident_id="", policy=f"{POLICY_PREFIX}{c.why}", mode=Mode.AUTO, steps=steps,
                reason=f"{c.node} is {'new' if c.why == 'new' else 'back from repair'}: health check before work",
                node=c.node, fault_class="acceptance", created_at=now)
