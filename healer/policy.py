"""Policy: which plan (and mode) an incident gets. Pure: incident and a snapshot of context in, plan out."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from analyzer.records import Incident
from healer.keys import CONDITION_TYPE, FAULT_TAINT_KEY, MANAGED_LABEL
from healer.policy_explain import explain
from healer.policy_file import DrainScope, PlanTemplate, PolicyFile, RepairKind, StepName
from healer.records import ActionStep, Mode, Plan, StepKind, unique_plan_id
from healer.steps.node import RELEASE_WRITES, rfc3339

__all__ = ["CONDITION_TYPE", "FAULT_TAINT_KEY", "MANAGED_LABEL", "PlanContext", "PolicyConfig", "choose_plan",
           "operator_quarantine_plan", "plan_id_for"]

NODE_STEPS = frozenset({StepName.QUARANTINE, StepName.DRAIN, StepName.SPARE_SWAP, StepName.REPAIR,
                        StepName.VALIDATE, StepName.RETURN})
"""Steps that change a node."""


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Global switches that override every rule."""

    dry_run: bool = False
    """Plan everything, change nothing."""
    require_approval: bool = False
    """Plans that change nodes wait for an operator."""


@dataclass(frozen=True, slots=True)
class PlanContext:
    """What the policy needs to know beyond the incident, read from the cluster and the journal."""

    now: float
    """Time the plan is chosen."""
    node_labels: Mapping[str, str] = field(default_factory=dict)
    """Labels of the root-cause node (hardware match, opt-out)."""
    namespace: str | None = None
    """Namespace of the affected job."""
    opted_out: str = ""
    """Why the namespace, job or node is not managed (``kmend.io/managed=false``), if it is not."""
    node_held_by: str | None = None
    """Another active plan that already holds the node."""
    in_cooldown: bool = False
    """The node was quarantined by an earlier plan within the cooldown."""
    job: str | None = None
    """The job bound to the root-cause node now, asked from the cluster ('': none; None: keep the incident's)."""
    attempts: Mapping[RepairKind, int] = field(default_factory=dict)
    """Repairs of each kind already tried on this node (resets: on this GPU) within the attempts window."""
    lemon: str = ""
    """Why the node is a lemon (repeated hardware faults within the lemon window), if it is."""


LADDER = (RepairKind.RESET_GPU, RepairKind.REBOOT, RepairKind.REPLACE)
"""Repairs from least to most disruptive; past the last rung a person decides."""


def climb(policy: PolicyFile, template: PlanTemplate, ctx: PlanContext) -> tuple[PlanTemplate, str, bool]:
    """The ladder rung for this node: the template's repair unless tried ``max_attempts`` times already.

    Returns the template, why it changed ('' when it did not) and whether a person must decide.
    """
    if StepName.REPAIR not in template.steps:
        return template, "", False
    cap = policy.safety.max_attempts
    start = LADDER.index(template.repair)
    if ctx.lemon:
        start = max(start, LADDER.index(RepairKind.REPLACE))
    why = [ctx.lemon] if ctx.lemon else []
    for kind in LADDER[start:]:
        tried = ctx.attempts.get(kind, 0)
        if tried < cap:
            if kind is template.repair:
                return template, "; ".join(why), False
            found = next((t for t in policy.plans.values()
                          if t.repair is kind and StepName.REPAIR in t.steps), None)
            if found is not None:
                return found, "; ".join([*why, f"escalated to {kind.value}"]), False
        else:
            why.append(f"{kind.value} tried {tried} time(s) within {policy.safety.attempts_window_s:.0f} s "
                       f"(max {cap})")
    person = next((t for t in policy.plans.values()
                   if StepName.QUARANTINE in t.steps and StepName.REPAIR not in t.steps), template)
    return person, "; ".join([*why, "every rung tried: a person decides"]), True


def plan_id_for(incident: Incident) -> str:
    """One plan per incident and root cause: a re-rooted incident gets a new plan."""
    key = f"{incident.id}/{incident.root_finding.id}"
    return "plan-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def _camel(s: str) -> str:
    return "".join(part.capitalize() for part in s.split("_"))


