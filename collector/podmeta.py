"""Which training job and rank a pod belongs to, from its labels.

The labels come from the Kubernetes API once per pod. The in-cluster reader
uses plain HTTPS with the pod's service-account token (httpx) rather than the
``kubernetes`` client: the agent needs one GET per new pod, and only the
healer's cluster adapter may import the client.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx
import yaml

# (job-name label, rank label) pairs, most specific first.
JOB_LABELS: tuple[tuple[str, str | None], ...] = (
    ("kmend.io/job", "kmend.io/rank"),
    ("training.kubeflow.org/job-name", "training.kubeflow.org/replica-index"),
    ("jobset.sigs.k8s.io/jobset-name", "jobset.sigs.k8s.io/job-index"),
    ("volcano.sh/job-name", "volcano.sh/task-index"),
    ("batch.kubernetes.io/job-name", "batch.kubernetes.io/job-completion-index"),
)


def job_and_rank(labels: Mapping[str, str]) -> tuple[str | None, int | None]:
    """Job name and rank from pod labels (Kubeflow, JobSet, Volcano, ``kmend.io/job``)."""
    for job_key, rank_key in JOB_LABELS:
        job = labels.get(job_key)
        if not job:
            continue
        raw = labels.get(rank_key) if rank_key else None
        rank = int(raw) if raw is not None and raw.isdigit() else None
        return job, rank
    return None, None


class PodMetadataProvider(Protocol):
    """Looks up a pod's labels.

    Guarantees: returns ``None`` for a pod it cannot find (deleted, not yet
    visible) rather than raising; raises only on transport errors, which the
    caller may retry later. Each call is bounded by a short timeout.
    """

    def labels(self, namespace: str, pod: str, uid: str) -> Mapping[str, str] | None:
        """Labels of the pod, or ``None`` when it is unknown."""
        ...


@dataclass
class StaticPodMetadata:
    """Fixed labels per ``namespace/pod`` (tests, or nodes without API access)."""

    pods: dict[str, dict[str, str]] = field(default_factory=dict)
    """``"namespace/pod"`` to labels."""
    calls: int = 0
    """How many lookups were made (to check caching)."""

    def labels(self, namespace: str, pod: str, uid: str) -> Mapping[str, str] | None:
        """Labels of the pod, or ``None`` when it is unknown."""
        self.calls += 1
        return self.pods.get(f"{namespace}/{pod}")


SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeApiPodMetadata:
    """Reads pod labels from the API server with the service-account token."""

    def __init__(
        self,
        *,
        base_url: str = "https://kubernetes.default.svc",
        sa_dir: Path = SA_DIR,
        timeout: float = 2.0,
        client: httpx.Client | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.sa_dir = sa_dir
        ca = sa_dir / "ca.crt"
        self._client = client or httpx.Client(
            timeout=timeout, verify=str(ca) if ca.exists() else True
        )

    def _token(self) -> str:
        # Re-read every call: projected tokens are rotated by the kubelet.
        return (self.sa_dir / "token").read_text().strip()

    def labels(self, namespace: str, pod: str, uid: str) -> Mapping[str, str] | None:
        """Labels of the pod, or ``None`` when it is unknown or was replaced."""
        url = f"{self.base_url}/api/v1/namespaces/{namespace}/pods/{pod}"
        resp = self._client.get(url, headers={"Authorization": f"Bearer {self._token()}"})
        if resp.status_code == 404:
            return None
        resp.raise_for_status()
        meta = resp.json().get("metadata", {})
        if uid and meta.get("uid") not in (None, uid):
            return None
        labels = meta.get("labels") or {}
        return {str(k): str(v) for k, v in labels.items()}

    @classmethod
    def in_cluster(cls) -> KubeApiPodMetadata | None:
        """A reader for the cluster this pod runs in, or ``None`` outside a cluster."""
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host or not (SA_DIR / "token").exists():
            return None
        if ":" in host:
            host = f"[{host}]"
        return cls(base_url=f"https://{host}:{port}")


class FilePodMetadata:
    """Labels from a file, for nodes without API access (off-cluster, or an agent without RBAC).

    The file is JSON or YAML mapping ``"namespace/pod"`` (or a bare pod name, any namespace)
    to that pod's labels. It is read again when it changes, so whatever writes it (a
    sidecar, a launcher script) can add pods while the agent runs.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._pods: dict[str, dict[str, str]] = {}
        self._load()

    def _load(self) -> None:
        st = self.path.stat()
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        self._pods = parse_labels_file(self.path.read_text(encoding="utf-8"), str(self.path))
        self._stamp = stamp

    def labels(self, namespace: str, pod: str, uid: str) -> Mapping[str, str] | None:
        """Labels of the pod, or ``None`` when the file does not list it."""
        self._load()
        return self._pods.get(f"{namespace}/{pod}") or self._pods.get(pod)


def parse_labels_file(text: str, name: str) -> dict[str, dict[str, str]]:
    """``{"ns/pod" or "pod": {label: value}}`` from JSON or YAML; a bad file is one ValueError naming it."""
    try:
        doc = yaml.safe_load(text)  # JSON is YAML
    except yaml.YAMLError as exc:
        raise ValueError(f"{name}: not JSON or YAML: {exc}") from exc
    if doc is None:
        return {}
    if not isinstance(doc, dict) or not all(isinstance(v, dict) for v in doc.values()):
        raise ValueError(f"{name}: expected a mapping of pod name to a mapping of labels")
    return {str(pod): {str(k): str(v) for k, v in labels.items()} for pod, labels in doc.items()}
