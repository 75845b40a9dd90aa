"""Healer: policy choice, the full replace-node runbook on the simulated world, retries, dry-run, crash resume."""

from __future__ import annotations

from pathlib import Path

from analyzer.rules import Rule
from healer.cluster import PermanentError, TemporaryError
from healer.keys import FAULT_TAINT_KEY, QUARANTINED_BY, QUARANTINED_LABEL, RESUME_FROM, SPARE_LABEL
from healer.records import Mode, PlanState, StepKind, StepState
from tests.builders import XID13, XID79, container, kernel
from tests.healing import Harness, crashed_at, incident, steps

NODE_STEPS = ["evidence", "cordon", "taint",
              "label", "condition", "event", "drain", "spare_swap", "checkpoint", "restart_job",
              "repair", "validate", "return"]


def test_gpu_lost_gets_the_replace_node_runbook(shipped_rules: list[Rule], tmp_path: Path) -> None:
    h = Harness(tmp_path)
    plan = h.plan(incident(shipped_rules, [kernel("gpu-node-03", XID79)]))
    assert plan.mode is Mode.AUTO and plan.policy == "gpu-replace/replace-node"
    assert [s.kind.value for s in plan.steps] == NODE_STEPS
    taint = plan.steps[2].params
    assert (taint["key"], taint["value"], taint["effect"]) == ("kmend.io/fault", "gpu_lost", "NoSchedule")


def test_application_fault_only_notifies(shipped_rules: list[Rule], tmp_path: Path) -> None:
    h = Harness(tmp_path)
    inc = incident(shipped_rules, [container("gpu-node-01", "x", job="j"), kernel("gpu-node-01", XID13)])
    plan = h.plan(inc)
    assert [s.kind for s in plan.steps] == [StepKind.NOTIFY]
    done = h.run(plan)
    assert done.state is PlanState.SUCCEEDED
    assert not any(n.unschedulable for n in h.cluster.list_nodes())
    assert "app_error" in str(h.notifier.sent[0]["message"])


