"""Policy: which plan (and mode) an incident gets. Pure: incident in, plan out."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from analyzer.records import Action, Incident
from healer.records import ActionStep, Mode, Plan, StepKind

FAULT_TAINT_KEY = "kmend.io/fault"
"""Taint key kmend puts on quarantined nodes; the value is the fault class."""
CONDITION_TYPE = "KmendHealthy"
"""Node condition kmend owns; ``False`` while a fault is open on the node."""

QUARANTINE_ACTIONS = frozenset({Action.RESET_GPU, Action.REBOOT_NODE, Action.REPLACE_NODE})
"""Recommended actions that take the node out of scheduling first."""


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Knobs of the default policy."""

    dry_run: bool = False
    """Plan everything, change nothing."""
    require_approval: bool = False
    """Quarantine plans wait for an operator."""


def plan_id_for(incident: Incident) -> str:
    """One plan per incident and root cause: a re-rooted incident gets a new plan."""
    key = f"{incident.id}/{incident.root_finding.id}"
    return "plan-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def _quarantine_steps(pid: str, incident: Incident, node: str) -> list[ActionStep]:
    fc = incident.fault_class.value
    what = f"{fc} on {node}"
    if incident.root_cause.gpu or incident.root_cause.pci:
        what += f" (GPU {incident.root_cause.gpu or incident.root_cause.pci})"
    message = f"kmend incident {incident.id}: {what}; {incident.root_finding.message[:200]}"
    return [
        ActionStep(f"{pid}-0", StepKind.CORDON, node),
        ActionStep(f"{pid}-1", StepKind.TAINT, node,
                   {"key": FAULT_TAINT_KEY, "value": fc, "effect": "NoSchedule"}),
        ActionStep(f"{pid}-2", StepKind.CONDITION, node,
                   {"type": CONDITION_TYPE, "status": "False", "reason": _camel(fc), "message": message}),
        ActionStep(f"{pid}-3", StepKind.EVENT, node,
                   {"reason": "KmendQuarantine", "message": message, "type": "Warning"}),
    ]


def _camel(s: str) -> str:
    return "".join(part.capitalize() for part in s.split("_"))


def choose_plan(incident: Incident, config: PolicyConfig) -> Plan:
    """Hardware faults that need the node out → quarantine; application faults → notify, never cordon."""
    pid = plan_id_for(incident)
    node = incident.root_cause.node
    mode = Mode.DRY_RUN if config.dry_run else Mode.AUTO
    if incident.hardware and incident.recommended_action in QUARANTINE_ACTIONS and node:
        if config.require_approval and mode is Mode.AUTO:
            mode = Mode.APPROVAL
        return Plan(
            id=pid, incident_id=incident.id, policy="quarantine-hardware", mode=mode,
            steps=tuple(_quarantine_steps(pid, incident, node)),
            reason=f"hardware fault {incident.fault_class.value} recommends "
                   f"{incident.recommended_action.value}",
        )
    who = "the job's owner" if not incident.hardware else "the operator"
    summary = (f"kmend incident {incident.id}: {incident.fault_class.value} "
               f"({incident.recommended_action.value}) job={incident.root_cause.job} "
               f"node={incident.root_cause.node}: {incident.root_finding.message[:200]}")
    return Plan(
        id=pid, incident_id=incident.id, policy="notify", mode=mode,
        steps=(ActionStep(f"{pid}-0", StepKind.NOTIFY, node, {"to": who, "message": summary}),),
        reason=("application fault: tell the job's owner, never cordon a node for it"
                if not incident.hardware else "no node action recommended"),
    )
