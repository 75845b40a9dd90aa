"""A rank held back from outside: the share of a survey's window a real process spent stopped or waiting for a CPU
(``collector.sched``), and the survey detector naming the rank whose share stands far above its peers' while they wait
in the collectives (a loaded machine that holds every rank back alike, or a rank stopped for good, names nobody)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from analyzer.detectors.book import JobBook
from analyzer.detectors.survey import SurveyDetector
from analyzer.progress import ProgressEvent
from analyzer.progress_rules import ProgressKind
from collector.sched import SchedWatch
from collector.signal import MetricSample, Signal, Source
from collector.survey import METRIC


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.01)"])
    try:
        yield p
    finally:
        os.kill(p.pid, signal.SIGCONT)
        p.kill()
        p.wait(timeout=10)


def test_a_process_stopped_half_the_window_is_seen_stopped_about_half_of_it(
        sleeper: subprocess.Popen[bytes]) -> None:
    time.sleep(0.2)
    calm = SchedWatch([sleeper.pid, 999_999_999])
    time.sleep(0.5)
    seen = calm.stop()
    assert list(seen) == [sleeper.pid]  # a process that is not there is left out
    assert seen[sleeper.pid].stopped == 0.0 and seen[sleeper.pid].looks >= 10
    assert 0.0 <= seen[sleeper.pid].cpu_wait < 0.5

    watch = SchedWatch([sleeper.pid])
    time.sleep(0.5)
    os.kill(sleeper.pid, signal.SIGSTOP)
    time.sleep(0.5)
    os.kill(sleeper.pid, signal.SIGCONT)
    held = watch.stop()[sleeper.pid]
    assert 0.25 <= held.stopped <= 0.75, held


def test_proc_root_without_schedstat_leaves_the_process_out(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "stat").write_text("42 (python) S 1 1 1 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 100 0 0\n")
    assert SchedWatch([42], proc_root=tmp_path).stop() == {}


def _book() -> JobBook:
    book = JobBook()
    for r in range(4):
        book.observe_progress(ProgressEvent(job="llama", rank=r, node=f"n{r // 2}", ts=0.0, kind=ProgressKind.STEP,
                                            step=1, namespace="train"))
    return book


def _survey(rank: int, ts: float, collective: float, cpu_wait: float, stopped: float, samples: int = 200) -> Signal:
    labels = {"job": "llama", "rank": str(rank), "namespace": "train", "samples": str(samples),
              "cpu_wait": f"{cpu_wait:.3f}", "stopped": f"{stopped:.3f}"}
    if samples:
        labels.update({"share_collective": f"{collective:.3f}", "share_code": f"{1 - collective:.3f}"})
    return Signal(f"n{rank // 2}/survey/{rank}/{ts}", f"n{rank // 2}", Source.PROGRESS, ts,
                  MetricSample(METRIC, collective if samples else 0.0, labels))


def _named(held: dict[int, tuple[float, float, int]], surveys: int = 3) -> list[tuple[int, int, str]]:
    """Rounds of 4 ranks' surveys; `held`: rank -> (cpu wait, stopped, samples) for the ranks held back (the others
    wait in the collectives 80 % of their samples and wait for a CPU 10 % of the window). (round, rank, where)."""
    book = _book()
    detector, found = SurveyDetector(book), []
    for k in range(surveys):
        ts = 10.0 * (k + 1)
        for r in range(4):
            book.observe_progress(ProgressEvent(job="llama", rank=r, node=f"n{r // 2}", ts=ts,
                                                kind=ProgressKind.STEP, step=10 * (k + 2), namespace="train"))
            wait, stopped, samples = held.get(r, (0.1, 0.0, 200))
            # The held rank's samples look like its peers' would: the same code, only less of the time.
            detector.observe(_survey(r, ts, 0.8, wait, stopped, samples))
        found += [(k, int(f.where.rank or -1), f.fields["where"]) for f in detector.evaluate(ts + 1.0)]
    return found


def test_a_rank_stopped_a_third_of_the_time_is_named_after_two_surveys() -> None:
    assert _named({2: (0.15, 0.35, 200)}) == [(1, 2, "stopped")]


def test_a_rank_starved_of_cpu_is_named_even_when_its_stacks_could_not_be_sampled() -> None:
    assert _named({1: (0.55, 0.05, 0)}) == [(1, 1, "waiting for a CPU")]


def test_a_loaded_machine_holding_every_rank_back_and_a_rank_stopped_for_good_name_nobody() -> None:
    assert _named({r: (0.5, 0.1, 200) for r in range(4)}) == []
    # A healthy rank on a loaded machine waits for a CPU 0.1-0.2 more than its peers now and then: not held back.
    assert _named({1: (0.3, 0.0, 200)}) == []
    assert _named({3: (0.0, 1.0, 0)}) == []  # a hang: the hang detector's
