"""The end of training processes, seen in the host's ``/proc``: a job whose processes are gone has finished.

A container that exits leaves its log file as it was: the runtime writes no last line, and
the pod's log directory stays until the pod is deleted. Off the cluster's API, the one thing
the node agent still sees is the training processes themselves (it runs with host PID access):
each rank's process while it runs, and its absence once it has ended. For each rank process
of a known job that disappears (or whose PID now belongs to another program), this source
emits an ``exit`` progress sample; once every rank the service knows of has exited, the job's
silence is its end, not a hang. A process that is stopped (SIGSTOP) is still there: its job
is stuck, not finished.

An agent that starts after a job ended never sees its processes at all: it reads the pods' old
step lines, and nothing ever exits. For each pod directory that was there when the agent
started, whose logs have not grown since and have been read to their end, in which no process
on the node runs (matched over every process, by pod UID, ``HOSTNAME``, ``KMEND_JOB`` and
torchrun's run id, as ranks are matched to jobs), this source emits an ``exit`` for each rank
the pod's step lines named. It says nothing unless its ``/proc`` is the host's (a container
without host PID access sees only its own processes) and every process there could be read.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Protocol

from collector.processes import Occupancy, ProcessFinder, TrainingProcess, host_view
from collector.signal import LogLine, ProgressSample, Signal, Source
from collector.sources.base import Clock, Poll

_LogState = tuple[tuple[str, str, int, int], ...]
"""(container, file, size, mtime) of each file of a pod's log directory."""


@dataclass(frozen=True, slots=True)
class _Seen:
    rank: int
    names: tuple[str, ...]
    namespace: str | None = None


class PodLogs(Protocol):
    """The node's container log reader.

    Guarantees: ``caught_up`` is True only once every log of the pod directory was read to its end and the
    lines handed on (polled before this source, so its lines leave before the exits).
    """

    def caught_up(self, pod_dir: str) -> bool:
        """Whether the pod directory's logs have been read to their end."""
        ...


class PodRanks:
    """The ranks each pod's step lines named, by ``(namespace, pod)``: what an ended pod's exits are about."""

    def __init__(self) -> None:
        self.by_pod: dict[tuple[str, str], set[tuple[str, int, str | None]]] = {}

    def note(self, line: LogLine, step: ProgressSample) -> None:
        """A step line of `line`'s pod, read as `step` (its job, rank and namespace)."""
        if line.pod:
            self.by_pod.setdefault((line.namespace or "", line.pod), set()).add(
                (step.job, step.rank, step.namespace))


class ProcessExitSource:
    """Watches the training processes on this node and reports each one's end (and ended pods' ranks)."""

    name = "processes"

    def __init__(self, *, node: str, finder: ProcessFinder, clock: Clock = time.time,
                 interval_s: float = 1.0, monotonic: Clock = time.monotonic, logs: PodLogs | None = None,
                 ranks: PodRanks | None = None) -> None:
        self.node = node
        self.finder = finder
        self.clock = clock
        self.interval_s = interval_s
        self.monotonic = monotonic
        self.logs = logs
        """The log reader (with `ranks`: pods that ended before the agent started are told too)."""
        self.ranks = ranks
        self._next = 0.0
        self._running: dict[tuple[int, int], _Seen] = {}
        self._at_start: dict[str, _LogState] | None = None
        """Pod directories when the agent started, with their logs' sizes, until told of (None before the first
        look; empty when this ``/proc`` is not the host's)."""

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
        signals += self._ended_pods(ts)
        return Poll(signals=signals)

    def _ended_pods(self, ts: float) -> list[Signal]:
        """Exits for the ranks of pods that ended before the agent started (see the module's docstring)."""
        root = self.finder.pods_root
        if self.logs is None or self.ranks is None or root is None:
            return []
        if self._at_start is None:
            host = host_view(self.finder.proc_root)
            self._at_start = {d: _log_state(root / d) for d in _pod_dirs(root)} if host else {}
        present = _pod_dirs(root) if self._at_start or self.ranks.by_pod else set()
        names = [d.rsplit("_", 1)[0] for d in present]
        for key in [k for k in self.ranks.by_pod if f"{k[0]}_{k[1]}" not in names]:
            del self.ranks.by_pod[key]  # the pod was deleted
        if not self._at_start:
            return []
        for gone in [d for d in self._at_start if d not in present]:
            del self._at_start[gone]  # deleted: the log source tells its ranks' exits
        ready: dict[str, set[tuple[str, int, str | None]]] = {}
        for d in list(self._at_start):
            if not self.logs.caught_up(d):
                continue
            if _log_state(root / d) != self._at_start[d]:
                del self._at_start[d]  # written since the agent started: its processes are the ones seen
                continue
            ns, pod, _ = d.split("_", 2)
            if not self.ranks.by_pod.get((ns, pod)):
                del self._at_start[d]  # read to its end without a step line: no rank to tell of
                continue
            ready[d] = self.ranks.by_pod[(ns, pod)]
        # A pod name reused (a new pod of that name beside the old one's directory): lines do not tell the two
        # apart, so no directory of that name tells its ranks.
        ready = {d: r for d, r in ready.items() if names.count(d.rsplit("_", 1)[0]) == 1}
        if not ready:
            return []
        here = self.finder.occupancy()
        out: list[Signal] = []
        for d, ranks in ready.items():
            if not here.complete or _occupied(d, here) or any(job in here.names for job, _, _ in ranks):
                continue
            del self._at_start[d]
            for job, rank, namespace in sorted(ranks, key=lambda r: (r[0], r[1], r[2] or "")):
                out.append(Signal(f"{self.node}/process/pod/{d}/exit/{job}/{rank}", self.node, Source.PROGRESS, ts,
                                  ProgressSample(job, rank, 0, event="exit", namespace=namespace)))
        return out

    def close(self) -> None:
        """Nothing is held open between polls."""
        self._running.clear()


def _pod_dirs(root: os.PathLike[str]) -> set[str]:
    try:
        return {d for d in os.listdir(root) if d.count("_") == 2}
    except OSError:
        return set()


def _log_state(pod_dir: os.PathLike[str]) -> _LogState:
    out = []
    try:
        containers = sorted(os.listdir(pod_dir))
    except OSError:
        return ()
    for c in containers:
        try:
            with os.scandir(os.path.join(pod_dir, c)) as files:
                for f in files:
                    st = f.stat()
                    out.append((c, f.name, st.st_size, st.st_mtime_ns))
        except OSError:
            continue
    return tuple(sorted(out))


def _occupied(pod_dir: str, here: Occupancy) -> bool:
    """Whether a process on the node runs in the pod: its UID in a cgroup, or its name as a HOSTNAME."""
    _, pod, uid = pod_dir.split("_", 2)
    return uid in here.pod_uids or pod in here.hostnames
