"""A node's remediation history, read from the plan journal: attempts per repair kind, lemon nodes. Pure."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from healer.acceptance import is_acceptance
from healer.policy_file import RepairKind, Safety
from healer.records import Plan, StepKind, StepState
from healer.safety import OPERATOR_POLICY_PREFIX


def repair_attempts(plans: Iterable[Plan], since: float, gpu: str | None = None) -> dict[RepairKind, int]:
    """Repairs of each kind that plans created since `since` started; resets count only on `gpu` when given."""
    out: dict[RepairKind, int] = {}
    for p in plans:
        if p.created_at < since:
            continue
        for s in p.steps:
            if s.kind is not StepKind.REPAIR or s.state in (StepState.PENDING, StepState.SKIPPED):
                continue
            kind = RepairKind(s.params.get("kind", RepairKind.REPLACE.value))
            if kind is RepairKind.RESET_GPU and gpu and gpu not in (s.params.get("gpu"), s.params.get("pci")):
                continue
            out[kind] = out.get(kind, 0) + 1
    return out


def hardware_faults(plans: Iterable[Plan], since: float) -> list[float]:
    """When kmend quarantined the node for a fault (operators' quarantines aside), oldest first."""
    return sorted(p.created_at for p in plans
                  if p.created_at >= since and not p.policy.startswith(OPERATOR_POLICY_PREFIX)
                  and any(s.kind is StepKind.CORDON and s.state is StepState.SUCCEEDED for s in p.steps))


def mtbi_s(faults: list[float]) -> float | None:
    """Mean time between incidents over the faults seen (None with fewer than two)."""
    if len(faults) < 2:
        return None
    return (faults[-1] - faults[0]) / (len(faults) - 1)


def lemon_reason(faults: list[float], safety: Safety, *, counting_this_one: bool) -> str:
    """Why the node is a lemon ('' when it is not): repeated hardware faults within the lemon window."""
    n = len(faults) + (1 if counting_this_one else 0)
    if n < safety.lemon_faults:
        return ""
    return (f"lemon node: {n} hardware faults within {safety.lemon_window_s / 86400:.0f} days "
            f"(limit {safety.lemon_faults})")


def node_history(plans: list[Plan], safety: Safety, now: float, gpu: str | None) -> tuple[dict[RepairKind, int], str]:
    """Attempts per repair kind within the attempts window, and the lemon verdict counting the new incident."""
    attempts = repair_attempts(plans, now - safety.attempts_window_s, gpu)
    faults = hardware_faults(plans, now - safety.lemon_window_s)
    return attempts, lemon_reason(faults, safety, counting_this_one=True)


def node_records(plans: Iterable[Plan], s: Safety, now: float) -> dict[str, dict[str, Any]]:
    """Per node: the last health check, hardware faults and MTBI within the lemon window, the lemon verdict."""
    by_node: dict[str, list[Plan]] = {}
    for p in plans:
        if p.node:
            by_node.setdefault(p.node, []).append(p)
    out: dict[str, dict[str, Any]] = {}
    for node, mine in by_node.items():
        checks = sorted((p for p in mine if is_acceptance(p)), key=lambda p: p.created_at)
        faults = hardware_faults(mine, now - s.lemon_window_s)
        out[node] = {
            "validation": None if not checks else {
                "state": checks[-1].state.value, "plan": checks[-1].id, "at": checks[-1].created_at,
                "result": next((x.result for x in checks[-1].steps if x.kind is StepKind.VALIDATE), ""),
                "history": [{"plan": p.id, "state": p.state.value, "at": p.created_at} for p in checks[-10:]]},
            "faults_in_window": len(faults), "mtbi_s": mtbi_s(faults),
            "lemon": lemon_reason(faults, s, counting_this_one=False) or None,
        }
    return out
