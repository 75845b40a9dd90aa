"""SimCluster: an in-memory cluster that behaves like the API server on the Cluster port.

Honours ../shared/KUBERNETES-API.md where the port touches it: a new node carries
``node.kubernetes.io/not-ready:NoSchedule`` until its Ready condition is set;
taints replace by key+effect; every write bumps ``resourceVersion``; events are
append-only. Failures can be injected per operation for the safety tests.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from healer.cluster import (
    ClusterError,
    ClusterEvent,
    Condition,
    NodeInfo,
    NotFoundError,
    Taint,
)

NOT_READY = Taint("node.kubernetes.io/not-ready", "", "NoSchedule")


@dataclass
class _Node:
    name: str
    labels: dict[str, str]
    unschedulable: bool = False
    taints: list[Taint] = field(default_factory=list)
    conditions: dict[str, Condition] = field(default_factory=dict)
    resource_version: int = 1
    gpus: int = 8


class SimCluster:
    """In-memory implementation of the Cluster port (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nodes: dict[str, _Node] = {}
        self._rv = 1
        self.events: list[ClusterEvent] = []
        self.calls: list[tuple[str, str]] = []
        self._failures: dict[str, deque[ClusterError]] = {}

    # -- building the simulated world ----------------------------------------

    def add_node(self, name: str, *, labels: Mapping[str, str] | None = None, gpus: int = 8,
                 ready: bool = True) -> None:
        """Create a node; like a real one it is not-ready-tainted until Ready is set."""
        node = _Node(name, dict(labels or {}), taints=[NOT_READY], gpus=gpus)
        if ready:  # what the kubelet's first status update does
            node.conditions["Ready"] = Condition("Ready", "True", "KubeletReady", "kubelet is posting ready status")
            node.taints = []
        with self._lock:
            self._nodes[name] = node

    def fail_next(self, op: str, *errors: ClusterError) -> None:
        """Make the next calls of `op` (e.g. ``"cordon"``) raise these errors, in order."""
        with self._lock:
            self._failures.setdefault(op, deque()).extend(errors)

    def gpus(self, name: str) -> int:
        """GPU count of a simulated node."""
        return self._nodes[name].gpus

    # -- the Cluster port ------------------------------------------------------

    def list_nodes(self) -> Sequence[NodeInfo]:
        with self._lock:
            return [self._info(n) for n in sorted(self._nodes.values(), key=lambda n: n.name)]

    def get_node(self, name: str) -> NodeInfo:
        with self._lock:
            return self._info(self._get(name))

    def cordon(self, name: str) -> None:
        self._set_unschedulable(name, True, "cordon")

    def uncordon(self, name: str) -> None:
        self._set_unschedulable(name, False, "uncordon")

    def add_taint(self, name: str, taint: Taint) -> None:
        with self._lock:
            self._enter("add_taint", name)
            n = self._get(name)
            kept = [t for t in n.taints if (t.key, t.effect) != (taint.key, taint.effect)]
            if [*kept, taint] != n.taints:
                n.taints = [*kept, taint]
                self._bump(n)

    def remove_taint(self, name: str, key: str) -> None:
        with self._lock:
            self._enter("remove_taint", name)
            n = self._get(name)
            kept = [t for t in n.taints if t.key != key]
            if kept != n.taints:
                n.taints = kept
                self._bump(n)

    def set_condition(self, name: str, condition: Condition) -> None:
        with self._lock:
            self._enter("set_condition", name)
            n = self._get(name)
            if n.conditions.get(condition.type) != condition:
                n.conditions[condition.type] = condition
                self._bump(n)
            if condition.type == "Ready":
                ready = condition.status == "True"
                n.taints = [t for t in n.taints if t.key != NOT_READY.key]
                if not ready:
                    n.taints.append(NOT_READY)

    def emit_event(self, event: ClusterEvent) -> None:
        with self._lock:
            self._enter("emit_event", event.node)
            self._get(event.node)
            self.events.append(event)

    # -- internals ---------------------------------------------------------------

    def _enter(self, op: str, name: str) -> None:
        self.calls.append((op, name))
        q = self._failures.get(op)
        if q:
            raise q.popleft()

    def _get(self, name: str) -> _Node:
        try:
            return self._nodes[name]
        except KeyError:
            raise NotFoundError(f'nodes "{name}" not found') from None

    def _bump(self, n: _Node) -> None:
        self._rv += 1
        n.resource_version = self._rv

    def _set_unschedulable(self, name: str, value: bool, op: str) -> None:
        with self._lock:
            self._enter(op, name)
            n = self._get(name)
            if n.unschedulable != value:
                n.unschedulable = value
                self._bump(n)

    @staticmethod
    def _info(n: _Node) -> NodeInfo:
        return NodeInfo(
            name=n.name, unschedulable=n.unschedulable, taints=tuple(n.taints),
            labels=dict(n.labels), conditions=tuple(n.conditions.values()),
        )


def build_cluster(nodes: int = 16, gpus_per_node: int = 8, *, nodes_per_leaf: int = 8,
                  prefix: str = "gpu-node") -> SimCluster:
    """A cluster of GPU nodes with leaf/spine topology labels."""
    c = SimCluster()
    for i in range(nodes):
        leaf = i // nodes_per_leaf
        c.add_node(f"{prefix}-{i:02d}", gpus=gpus_per_node, labels={
            "nvidia.com/gpu.count": str(gpus_per_node),
            "topology.kmend.io/leaf": f"leaf-{leaf}",
            "topology.kmend.io/spine": "spine-0",
        })
    return c


def events_for(events: Iterable[ClusterEvent], node: str) -> list[ClusterEvent]:
    """Events about one node."""
    return [e for e in events if e.node == node]

