"""The end of training processes, seen in the host's ``/proc``: a job whose processes are gone has finished.

A container that exits leaves its log file as it was: the runtime writes no last line, and
the pod's log directory stays until the pod is deleted. Off the cluster's API, the one thing
the node agent still sees is the training processes themselves (it runs with host PID access):
each rank's process while it runs, and its absence once it has ended. For each rank process
of a known job that disappears (or whose PID now belongs to another program), this source
emits an ``exit`` progress sample; once every rank the service knows of has exited, the job's
silence is its end, not a hang. A process that is stopped (SIGSTOP) is still there: its job
is stuck, not finished.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from collector.processes import ProcessFinder, TrainingProcess
from collector.signal import ProgressSample, Signal, Source
from collector.sources.base import Clock, Poll


@dataclass(frozen=True, slots=True)
class _Seen:
    rank: int
    names: tuple[str, ...]
    namespace: str | None = None


class ProcessExitSource:
    """Watches the training processes on this node and reports each one's end."""

    name = "processes"

    def __init__(self, *, node: str, finder: ProcessFinder, clock: Clock = time.time,
                 interval_s: float = 1.0, monotonic: Clock = time.monotonic) -> None:
        self.node = node
        self.finder = finder
        self.clock = clock
        self.interval_s = interval_s
        self.monotonic = monotonic
        self._next = 0.0
        self._running: dict[tuple[int, int], _Seen] = {}

    def poll(self) -> Poll:
        """``exit`` samples for rank processes that ended since the last look (at most every `interval_s`)."""
        now = self.monotonic()
        if now < self._next:
            return Poll()
        self._next = now + self.interval_s
        procs: list[TrainingProcess] = self.finder.find()
        current = {(p.pid, p.started): _Seen(p.rank, p.names, p.pod.split("/", 1)[0] if p.pod else None)
                   for p in procs if p.names}
        signals: list[Signal] = []
        ts = self.clock()
        for (pid, started), seen in self._running.items():
            if (pid, started) in current:
                continue
            for job in seen.names:
                signals.append(Signal(f"{self.node}/process/{pid}/{started}/exit/{job}", self.node, Source.PROGRESS,
                                      ts, ProgressSample(job, seen.rank, 0, event="exit",
                                                                     namespace=seen.namespace)))
        self._running = current
        return Poll(signals=signals)

    def close(self) -> None:
        """Nothing is held open between polls."""
        self._running.clear()
