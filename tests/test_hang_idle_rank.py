"""A rank blocked for good without being stopped (a lock, a queue, a sleep loop in its own code) while its peers wait
in a collective: two looks with the same stack and no CPU used in between confirm the hang before the first progress
line and name that rank; a rank that used CPU, or waits on a compile's workers, or stacks without CPU times (an older
agent) keep the job from being called at the first look."""

from __future__ import annotations

import pytest

from analyzer.detectors.hang import HangConfig
from analyzer.detectors.stacks import StackDetector, StackSample, exoneration, idle_ranks
from analyzer.detectors.suite import DetectorSuite
from analyzer.progress import ProgressEvent
from analyzer.progress_rules import ProgressKind
from analyzer.records import Finding
from tests.test_hang_early import ALL_REDUCE, dump, reports, started
from tests.test_hang_stacks import first_hang

LOCKED = dump("_deadlock (loader.py:58)", "prepare (loader.py:80)", "main (train.py:20)", "<module> (train.py:90)")
"""Rank 1's main thread blocked on a lock another of its threads holds (``acquire`` is C: no frame of its own)."""
DECODING = dump("decode (loader.py:31)", "prepare (loader.py:80)", "main (train.py:20)", "<module> (train.py:90)")
"""Rank 1 decoding records in one long call: the same stack at every look, but busy."""
COMPILE_WAIT = dump("wait (threading.py:331)", "result (concurrent/futures/_base.py:451)",
                    "wait (torch/_inductor/async_compile.py:290)", "compile_fx (torch/_inductor/compile_fx.py:1200)",
                    "main (train.py:31)")
"""Rank 1 waiting for its compile workers (other processes: their CPU time is not its own)."""
LOOKS = (15.0, 22.5)
"""When the service asks for stacks before a first progress line: half and three quarters of `first_look_s`."""


def look(suite: DetectorSuite, ts: float, texts: dict[int, str], cpu: dict[int, float | None]) -> None:
    """One look at both ranks of job ``gpt`` at `ts`: each rank's stack and its process's CPU time then."""
    for r in (0, 1):
        suite.add_stack("gpt", StackSample(rank=r, node="n0", pid=100 + r, text=texts.get(r, ALL_REDUCE),
                                           state="S", cpu_s=cpu.get(r)), ts)


def hang_before_first_step(texts: dict[int, str], cpu_then: dict[int, float | None],
                           cpu_now: dict[int, float | None]) -> tuple[float, Finding] | None:
    suite = DetectorSuite(hang=HangConfig(first_steps_timeout_s=120.0))
    t0 = started(suite)
    look(suite, t0 + LOOKS[0], texts, cpu_then)
    look(suite, t0 + LOOKS[1], texts, cpu_now)
    got = first_hang(suite, t0 + 1.0, t0 + 100.0)
    return None if got is None else (got[0] - t0, got[1])


def test_a_rank_idle_in_its_own_code_while_its_peer_waits_is_a_hang_at_the_first_look_naming_it() -> None:
    # Rank 0 waits in its first all-reduce and burns some CPU doing it (gloo polls); rank 1 used 0.02 s in 7.5 s.
    got = hang_before_first_step({1: LOCKED}, {0: 3.0, 1: 4.00}, {0: 9.0, 1: 4.02})
    assert got is not None
    at, f = got
    assert at == pytest.approx(HangConfig().first_look_s, abs=1.01)
    assert f.where.rank == 1 and f.where.node == "n0" and f.fields["culprit_rank"] == "1"
    assert "rank 1 on n0 idle in _deadlock (loader.py:58) while its peers (0) wait in" in f.message
    assert "before its first step" not in f.message


@pytest.mark.parametrize(("texts", "cpu_then", "cpu_now"), [
    ({1: DECODING}, {0: 3.0, 1: 4.0}, {0: 3.1, 1: 11.0}),   # the same stack, but it used 7 s of CPU: busy
    ({1: LOCKED}, {0: 3.0, 1: None}, {0: 3.1, 1: None}),    # an older agent: no CPU time, today's judgement
    ({1: COMPILE_WAIT}, {0: 3.0, 1: 4.0}, {0: 3.1, 1: 4.0}),  # its compile workers do the work
    ({0: LOCKED, 1: LOCKED}, {0: 3.0, 1: 4.0}, {0: 3.0, 1: 4.0}),  # no one waits for it: nothing says who
], ids=["busy", "no-cpu-time", "compile-workers", "nobody-waits"])
def test_a_rank_that_is_not_shown_idle_is_no_hang_at_the_first_look(
        texts: dict[int, str], cpu_then: dict[int, float | None], cpu_now: dict[int, float | None]) -> None:
    got = hang_before_first_step(texts, cpu_then, cpu_now)
    assert got is None or got[0] >= 120.0, got


