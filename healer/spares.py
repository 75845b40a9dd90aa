"""The hot-spare pool: which nodes are spares, which are healthy, and the best one for a job. Pure."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from healer.cluster import NodeInfo
from healer.keys import CONDITION_TYPE, FAULT_TAINT_KEY, SPARE_FOR, SPARE_LABEL


@dataclass(frozen=True, slots=True)
class Spare:
    """One node of the spare pool as the API shows it."""

    name: str
    """Node name."""
    state: str
    """``available``, ``in-use`` or ``unhealthy``."""
    healthy: bool
    """Ready, schedulable apart from the spare taint, no kmend fault."""
    assigned_to: str
    """``<namespace>/<job>`` when handed to a job."""
    domains: tuple[str, ...]
    """Topology domain values (leaf, spine)."""


def spare_health(n: NodeInfo) -> bool:
    """Whether a spare can take a job right now."""
    bad_condition = any(c.type == CONDITION_TYPE and c.status == "False" for c in n.conditions)
    return n.ready and not n.unschedulable and n.taint(FAULT_TAINT_KEY) is None and not bad_condition


def pool(nodes: Iterable[NodeInfo], topology_keys: Sequence[str]) -> list[Spare]:
    """Every node labelled as a spare (in the pool or handed out)."""
    out = []
    for n in nodes:
        value = n.labels.get(SPARE_LABEL)
        if value not in ("true", "in-use"):
            continue
        healthy = spare_health(n)
        state = "in-use" if value == "in-use" else ("available" if healthy else "unhealthy")
        out.append(Spare(n.name, state, healthy, n.annotations.get(SPARE_FOR, ""),
                         tuple(n.labels.get(k, "") for k in topology_keys)))
    return sorted(out, key=lambda s: s.name)


def pick_spare(nodes: Sequence[NodeInfo], near: str, topology_keys: Sequence[str]) -> NodeInfo | None:
    """The healthy available spare closest to node `near`: same leaf, then same spine, then any."""
    by_name = {n.name: n for n in nodes}
    anchor = by_name.get(near)
    candidates = [n for n in nodes if n.labels.get(SPARE_LABEL) == "true" and spare_health(n)]
    if not candidates:
        return None

    def distance(n: NodeInfo) -> tuple[int, str]:
        if anchor is not None:
            for depth, key in enumerate(topology_keys):
                value = anchor.labels.get(key)
                if value is not None and n.labels.get(key) == value:
                    return depth, n.name
        return len(topology_keys), n.name

    return min(candidates, key=distance)
