"""Checkpoint restore: find the job's latest complete checkpoint and publish it as the resume point."""

from __future__ import annotations

import os
from pathlib import Path

from healer.checkpoint_remote import discovery_from_json, is_object_store_url, object_store_path
from healer.checkpoints import Discovery, discover
from healer.jobs import JobOwner, owner_of, pods_of_job
from healer.keys import CHECKPOINT_PATH, RESUME_FROM
from healer.records import ActionStep, Plan
from healer.steps.base import RepairRequest, StepContext, StepOutcome, done, skipped, started_at, waiting
from healer.workloads import ObjectKey, PodInfo

RESUME_CONFIG_MAP_SUFFIX = "-kmend-resume"
"""The ConfigMap ``<job>-kmend-resume`` carries KMEND_RESUME_FROM for the job to mount (envFrom)."""


def resume_config_map(job: str) -> str:
    """Name of the job's resume ConfigMap."""
    return f"{job}{RESUME_CONFIG_MAP_SUFFIX}"[:253]


def _resolve_path(step: ActionStep, ctx: StepContext, pods: list[PodInfo], owner: JobOwner | None,
                  job: str, ns: str) -> str:
    path = next((p.annotations[CHECKPOINT_PATH] for p in pods if CHECKPOINT_PATH in p.annotations), "")
    if not path and owner is not None and owner.key.kind != "Pod":
        obj = ctx.workloads.get_object(owner.key) or {}
        path = obj.get("metadata", {}).get("annotations", {}).get(CHECKPOINT_PATH, "")
    if not path:
        path = step.params.get("default_path", "").format(namespace=ns, job=job)
    return str(path)


def _search(step: ActionStep, plan: Plan, ctx: StepContext, path: str,
            pods: list[PodInfo]) -> Discovery | StepOutcome:
    """Discovery where the checkpoints are: the object store, a root the control plane mounts,
    or the node agent of a node running one of the job's pods (it reads the pod's own mounts)."""
    if is_object_store_url(path):
        return discover(object_store_path(path))
    roots = ctx.checkpoint_roots
    if roots is None or any(_under(path, r) for r in roots):
        return discover(Path(path), roots=roots)  # bounded, and never through a link out of the roots
    # The failed node's pods are going away; any other running pod of the job sees the same volume,
    # the longest-running first (a replacement just placed on a spare may not have started).
    live = sorted((p for p in pods if p.node and not p.terminating and p.uid),
                  key=lambda p: (p.node == (step.node or ""), p.phase != "Running", p.created, p.name))
    if not live:
        return skipped(f"no running pod of the job mounts {path} (and the control plane does not: "
                       "KMEND_CHECKPOINT_ROOTS); the job starts from scratch")
    pod = live[0]
    now = ctx.clock()
    req = ctx.requests.open(RepairRequest(f"{step.id}-find", pod.node, "find_checkpoint", {
        "path": path, "pod_uid": pod.uid, "pod": pod.name, "namespace": pod.namespace}))
    since = started_at(step, now)
    if req.state == "failed":
        return skipped(f"the agent on {pod.node} could not search {path}: {req.result}; the job starts from scratch")
    if req.state == "done":
        return discovery_from_json(req.result)
    why = ctx.agents.unable(pod.node, "find_checkpoint", now=now, waiting_since=since)
    if why:
        ctx.requests.answer(req.id, "failed", f"withdrawn: {why}")
        return skipped(f"{why}; {path} cannot be searched and the job starts from scratch")
    if now - since > float(step.params.get("timeout_s", "300")):
        return skipped(f"the agent on {pod.node} did not answer the checkpoint search within "
                       f"{step.params.get('timeout_s', '300')} s; the job starts from scratch")
    return waiting(f"the agent on {pod.node} searches {path} in pod {pod.name}", started_at=str(since),
                   request=req.id)


def _under(path: str, root: str) -> bool:
    p, r = os.path.normpath(path), os.path.normpath(root)
    return p == r or p.startswith(r.rstrip("/") + "/")


def checkpoint(step: ActionStep, plan: Plan, ctx: StepContext) -> StepOutcome:
    """Discover; publish the resume point (owner annotation + ConfigMap); report skipped newer checkpoints."""
    job, ns = step.params.get("job", ""), step.params.get("namespace", "")
    if not job:
        return skipped("no job affected")
    pods = pods_of_job(ctx.workloads.list_pods(namespace=ns or None), job, ns or None)
    owner = owner_of(pods)
    path = _resolve_path(step, ctx, pods, owner, job, ns)
    if not path:
        return skipped(f"no checkpoint path for {job} (annotation {CHECKPOINT_PATH} or policy checkpoint_path)")
    found = _search(step, plan, ctx, path, pods)
    if isinstance(found, StepOutcome):
        return found
    passed = "; ".join(f"skipped {p}: {why}" for p, why in found.skipped[:5])
    if found.latest is None:
        return skipped(f"no complete checkpoint under {path}; the job starts from scratch"
                       + (f" ({passed})" if passed else ""), checkpoint_skipped=str(len(found.skipped)))
    ck = found.latest
    ctx.workloads.apply_config_map(ns, resume_config_map(job), {
        "KMEND_RESUME_FROM": ck.path, "KMEND_RESUME_STEP": str(ck.step), "KMEND_CHECKPOINT_FORMAT": ck.format.value,
    }, labels={"app.kubernetes.io/managed-by": "kmend"})
    if owner is not None and owner.key.kind != "Pod":
        ctx.workloads.annotate(owner.key, {RESUME_FROM: ck.path})
    else:
        for p in pods:
            if not p.terminating:
                ctx.workloads.annotate(ObjectKey("v1", "Pod", p.namespace, p.name), {RESUME_FROM: ck.path})
    line = f"resume {job} from {ck.format.value} step {ck.step} at {ck.path}"
    return done(line + (f" ({passed})" if passed else ""), resume_from=ck.path, resume_step=str(ck.step),
                checkpoint_skipped=str(len(found.skipped)))
