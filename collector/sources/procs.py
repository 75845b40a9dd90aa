"""The start and end of training processes, seen in the host's ``/proc``: a job whose processes are gone has finished.

Each rank process of a known pod seen for the first time is told too (a ``start`` sample, under the job name its
pod's lines carry): a job that hangs before it prints its first progress line is known to the service only by these.

A container that exits leaves its log file as it was: the runtime writes no last line, and
the pod's log directory stays until the pod is deleted. Off the cluster's API, the one thing
the node agent still sees is the training processes themselves (it runs with host PID access):
each rank's process while it runs, and its absence once it has ended. For each rank process
of a known job that disappears (or whose PID now belongs to another program), this source
emits an ``exit`` progress sample; once every rank the service knows of has exited, the job's
silence is its end, not a hang. A process that is stopped (SIGSTOP) is still there: its job
is stuck, not finished.

An agent that starts after a job ended never sees its processes at all: it reads the pods' old
step lines, and nothing ever exits. A pod directory that was there when the agent started,
whose logs have not grown since (and were quiet for a look's interval before), and in which no
process on the node runs (matched over every process, not only ranks: by pod UID in its cgroup
or ``HOSTNAME``), has ended: this source emits an ``exit`` for each rank its step lines name, as
the log source reads them, right after that rank's steps (a backlog of many megabytes is read
over many polls, and the service keeps no exit of a rank it has not seen). A rank whose job a
process on the node still names (``KMEND_JOB``, torchrun's run id) is not told. It says nothing
unless its ``/proc`` is the host's (a container without host PID access sees only its own
processes: kernel threads are the tell) and every process there could be read.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from collector.processes import LogState, Occupancy, ProcessFinder, TrainingProcess, host_view, log_state
from collector.signal import LogLine, ProgressSample, Signal, Source
from collector.sources.base import Clock, Poll

log = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True)
class _Seen:
    rank: int
    names: tuple[str, ...]
    namespace: str | None = None


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
                 interval_s: float = 1.0, monotonic: Clock = time.monotonic, ranks: PodRanks | None = None) -> None:
        self.node = node
        self.finder = finder
        self.clock = clock
        self.interval_s = interval_s
        self.monotonic = monotonic
        self.ranks = ranks
        """The ranks the node's step lines named, by pod (given: pods that ended before the agent started are told)."""
        self._next = 0.0
        self._running: dict[tuple[int, int], _Seen] = {}
        self._watched: dict[str, LogState] | None = None
        """Pod directories there when the agent started, with their logs' sizes, until found ended or written to
        (None before the first look; empty when this ``/proc`` is not the host's)."""
        self._ended: dict[str, tuple[LogState, set[tuple[str, int, str | None]]]] = {}
        """Pod directories found ended: their logs as they were, and the ranks told of."""
        self._names: frozenset[str] = frozenset()
        """Job names in the environment of the node's processes, at the last look."""

    def poll(self) -> Poll:
        """``start`` samples for rank processes seen for the first time and ``exit`` samples for those that ended
        since the last look (at most every `interval_s`), and
        for ranks of ended pods as their step lines are read (every poll: each exit follows its rank's steps)."""
        now = self.monotonic()
        if now < self._next:
            return Poll(signals=self._tell_ended(self.clock()))
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
        for (pid, started), seen in current.items():
            if (pid, started) not in self._running and seen.namespace is not None:
                # Under the name its pod's lines carry (the first): the job exists before its first progress line.
                # A process in no known pod is not told: its names (torchrun's run id) may be no name its lines use.
                signals.append(Signal(f"{self.node}/process/{pid}/{started}/start/{seen.names[0]}", self.node,
                                      Source.PROGRESS, ts, ProgressSample(seen.names[0], seen.rank, 0, event="start",
                                                                          namespace=seen.namespace)))
        self._running = current
        signals += self._ended_pods(ts)
        return Poll(signals=signals)

    def _ended_pods(self, ts: float) -> list[Signal]:
        """Find pods that ended before the agent started (see the module's docstring); exits for their ranks."""
        root = self.finder.pods_root
        if self.ranks is None or root is None:
            return []
        present = _pod_dirs(root)
        names = [d.rsplit("_", 1)[0] for d in present]
        for key in [k for k in self.ranks.by_pod if f"{k[0]}_{k[1]}" not in names]:
            del self.ranks.by_pod[key]  # the pod was deleted
        for gone in [d for d in self._ended if d not in present]:
            del self._ended[gone]
        first = self._watched is None
        if self._watched is None:
            self._watched = ({d: st for d in present if (st := log_state(root / d))}
                             if host_view(self.finder.proc_root) else {})
        for d in [d for d in self._watched if d not in present or (not first and log_state(root / d)
                                                                     != self._watched[d])]:
            del self._watched[d]  # deleted (the log source tells its ranks), or written since the agent started
        # At the first look, only logs quiet for an interval before it; later, logs unchanged since the first.
        # A pod name reused (a new pod of that name beside the old one's directory): lines do not tell the two
        # apart, so no directory of that name tells its ranks.
        # Only pods with step lines read: the others have no rank to tell (and the look at every process is spared).
        quiet = (self.clock() - self.interval_s) * 1e9
        candidates = [d for d, st in self._watched.items() if names.count(d.rsplit("_", 1)[0]) == 1
                      and tuple(d.split("_", 2)[:2]) in self.ranks.by_pod
                      and (not first or max(f[3] for f in st) <= quiet)]
        if candidates:
            here = self.finder.occupancy()
            self._names = here.names
            for d in candidates:
                if here.complete and not _occupied(d, here):
                    self._ended[d] = (self._watched.pop(d), set())
                    log.info("pod %s ended before the agent started (no process on the node, its log unchanged): "
                             "its ranks are told exited", d)
        return self._tell_ended(ts)

    def _tell_ended(self, ts: float) -> list[Signal]:
        """Exits for the ranks of ended pods not told yet (a rank as soon as its step lines were read)."""
        if not self._ended or self.ranks is None or self.finder.pods_root is None:
            return []
        out: list[Signal] = []
        for d, (state, told) in list(self._ended.items()):
            ns, pod, _ = d.split("_", 2)
            new = self.ranks.by_pod.get((ns, pod), set()) - told
            if not new:
                continue
            if log_state(self.finder.pods_root / d) != state:
                del self._ended[d]  # written again (a container restarted in it): its processes are seen
                continue
            for job, rank, namespace in sorted(new, key=lambda r: (r[0], r[1], r[2] or "")):
                if job in self._names:
                    continue  # a process on the node names the job (KMEND_JOB, torchrun's run id): it runs
                told.add((job, rank, namespace))
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


def _occupied(pod_dir: str, here: Occupancy) -> bool:
    """Whether a process on the node runs in the pod: its UID in a cgroup, or its name as a HOSTNAME."""
    _, pod, uid = pod_dir.split("_", 2)
    return uid in here.pod_uids or pod in here.hostnames
