"""The Workloads port: pods, evictions, owners and ConfigMaps, as the healer's steps need them.

Adapters: ``healer.kube.workloads.KubeWorkloads`` (official client) and ``sim.workloads.SimWorkloads``
(in memory, with the API server's behaviour). Both pass ``tests/contract/test_workloads_contract.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class ObjectKey:
    """Names one namespaced object of any kind."""

    api_version: str
    """``batch/v1``, ``kubeflow.org/v1``, ..."""
    kind: str
    """``Job``, ``PyTorchJob``, ``JobSet``, ..."""
    namespace: str
    """Namespace."""
    name: str
    """Name."""

    def __str__(self) -> str:
        return f"{self.kind}/{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class OwnerRef:
    """One ``metadata.ownerReferences`` entry."""

    api_version: str
    """API version of the owner."""
    kind: str
    """Kind of the owner."""
    name: str
    """Name of the owner (same namespace as the pod)."""
    controller: bool = True
    """Whether the owner is the managing controller."""


@dataclass(frozen=True, slots=True)
class PodInfo:
    """What the healer needs to know about a pod."""

    namespace: str
    """Namespace."""
    name: str
    """Name."""
    uid: str
    """UID; a recreated namesake has another."""
    node: str = ""
    """Node it is bound to; empty while pending."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """Labels (job names, pod group)."""
    annotations: Mapping[str, str] = field(default_factory=dict)
    """Annotations (checkpoint path)."""
    owners: tuple[OwnerRef, ...] = ()
    """Owner references."""
    terminating: bool = False
    """``deletionTimestamp`` is set: the kubelet still runs it until it is gone."""
    phase: str = "Pending"
    """``Pending``, ``Running``, ``Succeeded``, ``Failed``."""
    created: float = 0.0
    """Creation time, seconds since the epoch."""
    manifest: Mapping[str, Any] = field(default_factory=dict)
    """The pod as created (metadata name/labels/annotations and spec), for recreating it."""

    @property
    def controller(self) -> OwnerRef | None:
        """The managing owner, if any."""
        return next((o for o in self.owners if o.controller), None)


@runtime_checkable
class Workloads(Protocol):
    """Pods and the objects that own them.

    Guarantees every adapter honours:
    - ``evict_pod`` goes through the Eviction API: a PodDisruptionBudget that allows no disruption
      raises ``TemporaryError`` (429) and nothing is deleted; a missing or already terminating pod
      is not an error;
    - deleting or evicting a bound pod only makes it terminating until its grace period ends;
    - creates are idempotent: an object that already exists (409 AlreadyExists) is not an error;
      deletes are idempotent: a missing object is not an error;
    - ``annotate`` and ``apply_config_map`` touch only the keys they name (None removes one);
    - the port's error classes as on the Cluster port (``TemporaryError`` for 409/429/5xx/timeouts,
      ``PermanentError`` with the API's message for other 4xx, ``NotFoundError`` for a missing target).
    """

    def list_pods(self, *, namespace: str | None = None, node: str | None = None,
                  selector: Mapping[str, str] | None = None) -> Sequence[PodInfo]:
        """Pods that are not finished, filtered by namespace, node and label equality."""
        ...

    def pods_on_node(self, node: str) -> Sequence[PodInfo]:
        """The unfinished pods bound to ``node`` now, for a decision (which job a fault hurts): from a pod watch
        where one is in sync, else listed. ``manifest`` may be empty; a step that recreates pods lists them."""
        ...

    def evict_pod(self, namespace: str, name: str, grace_s: int) -> None:
        """Evict through the Eviction API with this grace period."""
        ...

    def delete_pod(self, namespace: str, name: str, grace_s: int | None = None) -> None:
        """Delete (a controller recreates it; a plain pod is gone for good)."""
        ...

    def create_pod(self, namespace: str, manifest: Mapping[str, Any]) -> None:
        """Create a pod from a manifest."""
        ...

    def get_object(self, key: ObjectKey) -> Mapping[str, Any] | None:
        """The object as JSON, or None when it does not exist."""
        ...

    def create_object(self, key: ObjectKey, manifest: Mapping[str, Any]) -> None:
        """Create an object of any kind from a manifest."""
        ...

    def delete_object(self, key: ObjectKey) -> None:
        """Delete an object of any kind (its dependents go with it)."""
        ...

    def annotate(self, key: ObjectKey, annotations: Mapping[str, str | None]) -> None:
        """Set (None: remove) annotations on an object."""
        ...

    def apply_config_map(self, namespace: str, name: str, data: Mapping[str, str],
                         labels: Mapping[str, str] | None = None) -> None:
        """Create the ConfigMap or update these keys of it."""
        ...


def pod_key(pod: PodInfo) -> ObjectKey:
    """The key of a pod."""
    return ObjectKey("v1", "Pod", pod.namespace, pod.name)
