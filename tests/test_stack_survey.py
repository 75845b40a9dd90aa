"""Stack surveys: the node agent's periodic, non-pausing py-spy samples of each rank process, classified by where the
main thread was (collective, own code, data loader, checkpoint...), and the service naming the rank its peers wait
for a straggler only when surveys in a row agree, never for a checkpoint, a one-off hiccup or a finished job."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from analyzer.detectors.book import JobBook
from analyzer.detectors.survey import SurveyDetector
from analyzer.progress import ProgressEvent
from analyzer.progress_rules import ProgressKind
from analyzer.records import FaultClass
from collector.processes import TrainingProcess
from collector.signal import MetricSample, Signal, Source
from collector.survey import METRIC, PySpyProfiler, StackSurvey, main_thread_places
from kmend.commands.agent import _py_spy

# py-spy record --format raw --idle --threads of a DDP rank on CPU (gloo), trimmed to a few stacks.
RAW = """\
thread (7912): MainThread;<module> (train.py:35);main (train.py:29);Tensor.backward (torch/_tensor.py:623);\
backward (torch/autograd/__init__.py:395);_engine_run_backward (torch/autograd/graph.py:979) 57
thread (7912): MainThread;<module> (train.py:35);main (train.py:26);Module._wrapped_call_impl \
(torch/nn/modules/module.py:1778);Linear.forward (torch/nn/modules/linear.py:134) 25
thread (7912): MainThread;<module> (train.py:35);main (train.py:22);_SingleProcessDataLoaderIter._next_data \
(torch/utils/data/dataloader.py:789) 10
thread (7912): MainThread;<module> (train.py:35);main (train.py:40);save (torch/serialization.py:944) 8
thread (7920): Thread-1 (_pin_memory_loop);Thread._bootstrap (threading.py:1002);Thread.run (threading.py:982) 100
"""


def test_a_raw_profile_counts_the_main_threads_samples_by_place() -> None:
    assert main_thread_places(RAW) == Counter({"collective": 57, "code": 25, "data loader": 10, "checkpoint": 8})
    # Lines that are not samples are skipped; a profile without a main thread takes its busiest thread.
    other = "thread (1): worker;run (w.py:3) 4\nnot a sample\nthread (2): io;read (x.py:1) 2\n"
    assert main_thread_places(other) == Counter({"code": 4})
    # py-spy names no thread in a process that never imported threading: the main thread's id is the pid.
    unnamed = ("thread (77);<module> (t.py:7) 46\nthread (77);<module> (t.py:6);busy (t.py:4) 53\n"
               "thread (78);x (y.py:1) 900\n")
    assert main_thread_places(unnamed, 77) == Counter({"code": 99})
    assert main_thread_places("") == Counter()


class _Finder:
    def __init__(self, procs: list[TrainingProcess]) -> None:
        self.procs = procs

    def find(self) -> list[TrainingProcess]:
        return self.procs


class _Profiler:
    def __init__(self, by_pid: dict[int, str]) -> None:
        self.by_pid = by_pid
        self.calls: list[tuple[int, int, int]] = []

    def profile(self, pid: int, seconds: int, rate: int) -> str:
        self.calls.append((pid, seconds, rate))
        if pid not in self.by_pid:
            raise RuntimeError("gone")
        return self.by_pid[pid]


def _proc(pid: int, rank: int, state: str = "S") -> TrainingProcess:
    return TrainingProcess(pid=pid, rank=rank, job="llama", pipe=None, names=("llama",), state=state, started=1,
                           pod="train/llama-worker-0")


def test_the_agent_surveys_every_rank_process_and_sends_one_share_per_rank() -> None:
    now = [100.0]
    profiler = _Profiler({11: RAW, 12: RAW.replace(" 57\n", " 7\n")})
    procs = [_proc(11, 0), _proc(12, 1), _proc(13, 2), _proc(14, 3, state="T")]
    survey = StackSurvey(node="n1", finder=_Finder(procs), profiler=profiler,  # type: ignore[arg-type]
                         every_s=10.0, clock=lambda: now[0], monotonic=lambda: now[0], start=lambda fn: fn())
    assert survey.poll().signals == []  # the survey runs now; its samples leave at the next poll
    got = survey.poll().signals
    # A stopped rank is not sampled (the hang detector looks at it); a rank whose sampling failed sends nothing.
    assert sorted(p for p, _, _ in profiler.calls) == [11, 12, 13]
    assert [(s.source, s.node) for s in got] == [(Source.PROGRESS, "n1")] * 2
    first = got[0].payload
    assert isinstance(first, MetricSample) and first.name == METRIC
    assert first.value == pytest.approx(0.57)
    assert first.labels == {"job": "llama", "rank": "0", "namespace": "train", "samples": "100",
                            "share_collective": "0.570", "share_code": "0.250", "share_data_loader": "0.100",
                            "share_checkpoint": "0.080", "stacks": "4"}
    now[0] += 5.0
    assert survey.poll().signals == [] and len(profiler.calls) == 3  # not due again yet
    now[0] += 5.0
    survey.poll()
    assert len(profiler.calls) == 6


def _book(job: str = "llama", ranks: int = 4, ts: float = 0.0) -> JobBook:
    book = JobBook()
    for r in range(ranks):
        book.observe_progress(ProgressEvent(job=job, rank=r, node=f"n{r // 2}", ts=ts, kind=ProgressKind.STEP,
                                            step=1, namespace="train"))
    return book


def _sample(rank: int, ts: float, collective: float, code: float, *, checkpoint: float = 0.0,
            samples: int = 200) -> Signal:
    labels = {"job": "llama", "rank": str(rank), "namespace": "train", "samples": str(samples),
              "share_collective": f"{collective:.3f}", "share_code": f"{code:.3f}"}
    if checkpoint:
        labels["share_checkpoint"] = f"{checkpoint:.3f}"
    return Signal(f"n{rank // 2}/survey/{rank}/{ts}", f"n{rank // 2}", Source.PROGRESS, ts,
                  MetricSample(METRIC, collective, labels))


Shares = Callable[[int, int], tuple[float, float]]


def _run(detector: SurveyDetector, book: JobBook, surveys: int, shares: Shares) -> list[tuple[int, int]]:
    """Feed `surveys` rounds of 4 ranks' shares (``shares(round, rank)`` -> (collective, code)); the job steps on
    between rounds. Returns (round, rank) of each finding."""
    found = []
    for k in range(surveys):
        ts = 10.0 * (k + 1)
        for r in range(4):
            book.observe_progress(ProgressEvent(job="llama", rank=r, node=f"n{r // 2}", ts=ts, kind=ProgressKind.STEP,
                                                step=10 * (k + 2), namespace="train"))
            detector.observe(_sample(r, ts, *shares(k, r)))
        found += [(k, int(f.where.rank or -1)) for f in detector.evaluate(ts + 1.0)]
    return found


def test_the_rank_its_peers_wait_for_is_named_after_two_surveys_in_a_row() -> None:
    book = _book()
    detector = SurveyDetector(book)
    assert detector.evaluate(1.0) == []  # nothing without surveys
    found = _run(detector, book, 4, lambda k, r: (0.05, 0.9) if r == 2 else (0.8, 0.15))
    assert found == [(1, 2)]  # the second survey confirms the first; one finding for the episode
    # The finding itself.
    d2 = SurveyDetector(b2 := _book())
    out = []
    for k in range(2):
        ts = 10.0 * (k + 1)
        for r in range(4):
            b2.observe_progress(ProgressEvent(job="llama", rank=r, node=f"n{r // 2}", ts=ts, kind=ProgressKind.STEP,
                                              step=10 * (k + 2), namespace="train"))
            d2.observe(_sample(r, ts, *((0.05, 0.9) if r == 2 else (0.8, 0.15))))
        out = d2.evaluate(ts + 1.0)
    [f] = out
    assert f.fault_class is FaultClass.STRAGGLER and not f.hardware
    assert (f.where.rank, f.where.node, f.where.namespace, f.where.job) == (2, "n1", "train", "llama")
    assert f.fields["basis"] == "stacks" and f.fields["where"] == "code" and f.fields["surveys"] == "2"


def test_healthy_ranks_a_one_off_hiccup_and_a_checkpoint_on_rank_0_name_nobody() -> None:
    book = _book()
    detector = SurveyDetector(book)
    healthy = [(0.62, 0.38), (0.58, 0.42), (0.66, 0.34), (0.6, 0.4)]
    assert _run(detector, book, 6, lambda k, r: healthy[r]) == []
    # Rank 1's data loader stalls during one survey only: its peers wait, but the next survey looks healthy.
    assert _run(detector, book, 6, lambda k, r: (0.05, 0.95) if (r, k % 2) == (1, 0) else healthy[r]) == []
    # Rank 0 writes the checkpoint in every survey while the others wait in the barrier: busy, not slow.
    assert _run(detector, book, 4, lambda k, r: (0.05, 0.05) if r == 0 else (0.9, 0.1)) == []
    # Two ranks (a pipeline stage, say) work while the two others wait: a role, not one slow rank.
    assert _run(detector, book, 4, lambda k, r: (0.1, 0.9) if r in (0, 1) else (0.85, 0.15)) == []


def test_a_survey_of_a_finished_or_silent_job_names_nobody() -> None:
    book = _book(ranks=4)
    detector = SurveyDetector(book)
    book.jobs["train/llama"].ended_at = 1.0
    for k in range(3):
        for r in range(4):
            detector.observe(_sample(r, 10.0 * (k + 1), *((0.05, 0.9) if r == 2 else (0.8, 0.15))))
        assert detector.evaluate(10.0 * (k + 1) + 1.0) == []
    silent = _book(ranks=4, ts=0.0)
    d2 = SurveyDetector(silent)
    for k in range(3):  # progress stopped at t=0: a hang is the hang detector's, not a straggler
        for r in range(4):
            d2.observe(_sample(r, 40.0 + 10.0 * k, *((0.05, 0.9) if r == 2 else (0.8, 0.15))))
        assert d2.evaluate(41.0 + 10.0 * k) == []


@pytest.fixture
def spinner() -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen([sys.executable, "-c", "import time\ndef busy():\n    t = time.time()\n"
                          "    while time.time() - t < 0.05: pass\nwhile True:\n    busy()\n    time.sleep(0.05)\n"])
    time.sleep(0.5)
    yield p
    p.kill()
    p.wait()


def test_py_spy_samples_a_running_process_without_stopping_it(spinner: subprocess.Popen[bytes],
                                                              tmp_path: Path) -> None:
    binary = _py_spy("py-spy")
    if binary is None:
        pytest.skip("py-spy not installed")
    profiler = PySpyProfiler(binary, tmp_dir=str(tmp_path))
    places = main_thread_places(profiler.profile(spinner.pid, 1, 100), spinner.pid)
    # Idle samples (the sleep) are kept: about 100 in a second, half in the busy loop, half sleeping.
    assert 50 <= sum(places.values()) <= 130, places
    assert set(places) == {"code"}
    assert spinner.poll() is None
    with pytest.raises(RuntimeError, match="py-spy record failed"):
        profiler.profile(2**22 + 12345, 1, 100)
    assert not list(tmp_path.iterdir())  # each survey's file is removed, read or not
