"""Progress reduced at the edge: the agent's per-rank window summaries (fields, order, cursors, ids), their wire
form through both decoders, and the hang and straggler detectors finding their faults through summaries alone."""

from __future__ import annotations

import gzip
import json

import pytest

from analyzer.detectors.suite import DetectorSuite
from analyzer.records import FaultClass
from collector.progress_summary import ProgressWindows, SummarisedProgress
from collector.shipper import encode_batch
from collector.signal import LogLine, ProgressSample, Signal, Source
from collector.sources.base import Poll
from collector.wire import SignalBatch, to_record, to_wire
from kmend.api.signal_decode import decode_fast
from sim.agent_windows import drive, through_agent_windows
from sim.traces import Batch, Straggle, TraceJob


def _sample(rank: int, step: int, ts: float, step_time: float | None = 1.0, *, node: str = "n1",
            event: str = "step", phases: dict[str, float] | None = None, world: int | None = None) -> Signal:
    return Signal(f"n1/progress/r{rank}.jsonl/{step}", node, Source.PROGRESS, ts,
                  ProgressSample("llama", rank, step, step_time, phases or {}, event, world))


def test_a_window_becomes_one_summary_per_rank_with_last_step_and_step_time_stats() -> None:
    w = ProgressWindows()
    for step, st in enumerate([1.0, 1.2, 0.8, 3.0], start=10):
        assert w.add(_sample(0, step, 100.0 + step, st, phases={"compute": st / 2})) == []
        assert w.add(_sample(1, step, 100.5 + step, 2.0)) == []
    by_rank = {s.payload.rank: s for s in w.flush() if isinstance(s.payload, ProgressSample)}
    s0 = by_rank[0].payload
    assert isinstance(s0, ProgressSample)
    assert (s0.step, by_rank[0].ts, s0.samples) == (13, 113.0, 4)
    assert s0.step_time == pytest.approx(1.5) and (s0.step_time_min, s0.step_time_max) == (0.8, 3.0)
    assert s0.phases == {"compute": pytest.approx(0.75)}
    assert by_rank[1].id == "n1/progress-summary/llama/1/13" and by_rank[1].ts == 113.5
    assert w.flush() == []  # nothing new: nothing shipped


def test_the_same_job_name_in_two_namespaces_keeps_two_windows() -> None:
    w = ProgressWindows()
    for step in (1, 2, 3):
        for ns, st in (("team-a", 1.0), ("team-b", 4.0)):
            w.add(Signal(f"n1/progress/{ns}/{step}", "n1", Source.PROGRESS, 10.0 + step,
                         ProgressSample("llama", 0, step, st, namespace=ns)))
    out = {s.payload.namespace: s for s in w.flush() if isinstance(s.payload, ProgressSample)}
    assert set(out) == {"team-a", "team-b"}
    assert [out[ns].payload.step_time for ns in ("team-a", "team-b")] == [1.0, 4.0]  # type: ignore[union-attr]
    assert out["team-b"].id == "n1/progress-summary/team-b/llama/0/3"


def test_an_end_follows_the_steps_before_it_and_other_signals_pass_at_once() -> None:
    w = ProgressWindows()
    w.add(_sample(0, 1, 1.0))
    w.add(_sample(0, 2, 2.0))
    log = Signal("n1/cri/x/1", "n1", Source.CONTAINER, 2.5, LogLine("hello"))
    assert w.add(log) == [log]
    out = w.add(_sample(0, 2, 3.0, event="end"))
    assert [(s.payload.step, s.payload.event) for s in out if isinstance(s.payload, ProgressSample)] == \
        [(2, "step"), (2, "end")]
    first = _sample(0, 1, 4.0, world=8)
    assert w.add(first) == []
    second = _sample(0, 1, 5.0, world=16)
    assert w.add(second) == [first]  # a new run is not averaged with the old one; one sample leaves as read
    assert w.flush() == [second]


class _Source:
    name = "progress"

    def __init__(self) -> None:
        self.next: list[Poll] = []

    def poll(self) -> Poll:
        return self.next.pop(0) if self.next else Poll()

    def close(self) -> None:
        pass


def test_cursors_are_held_until_the_summary_covering_them_is_handed_on() -> None:
    now = [0.0]
    inner = _Source()
    src = SummarisedProgress(inner, 5.0, clock=lambda: now[0])
    inner.next = [Poll([_sample(0, 1, 1.0), _sample(0, 2, 2.0)], {"r0.jsonl": 100}, lines=2)]
    got = src.poll()
    assert got.signals == [] and dict(got.cursors) == {} and got.lines == 2
    now[0] = 5.0
    inner.next = [Poll([_sample(0, 3, 3.0)], {"r0.jsonl": 150}, lines=1)]
    got = src.poll()
    [summary] = got.signals
    assert isinstance(summary.payload, ProgressSample) and (summary.payload.step, summary.payload.samples) == (3, 3)
    assert dict(got.cursors) == {"r0.jsonl": 150}


