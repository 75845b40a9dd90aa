"""Hook jobs through the agent's default windows: summaries close every 16 steps on every rank and list each report,
so a fast job's slow rank is named within 30 steps, while a loaded machine that slows every rank at once names
nobody; the summaries' phase spreads cross the wire."""

from __future__ import annotations

import gzip
import json

from analyzer.detectors.suite import DetectorSuite
from analyzer.records import FaultClass, Finding
from collector.progress_summary import ProgressWindows
from collector.shipper import encode_batch
from collector.signal import ProgressSample, Signal, Source
from collector.wire import SignalBatch, to_record
from kmend.api.signal_decode import decode_fast
from kmend.commands.agent import AgentSettings
from sim.agent_windows import drive, through_agent_windows
from sim.traces import Load, Straggle, TraceJob

WINDOW_S = AgentSettings.model_fields["progress_summary_s"].default
"""The agent's default summary window."""
LOAD = (Load(40, 12, 1.0, 2.0), Load(80, 1, 10.0, 20.0))
"""Every rank slowed 1-2x each for 12 steps, then a 0.5-1 s pause of every rank at one step."""


def _stragglers(seed: int, slow: Straggle | None) -> tuple[TraceJob, list[Finding]]:
    job = TraceJob("hook", world=16, step_s=0.05, comm_s=0.01, jitter=0.1, seed=seed)
    batches = job.run(10, load=LOAD) + job.run(110, straggle=slow, load=LOAD)
    shipped = through_agent_windows(batches, WINDOW_S)
    found = drive(DetectorSuite(), shipped, until=job.ts + WINDOW_S, tick_s=0.05)
    return job, [f for f in found if f.fault_class is FaultClass.STRAGGLER]


def test_a_hook_jobs_slow_rank_is_named_within_30_steps_at_the_default_window() -> None:
    # 50 ms steps: about 80 steps in a 5 s window. A summary closed by time alone, counted as one sample, named
    # the rank after several windows (hundreds of steps).
    for seed in range(4):
        _, found = _stragglers(seed, Straggle(rank=5, factor=1.25, from_step=11))
        assert [f.where.rank for f in found] == [5], (seed, [f.message for f in found])
        assert int(found[0].fields["step"]) - 10 <= 30 and found[0].fields["basis"] == "compute"
        assert 1.15 < float(found[0].fields["slowdown"]) < 1.35


def test_a_loaded_machine_that_slows_every_rank_at_once_names_nobody() -> None:
    # Each rank slowed by its own factor: over one summary's 16 steps some ranks' means rise more than others',
    # but every hit rank's work is unsteady over those steps, which a slow rank's is not.
    named = {seed: [f.message for f in _stragglers(seed, None)[1]] for seed in range(12)}
    assert {seed: got for seed, got in named.items() if got} == {}


def _report(rank: int, step: int, compute: float) -> Signal:
    return Signal(f"n1/progress/r{rank}/{step}", "n1", Source.PROGRESS, 100.0 + step * 0.05,
                  ProgressSample("hook", rank, step, 0.06, {"compute": compute, "comm_wait": 0.06 - compute}))


def test_hook_summaries_close_at_the_step_cut_with_each_report_and_the_phases_spread() -> None:
    w = ProgressWindows()
    out = [s for step in range(1, 18) for s in w.add(_report(0, step, 0.04 if step % 2 else 0.05))]
    [summary] = out  # closed at step 16, the same step on every rank; step 17 opens the next window
    p = summary.payload
    assert isinstance(p, ProgressSample) and (p.step, p.samples) == (16, 16)
    assert [a[0] for a in p.arrivals] == list(range(1, 17)) and p.arrivals[0][1] == 100.05
    assert abs(p.phases["compute"] - 0.045) < 1e-9 and abs(p.phases_sd["compute"] - 0.005) < 1e-9
    raw = gzip.decompress(encode_batch([summary]))
    fast = decode_fast(raw)
    assert fast is not None and list(fast[0]) == [summary]
    assert [to_record(x) for x in SignalBatch.model_validate(json.loads(raw)).signals] == [summary]


def test_a_summary_whose_phases_go_below_zero_crosses_the_wire() -> None:
    # A trainer's own phase sums can come out negative (a wait measured as the step less a longer compute): the
    # summary's largest value of that phase is then negative too, and the service must take the batch.
    w = ProgressWindows()
    out = [s for step in range(1, 17) for s in w.add(_report(0, step, 0.07))]  # comm_wait = 0.06 - 0.07 < 0
    [summary] = out
    assert isinstance(summary.payload, ProgressSample) and summary.payload.phases_peak["comm_wait"] < 0
    raw = gzip.decompress(encode_batch([summary]))
    fast = decode_fast(raw)
    assert fast is not None and list(fast[0]) == [summary]
    assert [to_record(x) for x in SignalBatch.model_validate(json.loads(raw)).signals] == [summary]
