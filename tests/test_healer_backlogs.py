"""Backlogs do not delay a cordon: a fault that arrives while retention prunes a store filled past its time, or
while the healer plans for thousands of incidents found open at start, has its node cordoned within a bound by the
running service; the prune still removes everything due and every incident still gets its plan. A round plans for
a bounded number of new incidents, the most severe and then the oldest first."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from analyzer.pipeline import Analyzer
from analyzer.rules import Rule
from healer.notify import LogNotifier
from kmend.app import create_app
from kmend.demo import serve_in_thread
from kmend.service import Kmend
from kmend.settings import Settings
from kmend.store import Store
from kmend.wiring import make_kmend
from sim.cluster import SimCluster, build_cluster
from tests.builders import XID13, XID79, kernel
from tests.healing import Harness
from tests.hostile import wait_for

T0 = 1_700_000_000.0
BACKLOG = 400_000
CORDON_BOUND_S = 1.5
"""How soon the node of a new Xid 79 must be cordoned, on a loaded machine (a prune or a planning round of the
whole backlog takes far longer)."""


def _old_lines(store: Store, n: int) -> None:
    """`n` stored log lines a day older than the retention keeps (an upgrade's or a restart's backlog), and a newer
    one (lines age against the newest line's time)."""
    body = '{"message": "step"}'
    rows = [("new", "gpu-node-01", "container", T0, body)]
    rows += [(f"old-{i}", f"gpu-node-{i % 64:02d}", "container", T0 - 86400.0 - i, body) for i in range(n)]
    with store.engine.begin() as conn:  # the driver's executemany: the backlog is written in about a second
        conn.exec_driver_sql("INSERT INTO signals (id, node, source, ts, body) VALUES (?, ?, ?, ?, ?)", rows)


def _cordoned(cluster: SimCluster, node: str) -> bool:
    return cluster.get_node(node).unschedulable


def _time_to_cordon(k: Kmend, cluster: SimCluster, node: str) -> float:
    began = time.monotonic()
    k.ingest([kernel(node, XID79, ts=T0)])
    wait_for(lambda: _cordoned(cluster, node), timeout=300)
    return time.monotonic() - began


@pytest.mark.slow
def test_a_fault_during_the_prune_of_a_backlog_is_cordoned_within_a_bound(tmp_path: Path) -> None:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim", retention_signals_s=3600,
                        healer_interval_s=0.05)
    cluster = build_cluster(2)
    k = make_kmend(settings, cluster=cluster, notifier=LogNotifier())
    k.start()
    _old_lines(k.store, BACKLOG)
    with serve_in_thread(create_app(k, settings)):
        wait_for(lambda: k.store.count_signals() < BACKLOG, timeout=60)  # the prune is under way
        took = _time_to_cordon(k, cluster, "gpu-node-00")
        left = k.store.count_signals()
        assert took < CORDON_BOUND_S, f"cordoned {took:.1f} s after the fault, {left} lines left to prune"
        # Everything due goes all the same: only the newer line and the fault's are left.
        wait_for(lambda: k.store.count_signals() <= 2, timeout=600)  # at the shipped pace: a quarter of the time
    assert k.store.count_signals() == 2
    k.store.close()


@pytest.mark.slow
def test_a_fault_among_thousands_of_incidents_open_at_start_is_cordoned_within_a_bound(tmp_path: Path) -> None:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim", healer_interval_s=0.05,
                        incident_quiet_resolve_s=0)
    many = 5000
    first = make_kmend(settings, cluster=build_cluster(2), notifier=LogNotifier())
    first.start()
    # Notify-only faults on nodes of their own: one incident each, stored, no plan yet (the healer never ran).
    first.ingest([kernel(f"gpu-node-x{i:05d}", XID13, ts=T0 + i * 0.001) for i in range(many)])
    assert len(first.analyzer.correlator.active()) == many
    first.store.close()

    cluster = build_cluster(2)
    k = make_kmend(settings, cluster=cluster, notifier=LogNotifier())
    k.start()
    with serve_in_thread(create_app(k, settings)):
        took = _time_to_cordon(k, cluster, "gpu-node-00")
        planned = sum(k.store.plan_counts().values())
        assert took < CORDON_BOUND_S, f"cordoned {took:.1f} s after the fault, {planned} plans made by then"
        # The rest are planned all the same, in the rounds that follow.
        wait_for(lambda: sum(k.store.plan_counts().values()) == many + 1, timeout=300)
    k.store.close()


def test_a_round_plans_for_the_most_severe_new_incidents_first_and_leaves_the_rest_to_the_next(
        shipped_rules: list[Rule], tmp_path: Path) -> None:
    h = Harness(tmp_path, nodes=16)
    analyzer = Analyzer(shipped_rules)
    analyzer.process([kernel(f"gpu-node-{i:02d}", XID13, ts=T0 + i) for i in range(6)]
                     + [kernel("gpu-node-10", XID79, ts=T0 + 10)])
    incidents = analyzer.correlator.incidents()
    heal = h.healing()
    heal.new_per_round = 3
    first = heal.heal_once(incidents, lambda *_: None)
    # The newest incident, but the most severe: planned (and its node cordoned) in the first round.
    assert first[0].node == "gpu-node-10" and h.cluster.get_node("gpu-node-10").unschedulable
    assert [p.node for p in first[1:]] == ["gpu-node-00", "gpu-node-01"]  # then the oldest
    assert heal.backlog == 4
    second = heal.heal_once(incidents, lambda *_: None)  # its new plans, then (at least) one plan resumed
    assert [p.node for p in second[:3]] == ["gpu-node-02", "gpu-node-03", "gpu-node-04"]
    heal.heal_once(incidents, lambda *_: None)
    assert heal.backlog == 0
    assert len(h.store.plan_ids()) == 7
