"""Quarantine and return: cordon, taint, who/why/when labels, condition, Event; back to the spare pool."""

from __future__ import annotations

import datetime as dt

from healer.cluster import Cluster, ClusterEvent, Condition, PermanentError, Taint
from healer.keys import (
    CONDITION_TYPE,
    FAULT_TAINT_KEY,
    PROBLEM_CONDITION_TYPE,
    QUARANTINE_PLAN,
    QUARANTINE_REASON,
    QUARANTINED_AT,
    QUARANTINED_BY,
    QUARANTINED_LABEL,
    REPAIR_DONE,
    REPAIR_REQUEST,
    SPARE_FOR,
    SPARE_LABEL,
    SPARE_PLAN,
    SPARE_TAINT_KEY,
    UNVALIDATED_TAINT_KEY,
    VALIDATED_AT,
)
from healer.records import ActionStep, Plan, StepKind
from healer.steps.base import StepContext, StepOutcome, done, skipped


def _node(step: ActionStep) -> str:
    if not step.node:
        raise PermanentError(f"step {step.kind.value} needs a node")
    return step.node


def rfc3339(ts: float) -> str:
    """Kubernetes time format."""
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def cordon(step: ActionStep, plan: Plan, ctx: StepContext) -> StepOutcome:
    """Mark the node unschedulable."""
    node = _node(step)
    ctx.cluster.cordon(node)
    return done(f"cordoned {node}")


def taint(step: ActionStep, plan: Plan, ctx: StepContext) -> StepOutcome:
    """Add the fault taint."""
    node, p = _node(step), step.params
    ctx.cluster.add_taint(node, Taint(p["key"], p["value"], p["effect"]))
    return done(f"tainted {node} {p['key']}={p['value']}:{p['effect']}")


def label(step: ActionStep, plan: Plan, ctx: StepContext) -> StepOutcome:
    """Who, why and when, as a label and annotations (``when`` is fixed at plan creation: idempotent)."""
    node, p = _node(step), step.params
    ctx.cluster.patch_node_metadata(
        node, labels={QUARANTINED_LABEL: "true"},
        annotations={QUARANTINED_BY: p["by"], QUARANTINE_REASON: p["reason"], QUARANTINED_AT: p["at"],
                     QUARANTINE_PLAN: plan.id})
    return done(f"labelled {node} {QUARANTINED_LABEL}=true (by {p['by']})")


def with_problem_condition(condition: Condition) -> list[Condition]:
    """kmend's health condition and its node-problem-detector-style twin (``KmendFault``, True while faulted)."""
    if condition.type != CONDITION_TYPE:
        return [condition]
    problem = "False" if condition.status == "True" else "True"
    return [condition, Condition(PROBLEM_CONDITION_TYPE, problem, condition.reason, condition.message)]


def set_health(cluster: Cluster, node: str, condition: Condition) -> None:
    """Write kmend's health condition and its twin; each write is idempotent, so a resumed step repeats it safely."""
    for c in with_problem_condition(condition):
        cluster.set_condition(node, c)


def condition(step: ActionStep, plan: Plan, ctx: StepContext) -> StepOutcome:
    """Set kmend's node condition (and, for its health condition, the NPD-style problem condition too)."""
    node, p = _node(step), step.params
    set_health(ctx.cluster, node, Condition(p["type"], p["status"], p["reason"], p["message"]))
    return done(f"condition {p['type']}={p['status']} on {node}")


def event(step: ActionStep, plan: Plan, ctx: StepContext) -> StepOutcome:
    """Record an Event on the node, once (keyed by the step id)."""
    node, p = _node(step), step.params
    ctx.cluster.emit_event(ClusterEvent(node, p["reason"], p["message"], p.get("type", "Warning"), key=step.id))
    return done(f"event {p['reason']} on {node}")


def notify(step: ActionStep, plan: Plan, ctx: StepContext) -> StepOutcome:
    """Tell a person; the step id is the receiver's idempotency key."""
    ctx.notifier.notify({"event": "notification", "step": step.id, "plan": plan.id, "incident": plan.incident_id,
                         "node": step.node, **step.params})
    return done(f"notified {step.params.get('to', '')}".strip())


