"""The Cluster port: the one narrow door through which the healer touches a cluster.

Adapters: ``healer.kube.cluster.KubeCluster`` (official client, real API server) and
``sim.cluster.SimCluster`` (in memory). Both pass ``tests/contract``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


class ClusterError(Exception):
    """Base of errors raised by Cluster adapters."""


class ClusterConfigError(ClusterError):
    """The cluster cannot be reached as configured (no or unreadable kubeconfig, no in-cluster account)."""


class TemporaryError(ClusterError):
    """Retry later (409 conflict, 429, 5xx, timeouts); `delay` is a hint in seconds."""

    def __init__(self, message: str, delay: float = 1.0, *, unreachable: bool = False,
                 retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.delay = delay
        self.unreachable = unreachable
        """The server did not answer (refused, reset, timed out) or answered 5xx/429: a loop backs off, and the
        outage is said once (``healer.reach``), not per call."""
        self.retry_after = retry_after
        """Seconds the server asked for (``Retry-After``); 0 when it did not say."""


class PermanentError(ClusterError):
    """Do not retry (4xx other than 409/429); the message is the API's."""


class NotFoundError(PermanentError):
    """The object does not exist."""


@dataclass(frozen=True, slots=True)
class Taint:
    """A node taint."""

    key: str
    """Taint key, e.g. ``kmend.io/fault``."""
    value: str
    """Taint value, e.g. the fault class."""
    effect: str
    """``NoSchedule``, ``PreferNoSchedule`` or ``NoExecute``."""


@dataclass(frozen=True, slots=True)
class Condition:
    """A node condition as kmend reads it back."""

    type: str
    """Condition type, e.g. ``KmendGPUHealthy``."""
    status: str
    """``True``, ``False`` or ``Unknown``."""
    reason: str
    """CamelCase reason."""
    message: str
    """Human-readable message."""


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What the healer needs to know about a node."""

    name: str
    """Node name."""
    unschedulable: bool
    """Cordoned."""
    taints: tuple[Taint, ...] = ()
    """All taints on the node."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """Node labels (topology, spare pool, opt-out)."""
    conditions: tuple[Condition, ...] = ()
    """Node conditions."""
    annotations: Mapping[str, str] = field(default_factory=dict)
    """Node annotations (who/why/when of a quarantine, repair requests)."""

    def taint(self, key: str) -> Taint | None:
        """The first taint with this key, if any."""
        return next((t for t in self.taints if t.key == key), None)

    @property
    def ready(self) -> bool:
        """The kubelet reports Ready=True."""
        return any(c.type == "Ready" and c.status == "True" for c in self.conditions)


@dataclass(frozen=True, slots=True)
class ClusterEvent:
    """A Kubernetes Event about a node, as emitted by kmend."""

    node: str
    """Node the event is about."""
    reason: str
    """CamelCase reason."""
    message: str
    """Message."""
    type: str = "Warning"
    """``Normal`` or ``Warning``."""
    key: str = ""
    """Idempotency key (the step id): an event with a key already recorded is not recorded again."""


@runtime_checkable
class Cluster(Protocol):
    """Side effects on a cluster.

    Guarantees every adapter honours:
    - every mutating call is idempotent: repeating it leaves the same state and
      does not raise (cordoning a cordoned node, adding a taint that exists);
    - ``NotFoundError`` for a missing node, ``TemporaryError`` for conditions a
      retry can fix (conflicts, throttling, server errors), ``PermanentError``
      for the rest;
    - a taint or condition write replaces only its own key/type, never others';
    - ``patch_node_metadata`` touches only the keys it names (None removes a key);
    - an event with a ``key`` is recorded at most once (a retry after a crash finds it).
    """

    def list_nodes(self, labels: Mapping[str, str] | None = None) -> Sequence[NodeInfo]:
        """All nodes, or those carrying every one of ``labels`` (selected by the server where there is one)."""
        ...

    def get_node(self, name: str) -> NodeInfo:
        """One node."""
        ...

    def peek_node(self, name: str) -> NodeInfo:
        """One node as last seen, without asking the server where a watch keeps it (it may trail the server by the
        watch's delay): for decisions whose writes check the node again, as ``cordon`` does."""
        ...

    def cordon(self, name: str) -> None:
        """Mark the node unschedulable; ``PermanentError`` for a node labelled ``kmend.io/managed=false``, judged
        on the very version of the node the write applies to."""
        ...

    def uncordon(self, name: str) -> None:
        """Mark the node schedulable."""
        ...

    def add_taint(self, name: str, taint: Taint) -> None:
        """Add or update the taint with this key and effect."""
        ...

    def remove_taint(self, name: str, key: str) -> None:
        """Remove every taint with this key."""
        ...

    def set_condition(self, name: str, condition: Condition) -> None:
        """Set one node condition through the status subresource."""
        ...

    def emit_event(self, event: ClusterEvent) -> None:
        """Record a Kubernetes Event on the node."""
        ...

    def patch_node_metadata(self, name: str, *, labels: Mapping[str, str | None] | None = None,
                            annotations: Mapping[str, str | None] | None = None) -> None:
        """Set (or, with None, remove) these labels and annotations, leaving the others alone."""
        ...
