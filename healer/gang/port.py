"""The PodScheduling port: the one door through which the gang scheduler reads and binds pods.

Adapters: ``healer.kube.pods.KubePodScheduling`` (official client, real API server) and
``sim.pods.SimPods`` (in memory). Both pass ``tests/contract/test_binding_contract.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, runtime_checkable

from healer.cluster import TemporaryError
from healer.gang.records import NodeRecord, PodGroupKind, PodGroupRecord, PodRecord, Snapshot

PodKey = tuple[str, str]
"""``(namespace, name)`` of a pod."""


class ConflictError(TemporaryError):
    """409 Conflict: the pod is already bound, is being deleted, or its UID changed."""


class UncertainError(TemporaryError):
    """The request may or may not have taken effect (a timeout or a dropped connection)."""


class PodGroupPhase(StrEnum):
    """PodGroup phases kmend writes (coscheduling's names)."""

    PENDING = "Pending"
    SCHEDULED = "Scheduled"


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """An object an event is about."""

    kind: str
    """``Pod`` or ``PodGroup``."""
    namespace: str
    """Namespace."""
    name: str
    """Name."""
    uid: str = ""
    """UID, when known."""
    api_version: str = "v1"
    """API version of the kind."""


@dataclass(frozen=True, slots=True)
class PodGroupStatus:
    """What kmend reports on a PodGroup."""

    phase: PodGroupPhase
    """Pending while it waits, Scheduled once every required member is bound."""
    scheduled: int
    """Members bound."""
    reason: str = ""
    """Why it waits, with numbers; empty once scheduled."""


@dataclass(frozen=True, slots=True)
class PodChanges:
    """What changed since a cursor: pods as deltas, nodes and PodGroups whole (they are few)."""

    cursor: str
    """Pass it to the next ``changes`` call to read only what happens after this one."""
    full: bool
    """``pods`` holds every unfinished pod (first read, or the cursor expired): replace, do not merge."""
    pods: tuple[PodRecord, ...]
    """Pods added or changed since the cursor, each in its latest state; every pod when ``full``."""
    gone: tuple[PodKey, ...]
    """Pods deleted or finished since the cursor and not recreated."""
    nodes: tuple[NodeRecord, ...]
    """All nodes."""
    pod_groups: tuple[PodGroupRecord, ...]
    """All PodGroups."""


def pod_ref(pod: PodRecord) -> ObjectRef:
    """The event target for a pod."""
    return ObjectRef("Pod", pod.namespace, pod.name, pod.uid)


def group_ref(namespace: str, name: str, uid: str, kind: PodGroupKind) -> ObjectRef:
    """The event target for a PodGroup of either API."""
    return ObjectRef("PodGroup", namespace, name, uid, str(kind))


@runtime_checkable
class PodScheduling(Protocol):
    """Reading and binding pods for a secondary scheduler.

    Guarantees every adapter honours:
    - ``changes(cursor)`` applied to what the previous call returned gives what ``snapshot`` would
      return now (pods keyed by namespace and name), once the adapter has seen the writes: a
      watching adapter sees them when its stream delivers them, so a write made a moment ago may
      show in the next call instead; an empty or expired cursor gives a full list, and so does
      an adapter that lost track of changes (its watch expired), which sets ``full``;
    - ``snapshot`` returns nodes, every pod that is not finished (pending, bound and terminating,
      whatever its scheduler) and every PodGroup, each list read in one pass;
    - ``bind`` follows the Binding API: a pod that is already bound, is being deleted or whose UID
      differs from the record's raises ``ConflictError``; there is no unbind;
    - ``delete_pod`` is idempotent: a missing pod is not an error; a bound pod only turns
      terminating and keeps its resources until it is gone; an unbound pod goes at once;
    - ``NotFoundError`` for a missing pod on ``bind``, ``TemporaryError`` (``ConflictError``,
      ``UncertainError``) for what a retry or a later cycle can fix (409, 429, 5xx, timeouts),
      ``PermanentError`` with the API's message for the rest;
    - events and PodGroup status writes never raise for a missing object (the write is dropped).
    """

    def list_pending(self, scheduler_name: str) -> Sequence[PodRecord]:
        """Unbound, non-terminating pods whose ``spec.schedulerName`` is ``scheduler_name``."""
        ...

    def snapshot(self) -> Snapshot:
        """Nodes, unfinished pods and PodGroups."""
        ...

    def changes(self, cursor: str) -> PodChanges:
        """Pods changed and gone since ``cursor`` ("" for everything), with all nodes and PodGroups."""
        ...

    def bind(self, pod: PodRecord, node: str) -> None:
        """Bind the pod (by namespace, name and UID) to ``node`` through the Binding API."""
        ...

    def delete_pod(self, pod: PodRecord) -> None:
        """Delete the pod so its controller recreates it (releases a half-bound gang)."""
        ...

    def emit_event(self, ref: ObjectRef, reason: str, message: str, type: str = "Normal") -> None:
        """Record a Kubernetes Event about ``ref``."""
        ...

    def set_pod_group_status(self, namespace: str, name: str, kind: PodGroupKind,
                             status: PodGroupStatus) -> None:
        """Write the PodGroup's phase and scheduled count, and the reason kmend gives."""
        ...
