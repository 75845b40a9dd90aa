"""Finding and Incident: the records the analyzer stage produces."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum


class FaultClass(StrEnum):
    """Stable fault-class strings (API, CLI JSON and metrics use them)."""

    GPU_LOST = "gpu_lost"
    GPU_MEMORY = "gpu_memory"
    GPU_HARDWARE = "gpu_hardware"
    GPU_THERMAL_POWER = "gpu_thermal_power"
    NVLINK = "nvlink"
    PCIE = "pcie"
    NETWORK = "network"
    NCCL_TIMEOUT = "nccl_timeout"
    NCCL_ERROR = "nccl_error"
    HANG = "hang"
    STRAGGLER = "straggler"
    APP_ERROR = "app_error"
    OOM_GPU = "oom_gpu"
    OOM_HOST = "oom_host"
    NODE = "node"
    STORAGE = "storage"


class Action(StrEnum):
    """Recommended remediation, least to most disruptive."""

    NONE = "none"
    NOTIFY = "notify"
    FIX_APPLICATION = "fix_application"
    RESTART_JOB = "restart_job"
    RESET_GPU = "reset_gpu"
    REBOOT_NODE = "reboot_node"
    REPLACE_NODE = "replace_node"


ACTION_RANK: Mapping[Action, int] = {a: i for i, a in enumerate(Action)}
"""Order of disruptiveness, used to pick the strongest action of several findings."""


class Severity(StrEnum):
    """How bad a finding is."""

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"


SEVERITY_RANK: Mapping[Severity, int] = {s: i for i, s in enumerate(Severity)}
"""Order of severity."""


class IncidentState(StrEnum):
    """Lifecycle of an incident."""

    OPEN = "open"
    REMEDIATING = "remediating"
    RESOLVED = "resolved"
    SUPPRESSED = "suppressed"


@dataclass(frozen=True, slots=True)
class Location:
    """Where a fault is: any field may be unknown."""

    node: str | None = None
    """Kubernetes node name."""
    gpu: str | None = None
    """GPU index on the node, as a string (``"3"``)."""
    pci: str | None = None
    """PCI bus id of the device (``0000:3b:00.0`` or the short ``0000:3b:00``)."""
    port: str | None = None
    """NIC device and port (``mlx5_0/1``)."""
    rank: int | None = None
    """Global rank of the process."""
    job: str | None = None
    """Training job name."""
    namespace: str | None = None
    """Kubernetes namespace of the job, when the evidence says: ``train`` in two namespaces is two jobs."""

    @property
    def job_key(self) -> str | None:
        """The job's identity: ``namespace/job`` when the namespace is known, else the bare name."""
        return job_key(self.namespace, self.job)


def job_key(namespace: str | None, job: str | None) -> str | None:
    """``namespace/job``, or `job` alone when no namespace is known (names of both never hold a ``/``)."""
    return f"{namespace}/{job}" if namespace and job else job


def job_location(key: str, *, node: str | None = None, rank: int | None = None) -> Location:
    """Where a job's finding is, from the job's key (``namespace/job`` or a bare name)."""
    ns, sep, name = key.partition("/")
    return Location(node=node, rank=rank, job=name, namespace=ns) if sep else Location(node=node, rank=rank, job=key)


@dataclass(frozen=True, slots=True)
class Finding:
    """One rule match or detector verdict."""

    id: str
    """Stable id: rule or detector id + evidence signal id, so re-analysis is idempotent."""
    ts: float
    """Time of the evidence, seconds since the Unix epoch."""
    fault_class: FaultClass
    """What kind of fault this is."""
    severity: Severity
    """How bad it is."""
    hardware: bool
    """True when the node's hardware is at fault, False when the application is."""
    where: Location
    """Where the fault is."""
    rule_id: str
    """Id of the rule or detector that produced it."""
    recommended_action: Action
    """What the rule recommends doing about it alone."""
    evidence: tuple[str, ...]
    """Ids of the signals that support it."""
    message: str = ""
    """Human-readable summary, usually the matched line."""
    symptom_of: frozenset[FaultClass] = frozenset()
    """Fault classes that, when present nearby, explain this finding (it is then a symptom)."""
    fields: Mapping[str, str] = field(default_factory=dict)
    """Fields extracted from the evidence (xid, seq, op, peer, ...)."""

    @property
    def is_symptom_class(self) -> bool:
        """True when the finding can be explained by another fault."""
        return bool(self.symptom_of)


@dataclass(frozen=True, slots=True)
class TimelineEntry:
    """One event in an incident's life."""

    ts: float
    """When it happened."""
    what: str
    """What happened, one line."""


@dataclass(frozen=True, slots=True)
class Incident:
    """Findings that share one cause, with that cause named."""

    id: str
    """Stable id, derived from the first root-cause finding."""
    fault_class: FaultClass
    """Class of the root-cause finding."""
    severity: Severity
    """Highest severity among the findings."""
    hardware: bool
    """Whether the root cause is hardware."""
    recommended_action: Action
    """Action for the incident as a whole."""
    root_cause: Location
    """Node, GPU, rank and job at the root of the incident."""
    opened_at: float
    """Time of the earliest finding."""
    updated_at: float
    """Time of the latest finding."""
    findings: tuple[Finding, ...]
    """All findings folded into the incident, root cause first."""
    jobs: frozenset[str] = frozenset()
    """Jobs affected."""
    state: IncidentState = IncidentState.OPEN
    """Lifecycle state."""
    timeline: tuple[TimelineEntry, ...] = ()
    """What happened, in order."""

    @property
    def root_finding(self) -> Finding:
        """The finding that names the root cause."""
        return self.findings[0]
