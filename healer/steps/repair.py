"""Repair and validation: ask the node agent or the platform to repair, then prove the node healthy."""

from __future__ import annotations

import hashlib
from typing import Any

import yaml

from healer.cluster import ClusterEvent
from healer.keys import REPAIR_DONE, REPAIR_REQUEST
from healer.records import ActionStep, Plan
from healer.steps.base import RepairRequest, StepContext, StepOutcome, done, failed, started_at, waiting
from healer.workloads import ObjectKey

AGENT_KINDS = frozenset({"reset_gpu"})
"""Repairs the node agent carries out (the platform's tooling does the rest)."""


def repair(step: ActionStep, plan: Plan, ctx: StepContext) -> StepOutcome:
    """GPU reset goes to the node agent (it polls GET /v1/nodes/{name}/requests); reboot and replacement go to
    the platform's tooling as a node annotation, an Event and a webhook. Waits for the answer."""
    node = step.node or ""
    p = step.params
    kind = p.get("kind", "replace")
    now = ctx.clock()
    req = ctx.requests.open(RepairRequest(step.id, node, kind, {
        k: v for k, v in p.items() if k in ("gpu", "pci", "require_idle", "fault_class")}))
    if kind != "reset_gpu" and "announced" not in step.outputs:
        ctx.cluster.patch_node_metadata(node, annotations={REPAIR_REQUEST: f"{kind}:{req.id}"})
        ctx.cluster.emit_event(ClusterEvent(node, "KmendRepairRequested",
                                            f"kmend plan {plan.id}: {kind} requested for {node} "
                                            f"(incident {plan.incident_id}); annotate {REPAIR_DONE}={req.id} "
                                            "or POST /v1/nodes/{node}/requests/{id} when done", key=step.id))
        ctx.notifier.notify({"event": "repair_requested", "step": step.id, "plan": plan.id, "node": node,
                             "kind": kind, "request": req.id, "incident": plan.incident_id,
                             "message": f"kmend: {kind} requested for {node}"})
    out = {"started_at": str(started_at(step, now)), "announced": "1", "request": req.id}
    if req.state == "failed":
        return failed(f"{kind} of {node} failed: {req.result}")
    if req.state == "done" or ctx.cluster.get_node(node).annotations.get(REPAIR_DONE) == req.id:
        return done(f"{kind} of {node} done{': ' + req.result if req.result else ''}", request=req.id)
    if kind in AGENT_KINDS:
        # Say so within a minute when no agent there can do it, instead of timing out after half an hour.
        why = ctx.agents.unable(node, kind, now=now, waiting_since=float(out["started_at"]))
        if why:
            # Withdrawn, so an agent that turns up later does not act on a plan that gave up.
            ctx.requests.answer(req.id, "failed", f"withdrawn: {why}")
            return failed(why)
    if now - float(out["started_at"]) > float(p.get("timeout_s", "1800")):
        return failed(f"{kind} of {node} not done within {p.get('timeout_s')} s")
    who = "the node agent" if kind == "reset_gpu" else "the platform"
    return waiting(f"waiting for {who} to {kind.replace('_', ' ')} {node} (request {req.id})", **out)


CHECK_DEFAULTS = {"dcgm_level": "2", "nccl_min_busbw_gbps": "0", "ib_loopback": "false"}
"""Health-check settings a template may use, and their values when a step does not set them."""


def render_health_check(template: str, *, name: str, namespace: str, node: str, image: str,
                        plan: str, checks: dict[str, str] | None = None) -> dict[str, Any]:
    """The validation Job for a node, from the template in deploy/healthcheck/."""
    text = template
    values = {**CHECK_DEFAULTS, **(checks or {}), "name": name, "namespace": namespace, "node": node,
              "image": image, "plan": plan}
    for k, v in values.items():
        text = text.replace("{{" + k + "}}", v)
    manifest = yaml.safe_load(text)
    if not isinstance(manifest, dict) or manifest.get("kind") != "Job":
        raise ValueError("the health-check template must be one batch/v1 Job")
    return manifest


def validate(step: ActionStep, plan: Plan, ctx: StepContext) -> StepOutcome:
    """Run the health-check Job on the node (named after the step: created once) and wait for its verdict."""
    node = step.node or ""
    if not ctx.health_check_template:
        return failed("no health-check Job template configured (KMEND_HEALTH_CHECK_TEMPLATE)")
    now = ctx.clock()
    name = f"kmend-validate-{hashlib.sha256(step.id.encode()).hexdigest()[:10]}"
    key = ObjectKey("batch/v1", "Job", ctx.namespace, name)
    obj = ctx.workloads.get_object(key)
    if obj is None:
        manifest = render_health_check(ctx.health_check_template, name=name, namespace=ctx.namespace, node=node,
                                       image=step.params.get("image", ""), plan=plan.id,
                                       checks={k: step.params[k] for k in CHECK_DEFAULTS if k in step.params})
        ctx.workloads.create_object(key, manifest)
        obj = ctx.workloads.get_object(key) or {}
    status = obj.get("status", {})
    out = {"started_at": str(started_at(step, now)), "job": name}
    if int(status.get("succeeded", 0) or 0) >= 1:
        return done(f"health check {name} passed on {node}", job=name)
    if int(status.get("failed", 0) or 0) >= 1:
        return failed(f"health check {name} failed on {node}: the node stays quarantined")
    if now - float(out["started_at"]) > float(step.params.get("timeout_s", "1800")):
        return failed(f"health check {name} on {node} gave no verdict within {step.params.get('timeout_s')} s")
    return waiting(f"health check {name} running on {node}", **out)
