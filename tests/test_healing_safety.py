"""Healing on the cluster as it is now: the job on a node is asked from the cluster; placements expire; the
breaker caps the level of nodes out; repeated repairs climb the ladder to a person; soft evidence must repeat;
lemon nodes are replaced; every plan that acts keeps its evidence first."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import yaml

from analyzer.correlate import Correlator
from analyzer.detectors.straggler import DETECTOR_ID as STRAGGLER
from analyzer.pipeline import Analyzer
from analyzer.records import Action, FaultClass, Finding, Incident, IncidentState, Location, Severity
from analyzer.rules import Rule
from healer.keys import QUARANTINED_BY, QUARANTINED_LABEL
from healer.policy_file import default_policy_path, parse_policy
from healer.records import Mode, PlanState, StepKind
from tests.builders import XID79, container, kernel
from tests.healing import Harness, incident

T0 = 1_700_000_000.0
XID48 = ("NVRM: Xid (PCI:0000:3b:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error "
         "(DBE) has been detected on GPU in the framebuffer at partition 0, subpartition 0.")


def _no_state(*_: object) -> None:
    return None


def test_an_xid_belongs_to_the_job_on_the_node_now_not_to_every_job_it_ever_ran(shipped_rules: list[Rule]) -> None:
    analyzer = Analyzer(shipped_rules)
    analyzer.process([container("gpu-node-04", "step 10 loss 3.2", job="old-run", ts=T0)])
    analyzer.process([container("gpu-node-04", "step 1 loss 9.1", job="llama", ts=T0 + 7200)])
    analyzer.process([kernel("gpu-node-04", XID79, ts=T0 + 7260)])
    [inc] = [i for i in analyzer.correlator.incidents() if i.fault_class is FaultClass.GPU_LOST]
    assert inc.root_cause.job == "llama"
    assert analyzer.correlator.jobs_on("gpu-node-04", at=T0 + 7260) == {"training/llama"}


def test_a_bundle_placement_never_expires() -> None:
    c = Correlator(window_s=60)
    c.observe_placement("j", "n1")
    assert c.jobs_on("n1", at=T0 + 10**6) == {"j"}


def test_the_plan_acts_on_the_job_bound_to_the_node_now(shipped_rules: list[Rule], tmp_path: Path) -> None:
    h = Harness(tmp_path, job_nodes=4)
    # The signals last showed another job on gpu-node-01; the cluster says llama runs there now.
    inc = incident(shipped_rules, [container("gpu-node-01", "step 5", job="finished-run"),
                                   kernel("gpu-node-01", XID79)])
    assert inc.root_cause.job == "finished-run"
    [plan] = h.healing().heal_once([inc], _no_state)
    assert plan.job == "llama" and plan.namespace == "training"
    drain = next(s for s in plan.steps if s.kind is StepKind.DRAIN)
    assert drain.params["job"] == "llama"
    assert next(s for s in plan.steps if s.kind is StepKind.SPARE_SWAP).state.value == "succeeded"


def test_the_plan_acts_on_the_namespace_whose_job_runs_on_the_node(shipped_rules: list[Rule],
                                                                    tmp_path: Path) -> None:
    h = Harness(tmp_path, job_nodes=4)
    # Job names repeat across namespaces: another team's "llama" (listed first) runs on a node of its own.
    h.workloads.add_pod("a-team", "llama-worker-0", node="gpu-node-09", labels={
        "training.kubeflow.org/job-name": "llama", "training.kubeflow.org/replica-index": "0"})
    inc = incident(shipped_rules, [container("gpu-node-01", "step 5", job="llama"), kernel("gpu-node-01", XID79)])
    [plan] = h.healing().heal_once([inc], _no_state)
    assert plan.job == "llama" and plan.namespace == "training"
    assert {s.params.get("namespace") for s in plan.steps if s.params.get("job")} == {"training"}
    plan = h.run(plan)
    assert not [p for p in h.workloads.list_pods(node="gpu-node-01") if not p.terminating]
    assert [p.node for p in h.workloads.list_pods(namespace="a-team")] == ["gpu-node-09"]


def test_the_breaker_counts_nodes_still_out_from_long_ago(shipped_rules: list[Rule], tmp_path: Path) -> None:
    h = Harness(tmp_path, nodes=20, spares=0)
    for name in ("gpu-node-10", "gpu-node-11"):  # quarantined by kmend yesterday, still waiting for repair
        h.cluster.cordon(name)
        h.cluster.patch_node_metadata(name, labels={QUARANTINED_LABEL: "true"}, annotations={QUARANTINED_BY: "kmend"})
    h.clock.advance(86400)
    plan = h.run(h.plan(incident(shipped_rules, [kernel("gpu-node-03", XID79)])))
    assert plan.state is PlanState.BLOCKED, plan.reason
    assert "3 of 20 GPU nodes out of service" in plan.reason
    assert not h.cluster.get_node("gpu-node-03").unschedulable


def _xid48(shipped_rules: list[Rule], i: int) -> Incident:
    return incident(shipped_rules, [kernel("gpu-node-05", XID48, ts=T0 + 1000 * i)])


def _finish(h: Harness, plan_id: str) -> None:
    plan = h.store.get_plan(plan_id)
    assert plan is not None
    h.store.save_plan(replace(plan, state=PlanState.FAILED))


def test_repeated_repairs_climb_the_ladder_to_a_person(shipped_rules: list[Rule], tmp_path: Path) -> None:
    data = yaml.safe_load(default_policy_path().read_text())
    data["safety"]["lemon_faults"] = 10  # the ladder alone, without the lemon verdict
    h = Harness(tmp_path, policy=parse_policy(data, "ladder"))
    heal = h.healing()
    chosen = []
    for i in range(4):
        h.clock.advance(7200)  # past the node cooldown
        [plan] = heal.heal_once([_xid48(shipped_rules, i)], _no_state)
        if plan.mode is Mode.APPROVAL:
            plan = heal.approve(plan.id, "ops", _no_state)
        chosen.append(plan.policy.split("/")[1])
        evidence = plan.steps[0]
        assert evidence.kind is StepKind.EVIDENCE and "xid-48" in evidence.outputs.get("lines", "")
        _finish(h, plan.id)
    assert chosen == ["reset-gpu", "reboot-node", "replace-node", "quarantine-only"]
    last = h.store.list_plans(node="gpu-node-05")
    person = next(p for p in last if p.policy.endswith("quarantine-only"))
    assert "every rung tried: a person decides" in person.reason
    assert "reset_gpu tried 1 time(s)" in person.steps[0].params["ladder"]


def test_a_lemon_node_is_sent_to_replace(shipped_rules: list[Rule], tmp_path: Path) -> None:
    h = Harness(tmp_path)
    heal = h.healing()
    # A double-bit error on one GPU after another: each reset once, but the node keeps failing.
    for i, pci in enumerate(("3b", "5d")):
        h.clock.advance(7200)
        [plan] = heal.heal_once([incident(shipped_rules, [kernel("gpu-node-06", XID48.replace("3b", pci),
                                                                 ts=T0 + i)])], _no_state)
        if plan.mode is Mode.APPROVAL:
            plan = heal.approve(plan.id, "ops", _no_state)
        assert plan.policy.endswith("reset-gpu") and h.cluster.get_node("gpu-node-06").unschedulable
        _finish(h, plan.id)
    h.clock.advance(7200)
    [plan] = heal.heal_once([incident(shipped_rules, [kernel("gpu-node-06", XID48.replace("3b", "86"))])], _no_state)
    assert plan.policy.endswith("replace-node") and "lemon node: 3 hardware faults" in plan.reason


def _straggler(n: int, age_s: float = 0.0) -> Incident:
    c = Correlator()
    for i in range(n):
        c.add(Finding(f"{STRAGGLER}:llama:3:{100 + 10 * i}", T0 + 60 * i, FaultClass.STRAGGLER, Severity.WARNING, True,
                      Location(node="gpu-node-02", rank=3, job="llama"), STRAGGLER, Action.REPLACE_NODE, (),
                      "rank 3 on gpu-node-02 is 1.31x slower than the median rank; node: GPU 2 clock throttled "
                      "(reasons 0x20)"))
    [inc] = c.incidents()
    return inc


def test_soft_evidence_must_repeat_stay_fresh_and_ask_a_person(tmp_path: Path) -> None:
    h = Harness(tmp_path, job_nodes=4)
    heal = h.healing()
    h.clock.t = T0 + 60
    assert heal.heal_once([_straggler(1)], _no_state) == []  # one throttle sample: no plan at all
    h.clock.t = T0 + 3600
    assert heal.heal_once([_straggler(2)], _no_state) == []  # repeated, but an hour old
    h.clock.t = T0 + 120
    [plan] = heal.heal_once([_straggler(2)], _no_state)
    assert plan.mode is Mode.APPROVAL and plan.state is PlanState.AWAITING_APPROVAL
    assert not h.cluster.get_node("gpu-node-02").unschedulable


def test_application_faults_never_get_an_evidence_step_or_a_cordon(shipped_rules: list[Rule], tmp_path: Path) -> None:
    h = Harness(tmp_path)
    inc = incident(shipped_rules, [container("gpu-node-01", "x", job="j"),
                                   kernel("gpu-node-01", "NVRM: Xid (PCI:0000:05:00): 13, Graphics SM Warp Exception")])
    assert inc.state is IncidentState.OPEN
    [plan] = h.healing().heal_once([inc], _no_state)
    assert [s.kind for s in plan.steps] == [StepKind.NOTIFY]


def test_a_rank_the_hang_detector_names_gets_its_job_restarted_not_its_node_cordoned(
        shipped_rules: list[Rule], tmp_path: Path) -> None:
    from analyzer.detectors.suite import DetectorSuite
    from collector.signal import Source
    from sim.traces import TraceJob

    trace = TraceJob("llama", world=16, step_s=1.0, seed=1)
    batches = sorted(trace.run(20) + trace.hang_rank(11, behind=True, duration_s=300), key=lambda b: b[0])
    stall = max(s.ts for _, sigs in batches for s in sigs if s.source is Source.PROGRESS)
    analyzer = Analyzer(shipped_rules, detectors=DetectorSuite())
    t, i = batches[0][0], 0
    while t <= stall + 300:  # signals as they arrive, the detectors every second
        while i < len(batches) and batches[i][0] <= t:
            analyzer.process(batches[i][1])
            i += 1
        analyzer.evaluate(t)
        t += 1.0
    [inc] = analyzer.correlator.incidents()
    assert inc.fault_class is FaultClass.HANG and inc.root_cause.rank == 11
    h = Harness(tmp_path)
    h.clock.t = stall + 400
    [plan] = h.healing().heal_once([inc], _no_state)
    assert plan.policy == "restart-hung-job/restart-job" and plan.mode is Mode.AUTO
    assert [s.kind for s in plan.steps] == [StepKind.EVIDENCE, StepKind.CHECKPOINT, StepKind.RESTART_JOB]
    assert not any(n.unschedulable for n in h.cluster.list_nodes())


def test_a_hang_plan_keeps_the_ranks_flight_recorder_dumps_before_it_restarts(shipped_rules: list[Rule],
                                                                             tmp_path: Path) -> None:
    import pickle

    from analyzer.detectors.suite import DetectorSuite
    from sim.traces import TraceJob

    an = Analyzer(shipped_rules, detectors=DetectorSuite())
    job = TraceJob("llm", world=16, step_s=1.0, seed=2)
    an.process([s for _, sigs in job.run(20) for s in sigs])
    ts, timeouts = job.nccl_timeouts(job.ts + 30, seq=81, skip=frozenset({4}))
    an.process(timeouts)
    for r, doc in job.flight_recorder_dumps(81, frozenset({4})).items():
        assert an.detectors is not None
        an.detectors.add_flight_recorder_dump("llm", r, job.node_of(r), pickle.dumps(doc), ts,
                                              source=f"{job.node_of(r)}/flight-recorder/llm/{r}")
    an.evaluate(ts + 1)
    [inc] = [i for i in an.correlator.incidents() if i.state is IncidentState.OPEN]
    h = Harness(tmp_path)
    h.clock.t = ts + 60
    [plan] = h.healing().heal_once([inc], _no_state)
    assert plan.policy == "restart-hung-job/restart-job"
    evidence = plan.steps[0]
    assert evidence.state.value == "succeeded" and "stack dumps" in evidence.result
    dumps = evidence.outputs["stack_dumps"].split(",")
    assert len(dumps) == 16 and "llm-n000/flight-recorder/llm/0" in dumps
    assert "Watchdog caught collective operation timeout" in evidence.outputs["lines"]


def test_the_hourly_plan_limit_holds_a_plan_until_the_hour_is_over(shipped_rules: list[Rule], tmp_path: Path) -> None:
    data = yaml.safe_load(default_policy_path().read_text())
    data["safety"].update({"max_plans_per_hour": 1, "breaker_max_fraction": 0.5, "max_out_fraction": 0.5})
    data["defaults"]["drain_grace_s"] = 0
    h = Harness(tmp_path, nodes=10, policy=parse_policy(data, "one-an-hour"))
    first = h.run(h.plan(incident(shipped_rules, [kernel("gpu-node-03", XID79, ts=T0)])))
    assert h.cluster.get_node("gpu-node-03").unschedulable, first.reason
    second = h.plan(incident(shipped_rules, [kernel("gpu-node-05", XID79, ts=T0 + 60)]))
    # Retried every second for 20 s (the healer loop retries a waiting plan): still held, nothing done.
    second = h.run(second, rounds=20)
    assert second.state is PlanState.RUNNING and not h.cluster.get_node("gpu-node-05").unschedulable
    cordon = next(s for s in second.steps if s.kind is StepKind.CORDON)
    assert cordon.state.value == "pending" and "rate limit: 1 plans acted in the last hour" in cordon.result
    h.clock.advance(3600)
    second = h.run(second)
    assert h.cluster.get_node("gpu-node-05").unschedulable, second.reason


def test_notifications_never_use_up_the_hourly_budget_a_lost_gpu_needs(shipped_rules: list[Rule],
                                                                       tmp_path: Path) -> None:
    data = yaml.safe_load(default_policy_path().read_text())
    data["safety"].update({"max_plans_per_hour": 1, "breaker_max_fraction": 0.5, "max_out_fraction": 0.5})
    data["defaults"]["drain_grace_s"] = 0
    h = Harness(tmp_path, nodes=10, policy=parse_policy(data, "one-an-hour"))
    # A burst of application errors on several nodes: each is told to the job's owner at once, none is held.
    for i, node in enumerate(("gpu-node-04", "gpu-node-05", "gpu-node-06")):
        app = h.run(h.plan(incident(shipped_rules, [container(
            node, "RuntimeError: CUDA error: an illegal memory access was encountered", job=f"llm-{i}", ts=T0 + i)])))
        assert app.policy == "application-fault/notify" and app.state is PlanState.SUCCEEDED, app.reason
    # The budget is still there for the lost GPU that follows.
    lost = h.run(h.plan(incident(shipped_rules, [kernel("gpu-node-03", XID79, ts=T0 + 60)])))
    assert h.cluster.get_node("gpu-node-03").unschedulable, lost.reason
    # And spent by it: the next hardware plan waits for the hour, its notification would not.
    second = h.run(h.plan(incident(shipped_rules, [kernel("gpu-node-07", XID79, ts=T0 + 120)])), rounds=3)
    assert not h.cluster.get_node("gpu-node-07").unschedulable
    cordon = next(s for s in second.steps if s.kind is StepKind.CORDON)
    assert "rate limit: 1 plans acted in the last hour" in cordon.result
