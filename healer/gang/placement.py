"""Place one gang whole or not at all: narrowest topology, best fit, spares only for replacements."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from healer.gang import reason
from healer.gang.config import Level
from healer.gang.gangs import Gang, ShapeKey, shapes_of
from healer.gang.pick import TreeCaps, needed
from healer.gang.quantity import describe
from healer.gang.records import PodRecord
from healer.gang.state import ClusterState, Counts, Vector, filter_key
from healer.gang.statement import Binding, Statement
from healer.gang.taints import Mask


@dataclass(frozen=True, slots=True)
class Placement:
    """Where every pod of a gang goes."""

    gang: str
    """Gang key."""
    bindings: tuple[Binding, ...]
    """One binding per placed pod."""
    level: Level
    """Narrowest level with one domain holding the new pods."""
    leaves: int
    """Leaves the new pods span."""
    leaves_lower_bound: int
    """Fewest leaves that could have held them, ignoring spines and zones."""
    spares: tuple[str, ...] = ()
    """Spare nodes used (replacements only)."""


@dataclass(frozen=True, slots=True)
class Unfit:
    """Why a gang stays pending."""

    gang: str
    """Gang key."""
    reason: str
    """Reason with numbers."""
    kind: str = ""
    """The reason without its numbers, when they change as the cluster moves (pods arriving one by one):
    reports repeat only when the kind changes. Empty: the reason itself is the kind."""


class Placer:
    """Places gangs one after another against one cycle's state.

    Capacity only shrinks within a cycle, so once a shape of ``k`` pods failed, any later gang of
    the same shape with at least ``k`` pods fails too: that answer is remembered, which keeps a
    long queue of gangs that cannot fit cheap.
    """

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self._rejected: dict[tuple[ShapeKey, Level], tuple[int, str]] = {}

    def place(self, gang: Gang) -> Placement | Unfit:
        """Stage and commit the whole gang, or return why it does not fit (nothing staged)."""
        if gang.missing:
            have = len(gang.bound) + len(gang.pending)
            return Unfit(gang.key, f"waiting for pods: {have} of {gang.min_member} exist", "waiting for pods")
        short = self._min_resources(gang)
        if short:
            return Unfit(gang.key, short)
        attempts = [gang.pending]
        if 0 < gang.required < len(gang.pending):
            attempts.append(gang.pending[: gang.required])
        why = ""
        for pods in attempts:
            stmt = Statement(self.state)
            outcome = self._stage(gang, pods, stmt)
            if isinstance(outcome, str):
                stmt.discard()
                why = outcome
                continue
            level, lower, spares = outcome
            bindings = stmt.commit()
            leaves = len({self.state.topo.leaf_of[self.state.index[b.node]] for b in bindings})
            return Placement(gang.key, bindings, level, leaves, lower, spares)
        return Unfit(gang.key, why)

    def _min_resources(self, gang: Gang) -> str:
        if not gang.min_resources:
            return ""
        st = self.state
        free = np.maximum(st.free[st.open_nodes(gang.key)], 0).sum(axis=0)
        for name, amount in gang.min_resources.items():
            col = st.columns.get(name)
            have = int(free[col]) if col is not None else 0
            if have < amount:
                return (f"PodGroup minResources needs {describe(name, amount)} {name}; "
                        f"{describe(name, have)} free on open nodes")
        return ""

    def _stage(self, gang: Gang, pods: tuple[PodRecord, ...],
               stmt: Statement) -> str | tuple[Level, int, tuple[str, ...]]:
        st = self.state
        restarting = st.reservations.get(gang.key)
        home = self._home(gang)
        shapes = gang.shapes if pods is gang.pending and gang.shapes else shapes_of(pods)
        simple = restarting is None and not home.any() and len(shapes) == 1
        level, lower = Level.LEAF, 0
        spares: list[str] = []
        for group, sample in shapes:
            vec = st.vector(sample.requests)
            static = st.static_mask(sample)
            k = len(group)
            memo_key = ((tuple(sorted(sample.requests.items())), filter_key(sample)), gang.required_level)
            if simple:
                seen = self._rejected.get(memo_key)
                if seen and k >= seen[0]:
                    return seen[1]
            allowed = st.open_nodes(gang.key) & static
            if restarting is not None:
                if (st.terminating & (st.reserved_for == st.code(gang.key))).any():
                    return "waiting for the gang's old pods to terminate on its held nodes"
                allowed &= ~st.failed[gang.key]
            used = stmt.nodes_used() > 0
            if restarting is not None or home.any():
                counts, why = self._near(gang, vec, static, allowed, home | used, k)
                if why:
                    return why
                spares.extend(st.nodes[i].name for i in np.flatnonzero((counts > 0) & st.spare))
                level = max(level, self._level_of(counts))
            else:
                tree = TreeCaps(st.topo, st.fit(vec, allowed))
                spread = None
                if used.any():
                    # Later shapes of a gang (a launcher, parameter servers) join the leaves already used.
                    near = np.isin(st.topo.leaf_of, st.topo.leaf_of[used])
                    spread = TreeCaps(st.topo, st.fit(vec, allowed & near)).spread(k, gang.required_level)
                spread = spread or tree.spread(k, gang.required_level)
                if spread is None:
                    why = self._why_not(gang, vec, static, tree, k)
                    if simple:
                        self._rejected[memo_key] = (k, why)
                    return why
                counts = spread.counts
                lower += needed(tree.by_level[Level.LEAF], k) or 0
                level = max(level, spread.level)
            stmt.assume(group, counts, vec)
        if restarting is not None or home.any():
            lower = needed(np.bincount(st.topo.leaf_of, weights=stmt.nodes_used(),
                                       minlength=st.topo.counts[0]).astype(np.int64), len(pods)) or 0
        return level, lower, tuple(spares)

    def _home(self, gang: Gang) -> Mask:
        """Nodes the gang already occupies or holds: new members go close to them."""
        st = self.state
        home: Mask = st.reserved_for == st.code(gang.key)
        for pod in gang.bound:
            i = st.index.get(pod.node_name)
            if i is not None:
                home[i] = True
        return home

    def _near(self, gang: Gang, vec: Vector, static: Mask, allowed: Mask, home: Mask,
              k: int) -> tuple[Counts, str]:
        """Fill held nodes, then spares (restarts only), then open nodes, each nearest-first."""
        st = self.state
        topo = st.topo
        held = allowed & (st.reserved_for == st.code(gang.key))
        tiers: list[tuple[str, Mask]] = [("held nodes", held)]
        if gang.key in st.reservations:
            spare_ok = static & st.spare & ~st.unschedulable & ~st.terminating & (st.reserved_for == -1)
            tiers.append(("spares", spare_ok))
        tiers.append(("open nodes", allowed & ~held))
        same = [np.isin(d, d[home]) for d in (topo.leaf_of, topo.spine_of, topo.zone_of)]
        rings = [same[0], same[1] & ~same[0], same[2] & ~same[1], ~same[2]]
        counts = np.zeros(len(st.nodes), dtype=np.int64)
        took: list[str] = []
        remaining = k
        for label, mask in tiers:
            got = 0
            for ring in rings:
                if remaining == 0:
                    break
                part = TreeCaps(topo, st.fit(vec, mask & ring)).take(remaining)
                n = int(part.sum())
                counts += part
                remaining -= n
                got += n
            took.append(f"{label} {got}")
        if remaining:
            return counts, (f"needs {k} pods {reason.TIMES} {reason.shape(st, vec)} near its other members: "
                            f"room on {', '.join(took)}; {remaining} short")
        return counts, ""

    def _level_of(self, counts: Counts) -> Level:
        used = counts > 0
        topo = self.state.topo
        for level in (Level.LEAF, Level.SPINE, Level.ZONE):
            if np.unique(topo.domain_of(level)[used]).size <= 1:
                return level
        return Level.CLUSTER

    def _why_not(self, gang: Gang, vec: Vector, static: Mask, tree: TreeCaps, k: int) -> str:
        what = reason.shape(self.state, vec)
        if gang.required_level < Level.CLUSTER and tree.total() >= k:
            return reason.within(gang.required_level, k, what, tree.best(gang.required_level))
        return reason.short(k, what, tree.total(), tree.best(Level.SPINE), tree.best(Level.LEAF),
                            reason.excluded(self.state, gang.key, static))
