"""Hang lifecycle and culprit naming: finished, deleted and restarted jobs; jitter; timeout witnesses; stacks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from analyzer.correlate import Correlator
from analyzer.detectors.stacks import StackSample, in_collective, main_frames
from analyzer.detectors.suite import DetectorSuite
from analyzer.pipeline import Analyzer
from analyzer.progress_rules import default_progress_rules_dir, load_progress_rules
from analyzer.records import FaultClass, Finding, Incident
from analyzer.rules import default_rules_dir, load_rules
from collector.podmeta import StaticPodMetadata
from collector.progress_file import ProgressFileSource
from collector.progress_hook import ProgressReporter
from collector.signal import LogLine, ProgressSample, Signal, Source
from collector.sources.cri import CriLogSource
from tests.agent_helpers import CriWriter

PROGRESS = load_progress_rules([default_progress_rules_dir()])
RULES = load_rules([default_rules_dir()])
T0 = 1_800_000_000.0
STACKS = Path(__file__).parent / "fixtures" / "stacks"


def analyzer() -> Analyzer:
    return Analyzer(RULES, correlator=Correlator(), detectors=DetectorSuite(PROGRESS))


def run(an: Analyzer, batches: list[tuple[float, list[Signal]]], until: float) -> list[Finding]:
    """Feed batches in time order, evaluating once a second (as the service does)."""
    out: list[Finding] = []
    batches = sorted(batches, key=lambda b: b[0])
    t, i = batches[0][0], 0
    while t <= until:
        while i < len(batches) and batches[i][0] <= t:
            out += an.process(batches[i][1])[0]
            i += 1
        out += an.evaluate(t)[0]
        t += 1.0
    return out


def hangs(found: list[Finding]) -> list[Finding]:
    return [f for f in found if f.fault_class is FaultClass.HANG]


def line(job: str, rank: int, ts: float, text: str, n: int) -> Signal:
    return Signal(f"n{rank // 2}/container/{job}-{rank}/{n}", f"node-{rank // 2}", Source.CONTAINER, ts,
                  LogLine(text, namespace="train", pod=f"{job}-{rank}", container="trainer", job=job, rank=rank))


def sample(job: str, rank: int, ts: float, step: int, st: float = 0.2) -> Signal:
    return Signal(f"node-{rank // 2}/progress/{job}/{rank}/{step}/{ts}", f"node-{rank // 2}", Source.PROGRESS, ts,
                  ProgressSample(job, rank, step, st, {"compute": st * 0.8, "comm_wait": st * 0.2}))


def steps(job: str, first: int, last: int, t: float, *, step_s: float = 0.2, jitter_s: float = 0.0,
          world: int = 4, seed: int = 0) -> tuple[list[tuple[float, list[Signal]]], float]:
    """Hook samples of every rank for steps first..last; returns the batches and the time after the last."""
    rng = random.Random(seed)
    out = []
    for s in range(first, last + 1):
        t += step_s
        out.append((t + jitter_s, [sample(job, r, t + rng.uniform(0, jitter_s), s, step_s) for r in range(world)]))
    return out, t


# -- a job that finishes is no hang -------------------------------------------------


def test_a_job_whose_hook_says_it_finished_raises_no_hang(tmp_path: Path) -> None:
    # The hook's files as a real job writes them, read by the agent's source.
    reporters = [ProgressReporter(tmp_path, "done", r) for r in range(4)]
    t = T0
    for s in range(1, 41):
        t += 0.2
        for rep in reporters:
            rep.report_step(s, 0.2, {"compute": 0.15, "comm_wait": 0.05}, ts=t)
    for rep in reporters:
        rep.finish(ts=t + 0.05)
        rep.close()
    signals = ProgressFileSource(tmp_path, "node-0").poll().signals
    assert [s.payload.event for s in signals if isinstance(s.payload, ProgressSample)].count("end") == 4
    found = run(analyzer(), [(t + 0.1, signals)], until=t + 120)
    assert hangs(found) == []


def test_a_trainer_that_prints_its_end_of_training_line_raises_no_hang() -> None:
    # Hugging Face Trainer: its per-step metrics dict on every rank, then the final metrics dict on rank 0
    # (https://github.com/hiyouga/LlamaFactory/pull/10488); nothing is printed after it.
    an = analyzer()
    batches, t, n = [], T0, 0
    for s in range(1, 31):
        t += 1.0
        n += 1
        batches.append((t, [line("hf", r, t, f"{{'loss': {2.5 - s / 100:.4f}, 'learning_rate': 1e-05, "
                                             f"'epoch': {s / 30:.2f}}}", n) for r in range(4)]))
    batches.append((t + 0.3, [line("hf", 0, t + 0.3, "{'train_runtime': '2219', 'train_samples_per_second': '1.474', "
                                   "'train_steps_per_second': '0.185', 'train_loss': '0.7228', 'epoch': '3'}", n + 1)]))
    assert hangs(run(an, batches, until=t + 120)) == []


def test_a_job_whose_pods_are_gone_raises_no_hang(tmp_path: Path) -> None:
    # CRI files: the job's pods log steps, then kubelet removes their log directories (pods deleted).
    meta = StaticPodMetadata({f"train/del-{r}": {"kmend.io/job": "del", "kmend.io/rank": str(r)} for r in range(4)})
    writers = [CriWriter(tmp_path, ns="train", pod=f"del-{r}", uid=f"00000000-{r:04d}") for r in range(4)]
    clock = [T0]
    src = CriLogSource(node="node-0", root=tmp_path, pod_metadata=meta, clock=lambda: clock[0])
    an = analyzer()
    found: list[Finding] = []
    for s in range(1, 21):
        clock[0] += 0.5
        for w in writers:
            w.line(f"step {s} loss 0.5 step_time=0.5")
        sigs = [Signal(x.id, x.node, x.source, clock[0], x.payload) for x in src.poll().signals]
        found += an.process(sigs)[0] + an.evaluate(clock[0])[0]
    for w in writers:
        for f in w.dir.iterdir():
            f.unlink()
        w.dir.rmdir()
        w.dir.parent.rmdir()
    exits = src.poll().signals
    assert sorted(x.payload.rank for x in exits if isinstance(x.payload, ProgressSample)) == [0, 1, 2, 3]
    found += an.process(exits)[0]
    for k in range(120):
        found += an.evaluate(clock[0] + k)[0]
    assert hangs(found) == []


# -- jitter is not a culprit -----------------------------------------------------------


def test_jitter_in_when_ranks_log_the_same_last_step_names_no_rank_behind() -> None:
    # Every rank completes step 40 (a DDP all-reduce that never returns afterwards); their reports of it
    # are up to 0.15 s apart, as stdout buffering and scheduling make them on a loaded node.
    batches, t = steps("jit", 1, 40, T0, step_s=0.2, jitter_s=0.15, seed=3)
    [h] = hangs(run(analyzer(), batches, until=t + 30))
    assert h.fields["mode"] == "all_stalled"
    assert h.where.rank is None and "culprit_rank" not in h.fields


# -- a restarted job that hangs again is detected ---------------------------------------


def test_a_job_restarted_from_a_checkpoint_that_hangs_before_its_old_step_is_detected() -> None:
    an = analyzer()
    first, t = steps("rs", 1, 60, T0, step_s=0.5)
    # Crash at step 60 (the pods are replaced: 90 s of silence), resume from the checkpoint of step 50,
    # make five steps and hang again.
    second, t2 = steps("rs", 51, 55, t + 90, step_s=0.5)
    found = run(an, first + second, until=t2 + 20)
    late = [f for f in hangs(found) if f.ts > t2]
    assert late, [f.message for f in hangs(found)]
    assert late[0].ts - t2 <= 15.0
    assert late[0].fields["run"] == "1" and late[0].fields["last_step"] == "55"


def test_a_restart_at_another_world_size_is_a_new_run_and_its_hang_is_found(tmp_path: Path) -> None:
    # 4 ranks to step 30, then an elastic restart with 2 that goes on from step 31 (nothing goes back) and
    # hangs at step 45: ranks 2 and 3 are not behind, they are not in the run any more.
    t = T0
    reporters = [ProgressReporter(tmp_path / "a", "elastic", r, world_size=4) for r in range(4)]
    for s in range(1, 31):
        t += 0.5
        for rep in reporters:
            rep.report_step(s, 0.5, {"compute": 0.4, "comm_wait": 0.1}, ts=t)
    t += 6.0  # rendezvous of the new world
    reporters = [ProgressReporter(tmp_path / "b", "elastic", r, world_size=2) for r in range(2)]
    for s in range(31, 46):
        t += 0.5
        for rep in reporters:
            rep.report_step(s, 0.5, {"compute": 0.4, "comm_wait": 0.1}, ts=t)
    signals = ProgressFileSource(tmp_path / "a", "node-0").poll().signals
    signals += ProgressFileSource(tmp_path / "b", "node-0").poll().signals
    an = analyzer()
    found = run(an, [(s.ts, [s]) for s in signals], until=t + 30)
    [hang] = hangs(found)
    assert (hang.fields["run"], hang.fields["ranks"], hang.fields["mode"]) == ("1", "2", "all_stalled")
    assert hang.ts - t <= 15.0 and hang.where.rank is None


def test_a_restart_resets_the_straggler_history_too() -> None:
    suite = DetectorSuite(PROGRESS)
    first, t = steps("rs2", 1, 30, T0, step_s=0.5)
    for _, sigs in first:
        suite.observe(sigs)
    assert suite.book.jobs["rs2"].run == 0
    suite.observe([sample("rs2", 0, t + 60, 21)])
    job = suite.book.jobs["rs2"]
    assert job.run == 1 and job.max_step == 21 and set(job.ranks) == {0}


# -- all-stalled hang: who complained, and who did not ------------------------------------

# Real lines from a 4-rank gloo job (PyTorch 2.13, tests/jobs/tiny_ddp.py with rank 2 blocked before its
# all-reduce): the ranks waiting in the all-reduce raise these after the process group timeout.
GLOO_RECV = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
             "Timed out waiting 5000ms for recv operation to complete")
GLOO_SEND = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] "
             "Timed out waiting 5000ms for send operation to complete")


def _stalled_then_complaints(an: Analyzer, complain: dict[int, str], after_s: float) -> Incident:
    batches, t = steps("ddp", 1, 40, T0, step_s=0.2)
    batches.append((t + after_s, [line("ddp", r, t + after_s, text, 1000 + r) for r, text in complain.items()]))
    run(an, batches, until=t + after_s + 10)
    [inc] = [i for i in an.correlator.incidents() if "ddp" in i.jobs]
    return inc


def test_a_ddp_hang_names_the_rank_that_never_reported_the_gloo_timeout() -> None:
    inc = _stalled_then_complaints(analyzer(), {0: GLOO_RECV, 1: GLOO_RECV, 3: GLOO_SEND}, after_s=60)
    assert inc.fault_class is FaultClass.HANG
    assert (inc.root_cause.rank, inc.root_cause.node) == (2, "node-1")
    assert inc.root_finding.rule_id == "timeout-witnesses"
    assert inc.root_finding.fields["complained_ranks"] == "0,1,3"


def test_the_nccl_watchdog_lines_name_the_silent_rank_as_well() -> None:
    # https://github.com/hiyouga/LlamaFactory/issues/7396 (the watchdog line, rank in the text)
    lines = {r: (f"[rank{r}]:[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607] [Rank {r}] Watchdog caught "
                 "collective operation timeout: WorkNCCL(SeqNum=1580, OpType=ALLREDUCE, NumelIn=466119168, "
                 "NumelOut=466119168, Timeout(ms)=600000) ran for 600060 milliseconds before timing out.")
             for r in (0, 2, 3)}
    inc = _stalled_then_complaints(analyzer(), lines, after_s=600)
    assert inc.root_cause.rank == 1


def test_when_half_the_ranks_are_silent_no_rank_is_named() -> None:
    inc = _stalled_then_complaints(analyzer(), {0: GLOO_RECV, 3: GLOO_SEND}, after_s=60)
    assert inc.root_cause.rank is None


# -- stack dumps -------------------------------------------------------------------------------


def _stack(name: str) -> str:
    return (STACKS / name).read_text()


def test_py_spy_dumps_are_read_into_frames_and_collectives() -> None:
    waiting = main_frames(_stack("waiting_in_all_reduce.txt"))
    stuck = main_frames(_stack("stuck_in_sleep.txt"))
    assert waiting and in_collective(waiting)
    assert stuck and not in_collective(stuck)


def test_the_rank_whose_stack_is_outside_the_collective_is_named_and_the_stacks_attach() -> None:
    an = analyzer()
    batches, t = steps("stk", 1, 40, T0, step_s=0.2)
    run(an, batches, until=t + 12)
    suite = an.detectors
    assert suite is not None
    assert [job for job, _, _ in suite.suspects(t + 7)] == ["stk"]  # suspected before it is called a hang
    for r in range(4):
        text = _stack("stuck_in_sleep.txt" if r == 2 else "waiting_in_all_reduce.txt")
        suite.add_stack("stk", StackSample(rank=r, node=f"node-{r // 2}", pid=100 + r, text=text,
                                           source=f"node-{r // 2}/stack/stk/{r}"), t + 13)
    an.evaluate(t + 14)
    [inc] = [i for i in an.correlator.incidents() if "stk" in i.jobs]
    assert inc.root_cause.rank == 2 and inc.root_finding.rule_id == "stack-dump"
    # time.sleep is C code: py-spy shows the Python line that called it.
    assert "main (tiny_ddp.py:59)" in inc.root_finding.fields["culprit_stack"]
    assert inc.root_finding.fields["waiting_in_collective"] == "0,1,3"


def test_a_rank_whose_process_is_stopped_is_named_wherever_its_stack_is() -> None:
    # SIGSTOP while waiting in the all-reduce: its stack looks like the others', but it runs no code at all.
    an = analyzer()
    batches, t = steps("sig", 1, 40, T0, step_s=0.2)
    run(an, batches, until=t + 12)
    suite = an.detectors
    assert suite is not None
    for r in range(4):
        suite.add_stack("sig", StackSample(rank=r, node=f"node-{r // 2}", pid=100 + r,
                                           text=_stack("waiting_in_all_reduce.txt"), state="T" if r == 1 else "S",
                                           source=f"node-{r // 2}/stack/sig/{r}"), t + 13)
    an.evaluate(t + 14)
    [inc] = [i for i in an.correlator.incidents() if "sig" in i.jobs]
    assert (inc.root_cause.rank, inc.root_cause.node, inc.root_finding.rule_id) == (1, "node-0", "stack-dump")
    assert inc.root_finding.fields["stopped_ranks"] == "1" and "is stopped" in inc.root_finding.message


@pytest.mark.parametrize("pause", ["saving checkpoint at iteration     400 to /ckpt/llama",
                                   "***** Running Evaluation *****"])
def test_a_checkpoint_or_evaluation_announced_in_the_logs_stays_silent(pause: str) -> None:
    batches, t = steps("ck", 1, 40, T0, step_s=0.5)
    batches.append((t + 0.1, [line("ck", 0, t + 0.1, pause, 5000)]))
    after, t2 = steps("ck", 41, 50, t + 300, step_s=0.5)
    assert hangs(run(analyzer(), batches + after, until=t2 + 5)) == []


def test_stacks_taken_in_a_stall_that_then_resumes_raise_nothing() -> None:
    # The service asks for stacks at half the threshold; a data-loader stall that clears is no hang.
    an = analyzer()
    first, t = steps("slow", 1, 40, T0, step_s=0.2)
    run(an, first, until=t + 6)
    suite = an.detectors
    assert suite is not None
    for r in range(4):
        text = _stack("stuck_in_sleep.txt" if r == 2 else "waiting_in_all_reduce.txt")
        suite.add_stack("slow", StackSample(rank=r, node=f"node-{r // 2}", pid=100 + r, text=text), t + 6.5)
    after, t2 = steps("slow", 41, 80, t + 8, step_s=0.2)
    found = run(an, after, until=t2 + 5)
    assert [f for f in found if f.fault_class is FaultClass.HANG] == []
    assert an.correlator.incidents() == []


@pytest.mark.parametrize("end_line", [
    # rules/progress/lifecycle.yaml, lines from the URLs there
    "{'train_runtime': 116.1914, 'train_samples_per_second': 6.885, 'train_steps_per_second': 1.721, "
    "'train_loss': 2.819730052947998, 'epoch': 0.15}",
    "Training completed. Do not forget to share your model on huggingface.co/models =)",
    "`Trainer.fit` stopped: `max_epochs=1` reached.",
    "[after training is done] datetime: 2025-04-14 18:16:35 ",
    "W1130 12:13:49.388000 124326 torch/distributed/elastic/agent/server/api.py:723] Received 15 death signal, "
    "shutting down workers",
])
def test_each_end_of_training_line_ends_the_run_quietly(end_line: str) -> None:
    batches, t = steps("e", 1, 40, T0, step_s=0.5)
    batches.append((t + 0.2, [line("e", 0, t + 0.2, end_line, 7000)]))
    assert hangs(run(analyzer(), batches, until=t + 120)) == []


def test_the_trainers_bar_repeating_its_final_count_after_the_end_line_is_no_new_run() -> None:
    # The Hugging Face Trainer prints its final metrics dict, then its tqdm bar once more at the same count.
    batches, t, n = [], T0, 0
    for s in range(1, 31):
        t += 1.0
        n += 1
        batches.append((t, [line("bar", 0, t, f"{100 * s // 30:3d}%|█████| {s}/30 [00:{s:02d}<00:00,  1.00s/it]",
                                 n)]))
    batches.append((t + 0.2, [line("bar", 0, t + 0.2, "{'train_runtime': 116.1914, 'train_samples_per_second': "
                                   "6.885, 'train_steps_per_second': 1.721, 'train_loss': 2.8197, 'epoch': 0.15}",
                                   n + 1)]))
    batches.append((t + 0.3, [line("bar", 0, t + 0.3, "100%|█████| 30/30 [00:30<00:00,  1.00s/it]", n + 2)]))
    an = analyzer()
    assert hangs(run(an, batches, until=t + 120)) == []
    assert an.detectors is not None and an.detectors.book.jobs["train/bar"].run == 0
