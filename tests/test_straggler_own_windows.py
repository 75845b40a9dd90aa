"""The own-time straggler score's per-rank windows: kept from the samples the book adds (`OwnWindows`), the same as
each rank's newest samples read whole, and read from the book at a cost that does not grow with a rank's history."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np

from analyzer.detectors.book import JobBook
from analyzer.detectors.own_times import OwnWindows
from analyzer.detectors.straggler import StragglerConfig, StragglerDetector
from analyzer.progress import ProgressEvent
from analyzer.progress_rules import ProgressKind


def _event(job: str, rank: int, step: int, ts: float, *, own: float, hook: bool, namespace: str | None = None
           ) -> ProgressEvent:
    if hook:  # the hook's report: the rank's own work from its phases
        return ProgressEvent(job, rank, f"n{rank}", ts, ProgressKind.STEP, step,
                             phases={"forward": own / 2, "backward": own / 2}, namespace=namespace)
    return ProgressEvent(job, rank, f"n{rank}", ts, ProgressKind.STEP, step, step_time=own, rule_id="megatron",
                         namespace=namespace)


def test_the_windows_kept_from_new_samples_are_each_ranks_newest_samples() -> None:
    """Step lines, the hook's reports of steps whose line came first (the line's sample replaced), a rank whose
    hook starts late (its samples cleared), jumps of many steps between reads, a restart and a job merged into its
    namespaced one (a rank's state replaced): after each read, every rank's window is its newest samples."""
    rng = random.Random(7)
    for trial in range(40):
        book = JobBook(window=rng.choice([8, 20, 64]))
        window = rng.choice([5, 20, 30])
        own = OwnWindows(window)
        run = 0
        steps = dict.fromkeys(range(rng.randint(1, 12)), 0)
        hooked: set[int] = set()
        for tick in range(120):
            for r in steps:
                for _ in range(rng.choice([0, 1, 1, 1, 2, 7, 40]) if tick % 17 else 1):
                    steps[r] += 1
                    ts = 1000.0 + tick + steps[r] * 1e-3
                    book.observe_progress(_event("j", r, steps[r], ts, own=rng.uniform(0.5, 1.5), hook=r in hooked))
                    if rng.random() < 0.05:  # the hook's report of a step whose log line came first
                        hooked.add(r)
                        book.observe_progress(_event("j", r, steps[r], ts, own=rng.uniform(0.5, 1.5), hook=True))
            if tick == 60 and trial % 3 == 0:  # a new run of the job: its steps start again
                for r in steps:
                    steps[r] = 1
                    book.observe_progress(_event("j", r, 1, 5000.0 + r, own=1.0, hook=r in hooked))
            if tick == 80 and trial % 3 == 1:  # the namespaced reporter of the same ranks: the job is merged
                for r in steps:
                    steps[r] += 1
                    book.observe_progress(_event("j", r, steps[r], 1000.0 + tick + 0.5, own=1.0, hook=r in hooked,
                                                 namespace="ns"))
            key = next(iter(book.jobs))
            job = book.jobs[key]
            if job.run != run:
                own, run = OwnWindows(window), job.run  # as the detector does: a new run's windows start empty
            if rng.random() < 0.6:
                continue  # several changes between reads
            own.update([(r, st) for r, st in job.ranks.items()])
            ranks = [r for r, st in job.ranks.items() if st.times]
            got = own.newest(ranks)
            m = min(min(len(job.ranks[r].times), window) for r in ranks) if ranks else 0
            want = np.array([list(job.ranks[r].times)[len(job.ranks[r].times) - m:] for r in ranks],
                            dtype=np.float64).reshape(len(ranks), m)
            assert np.array_equal(got, want), (trial, tick)


class _Counting(deque[float]):
    """A rank's own-time samples that count what a reader takes out of them."""

    taken = 0

    def __iter__(self) -> Iterator[float]:
        for x in super().__iter__():
            _Counting.taken += 1
            yield x

    def __reversed__(self) -> Iterator[float]:
        for x in super().__reversed__():
            _Counting.taken += 1
            yield x

    def __getitem__(self, i: Any) -> Any:
        _Counting.taken += 1
        return super().__getitem__(i)


def test_a_large_jobs_own_time_score_reads_only_the_new_samples_however_long_its_history() -> None:
    """2,048 lock-stepped ranks, one step line each a second, the book keeping 64 samples a rank: every evaluation
    reads the one new sample of each rank, at step 30 as at step 72 (before, each rank's whole history each time:
    64 x 2,048 samples once the history is full), and the slow rank is named all the same."""
    ranks, slow = 2048, 77
    book = JobBook(window=64)
    detector = StragglerDetector(book, StragglerConfig())
    rng = random.Random(1)
    reads: dict[int, int] = {}
    named: set[int | None] = set()
    for step in range(1, 73):
        for r in range(ranks):
            own = (1.3 if r == slow and step > 40 else 1.0) * (1 + rng.uniform(-0.01, 0.01))
            book.observe_progress(_event("big", r, step, 1000.0 + step + rng.uniform(0, 0.01), own=own, hook=False))
        if step == 10:  # from now on, count what is read out of every rank's samples
            for st in book.jobs["big"].ranks.values():
                st.times = _Counting(st.times, maxlen=st.times.maxlen)
        _Counting.taken = 0
        named |= {f.where.rank for f in detector.evaluate(1001.0 + step)}
        reads[step] = _Counting.taken
    assert named == {slow}
    assert all(len(st.times) == 64 for st in book.jobs["big"].ranks.values())
    per_eval = [reads[s] for s in range(12, 73)]
    assert max(per_eval) <= ranks, f"samples read per evaluation: {sorted(set(per_eval))}"
    assert reads[72] == reads[30], (reads[30], reads[72])