def quarantine_steps(pid: str, start: int, node: str, fault: str, message: str, by: str,
                     now: float) -> list[ActionStep]:
    """Cordon, taint, who/why/when, condition, Event."""
    i = start
    return [
        ActionStep(f"{pid}-{i}", StepKind.CORDON, node),
        ActionStep(f"{pid}-{i + 1}", StepKind.TAINT, node, {"key": FAULT_TAINT_KEY, "value": fault,
                                                            "effect": "NoSchedule"}),
        ActionStep(f"{pid}-{i + 2}", StepKind.LABEL, node, {"by": by, "reason": message[:250], "at": rfc3339(now)}),
        ActionStep(f"{pid}-{i + 3}", StepKind.CONDITION, node,
                   {"type": CONDITION_TYPE, "status": "False", "reason": _camel(fault), "message": message}),
        ActionStep(f"{pid}-{i + 4}", StepKind.EVENT, node,
                   {"reason": "KmendQuarantine", "message": message, "type": "Warning"}),
    ]


def _steps(pid: str, template: PlanTemplate, incident: Incident, policy: PolicyFile, ctx: PlanContext,
           message: str, rung: str = "") -> list[ActionStep]:
    node = incident.root_cause.node or ""
    job = (incident.root_cause.job if ctx.job is None else ctx.job) or ""
    ns = ctx.namespace or ""
    d = policy.defaults
    out: list[ActionStep] = []
    if (NODE_STEPS | {StepName.RESTART_JOB}) & set(template.steps):
        # Before anything destructive, what the plan acts on is kept with it (the journal is the record).
        lines = [f"{f.rule_id} {f.where.node or '-'}: {f.message}"[:500] for f in incident.findings[:20]]
        out.append(ActionStep(f"{pid}-0", StepKind.EVIDENCE, node or None, {
            "incident": incident.id, "lines": "\n".join(lines),
            "signals": ",".join(e for f in incident.findings[:20] for e in f.evidence[:3]),
            "gpu": incident.root_cause.gpu or "", "pci": incident.root_cause.pci or "",
            "hang": str(incident.fault_class.value in ("hang", "nccl_timeout", "nccl_error")).lower(),
            # The ranks' Flight Recorder dumps (their stacks per collective) the agent sent, when a hang is involved.
            "stack_dumps": ",".join(e for f in incident.findings if f.rule_id == "flight-recorder"
                                    for e in f.evidence[:64]),
            "ladder": rung}))
    for name in template.steps:
        i = len(out)
        sid = f"{pid}-{i}"
        if name is StepName.QUARANTINE:
            out += quarantine_steps(pid, i, node, incident.fault_class.value, message, "kmend", ctx.now)
        elif name is StepName.DRAIN:
            params = {"job": job, "namespace": ns, "grace_s": str(d.drain_grace_s),
                      "timeout_s": str(d.drain_timeout_s)}
            rc = incident.root_cause
            if template.drain is DrainScope.GPU and (rc.gpu or rc.pci):
                params.update(scope="gpu", gpu=rc.gpu or "", pci=rc.pci or "",
                              gpu_annotations=",".join(d.gpu_assignment_annotations))
            out.append(ActionStep(sid, StepKind.DRAIN, node, params))
        elif name is StepName.SPARE_SWAP:
            out.append(ActionStep(sid, StepKind.SPARE_SWAP, node, {"job": job, "namespace": ns}))
        elif name is StepName.CHECKPOINT:
            out.append(ActionStep(sid, StepKind.CHECKPOINT, node or None, {"job": job, "namespace": ns,
                                                                           "default_path": d.checkpoint_path}))
        elif name is StepName.RESTART_JOB:
            out.append(ActionStep(sid, StepKind.RESTART_JOB, node or None, {
                "job": job, "namespace": ns, "max_retry": str(d.max_retry),
                "escalation": ",".join(e.value for e in d.escalation), "timeout_s": str(d.restart_timeout_s),
                "grace_s": str(d.drain_grace_s)}))
        elif name is StepName.REPAIR:
            out.append(ActionStep(sid, StepKind.REPAIR, node, {
                "kind": template.repair.value, "gpu": incident.root_cause.gpu or "",
                "pci": incident.root_cause.pci or "", "require_idle": str(d.gpu_reset_when_idle).lower(),
                "fault_class": incident.fault_class.value, "timeout_s": str(d.validation_timeout_s)}))
        elif name is StepName.VALIDATE:
            out.append(ActionStep(sid, StepKind.VALIDATE, node, {"image": d.health_check_image,
                                                                 "timeout_s": str(d.validation_timeout_s)}))
        elif name is StepName.RETURN:
            out.append(ActionStep(sid, StepKind.RETURN, node))
        elif name is StepName.NOTIFY:
            who = "the job's owner" if not incident.hardware else "the operator"
            out.append(ActionStep(sid, StepKind.NOTIFY, node or None, {"to": who, "message": message}))
    return out


