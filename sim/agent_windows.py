"""Traces as the node agents ship them, and the detectors driven over them on the traces' own clock.

Each agent keeps one progress window per rank (``collector.progress_summary.ProgressWindows``) and hands its
summaries on every `window_s` and every ``step_cut`` steps; anything else passes at once. A summary lists every step
with its time. With `lines`, the samples are the agent's reading of trainers' step lines: a line tells its step and
time, not the hook's phases.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from analyzer.detectors.suite import DetectorSuite
from analyzer.records import Finding
from collector.progress_summary import STEP_CUT, ProgressWindows
from collector.signal import ProgressSample, Signal
from sim.traces import Batch


def through_agent_windows(batches: list[Batch], window_s: float, *, lines: bool = False, step_cut: int = STEP_CUT,
                          encode: Callable[[Signal], Signal] | None = None) -> list[Batch]:
    """The batches as the agents ship them: each window's summaries at its end (through `encode`, e.g. the wire,
    when given), what a step cuts at once, anything else as it comes."""
    windows = ProgressWindows(step_cut=step_cut)
    out: list[Batch] = []
    due: float | None = None
    for t, sigs in sorted(batches, key=lambda b: b[0]):
        due = t + window_s if due is None else due
        if t >= due:
            flushed = windows.flush(due)
            out.append((due, [encode(s) for s in flushed] if encode else flushed))
            due += window_s * (1 + int((t - due) // window_s))
        if lines:
            sigs = [replace(s, payload=replace(s.payload, phases={})) if isinstance(s.payload, ProgressSample) else s
                    for s in sigs]
        passed = [x for sig in sigs for x in windows.add(sig)]
        if passed:
            out.append((t, passed))
    out.append((due or 0.0, windows.flush(due or 0.0)))
    return out


def drive(suite: DetectorSuite, batches: list[Batch], until: float, tick_s: float = 1.0) -> list[Finding]:
    """Feed the batches at their times and evaluate every `tick_s` until `until`; every finding, in order."""
    found: list[Finding] = []
    batches = sorted(batches, key=lambda b: b[0])
    t, i = batches[0][0], 0
    while t <= until:
        while i < len(batches) and batches[i][0] <= t:
            suite.observe(batches[i][1])
            i += 1
        found.extend(suite.evaluate(t))
        t += tick_s
    return found
