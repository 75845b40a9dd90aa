"""SimCluster: an in-memory cluster that behaves like the API server on the Cluster port.

Honours ../shared/KUBERNETES-API.md where the port touches it: a new node carries
``node.kubernetes.io/not-ready:NoSchedule`` until its Ready condition is set;
taints replace by key+effect; every write bumps ``resourceVersion``; events are
append-only (one per idempotency key). Failures can be injected per operation for the safety
tests. Every change that takes effect is reported to an optional ``on_change`` callback, which
``sim.world`` uses to keep an action log and to persist the simulated world to a file.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from healer.cluster import (
    ClusterError,
    ClusterEvent,
    Condition,
    NodeInfo,
    NotFoundError,
    PermanentError,
    Taint,
)
from healer.keys import MANAGED_LABEL

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
    annotations: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "labels": self.labels, "unschedulable": self.unschedulable,
                "taints": [[t.key, t.value, t.effect] for t in self.taints],
                "conditions": [[c.type, c.status, c.reason, c.message] for c in self.conditions.values()],
                "rv": self.resource_version, "gpus": self.gpus, "annotations": self.annotations}

    @staticmethod
    def from_json(d: dict[str, Any]) -> _Node:
        return _Node(d["name"], dict(d["labels"]), d["unschedulable"], [Taint(*t) for t in d["taints"]],
                     {c[0]: Condition(*c) for c in d["conditions"]}, d["rv"], d["gpus"], dict(d["annotations"]))


OnChange = Callable[[str, str], None]
"""Called with (operation, target) after every change that took effect, under the cluster's lock."""


class SimCluster:
    """In-memory implementation of the Cluster port (thread-safe)."""

    def __init__(self, *, on_change: OnChange | None = None) -> None:
        self._lock = threading.RLock()
        self._nodes: dict[str, _Node] = {}
        self._rv = 1
        self.events: list[ClusterEvent] = []
        self.calls: list[tuple[str, str]] = []
        self._failures: dict[str, deque[ClusterError]] = {}
        self.on_change = on_change

    @property
    def lock(self) -> threading.RLock:
        """The lock every operation holds (the world persists under it)."""
        return self._lock

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

    def list_nodes(self, labels: Mapping[str, str] | None = None) -> Sequence[NodeInfo]:
        with self._lock:
            nodes = [self._info(n) for n in sorted(self._nodes.values(), key=lambda n: n.name)]
        return [n for n in nodes if all(n.labels.get(k) == v for k, v in (labels or {}).items())]

    def get_node(self, name: str) -> NodeInfo:
        with self._lock:
            return self._info(self._get(name))

    def peek_node(self, name: str) -> NodeInfo:
        return self.get_node(name)

    def cordon(self, name: str) -> None:
        with self._lock:
            if self._get(name).labels.get(MANAGED_LABEL) == "false":
                raise PermanentError(f"node {name} has {MANAGED_LABEL}=false: not cordoned")
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
                self._bump(n, f"add_taint {taint.key}={taint.value}:{taint.effect}", name)

    def remove_taint(self, name: str, key: str) -> None:
        with self._lock:
            self._enter("remove_taint", name)
            n = self._get(name)
            kept = [t for t in n.taints if t.key != key]
            if kept != n.taints:
                n.taints = kept
                self._bump(n, f"remove_taint {key}", name)

    def set_condition(self, name: str, condition: Condition) -> None:
        with self._lock:
            self._enter("set_condition", name)
            n = self._get(name)
            if n.conditions.get(condition.type) != condition:
                n.conditions[condition.type] = condition
                self._bump(n, f"set_condition {condition.type}={condition.status}", name)
            if condition.type == "Ready":
                ready = condition.status == "True"
                n.taints = [t for t in n.taints if t.key != NOT_READY.key]
                if not ready:
                    n.taints.append(NOT_READY)

    def emit_event(self, event: ClusterEvent) -> None:
        with self._lock:
            self._enter("emit_event", event.node)
            self._get(event.node)
            if event.key and any(e.key == event.key for e in self.events):
                return  # AlreadyExists: the event was recorded before a crash
            self.events.append(event)
            self._changed(f"emit_event {event.reason}", event.node)

    def patch_node_metadata(self, name: str, *, labels: Mapping[str, str | None] | None = None,
                            annotations: Mapping[str, str | None] | None = None) -> None:
        with self._lock:
            self._enter("patch_node_metadata", name)
            n = self._get(name)
            changed = _apply(n.labels, labels or {}) | _apply(n.annotations, annotations or {})
            if changed:
                self._bump(n, "patch_node_metadata " + ",".join(sorted(changed)), name)

    # -- persistence (sim.world) --------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The whole simulated state, for a file-backed world."""
        with self._lock:
            return {"rv": self._rv, "nodes": [n.to_json() for n in self._nodes.values()],
                    "events": [[e.node, e.reason, e.message, e.type, e.key] for e in self.events]}

    def load_json(self, d: dict[str, Any]) -> None:
        """Replace the state with one written by ``to_json``."""
        with self._lock:
            self._rv = d["rv"]
            self._nodes = {n["name"]: _Node.from_json(n) for n in d["nodes"]}
            self.events = [ClusterEvent(*e) for e in d["events"]]

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

    def _bump(self, n: _Node, op: str, target: str) -> None:
        self._rv += 1
        n.resource_version = self._rv
        self._changed(op, target)

    def _changed(self, op: str, target: str) -> None:
        if self.on_change is not None:
            self.on_change(op, target)

    def _set_unschedulable(self, name: str, value: bool, op: str) -> None:
        with self._lock:
            self._enter(op, name)
            n = self._get(name)
            if n.unschedulable != value:
                n.unschedulable = value
                self._bump(n, op, name)

    @staticmethod
    def _info(n: _Node) -> NodeInfo:
        return NodeInfo(
            name=n.name, unschedulable=n.unschedulable, taints=tuple(n.taints),
            labels=dict(n.labels), conditions=tuple(n.conditions.values()), annotations=dict(n.annotations),
        )


