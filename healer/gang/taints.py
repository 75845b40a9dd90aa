"""Taints and tolerations, with the same matching rules as kube-scheduler's TaintToleration filter."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from healer.cluster import Taint
from healer.gang.records import NodeRecord, TaintEffect, Toleration, TolerationOperator

Mask = npt.NDArray[np.bool_]
"""One boolean per node, in snapshot order."""

_FILTERING = (TaintEffect.NO_SCHEDULE, TaintEffect.NO_EXECUTE)


def tolerates(toleration: Toleration, taint: Taint) -> bool:
    """Whether one toleration matches one taint (key, effect, then value per operator)."""
    if toleration.effect and toleration.effect != taint.effect:
        return False
    if toleration.key and toleration.key != taint.key:
        return False
    if toleration.operator == TolerationOperator.EXISTS:
        return True
    return toleration.value == taint.value


def all_tolerated(tolerations: Iterable[Toleration], taints: Iterable[Taint]) -> bool:
    """Whether every NoSchedule/NoExecute taint is tolerated; PreferNoSchedule never filters."""
    tols = tuple(tolerations)
    return all(any(tolerates(t, taint) for t in tols) for taint in taints if taint.effect in _FILTERING)


class TaintIndex:
    """Nodes grouped by their filtering taints, so a toleration set is checked once per distinct group.

    Clusters have few distinct taint sets (none, cordon-style taints, a fault taint), so this turns
    a per-node check into a handful of set checks and one vectorised OR.
    """

    def __init__(self, nodes: Sequence[NodeRecord], *, ignore_keys: frozenset[str] = frozenset()) -> None:
        groups: dict[tuple[Taint, ...], list[int]] = {}
        for i, node in enumerate(nodes):
            kept = (t for t in node.taints if t.effect in _FILTERING and t.key not in ignore_keys)
            key = tuple(sorted(kept, key=lambda t: (t.key, t.effect, t.value)))
            groups.setdefault(key, []).append(i)
        self._groups = [(taints, np.asarray(idx, dtype=np.intp)) for taints, idx in groups.items()]
        self._n = len(nodes)

    def tolerated(self, tolerations: tuple[Toleration, ...]) -> Mask:
        """Nodes whose filtering taints the tolerations all match."""
        mask = np.zeros(self._n, dtype=np.bool_)
        for taints, idx in self._groups:
            if all_tolerated(tolerations, taints):
                mask[idx] = True
        return mask

    def untolerated_count(self, tolerations: tuple[Toleration, ...], among: Mask) -> int:
        """How many of the nodes in ``among`` have a taint the tolerations miss (for reasons)."""
        return int((~self.tolerated(tolerations) & among).sum())
