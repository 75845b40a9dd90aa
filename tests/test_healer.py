"""Healer: policy choice, step execution with retries, dry-run, and resuming a plan after a crash."""

from __future__ import annotations

from dataclasses import replace

from analyzer.pipeline import Analyzer
from analyzer.records import Incident
from analyzer.rules import Rule
from healer.cluster import PermanentError, TemporaryError
from healer.executor import PlanExecutor
from healer.notify import LogNotifier
from healer.policy import PolicyConfig, choose_plan
from healer.records import Mode, Plan, PlanState, StepKind, StepState
from sim.cluster import build_cluster
from tests.builders import XID13, XID79, container, kernel


class MemoryJournal:
    """Journal fake: keeps every save in order."""

    def __init__(self) -> None:
        self.plans: dict[str, Plan] = {}
        self.step_log: list[tuple[str, StepState]] = []

    def save_plan(self, plan: Plan) -> None:
        self.plans[plan.id] = plan

    def save_step(self, plan_id: str, step: object) -> None:
        self.step_log.append((step.id, step.state))  # type: ignore[attr-defined]


def _incident(rules: list[Rule], *signals: object) -> Incident:
    analyzer = Analyzer(rules)
    analyzer.process(list(signals))  # type: ignore[arg-type]
    [inc] = analyzer.correlator.incidents()
    return inc


def test_hardware_fault_plan_quarantines_the_root_node(shipped_rules: list[Rule]) -> None:
    plan = choose_plan(_incident(shipped_rules, kernel("gpu-node-03", XID79)), PolicyConfig())
    assert plan.mode is Mode.AUTO and plan.policy == "quarantine-hardware"
    assert [s.kind for s in plan.steps] == [StepKind.CORDON, StepKind.TAINT, StepKind.CONDITION, StepKind.EVENT]
    assert {s.node for s in plan.steps} == {"gpu-node-03"}
    taint = plan.steps[1].params
    assert (taint["key"], taint["value"], taint["effect"]) == ("kmend.io/fault", "gpu_lost", "NoSchedule")


def test_application_fault_only_notifies(shipped_rules: list[Rule]) -> None:
    inc = _incident(shipped_rules, container("gpu-node-01", "x", job="j"), kernel("gpu-node-01", XID13))
    plan = choose_plan(inc, PolicyConfig())
    assert [s.kind for s in plan.steps] == [StepKind.NOTIFY]
    cluster = build_cluster(4)
    notifier = LogNotifier()
    done = PlanExecutor(cluster, MemoryJournal(), notifier).execute(plan)
    assert done.state is PlanState.SUCCEEDED
    assert not any(n.unschedulable for n in cluster.list_nodes())
    assert "app_error" in str(notifier.sent[0]["message"])


def test_temporary_errors_are_retried_and_permanent_ones_fail_the_plan(shipped_rules: list[Rule]) -> None:
    plan = choose_plan(_incident(shipped_rules, kernel("gpu-node-02", XID79)), PolicyConfig())
    cluster = build_cluster(4)
    cluster.fail_next("cordon", TemporaryError("429 Too Many Requests"), TemporaryError("500"))
    cluster.fail_next("add_taint", PermanentError("403 Forbidden: nodes is forbidden"))
    sleeps: list[float] = []
    done = PlanExecutor(cluster, MemoryJournal(), LogNotifier(), sleep=sleeps.append).execute(plan)
    assert len(sleeps) == 2
    assert done.state is PlanState.FAILED
    assert done.steps[0].state is StepState.SUCCEEDED and done.steps[1].state is StepState.FAILED
    assert "403" in done.steps[1].result and done.steps[2].state is StepState.PENDING
    assert cluster.get_node("gpu-node-02").unschedulable


def test_dry_run_changes_nothing(shipped_rules: list[Rule]) -> None:
    plan = choose_plan(_incident(shipped_rules, kernel("gpu-node-02", XID79)), PolicyConfig(dry_run=True))
    cluster = build_cluster(4)
    done = PlanExecutor(cluster, MemoryJournal(), LogNotifier()).execute(plan)
    assert done.state is PlanState.DRY_RUN and all(s.state is StepState.SKIPPED for s in done.steps)
    assert cluster.calls == [] and cluster.events == []


def test_resumed_plan_runs_only_unfinished_steps_and_applies_each_once(shipped_rules: list[Rule]) -> None:
    plan = choose_plan(_incident(shipped_rules, kernel("gpu-node-01", XID79)), PolicyConfig())
    # As journaled before a crash: cordon done, taint started but its result never recorded.
    crashed = replace(plan, state=PlanState.RUNNING, steps=(
        replace(plan.steps[0], state=StepState.SUCCEEDED), replace(plan.steps[1], state=StepState.RUNNING),
        *plan.steps[2:]))
    cluster = build_cluster(4)
    cluster.cordon("gpu-node-01")
    cluster.calls.clear()
    done = PlanExecutor(cluster, MemoryJournal(), LogNotifier()).execute(crashed)
    assert done.state is PlanState.SUCCEEDED
    assert [op for op, _ in cluster.calls] == ["add_taint", "set_condition", "emit_event"]
    assert len(cluster.events) == 1
    assert [t.value for t in cluster.get_node("gpu-node-01").taints if t.key == "kmend.io/fault"] == ["gpu_lost"]
