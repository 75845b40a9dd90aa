"""A plan an operator rejected or cancelled keeps that decision, on SQLite and a real PostgreSQL: a later save of the
plan by a run that had not seen it (another replica's task, a round that read the plan before) changes neither the
plan's state nor its steps; a save of the decision itself still goes through."""

from __future__ import annotations

from dataclasses import replace

import pytest

from healer.records import ActionStep, Mode, Plan, PlanState, StepKind, StepState
from kmend.store import Store

pytestmark = pytest.mark.postgres


@pytest.mark.parametrize("decided", [PlanState.REJECTED, PlanState.CANCELLED])
def test_a_stale_save_does_not_overwrite_an_operators_decision(database_url: str, decided: PlanState) -> None:
    store = Store(database_url)
    store.migrate()
    try:
        steps = (ActionStep("p-0", StepKind.CORDON, "gpu-1", state=StepState.SUCCEEDED),
                 ActionStep("p-1", StepKind.DRAIN, "gpu-1"))
        running = Plan("p", "inc-p", "r/p", Mode.AUTO, steps, PlanState.RUNNING, reason="Xid 79", node="gpu-1")
        store.save_plan(running)
        ended = (steps[0], replace(steps[1], state=StepState.SKIPPED, result="not run"))
        store.save_plan(replace(running, state=decided, steps=ended, reason="Xid 79 | decided by alice"))
        # The run that read the plan before: its drain done, the plan succeeded.
        store.save_plan(replace(running, state=PlanState.SUCCEEDED,
                                steps=(steps[0], replace(steps[1], state=StepState.SUCCEEDED))))
        got = store.get_plan("p")
        assert got is not None and got.state is decided and got.reason.endswith("decided by alice"), got
        assert [s.state for s in got.steps] == [StepState.SUCCEEDED, StepState.SKIPPED], got.steps
        store.save_plan(replace(got, reason="Xid 79 | decided by alice | again"))  # the decision itself: saved
        again = store.get_plan("p")
        assert again is not None and again.reason.endswith("again"), again
    finally:
        store.close()
