"""A step-line job's slow rank through the agent's default windows (``bench/detect.py --only
straggler_fast_lines``): windows cut every 16 steps against windows closed by time only, on the same jobs."""

from __future__ import annotations

import random
import statistics
from typing import Any

from analyzer.detectors.straggler import StragglerConfig
from analyzer.detectors.suite import DetectorSuite
from analyzer.records import FaultClass
from sim.agent_windows import drive, through_agent_windows
from sim.traces import Straggle, TraceJob


def bench_straggler_fast_lines(trials: int, world: int, rng: random.Random) -> dict[str, Any]:
    """Lock-stepped jobs printing a step line every 50 ms (no hook), through the agent's default 5 s windows:
    one rank's work between two all-reduces takes 0.125-0.175 s longer, so its lines come after its peers' (the
    arrival lag); healthy twins with 10 % jitter and data-loader hiccups must name no one."""
    window_s = 5.0
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
                shipped = through_agent_windows(batches, window_s, lines=True, step_cut=cut)
                named = None
                for f in drive(suite, shipped, job.ts + window_s, tick_s=0.05):
                    if f.fault_class is not FaultClass.STRAGGLER:
                        continue
                    if slow and f.where.rank == 3:
                        named = int(f.fields["step"]) - 10 if named is None else named
                    else:
                        fp += 1
                if slow and named is not None:
                    found.append(named)
        res[label] = {"found_within_30_steps": sum(1 for n in found if n <= 30), "found_at_all": len(found),
                      "steps_to_detect_median": statistics.median(found) if found else None,
                      "steps_to_detect_max": max(found) if found else None, "false_findings": fp}
    res["simulated"] = (f"{trials} slow and {trials} healthy jobs of {world} ranks, 50 ms of work and 10 ms of "
                        "all-reduce a step, 10% jitter, 2% hiccups of 50-300 ms; agent windows of 5 s (the "
                        "default); the slow rank's work 3.5-4.5x its peers' from step 11 (its lines 0.125-0.175 s "
                        "late, past the 0.1 s lag floor; the job then steps every 0.19-0.24 s: 21-26 steps a "
                        "window)")
    return res
