"""Checkpoint restore: find the job's latest complete checkpoint and publish it as the resume point."""

from __future__ import annotations

from pathlib import Path

from healer.checkpoints import discover
from healer.jobs import owner_of, pods_of_job
from healer.keys import CHECKPOINT_PATH, RESUME_FROM
from healer.records import ActionStep, Plan
from healer.steps.base import StepContext, StepOutcome, done, skipped
from healer.workloads import ObjectKey

RESUME_CONFIG_MAP_SUFFIX = "-kmend-resume"
"""The ConfigMap ``<job>-kmend-resume`` carries KMEND_RESUME_FROM for the job to mount (envFrom)."""


def resume_config_map(job: str) -> str:
    """Name of the job's resume ConfigMap."""
    return f"{job}{RESUME_CONFIG_MAP_SUFFIX}"[:253]


def checkpoint(step: ActionStep, plan: Plan, ctx: StepContext) -> StepOutcome:
    """Discover; publish the resume point (owner annotation + ConfigMap); report skipped newer checkpoints."""
    job, ns = step.params.get("job", ""), step.params.get("namespace", "")
    if not job:
        return skipped("no job affected")
    pods = pods_of_job(ctx.workloads.list_pods(namespace=ns or None), job, ns or None)
    owner = owner_of(pods)
    path = next((p.annotations[CHECKPOINT_PATH] for p in pods if CHECKPOINT_PATH in p.annotations), "")
    if not path and owner is not None and owner.key.kind != "Pod":
        obj = ctx.workloads.get_object(owner.key) or {}
        path = obj.get("metadata", {}).get("annotations", {}).get(CHECKPOINT_PATH, "")
    if not path:
        path = step.params.get("default_path", "").format(namespace=ns, job=job)
    if not path:
        return skipped(f"no checkpoint path for {job} (annotation {CHECKPOINT_PATH} or policy checkpoint_path)")
    found = discover(Path(path), roots=ctx.checkpoint_roots)
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