def _apply(target: dict[str, str], patch: Mapping[str, str | None]) -> set[str]:
    """Apply a metadata patch; returns the keys that changed."""
    changed = set()
    for k, v in patch.items():
        if v is None:
            if k in target:
                del target[k]
                changed.add(k)
        elif target.get(k) != v:
            target[k] = v
            changed.add(k)
    return changed


SPARE_LABEL = "kmend.io/spare"
"""Label marking a node of the hot-spare pool (value ``true``)."""


def build_cluster(nodes: int = 16, gpus_per_node: int = 8, *, nodes_per_leaf: int = 8,
                  leaves_per_spine: int = 8, spares: int = 0, prefix: str = "gpu-node",
                  on_change: OnChange | None = None) -> SimCluster:
    """A cluster of GPU nodes with leaf/spine topology labels; the last `spares` of them form the spare pool."""
    c = SimCluster(on_change=on_change)
    width = max(2, len(str(nodes - 1)))
    for i in range(nodes):
        leaf = i // nodes_per_leaf
        name = f"{prefix}-{i:0{width}d}"
        c.add_node(name, gpus=gpus_per_node, labels={
            "nvidia.com/gpu.count": str(gpus_per_node),
            "topology.kmend.io/leaf": f"leaf-{leaf}",
            "topology.kmend.io/spine": f"spine-{leaf // leaves_per_spine}",
        })
        if i >= nodes - spares:
            with c.lock:
                n = c._nodes[name]
                n.labels[SPARE_LABEL] = "true"
                n.taints.append(Taint(SPARE_LABEL, "", "NoSchedule"))
    return c


def events_for(events: Iterable[ClusterEvent], node: str) -> list[ClusterEvent]:
    """Events about one node."""
    return [e for e in events if e.node == node]

