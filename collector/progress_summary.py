"""Progress reduced at the edge: the agent ships one summary per rank every few seconds, not one sample per step.

A 100,000-GPU fleet stepping once a second would send 100,000 progress samples a second; summarised every
5 s it sends 20,000, whatever the step rate, and the detector leader holds one rank's window per record.
A summary is a ``ProgressSample`` with ``samples`` > 1: the window's last step at the last step's time, the
mean step time and phases over the window, and the fastest and slowest step. The service's detectors read it
as they read one sample (old agents' per-step samples are still accepted).

Trainers' printed step lines are reduced the same way: given ``from_lines`` (the service's progress rules, wired
by the composition root), a wrapped log source's step lines become samples in their rank's window and leave as
summaries; progress lines the service must read itself (counted steps, pauses, the end) go on as lines, after
their job's windows. The service still extracts progress from the lines it receives, so old agents that ship
every line keep working.

Cursors of the wrapped source are held back until the summaries covering what it read are handed on, so a
crash re-reads the samples rather than losing them; a summary's id is made of its rank and last step, so the
one rebuilt after a restart is recognised as a repeat.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from collector.signal import MAX_ARRIVALS, LogLine, ProgressSample, Signal, Source
from collector.sources.base import Clock, Poll, SignalSource

STEP_CUT = 16
"""A rank's window of step lines also closes after a step whose number is a multiple of this: a job stepping every
50 ms runs 100 steps in a 5 s window, and its slow rank must be named within 30 steps. Cutting on step numbers (not
counts) closes every rank's windows at the same steps on every node, and rebuilds the same summary ids after a
restart; a job stepping slower than ``STEP_CUT`` steps a window is cut by time alone. The hook's windows are cut the
same way: their summaries list each report's time and step time as a step line's do, and carry the window's mean and
standard deviation and largest value of each phase, so the service compares ranks' own work over the same steps."""

LineStep = Callable[[LogLine], ProgressSample | bool]
"""A log line's step as a sample to summarise; True: a progress line the service reads itself; False: no progress."""


@dataclass(slots=True)
class _Window:
    """The step samples of one rank since its last summary."""

    first: Signal
    last: Signal
    count: int = 0
    times: list[float] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    phased: int = 0
    squares: dict[str, float] = field(default_factory=dict)
    """Sum of each phase's squared seconds (its spread over the window)."""
    peaks: dict[str, float] = field(default_factory=dict)
    """Each phase's largest seconds in the window."""
    arrivals: list[tuple[int, float, float | None]] | None = None
    """(step, time, step time) of each step (None: not listed, a summary of summaries)."""


class ProgressWindows:
    """Step samples in, one summary signal per (node, job, rank) out on `flush` (pure: no clock, no I/O)."""

    def __init__(self, *, step_cut: int = STEP_CUT) -> None:
        self._windows: dict[tuple[str, str, str, int], _Window] = {}
        self.step_cut = step_cut
        """Step-line windows close after steps that are multiples of this (0: by time alone)."""

    def __len__(self) -> int:
        return len(self._windows)

    def add(self, sig: Signal, *, arrival: bool = True) -> list[Signal]:
        """Take a signal: a step sample joins its rank's window (out: the window's summary when the step closes it,
        see `STEP_CUT`); anything else comes out at once,
        after its rank's window (an end or exit must follow the steps before it). With `arrival`, the step's
        time is listed in the summary (a step line's or a hook report's: the service compares ranks' arrivals
        at equal steps) and the window closes on the step cut."""
        p = sig.payload
        if not isinstance(p, ProgressSample):
            return [sig]
        key = (sig.node, p.namespace or "", p.job, p.rank)
        if p.event != "step":
            return [*self._take([key], sig.ts), sig]
        w = self._windows.get(key)
        if w is None:
            w = self._windows[key] = _Window(first=sig, last=sig, arrivals=[] if arrival else None)
        elif isinstance(w.last.payload, ProgressSample) and p.world_size != w.last.payload.world_size:
            out = self._take([key], sig.ts)  # a new run: its steps are not averaged with the old run's
            return [*out, *self.add(sig, arrival=arrival)]
        if w.arrivals is not None:
            w.arrivals.append((p.step, sig.ts, p.step_time))
        w.count += p.samples
        if sig.ts >= w.last.ts:
            w.last = sig
        if p.step_time is not None:
            w.times.append(p.step_time)
        if p.phases:
            w.phased += p.samples
        for name, sec in p.phases.items():
            w.phases[name] = w.phases.get(name, 0.0) + sec * p.samples
            w.squares[name] = w.squares.get(name, 0.0) + sec * sec * p.samples
            w.peaks[name] = max(w.peaks.get(name, sec), sec)
        if w.arrivals is not None and self.step_cut and p.step % self.step_cut == 0 and p.step > 0:
            return self._take([key], sig.ts)
        return []

    def flush_job(self, node: str, namespace: str, job: str, at: float = 0.0) -> list[Signal]:
        """The summaries of every rank of one job on one node (a line about the job is to follow them)."""
        return self._take([k for k in self._windows if k[:3] == (node, namespace, job)], at)

    def flush(self, at: float = 0.0) -> list[Signal]:
        """One summary per rank with steps since the last flush; `at`: the wall time a step-line summary is
        stamped with (its steps keep their own times in ``arrivals``)."""
        return self._take(list(self._windows), at)

    def _take(self, keys: Iterable[tuple[str, str, str, int]], at: float) -> list[Signal]:
        out: list[Signal] = []
        for key in keys:
            w = self._windows.pop(key, None)
            if w is not None:
                out.append(_summary(w, at))
        return out


