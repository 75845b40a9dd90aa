"""An agent's GPU report answered while its plan's later step runs in the background (here: a checkpoint restore held
until the test lets it go, then refused by the server, so that the task ends the plan with one whole-plan save) is
kept with the plan's evidence: the task's saves never write back the evidence step as the task read it before the
answer, and the task's own result is kept beside it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from analyzer.rules import Rule
from healer import gpu_report
from healer.cluster import PermanentError
from healer.records import PlanState, StepKind, StepState
from tests.builders import container, kernel
from tests.healing import incident
from tests.test_healing_background import BAD, XID48, _harness, _loop, _plan_of
from tests.waiting import until

REPORT = "==============NVSMI LOG==============\nGPU 00000000:18:00.0\n    Retired Pages: 3"


class Refused:
    """The resume point's ConfigMap write: held until ``released``, then refused (the plan fails in the task)."""

    def __init__(self, owner: object, name: str) -> None:
        self.entered = threading.Event()
        self.released = threading.Event()

        def held(*_: Any, **__: Any) -> None:
            self.entered.set()
            self.released.wait(120)
            raise PermanentError("422 ConfigMap data: Invalid value")

        setattr(owner, name, held)


def test_a_gpu_report_answered_while_the_plans_step_runs_in_the_background_is_kept(
        shipped_rules: list[Rule], tmp_path: Path) -> None:
    h = _harness(tmp_path, tmp_path / "ck", restart_on_dbe=True)
    heal = h.healing()
    gate = Refused(h.workloads, "apply_config_map")
    incidents = [incident(shipped_rules, [container(BAD, "step 10 loss 2.1", job="llama"), kernel(BAD, XID48)])]
    with _loop(h, heal, incidents) as errors:
        until("the checkpoint step held", gate.entered.is_set)
        ask = until("the GPU report asked of the agent", lambda: next(
            (r for r in heal.requests(BAD) if r.kind == gpu_report.GPU_REPORT), None))
        try:
            heal.answer(BAD, ask.id, "done", REPORT)  # while the task holds the plan as it read it
            kept = h.store.get_plan(gpu_report.plan_of(ask.id))
            assert kept is not None
            assert next(s for s in kept.steps if s.kind is StepKind.EVIDENCE).outputs.get("nvidia_smi_q") == REPORT
        finally:
            gate.released.set()
        done = until("the plan ended by its task", lambda: (p := _plan_of(h, BAD, "restart-job")) is not None
                      and p.state is PlanState.FAILED and p)
    assert not errors, errors
    evidence = next(s for s in done.steps if s.kind is StepKind.EVIDENCE)
    assert evidence.outputs.get("nvidia_smi_q") == REPORT, evidence.outputs  # the agent's answer
    checkpoint = next(s for s in done.steps if s.kind is StepKind.CHECKPOINT)
    assert checkpoint.state is StepState.FAILED and "422" in checkpoint.result, checkpoint  # the task's own
    answered = h.store.ledger.get(ask.id)
    assert answered is not None and answered.state == "done"
