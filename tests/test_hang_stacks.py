"""Two-stage hang judgement: stacks taken in a silence hold a hang finding while the stalled ranks are busy
(data loader, checkpoint, evaluation) and confirm it at once when a rank is stopped or waits in a collective
for a rank stuck elsewhere; the frame table on real py-spy dumps of a DataLoader wait and a gloo all_reduce."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from analyzer.detectors.stacks import StackSample, exoneration, main_frames, moved, place
from analyzer.detectors.suite import DetectorSuite
from analyzer.progress import ProgressEvent
from analyzer.progress_rules import ProgressKind
from analyzer.records import FaultClass, Finding
from tests.conftest import free_port

STACKS = Path(__file__).parent / "fixtures" / "stacks"
WORLD = 4
STEP = 1.0


def dump(*frames: str) -> str:
    body = "\n".join(f"    {f}" for f in frames)
    head = "Process 7: python train.py\nPython v3.11.7 (/usr/bin/python3.11)\n\n"
    return f'{head}Thread 7 (idle): "MainThread"\n{body}\n'


LOADER = dump("wait (threading.py:331)", "get (queue.py:180)",
              "_try_get_data (torch/utils/data/dataloader.py:1133)",
              "_get_data (torch/utils/data/dataloader.py:1294)", "_next_data (torch/utils/data/dataloader.py:1332)",
              "__next__ (torch/utils/data/dataloader.py:631)", "train (train.py:40)", "<module> (train.py:80)")
ALL_REDUCE = (STACKS / "waiting_in_all_reduce.txt").read_text()
SLEEP = (STACKS / "stuck_in_sleep.txt").read_text()
SAVING = dump("_save (torch/serialization.py:853)", "save (torch/serialization.py:629)",
              "_save_checkpoint (transformers/trainer.py:2930)", "train (train.py:52)")
DCP = dump("all_gather_object (torch/distributed/distributed_c10d.py:2421)",
           "gather_object (torch/distributed/checkpoint/utils.py:120)",
           "save (torch/distributed/checkpoint/state_dict_saver.py:150)", "train (train.py:52)")
FORWARD = dump("forward (model.py:30)", "_call_impl (torch/nn/modules/module.py:1527)", "train (train.py:44)")


def job_until(suite: DetectorSuite, steps: int = 30) -> float:
    """A 4-rank job reporting a step a second; returns when its last step was reported."""
    evs = [ProgressEvent("llm", r, f"n{r // 2}", 100.0 + s * STEP + r * 0.001, ProgressKind.STEP, s, step_time=STEP)
           for s in range(1, steps + 1) for r in range(WORLD)]
    suite.observe_digest(evs, [], evs[-1].ts)
    return evs[-1].ts


def stacks(suite: DetectorSuite, ts: float, texts: dict[int, str], *, stopped: int | None = None) -> None:
    for r in range(WORLD):
        suite.add_stack("llm", StackSample(rank=r, node=f"n{r // 2}", pid=100 + r, text=texts.get(r, ALL_REDUCE),
                                           state="T" if r == stopped else "S"), ts)


def first_hang(suite: DetectorSuite, start: float, until: float) -> tuple[float, Finding] | None:
    t = start
    while t <= until:
        for f in suite.evaluate(t):
            if f.fault_class is FaultClass.HANG and f.rule_id == "hang-detector":
                return t, f
        t += 1.0
    return None


def test_a_rank_busy_in_its_data_loader_holds_the_hang_until_the_longer_bound() -> None:
    suite = DetectorSuite()
    last = job_until(suite)
    stacks(suite, last + 8.0, {2: LOADER})  # rank 2 fetches a batch, the others wait for it in all_reduce
    got = first_hang(suite, last + 1.0, last + 200.0)
    thr = 13.0
    assert got is not None
    at, f = got
    assert 4 * thr <= at - last < 4 * thr + 2.0  # held, then called at the longer bound
    assert "rank(s) 2 in data loader" in f.fields["held_by_stacks"]


def test_a_held_job_that_resumes_raises_nothing() -> None:
    suite = DetectorSuite()
    last = job_until(suite)
    stacks(suite, last + 8.0, {r: LOADER for r in range(WORLD)})
    assert first_hang(suite, last + 1.0, last + 30.0) is None
    resume = [ProgressEvent("llm", r, f"n{r // 2}", last + 31.0, ProgressKind.STEP, 31, step_time=STEP)
              for r in range(WORLD)]
    suite.observe_digest(resume, [], last + 31.0)
    assert first_hang(suite, last + 31.0, last + 40.0) is None


@pytest.mark.parametrize(("texts", "stopped"), [
    ({2: SLEEP}, None),        # rank 2 stuck in its own code while the others wait for it
    ({}, None),                # every rank in all_reduce: no one left to finish it
    ({2: LOADER}, 2),          # the loader's rank is stopped (SIGSTOP): it runs no code at all
])
def test_stacks_that_show_a_stuck_rank_confirm_at_the_threshold(texts: dict[int, str], stopped: int | None) -> None:
    suite = DetectorSuite()
    last = job_until(suite)
    stacks(suite, last + 8.0, texts, stopped=stopped)
    got = first_hang(suite, last + 1.0, last + 60.0)
    assert got is not None and got[0] - last <= 15.0
    assert "held_by_stacks" not in got[1].fields


def test_a_missing_rank_or_stacks_from_before_the_silence_change_nothing() -> None:
    suite = DetectorSuite()
    last = job_until(suite)
    for r in range(WORLD - 1):  # rank 3's node never answered
        suite.add_stack("llm", StackSample(rank=r, node="n0", pid=r, text=LOADER), last + 8.0)
    got = first_hang(suite, last + 1.0, last + 60.0)
    assert got is not None and got[0] - last <= 15.0
    suite = DetectorSuite()
    stacks(suite, 50.0, {r: LOADER for r in range(WORLD)})  # taken in an earlier silence
    last = job_until(suite)
    got = first_hang(suite, last + 1.0, last + 60.0)
    assert got is not None and got[0] - last <= 15.0


def test_newer_stacks_that_show_a_stuck_rank_twice_end_the_hold_at_once() -> None:
    suite = DetectorSuite()
    last = job_until(suite)
    stacks(suite, last + 8.0, {2: LOADER})
    assert first_hang(suite, last + 1.0, last + 20.0) is None
    stacks(suite, last + 20.5, {2: SLEEP})  # rank 2 moved since the last look: it still runs
    assert first_hang(suite, last + 21.0, last + 26.0) is None
    stacks(suite, last + 26.5, {2: SLEEP})  # and now it stays where it was
    got = first_hang(suite, last + 27.0, last + 60.0)
    assert got is not None and got[0] - last == pytest.approx(27.0, abs=1.01)
    assert got[1].fields["held_by_stacks"] == "rank(s) 2 moved between two looks"


def test_a_second_look_that_moved_holds_what_one_look_would_confirm() -> None:
    suite = DetectorSuite()
    last = job_until(suite)
    stacks(suite, last + 8.0, {})  # every rank in all_reduce ...
    stacks(suite, last + 11.0, {r: FORWARD for r in range(WORLD)})  # ... then in forward: the job runs
    assert first_hang(suite, last + 1.0, last + 40.0) is None


@pytest.mark.parametrize(("text", "where"), [
    (LOADER, "data loader"), (SAVING, "checkpoint"), (DCP, "checkpoint"), (ALL_REDUCE, "collective"),
    (SLEEP, "code"), (FORWARD, "code"),
])
def test_the_frame_table_places_a_main_thread(text: str, where: str) -> None:
    assert place(main_frames(text)) == where


def test_every_rank_in_its_own_code_is_no_collective_hang() -> None:
    samples = {r: StackSample(rank=r, node="n", pid=r, text=FORWARD) for r in range(2)}
    assert exoneration(samples, 2) == "no rank waits in a collective: rank(s) 0,1 in code"


# Real processes: a DataLoader whose worker is slow, and a gloo all_reduce that rank 1 never joins.
LOADER_JOB = textwrap.dedent('''
    import time, torch
    from torch.utils.data import DataLoader, Dataset

    class Slow(Dataset):
        def __len__(self):
            return 4
        def __getitem__(self, i):
            time.sleep(600)  # a worker reading a slow shard
            return torch.zeros(2)

    if __name__ == "__main__":
        it = iter(DataLoader(Slow(), batch_size=1, num_workers=1))
        print("ready", flush=True)
        next(it)
''')
GLOO_JOB = textwrap.dedent('''
    import os, sys, time, torch, torch.distributed as dist
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=rank, world_size=2)
    print("ready", flush=True)
    if rank == 0:
        dist.all_reduce(torch.ones(4))
    else:
        time.sleep(600)
''')


def _start(code: str, *args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


@pytest.fixture
def spawned() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _dump_when(pid: int, want: str, deadline_s: float = 60.0) -> str:
    """py-spy's dump of `pid` once its main thread is in `want` (it gets there after start-up)."""
    from kmend.commands.agent import _py_spy
    binary = _py_spy("py-spy")
    if binary is None or os.geteuid() != 0:
        pytest.skip("py-spy must be installed and run as root (ptrace)")
    from collector.stacks import PySpyDumper
    end = time.monotonic() + deadline_s
    while True:
        text = PySpyDumper(binary).dump(pid)
        if place(main_frames(text)) == want or time.monotonic() > end:
            return text
        time.sleep(0.2)


