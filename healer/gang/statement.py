"""Statement: placements staged against the cycle's state, then committed or discarded together."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from healer.gang.records import PodRecord
from healer.gang.state import ClusterState, Counts, Vector


@dataclass(frozen=True, slots=True)
class Binding:
    """One pod bound to one node."""

    pod: PodRecord
    """The pod."""
    node: str
    """The node."""


class Statement:
    """Stages assumptions about where pods go; all of them stay, or none does.

    ``assume`` subtracts resources at once so that the next pod of the same gang sees them taken;
    ``discard`` gives every one back in reverse order; ``commit`` hands out the bindings.
    """

    def __init__(self, state: ClusterState) -> None:
        self._state = state
        self._staged: list[tuple[tuple[PodRecord, ...], Counts, Vector]] = []
        self._open = True

    def assume(self, pods: tuple[PodRecord, ...], counts: Counts, vec: Vector) -> None:
        """Stage ``pods`` (same requests ``vec``) on nodes, ``counts[i]`` of them on node ``i``, in order."""
        if not self._open:
            raise RuntimeError("statement already committed or discarded")
        if int(counts.sum()) != len(pods):
            raise ValueError(f"{len(pods)} pods but {int(counts.sum())} slots")
        self._state.free -= counts[:, None] * vec[None, :]
        self._staged.append((pods, counts, vec))

    def nodes_used(self) -> Counts:
        """Pods staged per node so far."""
        total = np.zeros(len(self._state.nodes), dtype=np.int64)
        for _, counts, _ in self._staged:
            total += counts
        return total

    def discard(self) -> None:
        """Give back everything staged."""
        for _, counts, vec in reversed(self._staged):
            self._state.free += counts[:, None] * vec[None, :]
        self._staged.clear()
        self._open = False

    def commit(self) -> tuple[Binding, ...]:
        """Keep everything staged and return the bindings, pods in rank order within each node run."""
        bindings: list[Binding] = []
        topo = self._state.topo
        for pods, counts, _ in self._staged:
            used = np.flatnonzero(counts)
            # Walk nodes leaf by leaf so that consecutive ranks share a node, then a leaf.
            used = used[np.lexsort((used, topo.leaf_of[used], topo.spine_of[used], topo.zone_of[used]))]
            slots = np.repeat(used, counts[used])
            names = self._state.nodes
            bindings.extend(Binding(pod, names[int(i)].name) for pod, i in zip(pods, slots, strict=True))
        self._staged.clear()
        self._open = False
        return tuple(bindings)