def thin(arrivals: list[tuple[int, float, float | None]]) -> tuple[tuple[int, float, float | None], ...]:
    """At most MAX_ARRIVALS steps: those that are multiples of the smallest power of two that leaves few enough,
    and the last. Every node thins a job's steps onto the same grid, so ranks on different nodes share steps."""
    stride = 1
    while sum(1 for a in arrivals if a[0] % stride == 0) > MAX_ARRIVALS - 1:
        stride *= 2
    kept = [a for a in arrivals[:-1] if a[0] % stride == 0]
    return (*kept, arrivals[-1]) if arrivals else ()


def _summary(w: _Window, at: float) -> Signal:
    last = w.last.payload
    assert isinstance(last, ProgressSample)
    if w.count == 1 and not (w.phased and w.arrivals):
        return w.last  # a hook report's window of one step is still a summary: its rank's steps stay contiguous
    mean = sum(w.times) / len(w.times) if w.times else None
    phases = {k: v / w.phased for k, v in w.phases.items()}
    sd = {k: max(w.squares.get(k, 0.0) / w.phased - m * m, 0.0) ** 0.5 for k, m in phases.items()}
    sample = ProgressSample(job=last.job, rank=last.rank, step=last.step, step_time=mean,
                            phases=phases, phases_sd=sd if w.arrivals else {},
                            phases_peak=dict(w.peaks) if w.arrivals else {}, world_size=last.world_size,
                            namespace=last.namespace, samples=w.count, step_time_min=min(w.times) if w.times else None,
                            step_time_max=max(w.times) if w.times else None,
                            arrivals=thin(sorted(w.arrivals)) if w.arrivals else ())
    job = f"{last.namespace}/{last.job}" if last.namespace else last.job
    sid = f"{w.last.node}/progress-summary/{job}/{last.rank}/{last.step}"
    # A step-line summary is stamped when it is made: the service's clock for hangs ("now" on the signals'
    # timeline) must not fall behind by the window; its steps carry their own times.
    ts = max(w.last.ts, at) if w.arrivals else w.last.ts
    return Signal(id=sid, node=w.last.node, source=Source.PROGRESS, ts=ts, payload=sample)


class SummarisedProgress:
    """Wraps a progress source: its step samples leave as one summary per rank every `interval_s` seconds.

    With `from_lines`, the source's log lines that carry a step are taken as step samples too.
    """

    def __init__(self, inner: SignalSource, interval_s: float, *, clock: Clock = time.monotonic,
                 from_lines: LineStep | None = None, wall: Clock = time.time) -> None:
        self.inner = inner
        self.from_lines = from_lines
        self.wall = wall
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
            out.extend(self._take(sig))
        self._held.update(got.cursors)
        cursors: dict[str, Any] = {}
        now = self.clock()
        if now >= self._due or not len(self.windows):
            out.extend(self.windows.flush(self.wall()))
            cursors, self._held = self._held, {}
            self._due = now + self.interval_s
        return Poll(signals=out, cursors=cursors, lines=got.lines, lost=got.lost, errors=got.errors,
                    filtered=got.filtered)

    def _take(self, sig: Signal) -> list[Signal]:
        line = sig.payload
        if self.from_lines is None or not isinstance(line, LogLine):
            return self.windows.add(sig)
        step = self.from_lines(line)
        if step is False:
            return [sig]
        if step is True:
            # Read by the service: the steps before it must reach the service first.
            return [*self.windows.flush_job(sig.node, line.namespace or "", line.job or line.pod or "", sig.ts), sig]
        return self.windows.add(Signal(id=sig.id, node=sig.node, source=Source.PROGRESS, ts=sig.ts, payload=step),
                                arrival=True)

    def close(self) -> None:
        """Close the inner source (samples still in a window are read again after a restart)."""
        self.inner.close()


class ExitsAfterSteps:
    """Wraps a source of rank exits (processes that ended): an exit leaves after its rank's open step-line
    window, as the rank's own log source would send it, so the service sees the steps before the exit."""

    def __init__(self, inner: SignalSource, windows: ProgressWindows) -> None:
        self.inner = inner
        self.name = inner.name
        self.windows = windows

    def poll(self) -> Poll:
        """The inner source's poll, each exit after its rank's summary."""
        got = self.inner.poll()
        out: list[Signal] = []
        for sig in got.signals:
            out.extend(self.windows.add(sig) if isinstance(sig.payload, ProgressSample) else [sig])
        return Poll(signals=out, cursors=got.cursors, lines=got.lines, lost=got.lost, errors=got.errors,
                    filtered=got.filtered)

    def close(self) -> None:
        """Close the inner source."""
        self.inner.close()
