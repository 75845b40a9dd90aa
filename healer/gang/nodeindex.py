"""Everything derived from the node list alone, reused across cycles while the nodes are unchanged."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from healer.gang.affinity import LabelIndex
from healer.gang.config import SchedulerConfig
from healer.gang.records import NodeRecord, PodRecord, SelectorTerm, Toleration
from healer.gang.taints import Mask, TaintIndex
from healer.gang.topology import Topology

FilterKey = tuple[tuple[Toleration, ...], tuple[tuple[str, str], ...], tuple[SelectorTerm, ...]]
"""What the static part of a pod's node filter depends on."""


def filter_key(pod: PodRecord) -> FilterKey:
    """The part of a pod that decides which nodes it may use regardless of free resources."""
    return pod.tolerations, tuple(sorted(pod.node_selector.items())), pod.affinity


class NodeIndex:
    """Topology, label and taint indexes, flags, allocatable and per-filter node masks.

    Nodes change far less often than pods, so a scheduler keeps one of these and rebuilds it only
    when a snapshot's node list differs; filter masks cached here then survive across cycles too.
    """

    def __init__(self, nodes: Sequence[NodeRecord], config: SchedulerConfig) -> None:
        self.nodes = tuple(nodes)
        """Nodes in snapshot order; array positions refer to them."""
        self.config = config
        """Settings the masks were built with."""
        self.index: dict[str, int] = {n.name: i for i, n in enumerate(self.nodes)}
        """Node name to position."""
        self.topo = Topology(self.nodes, config.topology)
        """The network tree."""
        self.labels = LabelIndex(self.nodes)
        """Label index for selectors and affinity."""
        self.taints = TaintIndex(self.nodes, ignore_keys=frozenset({config.spare_taint}))
        """Taint groups; the spare taint is left to the spare rules."""
        n = len(self.nodes)
        self.unschedulable: Mask = np.fromiter((x.unschedulable for x in self.nodes), dtype=np.bool_, count=n)
        """Cordoned nodes."""
        self.spare: Mask = np.fromiter((x.labels.get(config.spare_label) == "true" for x in self.nodes),
                                       dtype=np.bool_, count=n)
        """Nodes in the hot-spare pool."""
        names = sorted(set().union(*(x.allocatable for x in self.nodes)))
        self.allocatable: dict[str, npt.NDArray[np.int64]] = {
            r: np.fromiter((x.allocatable.get(r, 0) for x in self.nodes), dtype=np.int64, count=n)
            for r in names}
        """Allocatable per resource, one entry per node."""
        self._static: dict[FilterKey, Mask] = {}

    def same(self, nodes: Sequence[NodeRecord], config: SchedulerConfig) -> bool:
        """Whether this index still describes ``nodes`` under ``config``."""
        return config == self.config and (nodes is self.nodes or tuple(nodes) == self.nodes)

    def static_mask(self, pod: PodRecord) -> Mask:
        """Nodes whose taints, labels and name the pod accepts; cached per distinct pod filter."""
        key = filter_key(pod)
        mask = self._static.get(key)
        if mask is None:
            mask = self.taints.tolerated(pod.tolerations)
            mask &= self.labels.matches(pod.node_selector, pod.affinity)
            self._static[key] = mask
        return mask
