"""Snapshot records: what the gang scheduler sees of nodes, pods and pod groups in one cycle."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from healer.cluster import Taint

POD_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
"""Coscheduling (scheduler-plugins) label naming a pod's PodGroup."""
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
"""Volcano annotation naming a pod's PodGroup."""
REQUIRED_TOPOLOGY_ANNOTATION = "kmend.io/required-topology"
"""PodGroup or pod annotation: the widest domain (leaf, spine, zone) a gang may span."""


class TaintEffect(StrEnum):
    """Taint effects; PreferNoSchedule never filters."""

    NO_SCHEDULE = "NoSchedule"
    PREFER_NO_SCHEDULE = "PreferNoSchedule"
    NO_EXECUTE = "NoExecute"


class TolerationOperator(StrEnum):
    """How a toleration matches a taint's value."""

    EQUAL = "Equal"
    EXISTS = "Exists"


class SelectorOperator(StrEnum):
    """Node selector requirement operators of required node affinity."""

    IN = "In"
    NOT_IN = "NotIn"
    EXISTS = "Exists"
    DOES_NOT_EXIST = "DoesNotExist"
    GT = "Gt"
    LT = "Lt"


class PodGroupKind(StrEnum):
    """Which PodGroup API a group comes from."""

    COSCHEDULING = "scheduling.x-k8s.io/v1alpha1"
    VOLCANO = "scheduling.volcano.sh/v1beta1"


@dataclass(frozen=True, slots=True)
class Toleration:
    """A pod toleration."""

    key: str = ""
    """Taint key; empty with operator Exists tolerates every taint."""
    operator: TolerationOperator = TolerationOperator.EQUAL
    """Equal compares values; Exists ignores them."""
    value: str = ""
    """Value compared with Equal."""
    effect: str = ""
    """Effect tolerated; empty tolerates all effects."""


@dataclass(frozen=True, slots=True)
class Requirement:
    """One node selector requirement (``matchExpressions`` or ``matchFields`` entry)."""

    key: str
    """Label key, or ``metadata.name`` for a field requirement."""
    operator: SelectorOperator
    """How the label is compared."""
    values: tuple[str, ...] = ()
    """Values for In/NotIn; one integer for Gt/Lt."""


@dataclass(frozen=True, slots=True)
class SelectorTerm:
    """A node selector term: all its requirements must hold (terms are ORed)."""

    match_expressions: tuple[Requirement, ...] = ()
    """Requirements on node labels."""
    match_fields: tuple[Requirement, ...] = ()
    """Requirements on node fields; only ``metadata.name`` exists."""


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """One node as the scheduler sees it."""

    name: str
    """Node name."""
    allocatable: Mapping[str, int] = field(default_factory=dict)
    """Allocatable resources in canonical units (cpu millicores, memory bytes, counts)."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """Node labels, including topology and the spare flag."""
    taints: tuple[Taint, ...] = ()
    """Taints on the node."""
    unschedulable: bool = False
    """Cordoned (``spec.unschedulable``)."""


@dataclass(frozen=True, slots=True)
class PodRecord:
    """One pod as the scheduler sees it."""

    namespace: str
    """Namespace."""
    name: str
    """Pod name."""
    uid: str = ""
    """Pod UID; a binding carries it so that a recreated namesake is never bound by mistake."""
    requests: Mapping[str, int] = field(default_factory=dict)
    """Effective requests in canonical units (containers, init containers and overhead)."""
    node_name: str = ""
    """Node the pod is bound to; empty while pending."""
    scheduler_name: str = "default-scheduler"
    """``spec.schedulerName``."""
    terminating: bool = False
    """``deletionTimestamp`` is set: it still holds its resources until it is gone."""
    finished: bool = False
    """Phase Succeeded or Failed: it holds nothing."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """Pod labels (the coscheduling group label lives here)."""
    annotations: Mapping[str, str] = field(default_factory=dict)
    """Pod annotations (Volcano's group annotation lives here)."""
    tolerations: tuple[Toleration, ...] = ()
    """Tolerations."""
    node_selector: Mapping[str, str] = field(default_factory=dict)
    """``spec.nodeSelector``."""
    affinity: tuple[SelectorTerm, ...] = ()
    """Required node affinity terms (ORed); empty means no constraint."""
    priority: int = 0
    """Resolved priority (``spec.priority``)."""
    created: float = 0.0
    """Creation time, seconds since the epoch."""


def bound_to(pod: PodRecord, node: str) -> PodRecord:
    """The pod bound to ``node``: ``dataclasses.replace`` costs several times more, once per bound pod.

    ``tests/test_gang_cache.py`` checks it against ``dataclasses.replace`` so no field is dropped.
    """
    return PodRecord(pod.namespace, pod.name, pod.uid, pod.requests, node, pod.scheduler_name, pod.terminating,
                     pod.finished, pod.labels, pod.annotations, pod.tolerations, pod.node_selector, pod.affinity,
                     pod.priority, pod.created)


@dataclass(frozen=True, slots=True)
class PodGroupRecord:
    """A PodGroup object (coscheduling or Volcano)."""

    namespace: str
    """Namespace."""
    name: str
    """PodGroup name."""
    min_member: int = 1
    """Pods that must be placed together before any is bound."""
    min_resources: Mapping[str, int] = field(default_factory=dict)
    """Free resources the cluster must have before the gang is tried."""
    schedule_timeout_seconds: float | None = None
    """How long a partly bound gang may wait before its bound members are released."""
    created: float = 0.0
    """Creation time, seconds since the epoch."""
    uid: str = ""
    """Object UID, for events."""
    annotations: Mapping[str, str] = field(default_factory=dict)
    """Annotations (``kmend.io/required-topology``)."""
    kind: PodGroupKind = PodGroupKind.COSCHEDULING
    """Which API the object belongs to."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything one scheduling cycle reads, taken at one moment."""

    nodes: tuple[NodeRecord, ...]
    """All nodes."""
    pods: tuple[PodRecord, ...]
    """All pods that are not finished: bound, terminating and pending."""
    pod_groups: tuple[PodGroupRecord, ...] = ()
    """All PodGroups."""
