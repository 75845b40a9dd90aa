"""Jobs and their owners: which pods make up a job, and how a job is restarted as a gang. Pure."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from healer.keys import JOB_LABEL, MANAGED_LABEL, POD_GROUP_LABELS
from healer.workloads import ObjectKey, PodInfo, Workloads

JOB_NAME_LABELS = (
    JOB_LABEL,
    "training.kubeflow.org/job-name",
    "jobset.sigs.k8s.io/jobset-name",
    "volcano.sh/job-name",
    "batch.kubernetes.io/job-name",
    "job-name",
    *POD_GROUP_LABELS,
)
"""Pod labels that name the training job a pod belongs to, most specific first."""


class RestartMethod(StrEnum):
    """How a job's owner is made to restart every rank together."""

    DELETE_PODS = "delete_pods"
    """The owner's controller recreates deleted pods (PyTorchJob, indexed batch/v1 Job)."""
    DELETE_CHILD_JOBS = "delete_child_jobs"
    """The JobSet controller recreates deleted child Jobs, and they their pods."""
    VOLCANO_COMMAND = "volcano_command"
    """A ``bus.volcano.sh`` Command with action RestartJob, as ``vcctl`` sends."""
    RECREATE_PODS = "recreate_pods"
    """Plain pods of a pod group: kmend deletes them and recreates them from their recorded spec."""


@dataclass(frozen=True, slots=True)
class JobOwner:
    """The object that owns a training job's pods, and how to restart it."""

    key: ObjectKey
    """The owner (or, for plain pods, the first pod)."""
    method: RestartMethod
    """How to restart it."""


def job_of(pod: PodInfo) -> str | None:
    """The job a pod belongs to, by its labels."""
    for label in JOB_NAME_LABELS:
        if value := pod.labels.get(label):
            return value
    return None


def jobs_bound(pods: Iterable[PodInfo]) -> list[str]:
    """Jobs with a pod bound to the node now (DaemonSets' and terminating pods aside), by name."""
    return sorted({j for p in pods if p.node and not p.terminating and not is_daemon(p) and (j := job_of(p))})


def pods_of_job(pods: Iterable[PodInfo], job: str, namespace: str | None = None) -> list[PodInfo]:
    """The pods of one job (in one namespace when given)."""
    return [p for p in pods if job_of(p) == job and (namespace is None or p.namespace == namespace)]


def is_daemon(pod: PodInfo) -> bool:
    """Pods of a DaemonSet stay on a drained node."""
    return any(o.kind == "DaemonSet" for o in pod.owners)


def owner_of(pods: Sequence[PodInfo]) -> JobOwner | None:
    """The owner that restarts these pods as a gang; None for pods nothing can restart."""
    for p in pods:
        o = p.controller
        if o is None:
            continue
        if o.api_version.startswith("kubeflow.org") and o.kind.endswith("Job"):
            return JobOwner(ObjectKey(o.api_version, o.kind, p.namespace, o.name), RestartMethod.DELETE_PODS)
        if o.api_version.startswith("batch.volcano.sh") and o.kind == "Job":
            return JobOwner(ObjectKey(o.api_version, o.kind, p.namespace, o.name), RestartMethod.VOLCANO_COMMAND)
        if o.api_version == "batch/v1" and o.kind == "Job":
            if js := p.labels.get("jobset.sigs.k8s.io/jobset-name"):
                return JobOwner(ObjectKey("jobset.x-k8s.io/v1alpha2", "JobSet", p.namespace, js),
                                RestartMethod.DELETE_CHILD_JOBS)
            return JobOwner(ObjectKey(o.api_version, o.kind, p.namespace, o.name), RestartMethod.DELETE_PODS)
    for p in pods:
        if not p.owners and any(label in p.labels for label in POD_GROUP_LABELS):
            return JobOwner(ObjectKey("v1", "Pod", p.namespace, p.name), RestartMethod.RECREATE_PODS)
    return None


def child_jobs(pods: Iterable[PodInfo]) -> list[ObjectKey]:
    """The batch/v1 Jobs that own these pods (a JobSet's children)."""
    out = {ObjectKey("batch/v1", "Job", p.namespace, o.name)
           for p in pods for o in p.owners if o.api_version == "batch/v1" and o.kind == "Job"}
    return sorted(out, key=lambda k: k.name)


def recreatable(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """A pod manifest stripped of what the API server and scheduler set, ready to be created again."""
    meta = dict(manifest.get("metadata") or {})
    keep = {k: meta[k] for k in ("name", "labels", "annotations") if k in meta}
    spec = dict(manifest.get("spec") or {})
    spec.pop("nodeName", None)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": keep, "spec": spec}


def job_opted_out(workloads: Workloads, namespace: str, job: str, pod_labels: list[dict[str, str]]) -> str:
    """Why kmend leaves this job alone (its namespace or pods say ``kmend.io/managed=false``), or ""."""
    ns = workloads.get_object(ObjectKey("v1", "Namespace", "", namespace)) or {}
    if ns.get("metadata", {}).get("labels", {}).get(MANAGED_LABEL) == "false":
        return f"namespace {namespace} has {MANAGED_LABEL}=false"
    if any(labels.get(MANAGED_LABEL) == "false" for labels in pod_labels):
        return f"job {job} has {MANAGED_LABEL}=false"
    return ""