def test_real_py_spy_stacks_tell_a_data_loader_wait_from_a_gloo_all_reduce_wait(
        spawned: list[subprocess.Popen[str]]) -> None:
    pytest.importorskip("torch")
    port = str(free_port())
    spawned.append(_start(LOADER_JOB))
    r0 = subprocess.Popen([sys.executable, "-c", GLOO_JOB, "0", port], stdout=subprocess.PIPE, text=True,
                          start_new_session=True)
    spawned.append(r0)
    spawned.append(_start(GLOO_JOB, "1", port))
    assert r0.stdout is not None and r0.stdout.readline().strip() == "ready"
    loader = _dump_when(spawned[0].pid, "data loader")
    waiting = _dump_when(r0.pid, "collective")
    sleeping = _dump_when(spawned[2].pid, "code", 5.0)
    assert place(main_frames(loader)) == "data loader", loader
    assert place(main_frames(waiting)) == "collective", waiting
    assert place(main_frames(sleeping)) == "code", sleeping
    # Rank 0 waits for rank 1, which is in its loader: slow; in its own code (a sleep): the hang's culprit.
    def two(text1: str) -> dict[int, StackSample]:
        return {0: StackSample(0, "n", r0.pid, waiting), 1: StackSample(1, "n", 1, text1)}
    assert exoneration(two(loader), 2) is not None
    assert exoneration(two(sleeping), 2) is None


