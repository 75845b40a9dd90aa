"""Records <-> JSON-ready dicts, for the store, the HTTP API and the CLI."""

from __future__ import annotations

from typing import Any

from analyzer.records import (
    Action,
    FaultClass,
    Finding,
    Incident,
    IncidentState,
    Location,
    Severity,
    TimelineEntry,
)
from healer.records import ActionStep, Mode, Plan, PlanState, StepKind, StepState


def location_to_dict(loc: Location) -> dict[str, Any]:
    """Root cause / where, with every key present (null when unknown)."""
    return {"node": loc.node, "gpu": loc.gpu, "pci": loc.pci, "port": loc.port, "rank": loc.rank,
            "job": loc.job, "namespace": loc.namespace}


def location_from_dict(d: dict[str, Any]) -> Location:
    """Inverse of location_to_dict."""
    return Location(node=d.get("node"), gpu=d.get("gpu"), pci=d.get("pci"), port=d.get("port"),
                    rank=d.get("rank"), job=d.get("job"), namespace=d.get("namespace"))


def finding_to_dict(f: Finding) -> dict[str, Any]:
    """A finding as JSON."""
    return {
        "id": f.id, "ts": f.ts, "fault_class": f.fault_class.value, "severity": f.severity.value,
        "hardware": f.hardware, "where": location_to_dict(f.where), "rule_id": f.rule_id,
        "recommended_action": f.recommended_action.value, "evidence": list(f.evidence),
        "message": f.message, "symptom_of": sorted(c.value for c in f.symptom_of),
        "fields": dict(f.fields),
    }


def finding_from_dict(d: dict[str, Any]) -> Finding:
    """Inverse of finding_to_dict."""
    return Finding(
        id=d["id"], ts=d["ts"], fault_class=FaultClass(d["fault_class"]), severity=Severity(d["severity"]),
        hardware=d["hardware"], where=location_from_dict(d["where"]), rule_id=d["rule_id"],
        recommended_action=Action(d["recommended_action"]), evidence=tuple(d["evidence"]),
        message=d.get("message", ""), symptom_of=frozenset(FaultClass(c) for c in d.get("symptom_of", [])),
        fields=dict(d.get("fields", {})),
    )


def incident_to_dict(i: Incident, *, findings: bool = True) -> dict[str, Any]:
    """An incident as JSON (the shape of ``kmend analyze --format json`` and the API)."""
    out: dict[str, Any] = {
        "id": i.id, "state": i.state.value, "fault_class": i.fault_class.value, "severity": i.severity.value,
        "hardware": i.hardware, "recommended_action": i.recommended_action.value,
        "root_cause": location_to_dict(i.root_cause), "jobs": sorted(i.jobs),
        "opened_at": i.opened_at, "updated_at": i.updated_at, "finding_count": len(i.findings),
        "timeline": [{"ts": t.ts, "what": t.what} for t in i.timeline],
    }
    if findings:
        out["findings"] = [finding_to_dict(f) for f in i.findings]
    return out


def incident_from_dict(d: dict[str, Any]) -> Incident:
    """Inverse of incident_to_dict (with findings)."""
    return Incident(
        id=d["id"], fault_class=FaultClass(d["fault_class"]), severity=Severity(d["severity"]),
        hardware=d["hardware"], recommended_action=Action(d["recommended_action"]),
        root_cause=location_from_dict(d["root_cause"]), opened_at=d["opened_at"],
        updated_at=d["updated_at"], findings=tuple(finding_from_dict(f) for f in d.get("findings", [])),
        jobs=frozenset(d.get("jobs", [])), state=IncidentState(d["state"]),
        timeline=tuple(TimelineEntry(t["ts"], t["what"]) for t in d.get("timeline", [])),
    )


def step_to_dict(s: ActionStep) -> dict[str, Any]:
    """A plan step as JSON."""
    return {"id": s.id, "kind": s.kind.value, "node": s.node, "params": dict(s.params),
            "state": s.state.value, "result": s.result, "outputs": dict(s.outputs)}


def step_from_dict(d: dict[str, Any]) -> ActionStep:
    """Inverse of step_to_dict."""
    return ActionStep(id=d["id"], kind=StepKind(d["kind"]), node=d.get("node"), params=dict(d["params"]),
                      state=StepState(d["state"]), result=d.get("result", ""), outputs=dict(d.get("outputs") or {}))


def plan_to_dict(p: Plan) -> dict[str, Any]:
    """A plan as JSON."""
    return {"id": p.id, "incident_id": p.incident_id, "policy": p.policy, "mode": p.mode.value,
            "state": p.state.value, "reason": p.reason, "node": p.node, "job": p.job, "namespace": p.namespace,
            "fault_class": p.fault_class, "created_at": p.created_at, "steps": [step_to_dict(s) for s in p.steps]}


def plan_from_dict(d: dict[str, Any]) -> Plan:
    """Inverse of plan_to_dict."""
    return Plan(id=d["id"], incident_id=d["incident_id"], policy=d["policy"], mode=Mode(d["mode"]),
                steps=tuple(step_from_dict(s) for s in d["steps"]), state=PlanState(d["state"]),
                reason=d.get("reason", ""), node=d.get("node"), job=d.get("job"), namespace=d.get("namespace"),
                fault_class=d.get("fault_class", ""), created_at=float(d.get("created_at") or 0.0))
