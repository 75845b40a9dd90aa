"""Store on SQLite and a real PostgreSQL server: idempotent ingest, one-transaction results, the plan journal."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sqlalchemy import inspect

from analyzer.pipeline import Analyzer
from analyzer.rules import Rule
from healer.records import ActionStep, Mode, Plan, PlanState, StepKind, StepState
from kmend.store import Store
from kmend.store.store import Analyze
from tests.builders import XID79, container, kernel, nccl_timeout

pytestmark = pytest.mark.postgres


def _analyze(analyzer: Analyzer) -> Analyze:
    return lambda sigs: (*analyzer.process(sigs), analyzer.correlator.take_merges())


def _store(url: str) -> Store:
    s = Store(url)
    s.migrate()
    return s


def test_migration_creates_every_table_at_head(database_url: str) -> None:
    store = _store(database_url)
    tables = set(inspect(store.engine).get_table_names())
    assert {"signals", "findings", "incidents", "plans", "plan_steps", "alembic_version", "audit_log", "breaker",
            "node_requests", "leases_seen", "replica_feed", "feed_cursor"} <= tables
    assert store.revision() == "0008"
    store.migrate()  # idempotent
    assert store.revision() == "0008"
    from kmend.store import schema

    for table in schema.metadata.tables.values():  # the migrations create exactly the declared columns
        got = {c["name"] for c in inspect(store.engine).get_columns(table.name)}
        assert got == {c.name for c in table.columns}, table.name


def test_repeated_signal_ids_are_stored_and_analyzed_once(database_url: str, shipped_rules: list[Rule]) -> None:
    store = _store(database_url)
    analyzer = Analyzer(shipped_rules)
    batch = [kernel("gpu-1", XID79), container("gpu-1", "iteration 1")]
    first = store.ingest(batch, _analyze(analyzer))
    again = store.ingest(batch + batch, _analyze(analyzer))
    assert (first.accepted, first.duplicates, len(first.findings)) == (2, 0, 1)
    assert (again.accepted, again.duplicates, len(again.findings)) == (0, 4, 0)
    assert store.count_signals() == 2
    [inc] = store.list_incidents()
    assert inc["fault_class"] == "gpu_lost" and inc["root_cause"]["node"] == "gpu-1"


def test_a_failed_analysis_rolls_back_the_signals_too(database_url: str) -> None:
    store = _store(database_url)

    def broken(_signals: object) -> tuple[list[object], list[object]]:
        raise RuntimeError("analyzer crashed")

    with pytest.raises(RuntimeError):
        store.ingest([kernel("gpu-1", XID79)], broken)  # type: ignore[arg-type]
    assert store.count_signals() == 0  # redelivery will analyze it


def test_findings_replay_in_order_and_follow_adoption(database_url: str, shipped_rules: list[Rule]) -> None:
    store = _store(database_url)
    analyzer = Analyzer(shipped_rules)
    store.ingest([container("gpu-2", nccl_timeout(r), rank=r, ts=1.7e9 + 600) for r in range(4)], _analyze(analyzer))
    store.ingest([kernel("gpu-2", XID79, ts=1.7e9)], _analyze(analyzer))
    replayed = Analyzer(shipped_rules)
    for f in store.findings_in_order():
        replayed.correlator.add(f)
    assert [i.id for i in replayed.correlator.incidents()] == [i.id for i in analyzer.correlator.incidents()]
    [inc] = store.list_incidents()
    full = store.get_incident(inc["id"])
    assert full is not None and full["fault_class"] == "gpu_lost" and len(full["findings"]) == 5


def test_plan_journal_keeps_each_steps_latest_state(database_url: str) -> None:
    store = _store(database_url)
    steps = (ActionStep("p1-0", StepKind.CORDON, "n1"), ActionStep("p1-1", StepKind.EVENT, "n1", {"reason": "R"}))
    plan = Plan("p1", "inc-1", "quarantine-hardware", Mode.AUTO, steps, PlanState.RUNNING)
    store.save_plan(plan)
    store.save_step("p1", replace(steps[0], state=StepState.SUCCEEDED, result="cordoned n1"))
    store.save_step("p1", replace(steps[1], state=StepState.RUNNING))
    got = store.get_plan("p1")
    assert got is not None
    assert [s.state for s in got.steps] == [StepState.SUCCEEDED, StepState.RUNNING]
    assert got.steps[0].result == "cordoned n1" and got.steps[1].params == {"reason": "R"}
    assert [p.id for p in store.list_plans(state="running")] == ["p1"]


def test_a_cause_adopting_two_symptom_incidents_leaves_one_active(database_url: str, shipped_rules: list[Rule]) -> None:
    store = _store(database_url)
    analyzer = Analyzer(shipped_rules)
    run = _analyze(analyzer)
    store.ingest([container("gpu-4", nccl_timeout(1), job="job-a", rank=1, ts=1.7e9 + 600)], run)
    store.ingest([container("gpu-4", nccl_timeout(2), job="job-b", rank=2, ts=1.7e9 + 601)], run)
    assert len(store.list_incidents(state="open")) == 2
    store.ingest([kernel("gpu-4", XID79, ts=1.7e9)], run)
    [active] = store.list_incidents(state="open")
    [merged] = store.list_incidents(state="suppressed")
    assert active["fault_class"] == "gpu_lost" and merged["fault_class"] == "nccl_timeout"
    full = store.get_incident(active["id"])
    assert full is not None and {f["rule_id"] for f in full["findings"]} == {"xid-79", "nccl-watchdog-timeout"}
    assert len(full["findings"]) == 3 and sorted(full["jobs"]) == ["training/job-a", "training/job-b"]  # namespace/job


def test_healing_ledger_breaker_requests_audit_and_journal_counts(database_url: str) -> None:
    from healer.records import ActionStep, Mode, Plan, StepKind, StepState
    from healer.steps.base import RepairRequest

    store = _store(database_url)
    led = store.ledger
    assert not led.breaker().tripped
    first = led.trip_breaker(100.0, "5 of 40 GPU nodes")
    again = led.trip_breaker(200.0, "later")
    assert first.tripped and again.tripped_at == 100.0 and again.reason == "5 of 40 GPU nodes"
    assert not led.reset_breaker(300.0, "alice").tripped and led.breaker().reset_by == "alice"
    req = led.open(RepairRequest("plan-1-9", "gpu-1", "reset_gpu", {"gpu": "3"}))
    assert led.open(RepairRequest("plan-1-9", "gpu-1", "reboot")).kind == "reset_gpu"  # idempotent by id
    assert [r.id for r in led.requests_for("gpu-1")] == [req.id]
    assert led.answer(req.id, "done", "reset").state == "done"  # type: ignore[union-attr]
    assert led.answer(req.id, "failed", "late").state == "done"  # type: ignore[union-attr]
    assert led.requests_for("gpu-1") == []
    led.audit("alice", "POST", "/v1/breaker/reset", 200, {})
    assert led.audit_entries()[0]["actor"] == "alice"
    plan = Plan("plan-1", "inc-1", "r/p", Mode.AUTO, (ActionStep("plan-1-0", StepKind.CORDON, "gpu-1"),),
                node="gpu-1", job="j")
    store.save_plan(plan)
    store.save_step(plan.id, ActionStep("plan-1-0", StepKind.CORDON, "gpu-1", state=StepState.RUNNING))
    assert led.quarantined_nodes_since(0.0, exclude_plan="other") == {"gpu-1"}
    assert led.quarantined_nodes_since(0.0, exclude_plan="plan-1") == set()
    assert led.plans_started_since(0.0, exclude_plan="other") == 1


def test_lookups_by_incident_time_and_plan_are_indexed(database_url: str) -> None:
    """An incident's findings, findings by time and a plan's steps are read without scanning the tables."""
    store = _store(database_url)
    indexed = {(t, tuple(ix["column_names"])) for t in ("findings", "plan_steps")
               for ix in inspect(store.engine).get_indexes(t)}
    assert {("findings", ("incident_id",)), ("findings", ("ts",)), ("plan_steps", ("plan_id",))} <= indexed
