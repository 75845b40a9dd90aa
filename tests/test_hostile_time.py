"""Time poison: no timestamp makes the correlator forget a live incident; finished ones are pruned."""

from __future__ import annotations

import time
from pathlib import Path

from analyzer.correlate import Correlator
from analyzer.matcher import FastMatcher
from analyzer.records import Finding, IncidentState
from analyzer.rules import Rule
from collector.signal import Signal
from tests.builders import XID79, kernel
from tests.hostile import serve, wait_for


def _findings(rules: list[Rule], signals: list[Signal]) -> list[Finding]:
    return FastMatcher(rules).match(signals)


def test_a_future_dated_finding_does_not_make_the_next_prune_forget_live_incidents(shipped_rules: list[Rule]) -> None:
    corr = Correlator(window_s=600, max_incidents=3)
    t0 = 1_795_000_000.0
    live = corr.add_all(_findings(shipped_rules, [kernel(f"gpu-node-0{i}", XID79, ts=t0 + i) for i in range(3)]))
    assert len(live) == 3
    # One finding stamped a century ahead; the next batch pushes the count past max_incidents.
    corr.add_all(_findings(shipped_rules, [kernel("gpu-node-05", XID79, ts=t0 + 100 * 365 * 86400)]))
    corr.add_all(_findings(shipped_rules, [kernel("gpu-node-06", XID79, ts=t0 + 10)]))
    nodes = {i.root_cause.node for i in corr.incidents()}
    assert {"gpu-node-00", "gpu-node-01", "gpu-node-02", "gpu-node-06"} <= nodes


def test_finished_incidents_are_still_pruned_to_bound_memory(shipped_rules: list[Rule]) -> None:
    corr = Correlator(window_s=600, max_incidents=3)
    t0 = 1_795_000_000.0
    first = corr.add_all(_findings(shipped_rules, [kernel(f"gpu-node-0{i}", XID79, ts=t0 + i) for i in range(3)]))
    corr.set_state(first[0].id, IncidentState.RESOLVED, t0 + 10, "healed")
    corr.set_state(first[1].id, IncidentState.SUPPRESSED, t0 + 10, "silenced")
    corr.add_all(_findings(shipped_rules, [kernel("gpu-node-07", XID79, ts=t0 + 10 * 3600)]))
    assert {i.root_cause.node for i in corr.incidents()} == {"gpu-node-02", "gpu-node-07"}


def test_a_future_dated_signal_over_http_neither_opens_in_the_future_nor_hides_live_incidents(
        tmp_path: Path) -> None:
    with serve(tmp_path) as s:
        now = time.time()
        assert s.post([kernel("gpu-node-01", XID79, ts=now)]).status_code == 200
        assert s.post([kernel("gpu-node-02", XID79, ts=now + 10 * 365 * 86400)]).status_code == 200
        incs = wait_for(lambda: [i for i in s.incidents() if i["fault_class"] == "gpu_lost"]
                        if len(s.incidents()) >= 2 else None)
        assert {i["root_cause"]["node"] for i in incs} == {"gpu-node-01", "gpu-node-02"}
        assert max(i["updated_at"] for i in incs) < time.time() + 1
