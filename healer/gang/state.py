"""One cycle's view of the cluster as arrays: free resources per node and the masks that filter them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from healer.gang.affinity import LabelIndex
from healer.gang.config import SchedulerConfig
from healer.gang.quantity import PODS
from healer.gang.records import PodRecord, SelectorTerm, Snapshot, Toleration
from healer.gang.reservations import Reservation
from healer.gang.taints import Mask, TaintIndex
from healer.gang.topology import Topology

Matrix = npt.NDArray[np.int64]
"""A row per node, a column per resource."""
Vector = npt.NDArray[np.int64]
"""One amount per resource column."""
Counts = npt.NDArray[np.int64]
"""One integer per node."""

FilterKey = tuple[tuple[Toleration, ...], tuple[tuple[str, str], ...], tuple[SelectorTerm, ...]]
"""What the static (per-cycle) part of a pod's node filter depends on."""


def filter_key(pod: PodRecord) -> FilterKey:
    """The part of a pod that decides which nodes it may use regardless of free resources."""
    return pod.tolerations, tuple(sorted(pod.node_selector.items())), pod.affinity


class ClusterState:
    """Free resources and node masks, built from one snapshot; placements change ``free`` only.

    Terminating and bound pods both count as using their requests: a terminating pod's GPUs are
    not free until the pod object is gone.
    """

    def __init__(self, snapshot: Snapshot, config: SchedulerConfig,
                 reservations: Sequence[Reservation] = ()) -> None:
        nodes = snapshot.nodes
        self.config = config
        """Settings in force."""
        self.nodes = nodes
        """Nodes in snapshot order; array positions refer to them."""
        self.index: dict[str, int] = {n.name: i for i, n in enumerate(nodes)}
        """Node name to position."""
        self.topo = Topology(nodes, config.topology)
        """The network tree."""
        names = {PODS}
        for node in nodes:
            names.update(node.allocatable)
        for pod in snapshot.pods:
            names.update(pod.requests)
        self.resources: tuple[str, ...] = tuple(sorted(names))
        """Resource names, one per column."""
        self.columns: dict[str, int] = {r: i for i, r in enumerate(self.resources)}
        """Resource name to column."""
        n, r = len(nodes), len(self.resources)
        self.allocatable: Matrix = np.zeros((n, r), dtype=np.int64)
        """Allocatable per node and resource."""
        for i, node in enumerate(nodes):
            for name, amount in node.allocatable.items():
                self.allocatable[i, self.columns[name]] = amount
        rows: list[int] = []
        cols: list[int] = []
        vals: list[int] = []
        terminating = np.zeros(n, dtype=np.bool_)
        pods_col = self.columns[PODS]
        for pod in snapshot.pods:
            i = self.index.get(pod.node_name, -1) if pod.node_name else -1
            if i < 0 or pod.finished:
                continue
            if pod.terminating:
                terminating[i] = True
            rows.append(i)
            cols.append(pods_col)
            vals.append(1)
            for name, amount in pod.requests.items():
                if name != PODS:
                    rows.append(i)
                    cols.append(self.columns[name])
                    vals.append(amount)
        used = np.zeros((n, r), dtype=np.int64)
        np.add.at(used, (np.asarray(rows, dtype=np.intp), np.asarray(cols, dtype=np.intp)),
                  np.asarray(vals, dtype=np.int64))
        self.free: Matrix = self.allocatable - used
        """Free resources per node; placements in this cycle subtract from it."""
        self.unschedulable: Mask = np.fromiter((nd.unschedulable for nd in nodes), dtype=np.bool_, count=n)
        """Cordoned nodes."""
        self.spare: Mask = np.fromiter((nd.labels.get(config.spare_label) == "true" for nd in nodes),
                                       dtype=np.bool_, count=n)
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
        self.labels = LabelIndex(nodes)
        """Label index for selectors and affinity."""
        self.taints = TaintIndex(nodes, ignore_keys=frozenset({config.spare_taint}))
        """Taint groups; the spare taint is left to the spare rules."""
        self._static: dict[FilterKey, Mask] = {}

    def vector(self, requests: Mapping[str, int]) -> Vector:
        """A pod's requests as a column vector; every pod takes one pod slot."""
        vec = np.zeros(len(self.resources), dtype=np.int64)
        for name, amount in requests.items():
            vec[self.columns[name]] = amount
        vec[self.columns[PODS]] = max(1, int(vec[self.columns[PODS]]))
        return vec

    def static_mask(self, pod: PodRecord) -> Mask:
        """Nodes whose taints, labels and name the pod accepts; cached per distinct pod filter."""
        key = filter_key(pod)
        mask = self._static.get(key)
        if mask is None:
            mask = self.taints.tolerated(pod.tolerations)
            mask &= self.labels.matches(pod.node_selector, pod.affinity)
            self._static[key] = mask
        return mask

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
