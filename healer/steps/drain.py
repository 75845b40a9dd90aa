"""Drain: evict the affected pods from the node through the Eviction API (PodDisruptionBudgets hold).

A node drain evicts the affected job's pods. A GPU drain (policy ``drain: gpu``, the incident naming one GPU)
evicts only the pods holding that GPU, whatever their job, and leaves the pods on the node's healthy GPUs
running; the node stays cordoned, so nothing new lands on it, and the bad GPU goes idle for its reset.

Which GPUs a pod holds is not in the pod's spec: the device plugin picks the devices at admission. Pods carry
it as an annotation where the device plugin or the node agent writes one (Volcano's GPU sharing writes
``volcano.sh/gpu-index``; ``kmend.io/gpus`` takes the indices, UUIDs or PCI ids the kubelet's pod-resources
API reports). A pod that asks for GPUs but names none may hold the bad one and is evicted too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from healer.cluster import TemporaryError
from healer.jobs import is_daemon, pods_of_job
from healer.records import ActionStep, Plan
from healer.steps.base import StepContext, StepOutcome, done, failed, started_at, waiting
from healer.stopping import stop_asked
from healer.workloads import PodInfo

GPU_RESOURCE = "nvidia.com/gpu"
"""Extended resource of NVIDIA's device plugin."""


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
    kept = 0
    if p.get("scope") == "gpu":
        gpu = p.get("gpu", "") or p.get("pci", "")
        pods = [x for x in on_node if holds_gpu(x, p.get("gpu", ""), p.get("pci", ""),
                                                p.get("gpu_annotations", "").split(","))]
        kept = len(on_node) - len(pods)
        what = f"pods on GPU {gpu}"
    else:
        pods = pods_of_job(on_node, job, p.get("namespace") or None) if job else on_node
        what = f"pods of {job or 'any job'}"
    left = f"; {kept} pod(s) on its other GPUs keep running" if kept else ""
    if not pods:
        return done(f"no {what} left on {node}{left}", kept=str(kept))
    grace = int(p.get("grace_s", "300"))
    blocked: list[str] = []
    evicted = 0
    for at, pod in enumerate(pods):
        if pod.terminating:
            continue
        if stop_asked():  # an operator stopped the plan: the evictions left are not made
            left_running = sum(1 for x in pods[at:] if not x.terminating)
            return waiting(f"stopped by an operator after {evicted} eviction(s) on {node}; {left_running} of the "
                           f"{what} not evicted", started_at=str(since))
        try:
            ctx.workloads.evict_pod(pod.namespace, pod.name, grace)
            evicted += 1
        except TemporaryError as exc:
            blocked.append(f"{pod.name} ({exc})")
    terminating = len(pods) - len(blocked)
    line = f"{terminating} pod(s) terminating on {node}{left}"
    if blocked:
        line += f"; eviction refused, retried later: {', '.join(blocked[:3])}"
    if now - since > float(p.get("timeout_s", "1800")):
        return failed(f"drain of {node} did not finish in {p.get('timeout_s')} s: {line}")
    return waiting(line, started_at=str(since))


def holds_gpu(pod: PodInfo, gpu: str, pci: str, annotations: Iterable[str]) -> bool:
    """Whether the pod may hold this GPU: named in an assignment annotation, or asking for GPUs and naming none."""
    for key in filter(None, annotations):
        if key in pod.annotations:
            held = [_same_gpu(x.strip(), gpu, pci) for x in pod.annotations[key].split(",") if x.strip()]
            # An id that cannot be compared (an index when only the PCI id is known) may be the bad GPU.
            return any(h is not False for h in held)
    return gpu_request(pod.manifest) > 0


def gpu_request(manifest: Mapping[str, Any]) -> int:
    """GPUs the pod's containers ask for."""
    containers: Sequence[Mapping[str, Any]] = (manifest.get("spec") or {}).get("containers") or []
    total = 0
    for c in containers:
        resources = c.get("resources") or {}
        value = (resources.get("limits") or {}).get(GPU_RESOURCE) or (resources.get("requests") or {}).get(GPU_RESOURCE)
        total += int(value or 0)
    return total


def _same_gpu(held: str, gpu: str, pci: str) -> bool | None:
    """True or False when ``held`` is comparable with what the incident names, None when it is not."""
    if ":" in held:  # a PCI bus id
        return _pci_bus(held) == _pci_bus(pci) if pci else None
    if gpu and (held.isdigit() == gpu.isdigit()):  # indices with indices, UUIDs with UUIDs
        return held == gpu
    return None


def _pci_bus(text: str) -> str:
    """``00000000:3B:00.0``, ``0000:3b:00.0`` and ``0000:3b:00`` all name bus 3b device 00."""
    parts = text.lower().split(":")
    return ":".join(parts[-2:]).split(".")[0] if len(parts) >= 2 else text.lower()
