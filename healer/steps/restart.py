"""Job restart as a gang, through the job's owner, so every rank restarts together on healthy nodes.

Idempotent across crashes: the first round records the UIDs of the pods of the run being restarted
(journaled before anything is deleted); later rounds act only on pods with those UIDs, so pods the
owner has already recreated are never restarted twice.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from healer.gang.records import POD_GROUP_LABEL, VOLCANO_GROUP_ANNOTATION
from healer.jobs import RestartMethod, child_jobs, owner_of, pods_of_job, recreatable
from healer.keys import FAULT_TAINT_KEY, RESUME_FROM
from healer.policy_file import Escalation
from healer.records import ActionStep, Plan
from healer.steps.base import StepContext, StepOutcome, done, failed, skipped, started_at, waiting
from healer.workloads import ObjectKey, PodInfo

VOLCANO_COMMAND_API = "bus.volcano.sh/v1alpha1"
"""API version of Volcano's Command (what ``vcctl job`` creates)."""
VOLCANO_JOB_API = "batch.volcano.sh/v1alpha1"
"""API version of Volcano's Job."""


def restart_job(step: ActionStep, plan: Plan, ctx: StepContext) -> StepOutcome:
    """Restart the job's gang; done once every rank is bound to a healthy node."""
    p = step.params
    job, ns = p.get("job", ""), p.get("namespace", "")
    if not job:
        return skipped("no job affected")
    now = ctx.clock()
    pods = pods_of_job(ctx.workloads.list_pods(namespace=ns or None), job, ns or None)
    if "old_uids" not in step.outputs:
        return _begin(step, plan, ctx, job, pods, now)
    out = dict(step.outputs)
    old = set(out["old_uids"].split(","))
    method = RestartMethod(out["method"])
    old_live = [x for x in pods if x.uid in old and not x.terminating]
    if method is RestartMethod.RECREATE_PODS:
        for x in old_live:
            ctx.workloads.delete_pod(x.namespace, x.name, int(p.get("grace_s", "30")))
        if any(x.uid in old for x in pods):
            return waiting(f"{sum(x.uid in old for x in pods)} pod(s) of {job} terminating", **out)
        manifests = json.loads(out["manifests"])
        for m in manifests:
            if out.get("resume_from"):
                m["metadata"].setdefault("annotations", {})[RESUME_FROM] = out["resume_from"]
            ctx.workloads.create_pod(m["metadata"].get("namespace", ns), m)
    elif old_live:
        _kick(method, out, old_live, ctx, step)
    still_old = [x for x in pods if x.uid in old]
    fresh = [x for x in pods if x.uid not in old and not x.terminating]
    if method is RestartMethod.RECREATE_PODS:
        fresh = pods_of_job(ctx.workloads.list_pods(namespace=ns or None), job, ns or None)
    bad = _unhealthy_nodes(ctx)
    bound = [x for x in fresh if x.node and x.node not in bad]
    want = int(out["ranks"])
    line = (f"{job} via {out['owner']}: {len(bound)}/{want} pods bound to healthy nodes, "
            f"{len(still_old)} of the old run left")
    if not still_old and len(bound) >= want:
        nodes = sorted({x.node for x in bound})
        return done(f"{line} on {len(nodes)} node(s)", **out, restarted_nodes=",".join(nodes))
    if now - started_at(step, now) > float(p.get("timeout_s", "900")):
        return failed(f"restart of {job} did not finish in {p.get('timeout_s')} s: {line}")
    return waiting(line, **out)


