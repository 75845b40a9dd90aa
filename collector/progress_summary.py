"""Progress reduced at the edge: the agent ships one summary per rank every few seconds, not one sample per step.

A 100,000-GPU fleet stepping once a second would send 100,000 progress samples a second; summarised every
5 s it sends 20,000, whatever the step rate, and the detector leader holds one rank's window per record.
A summary is a ``ProgressSample`` with ``samples`` > 1: the window's last step at the last step's time, the
mean step time and phases over the window, and the fastest and slowest step. The service's detectors read it
as they read one sample (old agents' per-step samples are still accepted).

Cursors of the wrapped source are held back until the summaries covering what it read are handed on, so a
crash re-reads the samples rather than losing them; a summary's id is made of its rank and last step, so the
one rebuilt after a restart is recognised as a repeat.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from collector.signal import ProgressSample, Signal, Source
from collector.sources.base import Clock, Poll, SignalSource


@dataclass(slots=True)
class _Window:
    """The step samples of one rank since its last summary."""

    first: Signal
    last: Signal
    count: int = 0
    times: list[float] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    phased: int = 0


class ProgressWindows:
    """Step samples in, one summary signal per (node, job, rank) out on `flush` (pure: no clock, no I/O)."""

    def __init__(self) -> None:
        self._windows: dict[tuple[str, str, str, int], _Window] = {}

    def __len__(self) -> int:
        return len(self._windows)

    def add(self, sig: Signal) -> list[Signal]:
        """Take a signal: a step sample joins its rank's window (nothing out); anything else comes out at once,
        after its rank's window (an end or exit must follow the steps before it)."""
        p = sig.payload
        if not isinstance(p, ProgressSample):
            return [sig]
        key = (sig.node, p.namespace or "", p.job, p.rank)
        if p.event != "step":
            return [*self._take([key]), sig]
        w = self._windows.get(key)
        if w is None:
            w = self._windows[key] = _Window(first=sig, last=sig)
        elif isinstance(w.last.payload, ProgressSample) and p.world_size != w.last.payload.world_size:
            out = self._take([key])  # a new run: its steps are not averaged with the old run's
            return [*out, *self.add(sig)]
        w.count += p.samples
        if sig.ts >= w.last.ts:
            w.last = sig
        if p.step_time is not None:
            w.times.append(p.step_time)
        if p.phases:
            w.phased += p.samples
        for name, sec in p.phases.items():
            w.phases[name] = w.phases.get(name, 0.0) + sec * p.samples
        return []

    def flush(self) -> list[Signal]:
        """One summary per rank with steps since the last flush."""
        return self._take(list(self._windows))

    def _take(self, keys: Iterable[tuple[str, str, str, int]]) -> list[Signal]:
        out: list[Signal] = []
        for key in keys:
            w = self._windows.pop(key, None)
            if w is not None:
                out.append(_summary(w))
        return out


def _summary(w: _Window) -> Signal:
    last = w.last.payload
    assert isinstance(last, ProgressSample)
    if w.count == 1:
        return w.last
    mean = sum(w.times) / len(w.times) if w.times else None
    sample = ProgressSample(job=last.job, rank=last.rank, step=last.step, step_time=mean,
                            phases={k: v / w.phased for k, v in w.phases.items()}, world_size=last.world_size,
                            namespace=last.namespace, samples=w.count, step_time_min=min(w.times) if w.times else None,
                            step_time_max=max(w.times) if w.times else None)
    job = f"{last.namespace}/{last.job}" if last.namespace else last.job
    sid = f"{w.last.node}/progress-summary/{job}/{last.rank}/{last.step}"
    return Signal(id=sid, node=w.last.node, source=Source.PROGRESS, ts=w.last.ts, payload=sample)


class SummarisedProgress:
    """Wraps a progress source: its step samples leave as one summary per rank every `interval_s` seconds."""

    def __init__(self, inner: SignalSource, interval_s: float, *, clock: Clock = time.monotonic) -> None:
        self.inner = inner
        self.name = inner.name
        self.interval_s = interval_s
        self.clock = clock
        self.windows = ProgressWindows()
        self._held: dict[str, Any] = {}
        self._due = clock() + interval_s

    def poll(self) -> Poll:
        """The inner source's poll, with step samples held in their windows until the next summary is due."""
        got = self.inner.poll()
        out: list[Signal] = []
        for sig in got.signals:
            out.extend(self.windows.add(sig))
        self._held.update(got.cursors)
        cursors: dict[str, Any] = {}
        now = self.clock()
        if now >= self._due or not len(self.windows):
            out.extend(self.windows.flush())
            cursors, self._held = self._held, {}
            self._due = now + self.interval_s
        return Poll(signals=out, cursors=cursors, lines=got.lines, lost=got.lost, errors=got.errors,
                    filtered=got.filtered)

    def close(self) -> None:
        """Close the inner source (samples still in a window are read again after a restart)."""
        self.inner.close()