def choose_plan(incident: Incident, policy: PolicyFile, config: PolicyConfig, ctx: PlanContext) -> Plan:
    """The first matching rule's plan, narrowed by opt-outs, a node already held, cooldown and global switches."""
    pid = plan_id_for(incident)
    node = incident.root_cause.node
    rc = incident.root_cause
    message = (f"kmend incident {incident.id}: {incident.fault_class.value} on {node or '-'}"
               + (f" (GPU {rc.gpu or rc.pci})" if rc.gpu or rc.pci else "")
               + (f" job={rc.job}" if rc.job else "") + f"; {incident.root_finding.message[:200]}")
    ex = explain(incident, policy, ctx.now, ctx.node_labels, ctx.job)
    rule, mode = ex.rule, ex.mode
    template = policy.plans[rule.plan]
    reason = (f"rule {rule.name!r}: {'hardware' if incident.hardware else 'application'} fault "
              f"{incident.fault_class.value} recommends {incident.recommended_action.value}"
              f" (evidence {ex.facts.rule_id})")
    if mode is not rule.mode:
        reason += f"; {rule.opt_in} opted in to run automatically"
    template, rung, person = climb(policy, template, ctx)
    if rung:
        reason += f"; {rung}: plan {template.name}"
        if person:
            mode = Mode.APPROVAL
    touches_node = bool(NODE_STEPS & set(template.steps))
    if touches_node and not node:
        template, reason = policy.plans[policy.fallback.plan], reason + "; no node named: notify only"
    elif ctx.opted_out:
        template, reason = policy.plans[policy.fallback.plan], f"{ctx.opted_out}: notify only"
    elif touches_node and ctx.node_held_by:
        template, reason = policy.plans[policy.fallback.plan], f"node held by plan {ctx.node_held_by}: notify only"
    elif touches_node and ctx.in_cooldown and mode is Mode.AUTO:
        mode, reason = Mode.APPROVAL, reason + "; node was quarantined within the cooldown: an operator decides"
    steps = _steps(pid, template, incident, policy, ctx, message, rung)
    if not any(s.kind is StepKind.NOTIFY for s in steps) and not steps:
        steps = [ActionStep(f"{pid}-0", StepKind.NOTIFY, node, {"to": "the operator", "message": message})]
    if config.require_approval and mode is Mode.AUTO and any(s.node for s in steps if s.kind is not StepKind.NOTIFY):
        mode = Mode.APPROVAL
    if config.dry_run:
        mode = Mode.DRY_RUN
    return Plan(id=pid, incident_id=incident.id, policy=f"{rule.name}/{template.name}", mode=mode,
                steps=tuple(steps), reason=reason, node=node, job=(rc.job if ctx.job is None else ctx.job) or None,
                namespace=ctx.namespace,
                fault_class=incident.fault_class.value, created_at=ctx.now)


def operator_quarantine_plan(node: str, by: str, reason: str, now: float) -> Plan:
    """A quarantine an operator asked for through the API (it bypasses the breaker, not the journal)."""
    pid = unique_plan_id("plan-op-")
    message = f"quarantined by {by}: {reason}"
    return Plan(id=pid, incident_id="", policy="operator/quarantine", mode=Mode.AUTO,
                steps=tuple(quarantine_steps(pid, 0, node, "operator", message, by, now)),
                reason=message, node=node, fault_class="operator", created_at=now)


RELEASE_POLICY = "operator/release"
"""The policy name of an operator's release (the loop finishes one it finds unfinished, other plans cancelled)."""


def release_plan(node: str, by: str, now: float) -> Plan:
    """An operator's release, journaled before it acts: one step per write (``RELEASE_WRITES``), so a release cut short
    by a crash is finished on restart and no write is made twice."""
    pid = unique_plan_id("plan-rel-")
    steps = tuple(ActionStep(f"{pid}-{i}", StepKind.RELEASE, node, {"write": w, "by": by})
                  for i, w in enumerate(RELEASE_WRITES))
    return Plan(id=pid, incident_id="", policy=RELEASE_POLICY, mode=Mode.AUTO, steps=steps,
                reason=f"released by {by}", node=node, fault_class="operator", created_at=now)
