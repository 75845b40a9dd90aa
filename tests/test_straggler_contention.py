"""Straggler naming on a loaded machine: CPU contention that slows every rank unevenly for a few steps names
nobody, while a rank that is slower step after step is still named."""

from __future__ import annotations

import random

from analyzer.detectors.suite import DetectorSuite
from analyzer.progress_rules import default_progress_rules_dir, load_progress_rules
from analyzer.records import FaultClass, Finding
from collector.signal import ProgressSample, Signal, Source

PROGRESS = load_progress_rules([default_progress_rules_dir()])
T0 = 1_800_000_000.0


def _job(seed: int, *, steps: int = 60, burst: range = range(5, 15), slow_rank: int | None = None,
         slow_factor: float = 1.3, slow_from: int = 10) -> list[Finding]:
    """A healthy 4-rank hook job (0.2 s of compute, 3% jitter) whose ranks are each slowed 1-2x at random during
    `burst`, as CPU contention does; optionally one rank slower from `slow_from` on. Returns straggler findings."""
    rng = random.Random(seed)
    suite = DetectorSuite(PROGRESS)
    t = T0
    found: list[Finding] = []
    for s in range(1, steps + 1):
        compute = []
        for r in range(4):
            c = 0.2 * max(1.0 + rng.gauss(0.0, 0.03), 0.5)
            if s in burst:
                c *= rng.uniform(1.0, 2.0)
            if r == slow_rank and s >= slow_from:
                c *= slow_factor
            compute.append(c)
        end = t + max(compute) + 0.03
        suite.observe([Signal(f"n/progress/{r}/{s}", "node-0", Source.PROGRESS, end + rng.uniform(0.0, 0.05),
                              ProgressSample("hook-job", r, s, end - t, {"compute": compute[r],
                                                                         "comm_wait": end - t - compute[r]}))
                       for r in range(4)])
        t = end
        found += [f for f in suite.evaluate(t + 0.06) if f.fault_class is FaultClass.STRAGGLER]
    return found


def test_uneven_contention_of_every_rank_for_a_few_steps_names_no_straggler() -> None:
    # 40 healthy jobs, each through one burst of contention: not one rank may be named.
    named = {seed: [(f.where.rank, f.fields["slowdown"]) for f in _job(seed)] for seed in range(40)}
    assert {seed: got for seed, got in named.items() if got} == {}


def test_a_rank_slower_every_step_is_still_named_through_the_same_contention() -> None:
    for seed in range(5):
        found = _job(seed, slow_rank=2)
        assert {f.where.rank for f in found} == {2}, seed
        assert int(found[0].fields["step"]) - 10 <= 30
