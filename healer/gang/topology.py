"""The network tree (zone > spine > leaf > node) as integer arrays, built once per snapshot."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from healer.gang.config import Level, TopologyKeys
from healer.gang.records import NodeRecord

Ints = npt.NDArray[np.intp]
"""An integer array."""


class Topology:
    """Domain ids per node and per level, plus each domain's children.

    A node without a leaf label is its own leaf, and a leaf without a spine label its own spine,
    so that an unlabelled node never looks close to anything; a missing zone is one shared zone.
    Leaves are keyed by (spine, leaf) so that racks named alike under different spines stay apart.
    """

    def __init__(self, nodes: Sequence[NodeRecord], keys: TopologyKeys) -> None:
        leaf_ids: dict[tuple[str, str], int] = {}
        spine_ids: dict[tuple[str, str], int] = {}
        zone_ids: dict[str, int] = {}
        leaf_of = np.empty(len(nodes), dtype=np.intp)
        spine_of_leaf: list[int] = []
        zone_of_spine: list[int] = []
        self.leaf_names: list[str] = []
        """Display name of each leaf."""
        self.spine_names: list[str] = []
        """Display name of each spine."""
        self.zone_names: list[str] = []
        """Display name of each zone."""
        for i, node in enumerate(nodes):
            leaf = node.labels.get(keys.leaf) or f"node:{node.name}"
            spine = node.labels.get(keys.spine) or f"leaf:{leaf}"
            zone = node.labels.get(keys.zone, "")
            z = zone_ids.get(zone)
            if z is None:
                z = zone_ids[zone] = len(zone_ids)
                self.zone_names.append(zone)
            s = spine_ids.get((zone, spine))
            if s is None:
                s = spine_ids[(zone, spine)] = len(spine_ids)
                zone_of_spine.append(z)
                self.spine_names.append(spine)
            lf = leaf_ids.get((spine, leaf))
            if lf is None:
                lf = leaf_ids[(spine, leaf)] = len(leaf_ids)
                spine_of_leaf.append(s)
                self.leaf_names.append(leaf)
            leaf_of[i] = lf
        self.leaf_of: Ints = leaf_of
        """Leaf id of each node."""
        self.spine_of_leaf: Ints = np.asarray(spine_of_leaf, dtype=np.intp)
        """Spine id of each leaf."""
        self.zone_of_spine: Ints = np.asarray(zone_of_spine, dtype=np.intp)
        """Zone id of each spine."""
        self.spine_of: Ints = self.spine_of_leaf[leaf_of] if len(nodes) else np.empty(0, dtype=np.intp)
        """Spine id of each node."""
        self.zone_of: Ints = self.zone_of_spine[self.spine_of] if len(nodes) else np.empty(0, dtype=np.intp)
        """Zone id of each node."""
        self.counts = (len(leaf_ids), len(spine_ids), len(zone_ids), 1)
        """Number of domains per level (leaf, spine, zone, cluster)."""
        self.children: tuple[list[Ints], list[Ints], list[Ints], list[Ints]] = (
            _group(leaf_of, len(leaf_ids)),
            _group(self.spine_of_leaf, len(spine_ids)),
            _group(self.zone_of_spine, len(zone_ids)),
            [np.arange(len(zone_ids), dtype=np.intp)],
        )
        """For each level, each domain's children: nodes of a leaf, leaves of a spine, spines of a zone."""

    def parent_of_child(self, level: Level) -> Ints:
        """Domain id at ``level`` of each child one level down (nodes for LEAF)."""
        if level == Level.LEAF:
            return self.leaf_of
        if level == Level.SPINE:
            return self.spine_of_leaf
        if level == Level.ZONE:
            return self.zone_of_spine
        return np.zeros(self.counts[Level.ZONE], dtype=np.intp)

    def domain_of(self, level: Level) -> Ints:
        """Domain id at ``level`` of each node."""
        return (self.leaf_of, self.spine_of, self.zone_of,
                np.zeros(len(self.leaf_of), dtype=np.intp))[level]

    def name(self, level: Level, domain: int) -> str:
        """A domain's display name."""
        if level == Level.CLUSTER:
            return "cluster"
        return (self.leaf_names, self.spine_names, self.zone_names)[level][domain]


def _group(parent: Ints, n: int) -> list[Ints]:
    order = np.argsort(parent, kind="stable")
    bounds = np.searchsorted(parent[order], np.arange(n + 1))
    return [order[bounds[i]:bounds[i + 1]] for i in range(n)]