def _stack_findings(suite: DetectorSuite, start: float, until: float) -> list[Finding]:
    out: list[Finding] = []
    t = start
    while t <= until and not out:
        out = [f for f in suite.evaluate(t) if f.rule_id == "stack-dump"]
        t += 1.0
    return out


def test_ranks_whose_node_sent_no_stack_are_named_when_every_rank_that_did_waits_in_a_collective() -> None:
    suite = DetectorSuite()
    last = job_until(suite)
    for r in (0, 1):  # node n1 (ranks 2 and 3) never answers: its agent, or the node, is gone
        suite.add_stack("llm", StackSample(rank=r, node="n0", pid=100 + r, text=ALL_REDUCE), last + 8.0)
    [f] = _stack_findings(suite, last + 1.0, last + 60.0)
    assert (f.where.rank, f.where.node) == (2, "n1")
    assert f.fields["no_stack"] == "2,3" and f.fields["culprit_rank"] == "2"
    assert "2,3 on n1 sent no stack" in f.message


def test_a_minority_that_answered_names_no_one() -> None:
    suite = DetectorSuite()
    last = job_until(suite)
    suite.add_stack("llm", StackSample(rank=0, node="n0", pid=100, text=ALL_REDUCE), last + 8.0)
    [f] = _stack_findings(suite, last + 1.0, last + 60.0)
    assert f.where.rank is None and "culprit_rank" not in f.fields and f.fields["no_stack"] == "1,2,3"


