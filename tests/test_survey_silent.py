"""Stragglers of a job that prints no progress, judged from the stack surveys alone: named while the peers' surveys
show them entering and leaving the collectives (many distinct stacks, samples in and out), never when they sit in one
collective (a hang's shape), when the surveys come from an agent that does not count stacks, or once the hang
detector called the silence a hang; and the agent counting the main thread's distinct stacks."""

from __future__ import annotations

from collections import Counter

from analyzer.detectors.book import JobBook
from analyzer.detectors.suite import DetectorSuite
from analyzer.detectors.survey import SurveyDetector
from analyzer.progress import ProgressEvent
from analyzer.progress_rules import ProgressKind
from analyzer.records import FaultClass
from collector.signal import MetricSample, Signal, Source
from collector.survey import METRIC, main_thread_survey

# A rank that sleeps before each forward pass (its code), and its peer waiting for it in the all-reduce, leaving it
# for a moment each step: shares and distinct stacks as the agent measured them on a real Lightning job.
SLOW = (0.05, 0.95, 8)
WAITS = (0.98, 0.02, 5)
HUNG_PEER = (1.0, 0.0, 1)


def _started(ranks: int = 2) -> JobBook:
    """A job whose rank processes were seen at t=0 and that never printed a progress line."""
    book = JobBook()
    for r in range(ranks):
        book.observe_progress(ProgressEvent(job="lit", rank=r, node="n0", ts=0.0, kind=ProgressKind.START, step=None,
                                            namespace="train"))
    return book


def _sample(rank: int, ts: float, collective: float, code: float, stacks: int | None) -> Signal:
    labels = {"job": "lit", "rank": str(rank), "namespace": "train", "samples": "199",
              "share_collective": f"{collective:.3f}", "share_code": f"{code:.3f}"}
    if stacks is not None:
        labels["stacks"] = str(stacks)
    return Signal(f"n0/survey/{rank}/{ts}", "n0", Source.PROGRESS, ts, MetricSample(METRIC, collective, labels))


def _surveys(detector: SurveyDetector, rounds: int, shares: dict[int, tuple[float, float, int | None]],
             start: float = 40.0) -> list[tuple[int, int]]:
    """Feed `rounds` surveys 10 s apart of each rank's (collective, code, distinct stacks); (round, rank) found."""
    found = []
    for k in range(rounds):
        ts = start + 10.0 * k
        for r, (coll, code, stacks) in shares.items():
            detector.observe(_sample(r, ts, coll, code, stacks))
        found += [(k, int(f.where.rank if f.where.rank is not None else -1)) for f in detector.evaluate(ts + 1.0)]
    return found


def test_a_silent_jobs_rank_its_running_peers_wait_for_is_named_from_the_surveys_alone() -> None:
    detector = SurveyDetector(_started())
    assert _surveys(detector, 4, {0: WAITS, 1: SLOW}) == [(1, 1)]  # two surveys in a row; one finding
    d2 = SurveyDetector(_started())
    _surveys(d2, 1, {0: WAITS, 1: SLOW})
    d2.observe(_sample(0, 50.0, *WAITS))
    d2.observe(_sample(1, 50.0, *SLOW))
    [f] = d2.evaluate(51.0)
    assert f.fault_class is FaultClass.STRAGGLER and (f.where.job, f.where.rank, f.where.node) == ("lit", 1, "n0")
    assert f.fields["progress"].startswith("none recent") and f.fields["where"] == "code"
    # A run that printed steps and then stopped is not judged in its silence: it may be hanging (the real HF Trainer
    # whose rank 1 was stopped had it named a straggler beside its hang before this), the hang detector's.
    book = JobBook()
    for r in range(2):
        book.observe_progress(ProgressEvent(job="lit", rank=r, node="n0", ts=0.0, kind=ProgressKind.STEP, step=1,
                                            namespace="train"))
    assert _surveys(SurveyDetector(book), 3, {0: WAITS, 1: SLOW}) == []


def test_a_silent_job_whose_peers_sit_in_one_collective_or_that_an_old_agent_surveyed_names_nobody() -> None:
    # Its peer never leaves the collective (one stack, every sample in it): a hang's shape, the hang detector's.
    assert _surveys(SurveyDetector(_started()), 4, {0: HUNG_PEER, 1: SLOW}) == []
    # In the collective at every sample through a few stacks (a wait loop's lines) is no sign of running either.
    assert _surveys(SurveyDetector(_started()), 4, {0: (1.0, 0.0, 3), 1: SLOW}) == []
    # Surveys from an agent that does not count stacks: judged as before (a silent job is not judged).
    assert _surveys(SurveyDetector(_started()), 4, {0: (0.98, 0.02, None), 1: (0.05, 0.95, None)}) == []
    # Healthy silent ranks look alike: nobody.
    assert _surveys(SurveyDetector(_started()), 4, {0: (0.6, 0.4, 12), 1: (0.55, 0.45, 11)}) == []
    # A hang in the middle breaks the streak: the first survey of the episode does not count with a later one.
    found = []
    detector = SurveyDetector(_started())
    for k, peer in enumerate((WAITS, HUNG_PEER, WAITS, HUNG_PEER)):
        found += _surveys(detector, 1, {0: peer, 1: SLOW}, start=40.0 + 10.0 * k)
    assert found == []


def test_a_silence_the_hang_detector_called_a_hang_is_not_judged_from_the_surveys() -> None:
    detector = SurveyDetector(_started())
    detector.hung = lambda job: job == "train/lit"
    assert _surveys(detector, 4, {0: WAITS, 1: SLOW}) == []
    # The suite asks its hang detector.
    suite = DetectorSuite()
    suite.book.observe_progress(ProgressEvent(job="lit", rank=0, node="n0", ts=0.0, kind=ProgressKind.START, step=None,
                                              namespace="train"))
    assert suite.survey.hung("train/lit") is False
    suite.hang._reported["train/lit"] = (suite.book.jobs["train/lit"].run, suite.book.jobs["train/lit"].newest)
    assert suite.survey.hung("train/lit") is True


def test_the_agent_counts_the_main_threads_distinct_stacks() -> None:
    raw = ("thread (7): MainThread;<module> (t.py:9);step (t.py:4);_engine_run_backward (torch/autograd/g.py:9) 60\n"
           "thread (7): MainThread;<module> (t.py:9);step (t.py:3);forward (torch/nn/modules/linear.py:134) 30\n"
           "thread (7): MainThread;<module> (t.py:9);step (t.py:2) 9\n"
           "thread (8): Thread-1;run (threading.py:982) 100\n")
    places, stacks = main_thread_survey(raw)
    assert (places["collective"], places["code"], stacks) == (60, 39, 3)
    stuck = "thread (7): MainThread;<module> (t.py:9);wait (torch/distributed/distributed_c10d.py:9) 200\n"
    assert main_thread_survey(stuck)[1] == 1
    assert main_thread_survey("") == (Counter(), 0)