def _begin(step: ActionStep, plan: Plan, ctx: StepContext, job: str, pods: Sequence[PodInfo],
           now: float) -> StepOutcome:
    p = step.params
    attempts = len(ctx.history.restarts_of(job, exclude_plan=plan.id))
    levels = [Escalation(x) for x in p.get("escalation", "job,notify").split(",")]
    level = levels[min(attempts, len(levels) - 1)]
    if attempts >= int(p.get("max_retry", "3")):
        level = Escalation.NOTIFY
    if level is Escalation.NOTIFY:
        ctx.notifier.notify({"event": "restart_given_up", "step": step.id, "plan": plan.id, "job": job,
                             "namespace": p.get("namespace", ""), "attempts": attempts,
                             "message": f"kmend: {job} restarted {attempts} times; not restarting it again"})
        return done(f"{job} already restarted {attempts} time(s) (max_retry {p.get('max_retry')}): owner notified",
                    escalation="notify")
    live = [x for x in pods if not x.terminating]
    owner = owner_of(pods)
    if owner is None or not live:
        return skipped(f"no running pods of {job} that an owner can restart")
    if level is Escalation.POD:
        live = [x for x in live if x.node == step.node] or live
    out: dict[str, str] = {
        "started_at": str(now), "escalation": level.value, "method": owner.method.value, "owner": str(owner.key),
        "old_uids": ",".join(sorted(x.uid for x in live)), "ranks": str(len(pods_of_job(pods, job))),
        "resume_from": plan.outputs().get("resume_from", ""),
    }
    _hold_capacity(ctx, step, live, now)
    if owner.method is RestartMethod.RECREATE_PODS:
        manifests = []
        for x in live:
            m = recreatable(dict(x.manifest))
            m["metadata"] = {**m["metadata"], "namespace": x.namespace}
            manifests.append(m)
        out["manifests"] = json.dumps(manifests)
    return waiting(f"restarting {len(live)} pod(s) of {job} through {owner.key} ({owner.method.value}, "
                   f"attempt {attempts + 1}, level {level.value})", **out)


def _kick(method: RestartMethod, out: dict[str, str], old_live: Sequence[PodInfo], ctx: StepContext,
          step: ActionStep) -> None:
    if method is RestartMethod.DELETE_PODS:
        for x in old_live:
            ctx.workloads.delete_pod(x.namespace, x.name, int(step.params.get("grace_s", "30")))
    elif method is RestartMethod.DELETE_CHILD_JOBS:
        for key in child_jobs(old_live):
            ctx.workloads.delete_object(key)
    elif method is RestartMethod.VOLCANO_COMMAND:
        kind, ns, name = out["owner"].split("/", 2)
        job = ctx.workloads.get_object(ObjectKey(VOLCANO_JOB_API, kind, ns, name))
        if job is None:
            return  # the Job was deleted: its pods go with it and nothing restarts them
        cmd = "kmend-restart-" + hashlib.sha256(step.id.encode()).hexdigest()[:10]
        # Volcano's Command schema makes the target a full OwnerReference: the API server refuses one
        # without the Job's uid (422), and the controller restarts only the Job with that uid.
        ctx.workloads.create_object(ObjectKey(VOLCANO_COMMAND_API, "Command", ns, cmd), {
            "metadata": {"name": cmd, "namespace": ns},
            "action": "RestartJob", "reason": f"kmend {step.id}",
            "target": {"apiVersion": VOLCANO_JOB_API, "kind": kind, "name": name,
                       "uid": job.get("metadata", {}).get("uid", "")},
        })


def _hold_capacity(ctx: StepContext, step: ActionStep, live: Sequence[PodInfo], now: float) -> None:
    """Keep the gang's healthy nodes for it while it restarts, so a smaller job cannot take them."""
    if ctx.reservations is None or not live:
        return
    first = live[0]
    group = first.labels.get(POD_GROUP_LABEL) or first.annotations.get(VOLCANO_GROUP_ANNOTATION)
    if not group:
        return
    nodes = {x.node for x in live if x.node}
    failed = (nodes & _unhealthy_nodes(ctx)) | ({step.node} if step.node else set())
    ctx.reservations.hold(f"{first.namespace}/{group}", nodes, failed=failed,
                          until=now + float(step.params.get("timeout_s", "900")))


def _unhealthy_nodes(ctx: StepContext) -> set[str]:
    return {n.name for n in ctx.cluster.list_nodes() if n.unschedulable or n.taint(FAULT_TAINT_KEY) is not None}
