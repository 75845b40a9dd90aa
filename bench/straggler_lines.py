"""A fast job's slow rank through the agent's default windows (``bench/detect.py --only straggler_fast_lines``):
step-line jobs with windows cut every 16 steps against windows closed by time only, and hook jobs whose summaries
close on the same steps and are compared across ranks over those steps against summaries closed by time that count
as one sample each, on the same jobs."""

from __future__ import annotations

import random
import statistics
from typing import Any

from analyzer.detectors.straggler import StragglerConfig
from analyzer.detectors.suite import DetectorSuite
from analyzer.records import FaultClass
from sim.agent_windows import drive, through_agent_windows
from sim.traces import Load, Straggle, TraceJob

WINDOW_S = 5.0
"""The agent's default summary window."""


def _result(found: list[int], fp: int) -> dict[str, Any]:
    return {"found_within_30_steps": sum(1 for n in found if n <= 30), "found_at_all": len(found),
            "steps_to_detect_median": statistics.median(found) if found else None,
            "steps_to_detect_max": max(found) if found else None, "false_findings": fp}


def _named(suite: DetectorSuite, job: TraceJob, shipped: list[Any], slow: bool, rank: int,
           onset: int) -> tuple[int | None, int]:
    """Steps from the onset to the slow rank's finding (None: not named), and findings about anyone else."""
    named, fp = None, 0
    for f in drive(suite, shipped, job.ts + WINDOW_S, tick_s=0.05):
        if f.fault_class is not FaultClass.STRAGGLER:
            continue
        if slow and f.where.rank == rank:
            named = int(f.fields["step"]) - onset if named is None else named
        else:
            fp += 1
    return named, fp


def bench_straggler_fast_lines(trials: int, world: int, rng: random.Random) -> dict[str, Any]:
    """Lock-stepped jobs printing a step line every 50 ms (no hook), through the agent's default 5 s windows:
    one rank's work between two all-reduces takes 0.125-0.175 s longer, so its lines come after its peers' (the
    arrival lag); healthy twins with 10 % jitter and data-loader hiccups must name no one."""
    res: dict[str, Any] = {}
    seeds = [rng.randrange(10**6) for _ in range(trials)]
    variants = (("now: windows cut every 16 steps, persistence in steps", 16, True),
                ("windows by time only, persistence in steps", 0, True),
                ("before: windows by time only, persistence in evaluations", 0, False))
    for label, cut, in_steps in variants:
        found: list[int] = []
        fp = 0
        for k, seed in enumerate(seeds):
            for slow in (True, False):
                job = TraceJob(f"f{k}", world=world, step_s=0.05, seed=seed, jitter=0.1, hiccup_p=0.02,
                               hiccup_s=(0.05, 0.3), comm_s=0.01)
                factor = 3.5 + (seed % 1000) / 1000
                batches = job.run(10, report_before_sync=True) + job.run(
                    120, straggle=Straggle(3, factor, 11) if slow else None, report_before_sync=True)
                suite = DetectorSuite(straggler=StragglerConfig(persistence_in_steps=in_steps))
                named, bad = _named(suite, job, through_agent_windows(batches, WINDOW_S, lines=True, step_cut=cut),
                                    slow, 3, 10)
                fp += bad
                if named is not None:
                    found.append(named)
        res[label] = _result(found, fp)
    res["simulated"] = (f"{trials} slow and {trials} healthy jobs of {world} ranks, 50 ms of work and 10 ms of "
                        "all-reduce a step, 10% jitter, 2% hiccups of 50-300 ms; agent windows of 5 s (the "
                        "default); the slow rank's work 3.5-4.5x its peers' from step 11 (its lines 0.125-0.175 s "
                        "late, past the 0.1 s lag floor; the job then steps every 0.19-0.24 s: 21-26 steps a "
                        "window)")
    res["hook"] = bench_straggler_fast_hook(trials, world, rng)
    return res


def bench_straggler_fast_hook(trials: int, world: int, rng: random.Random) -> dict[str, Any]:
    """Lock-stepped jobs reporting every 50 ms step through the hook (compute and all-reduce wait), through the
    agent's default 5 s windows: one rank's compute 1.2-1.5x its peers'. Every job, slow or healthy, goes through
    a loaded machine twice (every rank slowed at once, each by its own 1-2x, for 12 steps; then a 0.5-1 s pause of
    every rank at one step); healthy twins must name no one."""
    res: dict[str, Any] = {}
    seeds = [rng.randrange(10**6) for _ in range(trials)]
    load = (Load(60, 12, 1.0, 2.0), Load(100, 1, 10.0, 20.0))
    variants = (("now: summaries cut every 16 steps, ranks compared over the same steps", 16, True),
                ("before: summaries by time only, one sample each, persistence in evaluations", 0, False))
    for label, cut, in_steps in variants:
        found: list[int] = []
        fp = 0
        for k, seed in enumerate(seeds):
            onset = 11 + seed % 16  # anywhere in a summary's 16 steps
            for slow in (True, False):
                job = TraceJob(f"h{k}", world=world, step_s=0.05, seed=seed, jitter=0.1, hiccup_p=0.002,
                               hiccup_s=(0.05, 0.3), comm_s=0.01)
                factor = 1.2 + (seed % 1000) / 1000 * 0.3
                batches = job.run(onset - 1, load=load) + job.run(
                    150 - onset, straggle=Straggle(3, factor, onset) if slow else None, load=load)
                suite = DetectorSuite(straggler=StragglerConfig(persistence_in_steps=in_steps))
                named, bad = _named(suite, job, through_agent_windows(batches, WINDOW_S, step_cut=cut), slow, 3,
                                    onset - 1)
                fp += bad
                if named is not None:
                    found.append(named)
        res[label] = _result(found, fp)
    res["simulated"] = (f"{trials} slow and {trials} healthy hook jobs of {world} ranks, 50 ms of work and 10 ms of "
                        "all-reduce a step, 10% jitter, 0.2% hiccups of 50-300 ms in a rank's work; agent windows "
                        "of 5 s (the default); the slow rank's work 1.2-1.5x its peers' from a step between 11 and "
                        "26; every rank slowed 1-2x each at steps 60-71 and paused 0.5-1 s at step 100")
    return res
