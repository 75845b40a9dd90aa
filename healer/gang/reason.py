"""Why a gang does not fit, in numbers an operator can act on."""

from __future__ import annotations

from healer.gang.config import Level
from healer.gang.quantity import CPU, GPU, MEMORY, PODS, describe
from healer.gang.state import ClusterState, Vector
from healer.gang.taints import Mask

TIMES = "\N{MULTIPLICATION SIGN}"
"""The sign between a pod count and a pod size in reasons."""

_LEVEL_WORD = {Level.LEAF: "leaf", Level.SPINE: "spine", Level.ZONE: "zone"}


def shape(state: ClusterState, vec: Vector) -> str:
    """A pod's size in words: GPUs when it asks for any, else cpu and memory."""
    parts: list[str] = []
    gpu = state.columns.get(GPU)
    if gpu is not None and vec[gpu]:
        parts.append(f"{int(vec[gpu])} GPU" + ("s" if vec[gpu] > 1 else ""))
    else:
        for name in (CPU, MEMORY):
            col = state.columns.get(name)
            if col is not None and vec[col]:
                parts.append(describe(name, int(vec[col])))
    for name, col in state.columns.items():
        if name not in (CPU, MEMORY, PODS, GPU) and vec[col]:
            parts.append(f"{int(vec[col])} {name}")
    return ", ".join(parts) or "no resources"


def within(level: Level, k: int, what: str, best: int) -> str:
    """The reason when the cluster has room but no single domain of the required level does."""
    word = _LEVEL_WORD[level]
    return f"needs {k} pods {TIMES} {what} within one {word}; best {word} has room for {best}"


def short(k: int, what: str, total: int, best_spine: int, best_leaf: int, excluded: str) -> str:
    """The reason when the cluster as a whole lacks room."""
    text = f"needs {k} pods {TIMES} {what}; room for {total} (best spine {best_spine}, best leaf {best_leaf})"
    return f"{text}; ruled out: {excluded}" if excluded else text


def excluded(state: ClusterState, gang: str, static: Mask) -> str:
    """Counts of nodes ruled out, by cause; a node can count under more than one cause."""
    code = state.code(gang)
    causes = (
        ("cordoned", state.unschedulable),
        ("spares", state.spare),
        ("draining terminating pods", state.terminating & (state.reserved_for != code)),
        ("held for restarting gangs", (state.reserved_for >= 0) & (state.reserved_for != code)),
        ("by taints, selector or affinity", ~static),
    )
    return ", ".join(f"{int(m.sum())} {label}" for label, m in causes if m.any())