SPIN_JOB = textwrap.dedent('''
    import os, sys, time, torch, torch.distributed as dist

    def wait_for(path):  # a poll loop that never ends: the peer it waits for never writes the file
        turns = 0
        while not os.path.exists(path):
            turns += sum(range(20000)) % 7
            time.sleep(0.0005)
        return turns

    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=rank, world_size=2)
    print("ready", flush=True)
    if rank == 0:
        dist.all_reduce(torch.ones(4))
    else:
        wait_for("/nonexistent/kmend-test-go")
''')


def test_a_rank_spinning_in_a_poll_loop_has_not_moved_and_the_hang_is_confirmed_at_the_threshold(
        spawned: list[subprocess.Popen[str]]) -> None:
    # Real py-spy looks at a real rank polling for a file while its peer waits in gloo's all_reduce: each look
    # catches the loop at another line (or inside its body's call), which is no progress.
    pytest.importorskip("torch")
    port = str(free_port())
    r0 = subprocess.Popen([sys.executable, "-c", SPIN_JOB, "0", port], stdout=subprocess.PIPE, text=True,
                          start_new_session=True)
    spawned.append(r0)
    spawned.append(_start(SPIN_JOB, "1", port))
    assert r0.stdout is not None and r0.stdout.readline().strip() == "ready"
    waiting = _dump_when(r0.pid, "collective")
    first = _dump_when(spawned[1].pid, "code")
    second = first
    deadline = time.monotonic() + 60.0
    while main_frames(second) == main_frames(first):  # until a look catches the loop elsewhere in its body
        assert time.monotonic() < deadline, first
        second = _dump_when(spawned[1].pid, "code")
    assert "wait_for" in main_frames(first)[0] + main_frames(second)[0] + "".join(main_frames(second)[:2])
    assert not moved(main_frames(first), main_frames(second)), (first, second)
    suite = DetectorSuite()
    last = job_until(suite)
    thr = 13.0  # the 1 s-step job's threshold
    stacks(suite, last + 0.5 * thr, {1: first, 0: waiting, 2: waiting, 3: waiting})
    stacks(suite, last + 0.8 * thr, {1: second, 0: waiting, 2: waiting, 3: waiting})  # the second look
    found: list[Finding] = []
    t = last + 1.0
    while t <= last + 5 * thr and not any(f.rule_id == "hang-detector" for f in found):
        found += suite.evaluate(t)
        t += 1.0
    [hang] = [f for f in found if f.rule_id == "hang-detector"]
    assert hang.ts - last <= 2 * thr, hang  # held up to 4 thresholds when taken for "moved"
    assert "held_by_stacks" not in hang.fields
    found += suite.evaluate(t + 5.0)
    assert [f.where.rank for f in found if f.rule_id == "stack-dump"] == [1], [f.message for f in found]


def test_a_training_step_between_two_looks_has_moved() -> None:
    deep = main_frames(ALL_REDUCE)
    assert moved(main_frames(FORWARD), deep) and moved(deep, main_frames(LOADER))
    loop = ["wait_for (train.py:7)", "train (train.py:40)", "<module> (train.py:80)"]
    body = ["is_set (threading.py:570)", "wait_for (train.py:6)", "train (train.py:40)", "<module> (train.py:80)"]
    assert not moved(loop, body) and not moved(body, loop)
    assert moved(loop, ["wait_for (train.py:7)", "train (train.py:52)", "<module> (train.py:80)"])  # left, re-entered
    assert moved(["get (queue.py:180)", "_next_data (torch/utils/data/dataloader.py:1332)", "train (train.py:40)"],
                 ["sleep_forever (train.py:59)", "train (train.py:44)"])  # out of its data loader