def test_one_look_is_not_enough() -> None:
    suite = DetectorSuite(hang=HangConfig(first_steps_timeout_s=120.0))
    t0 = started(suite)
    look(suite, t0 + LOOKS[1], {1: LOCKED}, {0: 3.0, 1: 4.0})
    got = first_hang(suite, t0 + 1.0, t0 + 100.0)
    assert got is None


def test_a_rank_burning_cpu_with_the_same_stack_after_steps_holds_the_hang() -> None:
    # A job with a known pace: its rank 1 in one long call of its own code, the same frames at both looks.
    suite = DetectorSuite()
    last = reports(suite, 5, every_s=1.0, step_time=1.0)
    look(suite, last + 6.0, {1: DECODING}, {0: 3.0, 1: 4.0})
    look(suite, last + 9.0, {1: DECODING}, {0: 3.0, 1: 7.0})
    got = first_hang(suite, last + 1.0, last + 200.0)
    assert got is not None
    assert got[0] - last >= 4 * 13.0 and "used CPU between two looks" in got[1].fields["held_by_stacks"]


def test_after_steps_the_idle_rank_is_named_in_the_hang() -> None:
    suite = DetectorSuite()
    last = reports(suite, 5, every_s=1.0, step_time=1.0)
    look(suite, last + 6.0, {1: LOCKED}, {0: 3.0, 1: 4.0})
    look(suite, last + 9.0, {1: LOCKED}, {0: 3.0, 1: 4.0})
    got = first_hang(suite, last + 1.0, last + 60.0)
    assert got is not None and got[0] - last <= 15.0
    assert got[1].where.rank == 1 and "rank 1 on n0 idle in _deadlock" in got[1].message


@pytest.mark.parametrize("count", [1, 2])
def test_before_the_third_report_the_idle_rank_is_named_within_the_target(count: int) -> None:
    suite = DetectorSuite()
    last = reports(suite, count)
    look(suite, last + 5.0, {1: LOCKED}, {0: 3.0, 1: 4.0})
    look(suite, last + 8.0, {1: LOCKED}, {0: 3.2, 1: 4.0})
    got = first_hang(suite, last + 1.0, last + 60.0)
    assert got is not None and got[0] - last <= 13.0
    assert got[1].where.rank == 1 and got[1].fields["reports"] == str(count)
    assert "rank 1 on n0 idle in _deadlock" in got[1].message


def test_the_stack_dump_finding_says_the_rank_is_idle() -> None:
    det = StackDetector()
    for ts, cpu in ((10.0, 4.0), (18.0, 4.01)):
        for r in (0, 1):
            det.add("j", StackSample(rank=r, node="n0", pid=100 + r, text=LOCKED if r else ALL_REDUCE,
                                     cpu_s=cpu + r), ts, ranks=2, known={0: "n0", 1: "n0"})
    [f] = det.evaluate(30.0, lambda job, since: True)
    assert f.where.rank == 1 and f.fields["idle_ranks"] == "1"
    assert "rank 1 on n0 idle in _deadlock (loader.py:58) while its peers (0) wait in" in f.message


def test_the_rule_needs_two_looks_some_seconds_apart_of_the_same_process() -> None:
    now = {0: StackSample(rank=0, node="n0", pid=100, text=ALL_REDUCE, cpu_s=5.0),
           1: StackSample(rank=1, node="n0", pid=101, text=LOCKED, cpu_s=4.0)}
    then = dict(now)
    assert idle_ranks(now, 2, then, {0: 7.5, 1: 7.5}) == [1]
    assert idle_ranks(now, 2, then, {0: 1.0, 1: 1.0}) == []  # too close to say
    other = {**then, 1: StackSample(rank=1, node="n0", pid=999, text=LOCKED, cpu_s=4.0)}
    assert idle_ranks(now, 2, other, {0: 7.5, 1: 7.5}) == []  # a restarted process
    assert idle_ranks(now, 3, then, {0: 7.5, 1: 7.5}) == []  # a rank did not answer
    assert exoneration(now, 2, then, {0: 7.5, 1: 7.5}) is None


def test_progress_after_the_looks_resets_the_judgement() -> None:
    suite = DetectorSuite(hang=HangConfig(first_steps_timeout_s=120.0))
    t0 = started(suite)
    look(suite, t0 + LOOKS[0], {1: LOCKED}, {0: 3.0, 1: 4.0})
    look(suite, t0 + LOOKS[1], {1: LOCKED}, {0: 3.0, 1: 4.0})
    evs = [ProgressEvent("gpt", r, "n0", t0 + 25.0, ProgressKind.STEP, 1, step_time=1.0) for r in (0, 1)]
    suite.observe_digest(evs, [], t0 + 25.0)
    assert first_hang(suite, t0 + 25.0, t0 + 36.0) is None
