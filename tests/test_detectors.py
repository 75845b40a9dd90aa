"""Hang, straggler and Flight Recorder detectors on simulated traces and real dumps, and their models."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from analyzer.detectors.flight_recorder import DumpError, RankDump, analyze, load_dump
from analyzer.detectors.hang import HangConfig
from analyzer.detectors.suite import DetectorSuite
from analyzer.progress_rules import ProgressRule, default_progress_rules_dir, load_progress_rules
from analyzer.records import Action, FaultClass, Finding
from collector.signal import MetricSample, ProgressSample, Signal, Source
from models.isolation import NodeOutlierModel
from models.robust import RobustScorer
from sim.traces import Batch, Straggle, TraceJob

FIXTURES = Path(__file__).parent / "fixtures" / "flight_recorder"


@pytest.fixture(scope="module")
def progress_rules() -> list[ProgressRule]:
    return load_progress_rules([default_progress_rules_dir()])


def drive(suite: DetectorSuite, batches: list[Batch], until: float, tick: float = 1.0) -> list[Finding]:
    """Feed batches in time order and evaluate every `tick` seconds up to `until`."""
    out: list[Finding] = []
    batches = sorted(batches, key=lambda b: b[0])
    t, i = batches[0][0], 0
    while t <= until:
        while i < len(batches) and batches[i][0] <= t:
            suite.observe(batches[i][1])
            i += 1
        out.extend(suite.evaluate(t))
        t += tick
    return out


# -- hang ----------------------------------------------------------------------


@pytest.mark.parametrize("step_s", [1.0, 10.0])
def test_a_rank_left_behind_is_named_within_the_target(step_s: float) -> None:
    job = TraceJob("j", world=16, step_s=step_s, seed=1)
    batches = job.run(20)
    batches += job.hang_rank(11, behind=True, duration_s=300)
    # The job stalls when the last rank reports (the others finish the step rank 11 never starts).
    stall = max(s.ts for _, sigs in batches for s in sigs if s.source is Source.PROGRESS)
    [f] = drive(DetectorSuite(), batches, until=stall + 300)
    assert f.fault_class is FaultClass.HANG and f.fields["mode"] == "ranks_behind"
    assert (f.where.rank, f.where.node, f.where.job) == (11, "j-n001", "j")
    assert f.ts - stall <= max(5 * step_s, 30.0)
    assert f.recommended_action is Action.RESTART_JOB and FaultClass.GPU_LOST in f.symptom_of


def test_all_ranks_stalled_names_the_idle_gpu_among_busy_ones() -> None:
    job = TraceJob("j", world=16, step_s=1.0, gpu_metrics=True, seed=2)
    batches = job.run(20)
    stall = job.ts
    batches += job.hang_rank(5, behind=False, duration_s=60)
    [f] = drive(DetectorSuite(), batches, until=stall + 60)
    assert f.fields["mode"] == "all_stalled" and f.fields["busy_gpus"] == "15/16"
    assert (f.where.node, f.where.rank) == ("j-n000", 5)


def test_all_ranks_stalled_without_metrics_names_only_the_job() -> None:
    job = TraceJob("j", world=8, step_s=1.0, seed=3)
    batches = job.run(20)
    batches += job.hang_rank(2, behind=False, duration_s=60)
    [f] = drive(DetectorSuite(), batches, until=job.ts + 60)
    assert f.fields["mode"] == "all_stalled" and f.where.rank is None and f.where.node is None
    assert f.where.job == "j"


def test_a_checkpoint_announced_in_the_logs_is_not_a_hang(progress_rules: list[ProgressRule]) -> None:
    job = TraceJob("j", world=8, step_s=1.0, seed=4)
    batches = job.run(20) + job.pause(240) + job.run(20)
    assert drive(DetectorSuite(progress_rules), batches, until=job.ts + 5) == []
    # The same silence without the announcement is a hang.
    job = TraceJob("j", world=8, step_s=1.0, seed=4)
    batches = job.run(20)
    job.ts += 240
    batches += job.run(20)
    assert [f.fault_class for f in drive(DetectorSuite(progress_rules), batches, until=job.ts)] == [FaultClass.HANG]


def test_a_short_hiccup_start_up_and_a_finished_run_are_not_hangs() -> None:
    job = TraceJob("j", world=8, step_s=1.0, seed=5)
    batches = job.run(2)  # too little history to judge
    job.ts += 120
    batches += job.run(20)
    job.ts += 9  # well under the 15 s detection target for 1 s steps
    batches += job.run(5)
    assert drive(DetectorSuite(), batches, until=job.ts + 10) == []


@pytest.mark.parametrize(("step_s", "stall_s", "hiccup_s"), [(1.0, 6.0, 5.0), (2.0, 6.0, 4.0)])
def test_long_gaps_a_healthy_fast_job_makes_are_no_hang(progress_rules: list[ProgressRule], step_s: float,
                                                        stall_s: float, hiccup_s: float) -> None:
    # The false-alarm fleet's healthy noise at its worst: a checkpoint, then an unannounced stall, then a step
    # with a data-loader hiccup: about 12 s without progress, which the default 10 s floor called a hang.
    job = TraceJob("j", world=8, step_s=step_s, hiccup_p=0.0, seed=8)
    batches = job.run(int(600 / step_s))
    batches += job.pause(60)
    job.ts += stall_s
    job.hiccup_p, job.hiccup_s = 1.0, (hiccup_s, hiccup_s)
    batches += job.run(1)
    job.hiccup_p = 0.0
    batches += job.run(30)
    batches.append(job.finish())
    assert drive(DetectorSuite(progress_rules), batches, until=job.ts + 60) == []


def test_one_stall_is_reported_once_and_a_new_stall_again() -> None:
    job = TraceJob("j", world=8, step_s=1.0, seed=6)
    batches = job.run(10)
    job.ts += 60
    batches += job.run(10)
    job.ts += 60
    batches += job.run(1)
    found = drive(DetectorSuite(), batches, until=job.ts)
    assert len(found) == 2 and len({f.id for f in found}) == 2


def test_a_job_silent_for_a_day_is_forgotten_after_its_hang_was_reported() -> None:
    job = TraceJob("j", world=4, step_s=1.0, seed=12)
    suite = DetectorSuite(forget_after_s=3600)
    for _, sigs in job.run(10):
        suite.observe(sigs)
    assert [f.fault_class for f in suite.evaluate(job.ts + 60)] == [FaultClass.HANG]
    assert "training/j" in suite.book.jobs
    assert suite.evaluate(job.ts + 7200) == [] and "training/j" not in suite.book.jobs


def test_hang_floor_and_k_are_settings() -> None:
    job = TraceJob("j", world=4, step_s=0.1, seed=7)
    batches = job.run(30)
    stall = job.ts
    batches += job.hang_rank(1, behind=True, duration_s=10)
    [f] = drive(DetectorSuite(hang=HangConfig(floor_s=2.0)), batches, until=stall + 10, tick=0.25)
    assert f.ts - stall < 3.0 and f.where.rank == 1


# -- straggler -----------------------------------------------------------------


def test_a_ten_percent_slow_rank_among_256_is_found_with_its_slowdown() -> None:
    job = TraceJob("j", world=256, step_s=1.0, seed=8)
    suite = DetectorSuite()
    found: list[Finding] = []
    for t, sigs in job.run(10) + job.run(50, straggle=Straggle(rank=77, factor=1.10, from_step=11)):
        suite.observe(sigs)
        found.extend(suite.evaluate(t))
    [f] = found
    assert f.fault_class is FaultClass.STRAGGLER and f.where.rank == 77 and f.where.node == "j-n009"
    assert 1.07 < float(f.fields["slowdown"]) < 1.13 and f.fields["basis"] == "compute"
    assert int(f.fields["step"]) - 10 <= 50 and not f.hardware


def test_a_one_off_blip_is_not_a_straggler() -> None:
    job = TraceJob("j", world=32, step_s=1.0, seed=9)
    suite = DetectorSuite()
    found: list[Finding] = []
    batches = job.run(20) + job.run(1, straggle=Straggle(rank=3, factor=3.0, from_step=21)) + job.run(20)
    for t, sigs in batches:
        suite.observe(sigs)
        found.extend(suite.evaluate(t))
    assert found == []


def test_hook_phases_replace_the_log_lines_step_time_whichever_arrives_first(
    progress_rules: list[ProgressRule],
) -> None:
    suite = DetectorSuite(progress_rules)
    job = TraceJob("j", world=4, seed=13)
    for step in range(1, 5):
        job.step = step
        log = job.log(0, float(step), f"step {step} loss 0.5 step_time=0.9")
        hook = job.progress(0, float(step), step_time=0.9, compute=0.3)
        suite.observe([log, hook] if step % 2 else [hook, log])
    # A later step's log line may also come before this step's hook report.
    job.step = 5
    log5 = job.log(0, 5.0, "step 5 loss 0.5 step_time=0.9")
    log6 = job.log(0, 6.0, "step 6 loss 0.5 step_time=0.9")
    hook5 = job.progress(0, 6.0, step_time=0.9, compute=0.4)
    assert isinstance(hook5.payload, ProgressSample) and hook5.payload.step == 5
    suite.observe([log5, log6, hook5])
    rank = suite.book.jobs["training/j"].ranks[0]  # the hook's samples (no namespace) join the pod's job
    assert rank.basis == "compute" and list(rank.times) == [0.3, 0.3, 0.3, 0.3, 0.4]


def _gpu(node: str, gpu: int, name: str, value: float, ts: float) -> Signal:
    return Signal(f"{node}/{gpu}/{name}/{ts}", node, Source.DCGM, ts, MetricSample(name, value, {"gpu": str(gpu)}))


def test_a_throttled_node_makes_its_straggler_a_hardware_finding_and_is_flagged_itself() -> None:
    job = TraceJob("j", world=96, ranks_per_node=8, step_s=1.0, seed=10)
    suite = DetectorSuite()
    found: list[Finding] = []
    for t, sigs in job.run(10) + job.run(30, straggle=Straggle(rank=42, factor=1.3, from_step=11)):
        metrics = [_gpu(job.node_of(r), r % 8, "DCGM_FI_DEV_SM_CLOCK", 1200.0 if r // 8 == 5 else 1980.0, t)
                   for r in range(job.world)]
        metrics += [_gpu(job.node_of(r), r % 8, "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
                         float(0x40) if r == 42 else 0.0, t) for r in range(job.world)]
        suite.observe(sigs + metrics)
        found.extend(suite.evaluate(t))
    by_rule = {f.rule_id: f for f in found}
    rank_f, node_f = by_rule["straggler-detector"], by_rule["straggler-node-detector"]
    assert rank_f.where.rank == 42 and rank_f.hardware and rank_f.recommended_action is Action.REPLACE_NODE
    assert "throttled" in rank_f.fields["node_evidence"]
    assert node_f.where.node == "j-n005" and node_f.hardware
    assert {f.where.rank for f in found if f.rule_id == "straggler-detector"} == {42}


# -- flight recorder -------------------------------------------------------------


def test_real_gloo_dumps_name_the_rank_that_wrote_none() -> None:
    dumps = [RankDump(r, f"n{r}", load_dump((FIXTURES / f"gloo_trace_rank_{r}").read_bytes())) for r in (0, 2)]
    [v] = analyze(dumps)
    assert (v.seq, v.op, v.expected, v.missing, v.silent) == (3, "gloo:all_reduce", (0, 1, 2), (), (1,))
    assert v.culprits == (1,)


def test_nccl_style_dumps_name_the_ranks_that_never_joined() -> None:
    job = TraceJob("j", world=16, seed=11)
    docs = job.flight_recorder_dumps(seq=120, missing=frozenset({9}))
    suite = DetectorSuite(flight_recorder_settle_s=5.0)
    for r, doc in docs.items():
        suite.add_flight_recorder_dump("j", r, job.node_of(r), pickle.dumps(doc), ts=100.0)
    [f] = suite.evaluate(100.5)  # every rank's dump is in: no need to wait
    assert f.rule_id == "flight-recorder" and f.where.rank == 9 and f.where.node == "j-n001"
    assert f.fields["seq"] == "120" and f.fields["missing_ranks"] == "9"
    assert suite.evaluate(200.0) == []


def test_a_dump_that_would_run_code_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    with pytest.raises(DumpError, match="refused"):
        load_dump(pickle.dumps({"entries": [Evil()]}))
    assert not marker.exists()
    with pytest.raises(DumpError):
        load_dump(b"\x80\x04not a pickle")
    with pytest.raises(DumpError, match="entries"):
        load_dump(pickle.dumps({"version": "2.10"}))


# -- models ------------------------------------------------------------------------


def test_robust_scorer_is_estimator_shaped_and_ignores_the_outlier() -> None:
    x = np.array([1.0, 1.01, 0.99, 1.0, 1.02, 1.5])
    sc = RobustScorer(rel_floor=0.0)
    assert sc.fit(x) is sc and sc.center_ == pytest.approx(1.005)
    z = sc.score(x)
    assert z.argmax() == 5 and z[5] > 20 and abs(z[:5]).max() < 2
    assert sc.ratio(x)[5] == pytest.approx(1.5 / 1.005)


def test_node_outlier_model_isolates_the_odd_node_reproducibly() -> None:
    rng = np.random.default_rng(0)
    x = np.column_stack([rng.normal(1980, 5, 32), rng.normal(60, 1.5, 32)])
    x[7] = [1200, 85]
    m = NodeOutlierModel(random_state=3)
    assert m.fit(x) is m and hasattr(m, "forest_")
    assert m.predict(x)[7] == -1 and m.score_samples(x).argmin() == 7
    assert np.array_equal(NodeOutlierModel(random_state=3).fit(x).score_samples(x), m.score_samples(x))