def return_to_pool(step: ActionStep, plan: Plan, ctx: StepContext) -> StepOutcome:
    """A validated node goes back as a spare: spare taint first, then the fault comes off and it is uncordoned."""
    node = _node(step)
    info = ctx.cluster.get_node(node)
    if info.annotations.get(QUARANTINE_PLAN, plan.id) != plan.id:
        return skipped(f"{node} is held by plan {info.annotations[QUARANTINE_PLAN]}; left as it is")
    ctx.cluster.add_taint(node, Taint(SPARE_TAINT_KEY, "", "NoSchedule"))
    ctx.cluster.patch_node_metadata(
        node, labels={SPARE_LABEL: "true", QUARANTINED_LABEL: None},
        annotations={QUARANTINED_BY: None, QUARANTINE_REASON: None, QUARANTINED_AT: None, QUARANTINE_PLAN: None,
                     REPAIR_REQUEST: None, REPAIR_DONE: None, SPARE_FOR: None, SPARE_PLAN: None})
    set_health(ctx.cluster, node, Condition(CONDITION_TYPE, "True", "Validated",
                                            f"validated after incident {plan.incident_id}; returned as a spare"))
    ctx.cluster.remove_taint(node, FAULT_TAINT_KEY)
    ctx.cluster.uncordon(node)
    ctx.cluster.emit_event(ClusterEvent(node, "KmendReturnedToPool",
                                        f"kmend plan {plan.id}: {node} validated and returned to the spare pool",
                                        "Normal", key=step.id))
    return done(f"{node} returned to the spare pool")


def accept(step: ActionStep, plan: Plan, ctx: StepContext) -> StepOutcome:
    """The health check passed: the unvalidated taint comes off and the node takes work."""
    node = _node(step)
    ctx.cluster.patch_node_metadata(node, annotations={VALIDATED_AT: rfc3339(ctx.clock())})
    set_health(ctx.cluster, node, Condition(CONDITION_TYPE, "True", "Validated",
                                            f"health check passed ({step.params.get('why', 'new')} node)"))
    ctx.cluster.remove_taint(node, UNVALIDATED_TAINT_KEY)
    ctx.cluster.emit_event(ClusterEvent(node, "KmendValidated", f"kmend plan {plan.id}: {node} passed the health "
                                        "check and takes work", "Normal", key=step.id))
    return done(f"{node} validated: {UNVALIDATED_TAINT_KEY} removed")


RELEASE_WRITES = ("unlabel", "unvalidated", "untaint", "condition", "uncordon", "event")
"""An operator's release, one journaled step per write: kmend's marks come off, the node is tainted unvalidated (back
from repair, it takes work once its health check passes) and uncordoned, with an Event saying who released it."""


def release(step: ActionStep, plan: Plan, ctx: StepContext) -> StepOutcome:
    """One write of an operator's release (``params['write']``, one of ``RELEASE_WRITES``); each is idempotent."""
    node, p, cluster = _node(step), step.params, ctx.cluster
    match p.get("write"):
        case "unlabel":
            cluster.patch_node_metadata(node, labels={QUARANTINED_LABEL: None}, annotations={
                QUARANTINED_BY: None, QUARANTINE_REASON: None, QUARANTINED_AT: None, QUARANTINE_PLAN: None})
        case "unvalidated":
            cluster.add_taint(node, Taint(UNVALIDATED_TAINT_KEY, "repaired", "NoSchedule"))
        case "untaint":
            cluster.remove_taint(node, FAULT_TAINT_KEY)
        case "condition":
            set_health(cluster, node, Condition(CONDITION_TYPE, "True", "ReleasedByOperator", f"released by {p['by']}"))
        case "uncordon":
            cluster.uncordon(node)
        case "event":
            cluster.emit_event(ClusterEvent(node, "KmendReleased", f"{node} released by {p['by']}", "Normal",
                                            key=step.id))
        case other:
            raise PermanentError(f"unknown release write {other!r}")
    return done(f"release of {node}: {p['write']}")


RUNNERS = {
    StepKind.CORDON: cordon,
    StepKind.TAINT: taint,
    StepKind.LABEL: label,
    StepKind.CONDITION: condition,
    StepKind.EVENT: event,
    StepKind.NOTIFY: notify,
    StepKind.RETURN: return_to_pool,
    StepKind.ACCEPT: accept,
    StepKind.RELEASE: release,
}
"""Runners of the node steps by kind."""
