"""Choosing capacity in the network tree: fewest domains, narrowest level, best fit for the rest.

Everything works on per-node capacities ``c`` (how many pods of one shape each node can take) and
sums them up the tree with ``bincount``, so a placement costs a few array passes, not a loop over
pods and nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from healer.gang.config import Level
from healer.gang.topology import Topology

Counts = npt.NDArray[np.int64]
"""One integer per node (or per domain)."""


def needed(caps: Counts, k: int) -> int | None:
    """How many entries, largest first, hold ``k``; None when all of them together cannot."""
    if k <= 0:
        return 0
    csum = np.cumsum(np.sort(caps)[::-1])
    if csum.size == 0 or csum[-1] < k:
        return None
    return int(np.searchsorted(csum, k)) + 1


def pick(caps: Counts, k: int) -> list[tuple[int, int]]:
    """Entries and quotas holding ``k``: as few entries as possible, the last one the tightest fit.

    Taking the largest entries whole and then the smallest entry that holds the remainder keeps
    the count minimal (the greedy count) while leaving big free domains intact for big gangs.
    """
    order = np.argsort(-caps, kind="stable")
    ranked = caps[order]
    csum = np.cumsum(ranked)
    t = int(np.searchsorted(csum, k))
    before = int(csum[t - 1]) if t else 0
    rest = k - before
    # ranked[t:] is descending, so the entries that hold `rest` form a prefix; take its last.
    j = int(np.searchsorted(-ranked[t:], -rest, side="right")) - 1
    chosen = [(int(i), int(caps[i])) for i in order[:t]]
    chosen.append((int(order[t + j]), rest))
    return chosen


@dataclass(frozen=True, slots=True)
class Spread:
    """Where a gang of one shape goes."""

    counts: Counts
    """Pods per node."""
    level: Level
    """Narrowest level with one domain holding all of them."""


class TreeCaps:
    """Capacities of one pod shape summed per leaf, spine and zone."""

    def __init__(self, topo: Topology, c: Counts) -> None:
        self.topo = topo
        self.c = c
        leaf = np.bincount(topo.leaf_of, weights=c, minlength=topo.counts[0]).astype(np.int64)
        spine = np.bincount(topo.spine_of_leaf, weights=leaf, minlength=topo.counts[1]).astype(np.int64)
        zone = np.bincount(topo.zone_of_spine, weights=spine, minlength=topo.counts[2]).astype(np.int64)
        self.by_level: tuple[Counts, Counts, Counts, Counts] = (
            leaf, spine, zone, np.asarray([int(zone.sum())], dtype=np.int64))
        """Capacity of every domain at each level."""

    def total(self) -> int:
        """Capacity of the whole cluster."""
        return int(self.by_level[Level.CLUSTER][0])

    def best(self, level: Level) -> int:
        """Capacity of the roomiest domain at ``level``."""
        caps = self.by_level[level]
        return int(caps.max()) if caps.size else 0

    def spread(self, k: int, max_level: Level = Level.CLUSTER) -> Spread | None:
        """Place ``k`` pods in the narrowest level that holds them, or None if ``max_level`` cannot."""
        for level in Level:
            if level > max_level:
                return None
            caps = self.by_level[level]
            fits = np.flatnonzero(caps >= k)
            if fits.size:
                domain = self._choose(level, fits, k)
                counts = np.zeros(self.c.size, dtype=np.int64)
                self._assign(level, domain, k, counts)
                return Spread(counts, level)
        return None

    def take(self, k: int, max_level: Level = Level.CLUSTER) -> Counts:
        """Up to ``k`` pods: all of the capacity if it is not more than ``k``, else a spread of ``k``."""
        if self.total() <= k:
            return self.c.copy()
        spread = self.spread(k, max_level)
        return spread.counts if spread else np.zeros(self.c.size, dtype=np.int64)

    def _choose(self, level: Level, fits: npt.NDArray[np.intp], k: int) -> int:
        caps = self.by_level[level]
        if level == Level.LEAF or fits.size == 1:
            return int(fits[np.argmin(caps[fits])])
        best: tuple[int, ...] | None = None
        chosen = int(fits[0])
        for d in fits:
            # Fewer spines, then fewer leaves, then the tightest domain.
            spans = [needed(self.by_level[lower][self._under(level, int(d), lower)], k) or 0
                     for lower in reversed(range(level))]
            score = (*spans, int(caps[d]))
            if best is None or score < best:
                best, chosen = score, int(d)
        return chosen

    def _under(self, level: Level, domain: int, lower: int) -> npt.NDArray[np.intp]:
        ids = np.asarray([domain], dtype=np.intp)
        for lv in range(level, lower, -1):
            ids = np.concatenate([self.topo.children[lv][d] for d in ids]) if ids.size else ids
        return ids

    def _assign(self, level: Level, domain: int, k: int, counts: Counts) -> None:
        kids = self.topo.children[level][domain]
        if level == Level.LEAF:
            for i, q in pick(self.c[kids], k):
                counts[kids[i]] += q
            return
        below = Level(level - 1)
        for i, q in pick(self.by_level[below][kids], k):
            self._assign(below, int(kids[i]), q, counts)
