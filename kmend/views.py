"""The node and action views the API and the gauges read: per-node health, every step of every plan."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from analyzer.records import Incident
from healer.cluster import NodeInfo
from healer.keys import FAULT_TAINT_KEY, SPARE_LABEL, UNVALIDATED_TAINT_KEY
from healer.records import Plan

NO_RECORD: dict[str, Any] = {"validation": None, "faults_in_window": 0, "mtbi_s": None, "lemon": None}
"""A node's history when the journal has no plan about it."""


def open_by_node(active: Iterable[Incident]) -> dict[str, list[str]]:
    """Ids of the open incidents about each node."""
    by_node: dict[str, list[str]] = {}
    for inc in active:
        if inc.root_cause.node:
            by_node.setdefault(inc.root_cause.node, []).append(inc.id)
    return by_node


def node_health(nodes: Sequence[NodeInfo], by_node: dict[str, list[str]],
                records: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per-node health: healthy, spare (in the hot-spare pool), suspect (open incident), unvalidated or quarantined."""
    out: dict[str, dict[str, Any]] = {}
    for n in nodes:
        fault = next((t.value for t in n.taints if t.key == FAULT_TAINT_KEY), None)
        incs = by_node.get(n.name, [])
        spare = n.labels.get(SPARE_LABEL) == "true"
        state = "quarantined" if fault else ("suspect" if incs else ("spare" if spare else "healthy"))
        if not fault and n.taint(UNVALIDATED_TAINT_KEY) is not None:
            state = "unvalidated"
        out[n.name] = {
            "state": state, "cordoned": n.unschedulable, "fault": fault,
            "taints": [f"{t.key}={t.value}:{t.effect}" if t.value else f"{t.key}:{t.effect}" for t in n.taints],
            "incidents": incs,
            "conditions": {c.type: c.status for c in n.conditions},
            **records.get(n.name, NO_RECORD),
        }
    return out


def actions(plans: Iterable[Plan]) -> list[dict[str, Any]]:
    """Every step of every plan, flattened (for summaries)."""
    return [{"plan": p.id, "incident": p.incident_id, "kind": s.kind.value, "node": s.node,
             "result": s.state.value, "detail": s.result, "mode": p.mode.value} for p in plans for s in p.steps]
