"""One cycle's view of the cluster as arrays: free resources per node and the masks that filter them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import numpy.typing as npt

from healer.gang.config import SchedulerConfig
from healer.gang.nodeindex import FilterKey, NodeIndex, filter_key
from healer.gang.quantity import PODS
from healer.gang.records import PodRecord, Snapshot
from healer.gang.reservations import Reservation
from healer.gang.taints import Mask

Matrix = npt.NDArray[np.int64]
"""A row per node, a column per resource."""
Vector = npt.NDArray[np.int64]
"""One amount per resource column."""
Counts = npt.NDArray[np.int64]
"""One integer per node."""

__all__ = ["ClusterState", "Counts", "FilterKey", "Matrix", "Vector", "filter_key"]


def request_vector(columns: Mapping[str, int], requests: Mapping[str, int]) -> Vector:
    """Requests as a vector over ``columns``; every pod takes one pod slot."""
    vec = np.zeros(len(columns), dtype=np.int64)
    for name, amount in requests.items():
        vec[columns[name]] = amount
    vec[columns[PODS]] = max(1, int(vec[columns[PODS]]))
    return vec


def allocatable(nodes: NodeIndex, resources: Sequence[str]) -> Matrix:
    """Allocatable per node (rows) and resource (columns)."""
    out: Matrix = np.zeros((len(nodes.nodes), len(resources)), dtype=np.int64)
    for col, name in enumerate(resources):
        amounts = nodes.allocatable.get(name)
        if amounts is not None:
            out[:, col] = amounts
    return out


def usage(nodes: NodeIndex, resources: Sequence[str], pods: Iterable[PodRecord]) -> tuple[Matrix, Mask]:
    """Requests of bound, unfinished pods summed per node, and the nodes with a terminating pod.

    Pods on nodes not in the index hold nothing the scheduler can give out, so they are skipped.
    """
    index, n = nodes.index, len(nodes.nodes)
    columns = {r: i for i, r in enumerate(resources)}
    placed = [(index.get(p.node_name, -1), p) for p in pods if p.node_name and not p.finished]
    placed = [(i, p) for i, p in placed if i >= 0]
    rows = np.fromiter((i for i, _ in placed), dtype=np.intp, count=len(placed))
    terminating = np.zeros(n, dtype=np.bool_)
    terminating[[i for i, p in placed if p.terminating]] = True
    # Pods come in a few sizes: count pods per (node, size) and multiply by each size's vector,
    # so the per-pod Python work is one tuple and one dict lookup.
    sizes: dict[tuple[tuple[str, int], ...], int] = {}
    kinds = np.fromiter((sizes.setdefault(tuple(p.requests.items()), len(sizes)) for _, p in placed),
                        dtype=np.intp, count=len(placed))
    vectors = np.zeros((max(1, len(sizes)), len(resources)), dtype=np.int64)
    for size, k in sizes.items():
        vectors[k] = request_vector(columns, dict(size))
    per_node = np.bincount(rows * len(vectors) + kinds, minlength=n * len(vectors))
    used: Matrix = per_node.reshape(n, len(vectors)).astype(np.int64) @ vectors
    return used, terminating


class ClusterState:
    """Free resources and node masks, built from one snapshot; placements change ``free`` only.

    Terminating and bound pods both count as using their requests: a terminating pod's GPUs are
    not free until the pod object is gone.
    """

    def __init__(self, snapshot: Snapshot, config: SchedulerConfig,
                 reservations: Sequence[Reservation] = (), *, nodes: NodeIndex | None = None) -> None:
        if nodes is None or not nodes.same(snapshot.nodes, config):
            nodes = NodeIndex(snapshot.nodes, config)
        names = set(nodes.allocatable) | {PODS}
        names.update(*(p.requests for p in snapshot.pods))
        resources = tuple(sorted(names))
        used, terminating = usage(nodes, resources, snapshot.pods)
        self._setup(nodes, config, resources, used, terminating, reservations)

    @classmethod
    def of(cls, nodes: NodeIndex, config: SchedulerConfig, resources: tuple[str, ...], used: Matrix,
           terminating: Mask, reservations: Sequence[Reservation] = ()) -> ClusterState:
        """A state from usage kept elsewhere (the scheduler's cache); the arrays are copied."""
        state = cls.__new__(cls)
        state._setup(nodes, config, resources, used.copy(), terminating.copy(), reservations)
        return state

    def _setup(self, nodes: NodeIndex, config: SchedulerConfig, resources: tuple[str, ...], used: Matrix,
               terminating: Mask, reservations: Sequence[Reservation]) -> None:
        self.node_index = nodes
        """Node-only indexes; pass it to the next cycle's state to reuse it."""
        self.config = config
        """Settings in force."""
        self.nodes = nodes.nodes
        """Nodes in snapshot order; array positions refer to them."""
        self.index = nodes.index
        """Node name to position."""
        self.topo = nodes.topo
        """The network tree."""
        self.resources: tuple[str, ...] = resources
        """Resource names, one per column, sorted."""
        self.columns: dict[str, int] = {r: i for i, r in enumerate(self.resources)}
        """Resource name to column."""
        n = len(self.nodes)
        self.allocatable: Matrix = allocatable(nodes, resources)
        """Allocatable per node and resource."""
        self.free: Matrix = self.allocatable - used
        """Free resources per node; placements in this cycle subtract from it."""
        self.unschedulable: Mask = nodes.unschedulable
        """Cordoned nodes."""
        self.spare: Mask = nodes.spare
        """Nodes in the hot-spare pool."""
        self.terminating: Mask = terminating
        """Nodes with a terminating pod: closed to new gangs until it is gone."""
        self.reserved_for = np.full(n, -1, dtype=np.int64)
        """Code of the gang holding each node, or -1."""
        self.reservations: dict[str, Reservation] = {}
        """Holds in force, by gang key."""
        self._codes: dict[str, int] = {}
        self.failed: dict[str, Mask] = {}
        """Per restarting gang, the nodes being replaced (never used for it)."""
        for res in reservations:
            code = self._codes.setdefault(res.gang, len(self._codes))
            self.reservations[res.gang] = res
            held = [self.index[x] for x in res.nodes if x in self.index]
            self.reserved_for[held] = code
            failed = np.zeros(n, dtype=np.bool_)
            failed[[self.index[x] for x in res.failed if x in self.index]] = True
            self.failed[res.gang] = failed
        self.taints = nodes.taints
        """Taint groups; the spare taint is left to the spare rules."""

    def vector(self, requests: Mapping[str, int]) -> Vector:
        """A pod's requests as a column vector; every pod takes one pod slot."""
        return request_vector(self.columns, requests)

    def static_mask(self, pod: PodRecord) -> Mask:
        """Nodes whose taints, labels and name the pod accepts (cached across cycles)."""
        return self.node_index.static_mask(pod)

    def code(self, gang: str) -> int:
        """The reservation code of a gang, or -2 when it holds nothing (matches no node)."""
        return self._codes.get(gang, -2)

    def open_nodes(self, gang: str) -> Mask:
        """Schedulable, non-spare nodes that are neither held for another gang nor draining.

        A node held for this gang stays open to it even while its old pods terminate: their
        resources are still counted as used, so the gang simply waits until they are gone.
        """
        mine: Mask = self.reserved_for == self.code(gang)
        free_for_all: Mask = (self.reserved_for == -1) & ~self.terminating
        result: Mask = ~self.unschedulable & ~self.spare & (mine | free_for_all)
        return result

    def fit(self, vec: Vector, mask: Mask) -> Counts:
        """How many pods with requests ``vec`` each node in ``mask`` can take now."""
        cols = np.flatnonzero(vec)
        per = self.free[:, cols] // vec[cols]
        counts: Counts = per.min(axis=1) if cols.size else np.zeros(len(self.nodes), dtype=np.int64)
        counts = np.maximum(counts, 0).astype(np.int64, copy=False)
        counts[~mask] = 0
        return counts