def test_a_summary_crosses_the_wire_through_both_decoders() -> None:
    w = ProgressWindows()
    for step in range(1, 6):
        w.add(_sample(3, step, float(step), 0.5 + step / 10))
    [s] = w.flush()
    raw = gzip.decompress(encode_batch([s]))
    fast = decode_fast(raw)
    assert fast is not None and list(fast[0]) == [s]
    [slow] = [to_record(x) for x in SignalBatch.model_validate(json.loads(raw)).signals]
    assert slow == s and to_wire(slow) == to_wire(s)


def _wire(s: Signal) -> Signal:
    return to_record(SignalBatch.model_validate({"signals": [to_wire(s)]}).signals[0])


def _through_summaries(batches: list[Batch], every_s: float = 5.0, *, lines: bool = False) -> list[Batch]:
    """What a fleet of summarising agents ships: each window's summaries at its end, through the wire."""
    return through_agent_windows(batches, every_s, lines=lines, encode=_wire)


def test_a_rank_left_behind_is_named_through_summaries() -> None:
    job = TraceJob("j", world=16, step_s=1.0, seed=1)
    batches = job.run(40)
    batches += job.hang_rank(11, behind=True, duration_s=300)
    stall = max(s.ts for _, sigs in batches for s in sigs if s.source is Source.PROGRESS)
    shipped = _through_summaries(batches)
    progress = sum(1 for _, sigs in shipped for s in sigs if s.source is Source.PROGRESS)
    # One summary per rank per window and per 16 steps, not one per step.
    assert progress <= 16 * (41 // 5 + 41 // 16 + 2) < 16 * 41
    [f] = drive(DetectorSuite(), shipped, until=stall + 300)
    assert f.fault_class is FaultClass.HANG and f.fields["mode"] == "ranks_behind"
    assert (f.where.rank, f.where.job) == (11, "j")
    assert f.ts - stall <= 30.0


def test_a_slow_rank_is_found_through_summaries_with_its_slowdown() -> None:
    job = TraceJob("j", world=64, step_s=1.0, seed=8)
    batches = job.run(10) + job.run(150, straggle=Straggle(rank=37, factor=1.25, from_step=11))
    found = [f for f in drive(DetectorSuite(), _through_summaries(batches), until=job.ts + 10)
             if f.fault_class is FaultClass.STRAGGLER]
    assert [f.where.rank for f in found] == [37]
    assert 1.15 < float(found[0].fields["slowdown"]) < 1.35


def test_a_ten_percent_slow_rank_among_256_is_found_through_summaries_as_soon_as_through_samples() -> None:
    job = TraceJob("j", world=256, step_s=1.0, seed=8)
    batches = job.run(10) + job.run(50, straggle=Straggle(rank=77, factor=1.10, from_step=11))
    [f] = drive(DetectorSuite(), _through_summaries(batches), until=job.ts + 10)
    assert f.fault_class is FaultClass.STRAGGLER and (f.where.rank, f.where.node) == (77, "j-n009")
    assert 1.07 < float(f.fields["slowdown"]) < 1.13 and f.fields["basis"] == "compute"
    assert int(f.fields["step"]) - 10 <= 50 and not f.hardware


def test_a_slow_rank_of_a_fast_job_is_named_within_30_steps_through_the_agents_default_window() -> None:
    # A lock-stepped job printing a line every 50 ms runs 100 steps in the agent's default 5 s window: a window
    # closed only by time would tell the service of the slow rank (its lines come late) 100 steps late.
    from kmend.commands.agent import AgentSettings

    window_s = AgentSettings.model_fields["progress_summary_s"].default
    job = TraceJob("j", world=16, step_s=0.05, seed=3)
    # Rank 5's work between two all-reduces takes 0.15 s more (the real-job tests' injected sleep): its lines
    # come that much after its peers' every step.
    batches = job.run(10, report_before_sync=True) + job.run(
        300, straggle=Straggle(rank=5, factor=4.0, from_step=11), report_before_sync=True)
    found = [f for f in drive(DetectorSuite(), _through_summaries(batches, window_s, lines=True), until=job.ts + 10,
                               tick_s=0.05)
             if f.fault_class is FaultClass.STRAGGLER]
    assert [f.where.rank for f in found] == [5]
    assert int(found[0].fields["step"]) - 10 <= 30
