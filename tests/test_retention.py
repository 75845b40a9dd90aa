"""Retention: every table loses what is past its time — log lines, finished incidents with their findings,
finished plans with their steps, the audit log, answered node requests — and keeps what is live or recent,
on SQLite and PostgreSQL; the service prunes on its own (its retention thread), and a pass cut short by its
pace leaves the rest for the next one."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest
from sqlalchemy import func, select

from analyzer.pipeline import Analyzer
from analyzer.records import IncidentState
from analyzer.rules import Rule
from healer.notify import LogNotifier
from healer.records import ActionStep, Mode, Plan, PlanState, StepKind, StepState
from healer.steps.base import RepairRequest
from kmend.pruning import run_retention
from kmend.settings import Settings
from kmend.store import Store, schema
from kmend.store.retention import DAY, Pace, Retention
from kmend.wiring import make_kmend
from sim.cluster import build_cluster
from tests.builders import XID79, container, kernel
from tests.hostile import wait_for

T0 = 1_700_000_000.0


def _count(store: Store, table: str) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(schema.metadata.tables[table])).scalar_one())


def _plan(pid: str, state: PlanState) -> Plan:
    step = ActionStep(f"{pid}-0", StepKind.CORDON, "gpu-node-01", state=StepState.SUCCEEDED)
    return Plan(pid, f"inc-{pid}", "test", Mode.AUTO, (step,), state=state, node="gpu-node-01")


def test_each_table_keeps_what_is_live_or_recent_and_loses_the_rest(database_url: str,
                                                                    shipped_rules: list[Rule]) -> None:
    now = [T0]
    store = Store(database_url, clock=lambda: now[0])
    store.migrate()
    an = Analyzer(shipped_rules)

    def ingest(*sigs: object) -> None:
        store.ingest(list(sigs), lambda s: (*an.process(s), an.correlator.take_merges()))  # type: ignore[arg-type]

    ingest(kernel("gpu-node-01", XID79, ts=T0), container("gpu-node-01", "step 1", ts=T0))
    ingest(kernel("gpu-node-02", XID79, ts=T0 + 1))  # stays open: never aged out
    old_done, still_open = (i for i in an.correlator.incidents())
    store.save_incident(replace(old_done, state=IncidentState.RESOLVED))
    ingest(kernel("gpu-node-03", XID79, ts=T0 + 100 * DAY))
    [recent] = [i for i in an.correlator.incidents() if i.root_cause.node == "gpu-node-03"]
    store.save_incident(replace(recent, state=IncidentState.RESOLVED))
    store.save_plan(_plan("old-done", PlanState.SUCCEEDED))
    store.save_plan(_plan("old-waiting", PlanState.AWAITING_APPROVAL))
    store.ledger.audit("alice", "POST", "/v1/plans/x/approve", 200, {})
    store.ledger.open(RepairRequest("old-answered", "gpu-node-01", "stack_dump"))
    store.ledger.answer("old-answered", "done", "ok")
    store.ledger.open(RepairRequest("old-pending", "gpu-node-01", "stack_dump"))

    now[0] = T0 + 400 * DAY
    store.save_plan(_plan("new-done", PlanState.SUCCEEDED))
    store.ledger.audit("bob", "POST", "/v1/breaker/reset", 200, {})
    deleted = store.prune(Retention())

    assert deleted == {"signals": 3, "incidents": 1, "findings": 1, "plans": 1, "plan_steps": 1, "audit_log": 1,
                       "node_requests": 1}
    assert _count(store, "signals") == 1  # the line from 100 days later: the newest line's time is the clock
    assert {i["id"] for i in store.list_incidents()} == {still_open.id, recent.id}
    assert store.get_incident(still_open.id)["findings"]  # type: ignore[index]
    assert {p.id for p in store.list_plans()} == {"old-waiting", "new-done"}
    assert [e["actor"] for e in store.ledger.audit_entries()] == ["bob"]
    assert [r.id for r in store.ledger.requests_for("gpu-node-01", pending_only=False)] == ["old-pending"]
    assert store.prune(Retention()) == {}
    assert store.prune(Retention(0, 0, 0, 0, 0)) == {}
    store.close()


def test_the_retention_loop_prunes_on_its_own(tmp_path: Path) -> None:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim", retention_signals_s=60,
                        healer_interval_s=0.05)
    k = make_kmend(settings, cluster=build_cluster(2), notifier=LogNotifier())
    k.start()
    k.ingest([container("gpu-node-00", "step 1", ts=T0), container("gpu-node-00", "step 2", ts=T0 + 3600)])
    assert k.store.count_signals() == 2
    stop = threading.Event()
    loop = threading.Thread(target=run_retention, args=(k, stop))
    loop.start()
    try:
        wait_for(lambda: k.store.count_signals() == 1, timeout=60)
    finally:
        stop.set()
        loop.join(30)
    k.store.close()


def test_a_pass_cut_short_by_its_pace_leaves_the_rest_for_the_next(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'k.db'}")
    store.migrate()
    with store.engine.begin() as conn:
        conn.execute(schema.signals.insert(), [{"id": f"s{i}", "node": "gpu-node-01", "source": "container",
                                                "ts": T0 - i, "body": {}} for i in range(20_000)])
    keep = Retention(signals_s=60)
    first = Pace(share=0.5, pass_s=0.0)
    assert store.prune(keep, first) == {} and first.cut_short  # over at once: nothing deleted
    passes = 0
    while True:
        pace = Pace(share=0.5, pass_s=0.02)  # about one chunk a pass
        store.prune(keep, pace)
        passes += 1
        if not pace.cut_short:
            break
    assert passes > 1
    assert _count(store, "signals") == 61  # the lines within a minute of the newest (its own included)
    assert Pace(share=0.25).rest_s(0.02) == pytest.approx(0.06)  # its chunks take a quarter of the time
    store.close()
