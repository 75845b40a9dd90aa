"""An operator's reject of a plan whose step is held up in the background (here: a checkpoint restore whose resume
point write blocks until the test lets it go) answers at once with the plan rejected; the held step's result is still
journaled once it ends, no later step runs (the job is not restarted), and later rounds leave the plan rejected."""

from __future__ import annotations

import time
from pathlib import Path

from analyzer.rules import Rule
from healer.records import PlanState, StepKind, StepState
from tests.builders import XID79, container, kernel
from tests.healing import incident
from tests.test_healing_background import BAD, XID48, Gate, _harness, _loop, _plan_of
from tests.waiting import until

ANSWER_S = 5.0
"""How long the reject may take in process (the held step holds for as long as the test lets it)."""


def test_a_reject_while_a_checkpoint_restore_is_held_answers_at_once_and_stops_the_plan(
        shipped_rules: list[Rule], tmp_path: Path) -> None:
    h = _harness(tmp_path, tmp_path / "ck", restart_on_dbe=True)
    heal = h.healing()
    gate = Gate(h.workloads, "apply_config_map")  # the resume point, published by the checkpoint step
    incidents = [incident(shipped_rules, [container(BAD, "step 10 loss 2.1", job="llama"), kernel(BAD, XID48)])]
    with _loop(h, heal, incidents) as errors:
        until("the checkpoint step held", gate.entered.is_set)
        plan = _plan_of(h, BAD, "restart-job")
        assert plan is not None and plan.state is PlanState.RUNNING, plan
        t0 = time.monotonic()
        try:
            rejected = heal.reject(plan.id, "alice")
        finally:
            took = time.monotonic() - t0
            gate.released.set()
        assert rejected.state is PlanState.REJECTED and "rejected by alice" in rejected.reason
        done = until("the held step's result journaled", lambda: (p := h.store.get_plan(plan.id)) is not None and all(
            s.state is not StepState.RUNNING for s in p.steps) and p)
        # Rounds go on: a new fault elsewhere is planned and cordoned while the rejected plan stays as it is.
        incidents.append(incident(shipped_rules, [kernel("gpu-node-09", XID79)]))
        until("a later round's cordon", lambda: h.cluster.get_node("gpu-node-09").unschedulable)
    assert not errors, errors
    assert took < ANSWER_S, took
    after = h.store.get_plan(plan.id)
    assert after is not None and after.state is PlanState.REJECTED, after
    checkpoint = next(s for s in done.steps if s.kind is StepKind.CHECKPOINT)
    assert checkpoint.state is StepState.SUCCEEDED and "checkpoint-50" in checkpoint.result, checkpoint
    restart = next(s for s in after.steps if s.kind is StepKind.RESTART_JOB)
    assert restart.state is StepState.SKIPPED and "rejected by alice" in restart.result, restart
    assert not [t for o, t in h.world.applied() if o == "delete_pod"]  # the job was not restarted
    assert gate.calls == 1
