"""Drain: evict the affected job's pods from the node through the Eviction API (PodDisruptionBudgets hold)."""

from __future__ import annotations

from healer.cluster import TemporaryError
from healer.jobs import is_daemon, pods_of_job
from healer.records import ActionStep, Plan
from healer.steps.base import StepContext, StepOutcome, done, failed, started_at, waiting


def drain(step: ActionStep, plan: Plan, ctx: StepContext) -> StepOutcome:
    """Evict; terminating pods are waited for (their GPUs are busy until they are gone); 429 is retried later.

    Never falls back to deleting a pod a PodDisruptionBudget protects.
    """
    node = step.node or ""
    p = step.params
    now = ctx.clock()
    since = started_at(step, now)
    on_node = [x for x in ctx.workloads.list_pods(node=node) if not is_daemon(x)]
    job = p.get("job") or ""
    pods = pods_of_job(on_node, job, p.get("namespace") or None) if job else on_node
    if not pods:
        return done(f"no pods of {job or 'any job'} left on {node}")
    grace = int(p.get("grace_s", "300"))
    blocked: list[str] = []
    for pod in pods:
        if pod.terminating:
            continue
        try:
            ctx.workloads.evict_pod(pod.namespace, pod.name, grace)
        except TemporaryError as exc:
            blocked.append(f"{pod.name} ({exc})")
    terminating = len(pods) - len(blocked)
    line = f"{terminating} pod(s) terminating on {node}"
    if blocked:
        line += f"; eviction refused, retried later: {', '.join(blocked[:3])}"
    if now - since > float(p.get("timeout_s", "1800")):
        return failed(f"drain of {node} did not finish in {p.get('timeout_s')} s: {line}")
    return waiting(line, started_at=str(since))