def test_replace_node_runbook_heals_the_job_onto_a_spare(shipped_rules: list[Rule], tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    (ck / "checkpoint-100").mkdir(parents=True)
    (ck / "checkpoint-100" / "trainer_state.json").write_text('{"global_step": 100}')
    (ck / "checkpoint-100" / "pytorch_model.bin").write_bytes(b"")  # empty: unreadable, so skipped
    (ck / "checkpoint-50").mkdir()
    (ck / "checkpoint-50" / "trainer_state.json").write_text('{"global_step": 50}')
    import zipfile

    with zipfile.ZipFile(ck / "checkpoint-50" / "pytorch_model.bin", "w") as z:
        z.writestr("archive/data.pkl", b"x")
    h = Harness(tmp_path, nodes=16, spares=2, job_nodes=4, checkpoint_path=str(ck))
    bad = "gpu-node-02"
    plan = h.run(h.plan(incident(shipped_rules, [container(bad, "iteration 1", job="llama"), kernel(bad, XID79)])))
    assert plan.state is PlanState.RUNNING and plan.steps[10].state is StepState.WAITING  # repair: the platform
    node = h.cluster.get_node(bad)
    assert node.unschedulable and node.taint(FAULT_TAINT_KEY) is not None
    assert node.labels[QUARANTINED_LABEL] == "true" and node.annotations[QUARANTINED_BY] == "kmend"
    spare = plan.outputs()["spare"]
    assert spare == "gpu-node-14"  # spares 14 and 15 share gpu-node-02's spine, not its leaf: the first by name
    pods = [p for p in h.workloads.list_pods(namespace="training")]
    assert len(pods) == 4 and all(p.node and p.node != bad for p in pods)
    assert spare in {p.node for p in pods}
    assert h.workloads.get_object(_owner())["metadata"]["annotations"][RESUME_FROM] == str(ck / "checkpoint-50")
    assert "checkpoint-100" in plan.steps[8].result and "pytorch_model.bin is empty" in plan.steps[8].result
    h.answer_repairs()
    plan = h.run(plan)
    assert plan.state is PlanState.SUCCEEDED, steps(plan)
    back = h.cluster.get_node(bad)
    assert not back.unschedulable and back.taint(FAULT_TAINT_KEY) is None
    assert back.labels[SPARE_LABEL] == "true" and back.taint("kmend.io/spare") is not None
    # Each change applied once.
    ops = h.world.applied()
    assert ops.count(("cordon", bad)) == 1 and ops.count(("uncordon", bad)) == 1
    assert ops.count(("evict_pod", "training/llama-worker-2")) == 1
    # Every rank of the old run restarts together, including the one its controller recreated after eviction.
    assert sorted(t for o, t in ops if o == "delete_pod") == [f"training/llama-worker-{i}" for i in range(4)]


def _owner():  # type: ignore[no-untyped-def]
    from healer.workloads import ObjectKey

    return ObjectKey("kubeflow.org/v1", "PyTorchJob", "training", "llama")


def test_temporary_errors_are_retried_and_permanent_ones_fail_the_plan(shipped_rules: list[Rule],
                                                                        tmp_path: Path) -> None:
    h = Harness(tmp_path)
    plan = h.plan(incident(shipped_rules, [kernel("gpu-node-02", XID79)]))
    h.cluster.fail_next("cordon", TemporaryError("429 Too Many Requests"), TemporaryError("500"))
    h.cluster.fail_next("add_taint", PermanentError("403 Forbidden: nodes is forbidden"))
    done = h.executor.execute(plan)
    assert len(h.sleeps) == 2
    assert done.state is PlanState.FAILED
    assert done.steps[1].state is StepState.SUCCEEDED and done.steps[2].state is StepState.FAILED
    assert "403" in done.steps[2].result
    # A failed plan never runs again: the steps after the failure say so instead of staying pending forever.
    assert {s.state for s in done.steps[3:]} == {StepState.SKIPPED}
    assert done.steps[3].result == "not run: the plan failed (step taint failed: 403 Forbidden: nodes is forbidden)"
    assert h.store.get_plan(plan.id) == done
    assert h.cluster.get_node("gpu-node-02").unschedulable


def test_dry_run_changes_nothing(shipped_rules: list[Rule], tmp_path: Path) -> None:
    h = Harness(tmp_path)
    plan = h.plan(incident(shipped_rules, [kernel("gpu-node-02", XID79)]), dry_run=True)
    done = h.executor.execute(plan)
    assert done.state is PlanState.DRY_RUN and all(s.state is StepState.SKIPPED for s in done.steps)
    assert done.steps[1].result == "dry-run: would cordon gpu-node-02"
    assert h.cluster.calls == [] and h.cluster.events == [] and h.world.applied() == []


def test_resumed_plan_runs_only_unfinished_steps_and_applies_each_once(shipped_rules: list[Rule],
                                                                       tmp_path: Path) -> None:
    h = Harness(tmp_path)
    plan = h.plan(incident(shipped_rules, [kernel("gpu-node-01", XID79)]))
    h.cluster.cordon("gpu-node-01")  # applied before the crash; the journal says the taint step was running
    h.cluster.calls.clear()
    done = h.executor.execute(crashed_at(plan, 2))
    # The condition step writes KmendHealthy and its node-problem-detector-style twin KmendFault.
    assert [op for op, _ in h.cluster.calls][:5] == ["add_taint", "patch_node_metadata", "set_condition",
                                                     "set_condition", "emit_event"]
    assert [t.value for t in h.cluster.get_node("gpu-node-01").taints if t.key == FAULT_TAINT_KEY] == ["gpu_lost"]
    # The event step crashed after recording: it is keyed by its step id and not recorded twice.
    again = h.executor.execute(crashed_at(done, 5))
    assert len([e for e in h.cluster.events if e.reason == "KmendQuarantine"]) == 1
    assert again.steps[5].state is StepState.SUCCEEDED


def test_restart_holds_the_gangs_healthy_nodes_for_the_scheduler(shipped_rules: list[Rule], tmp_path: Path) -> None:
    from healer.gang.reservations import ReservationBook

    book = ReservationBook()
    h = Harness(tmp_path, nodes=16, spares=2, job_nodes=4, reservations=book)
    bad = "gpu-node-02"
    h.run(h.plan(incident(shipped_rules, [container(bad, "iteration 1", job="llama"), kernel(bad, XID79)])))
    held = book.get("training/llama")
    assert held is not None
    assert held.failed == frozenset({bad})
    # The healthy nodes of the old run (and wherever the controller already put the evicted rank).
    assert {"gpu-node-00", "gpu-node-01", "gpu-node-03"} <= held.nodes and bad not in held.nodes
    assert held.until > h.clock()
