"""Closing the steps a kill -9 left running in plans an operator had decided, on SQLite and a real PostgreSQL: only
rejected or cancelled plans' running steps, not a plan this process still runs, each closed once, and a cordon closed
that way still counted by the breaker."""

from __future__ import annotations

import pytest

from healer.records import ActionStep, Mode, Plan, PlanState, StepKind, StepState
from kmend.interrupted import close_interrupted
from kmend.store import Store

pytestmark = pytest.mark.postgres


def _plan(pid: str, state: PlanState, *kinds: tuple[StepKind, StepState]) -> Plan:
    steps = tuple(ActionStep(f"{pid}-{i}", kind, "gpu-1", state=st) for i, (kind, st) in enumerate(kinds))
    return Plan(pid, f"inc-{pid}", "r/p", Mode.AUTO, steps, state, reason="Xid 79 | rejected by alice", node="gpu-1")


def test_running_steps_of_decided_plans_are_closed_once_and_nothing_else(database_url: str) -> None:
    store = Store(database_url)
    store.migrate()
    drain = (StepKind.DRAIN, StepState.RUNNING)
    plans = [_plan("rejected", PlanState.REJECTED, (StepKind.CORDON, StepState.SUCCEEDED), drain,
                   (StepKind.RESTART_JOB, StepState.PENDING)),
             _plan("cancelled", PlanState.CANCELLED, (StepKind.CORDON, StepState.RUNNING)),
             _plan("running", PlanState.RUNNING, drain),  # resumed by the loop, not closed
             _plan("busy", PlanState.REJECTED, drain),  # its task still runs here: it journals the result itself
             _plan("waiting", PlanState.REJECTED, (StepKind.REPAIR, StepState.WAITING))]
    for p in plans:
        store.save_plan(p)
    closed = close_interrupted(store, busy={"busy"})
    assert [p.id for p in closed] == ["rejected", "cancelled"]
    got = {p.id: p for p in store.get_plans([p.id for p in plans])}
    assert [s.state for s in got["rejected"].steps] == [StepState.SUCCEEDED, StepState.INTERRUPTED,
                                                        StepState.PENDING]
    result = got["rejected"].steps[1].result
    assert "restarted" in result and "rejected" in result and "rejected by alice" in result, result
    assert got["rejected"].state is PlanState.REJECTED
    assert got["cancelled"].steps[0].state is StepState.INTERRUPTED
    assert got["running"].steps[0].state is StepState.RUNNING
    assert got["busy"].steps[0].state is StepState.RUNNING
    assert got["waiting"].steps[0].state is StepState.WAITING
    assert close_interrupted(store, busy={"busy"}) == []  # once
    # A cordon cut short may have reached the server: the breaker still counts its node.
    assert store.ledger.quarantined_nodes_since(0.0, exclude_plan="rejected") == {"gpu-1"}
