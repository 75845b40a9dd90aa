"""Stack surveys: where each training process spends its time, sampled now and then without pausing it.

In synchronous training every rank's step takes as long as the slowest rank's, and a
rank whose slowness lies before its gradient all-reduce (a slow forward pass, a data
loader, CPU contention, a sleep) logs each step at the same moment as its peers: the
step lines cannot tell it apart. Where the ranks' time goes can: the others wait for it
inside the collective while it works elsewhere. Every `every_s` the agent samples each
rank process on the node with ``py-spy record --nonblocking --idle`` (it reads the
process's memory and never stops it) for `seconds`, classifies each sample of the main
thread (``collector.frames.place``: in a collective, in a checkpoint, data loader,
evaluation or file I/O, or in its own code) and sends, per rank, the share of samples in
each place as one metric sample (``kmend_rank_stack_share``), with how many distinct main-thread stacks the samples
showed (``stacks``: a rank that runs shows many, one blocked in a collective one). With `proc_root`, the same sample
says how much of the window each rank's main thread could not run (``collector.sched``: stopped, or waiting for a
CPU), which the stacks cannot show; a rank stopped when the survey starts is watched that way only (py-spy cannot
attach to it).
The service compares the ranks of a job across nodes (``analyzer.detectors.survey``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from collector.frames import place
from collector.processes import ProcessFinder, TrainingProcess
from collector.sched import SchedShares, SchedWatch
from collector.signal import MetricSample, Signal, Source
from collector.sources.base import Clock, Poll

log = logging.getLogger(__name__)

METRIC = "kmend_rank_stack_share"
"""Share of a rank's sampled main-thread time in collectives; the other places' shares are labels."""
PLACES = ("collective", "code", "data loader", "checkpoint", "evaluation", "file I/O")
"""Where a sample can be (``collector.frames.place``)."""


class Profiler(Protocol):
    """Samples one process's Python stacks for a while.

    Guarantees: returns the samples as py-spy's raw format (``thread (tid): name;frame;...;frame count`` per
    line, outermost frame first), or raises ``RuntimeError`` with why it could not.
    """

    def profile(self, pid: int, seconds: int, rate: int) -> str:
        """Samples of `pid` taken `rate` times a second for `seconds`."""
        ...


class PySpyProfiler:
    """``py-spy record --nonblocking --idle`` into a temporary file (the process is never paused)."""

    def __init__(self, binary: str = "py-spy", *, tmp_dir: str | None = None) -> None:
        self.binary = binary
        self.tmp_dir = tmp_dir
        """Where py-spy writes each survey's samples (removed after reading); None: the system's temporary directory."""

    def profile(self, pid: int, seconds: int, rate: int) -> str:
        """Samples of `pid` in py-spy's raw format."""
        fd, path = tempfile.mkstemp(prefix="kmend-survey-", suffix=".txt", dir=self.tmp_dir)
        os.close(fd)
        argv = [self.binary, "record", "--pid", str(pid), "--duration", str(seconds), "--rate", str(rate),
                "--format", "raw", "--idle", "--nonblocking", "--threads", "-o", path]
        try:
            done = subprocess.run(argv, capture_output=True, timeout=seconds + 20, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"py-spy record failed on pid {pid}: {done.stderr.decode(errors='replace')[:300]}")
            with open(path, encoding="utf-8", errors="replace") as fh:
                return fh.read()
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"py-spy record failed on pid {pid}: {exc}") from exc
        finally:
            os.unlink(path)


def main_thread_places(raw: str, pid: int | None = None) -> Counter[str]:
    """Samples of the main thread (thread id `pid`, else the one named ``MainThread``, else the thread with the most
    samples) by place. A sample line is ``thread (tid)[: name];frame;...;frame count``, outermost frame first."""
    return main_thread_survey(raw, pid)[0]


def main_thread_survey(raw: str, pid: int | None = None) -> tuple[Counter[str], int]:
    """The main thread's samples by place (`main_thread_places`) and how many distinct stacks they show: a rank that
    runs passes through many (its modules, autograd, the collective and out again), one blocked or spinning in one
    place shows one or two."""
    by_thread: dict[str, tuple[Counter[str], set[str]]] = {}
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        head, *frames = stack.split(";")
        if not head.startswith("thread (") or not count.isdigit():
            continue
        places, stacks = by_thread.setdefault(head, (Counter(), set()))
        places[place(frames[::-1])] += int(count)
        stacks.add(stack)
    main = next((v for h, v in by_thread.items() if pid is not None and h.startswith(f"thread ({pid})")), None)
    main = main or next((v for h, v in by_thread.items() if h.endswith(": MainThread")), None)
    main = main or max(by_thread.values(), key=lambda v: sum(v[0].values()), default=(Counter(), set()))
    return main[0], len(main[1])


class StackSurvey:
    """Samples the node's rank processes every `every_s` on a thread of its own; ``poll`` ships the shares."""

    name = "stack-survey"

    def __init__(self, *, node: str, finder: ProcessFinder, profiler: Profiler, every_s: float = 10.0,
                 seconds: int = 2, rate: int = 100, clock: Clock = time.time, monotonic: Clock = time.monotonic,
                 start: Callable[[Callable[[], None]], object] | None = None,
                 proc_root: Path | None = None) -> None:
        self.node = node
        self.proc_root = proc_root
        """The host's ``/proc``, where each rank's time stopped or waiting for a CPU is read (None: not read)."""
        self.finder = finder
        self.profiler = profiler
        self.every_s = every_s
        self.seconds = seconds
        self.rate = rate
        self.clock = clock
        self.monotonic = monotonic
        self._start = start or _thread
        self._next = 0.0
        self._busy = False
        self._lock = threading.Lock()
        self._ready: list[Signal] = []
        self.surveys = 0
        """Surveys taken since start."""

    def poll(self) -> Poll:
        """The shares of the last survey (once), and a new survey started when one is due."""
        now = self.monotonic()
        with self._lock:
            out, self._ready = self._ready, []
            due = not self._busy and now >= self._next
            if due:
                self._busy, self._next = True, now + self.every_s
        if due:
            procs = [p for p in self.finder.find() if p.job is not None
                     and (self.proc_root is not None or not p.stopped)]
            if procs:
                self._start(lambda: self._survey(procs))
            else:
                with self._lock:
                    self._busy = False
        return Poll(signals=out)

    def _survey(self, procs: list[TrainingProcess]) -> None:
        """Sample every rank process at once (each on its own py-spy), then queue one sample per rank."""
        results: dict[int, tuple[Counter[str], int]] = {}
        # py-spy cannot attach to a stopped process; the scheduler's view covers it.
        threads = [threading.Thread(target=self._one, args=(p, results), daemon=True) for p in procs if not p.stopped]
        watch = SchedWatch([p.pid for p in procs], proc_root=self.proc_root) if self.proc_root is not None else None
        sched: dict[int, SchedShares] = {}
        try:
            for t in threads:
                t.start()
            if watch is not None and not threads:
                time.sleep(self.seconds)  # every rank stopped: watched for a survey's length all the same
            for t in threads:
                t.join()
            if watch is not None:
                sched = watch.stop()
            ts = self.clock()
            signals = []
            for p in procs:
                got, distinct = results.get(p.pid) or (Counter(), 0)
                total = sum(got.values())
                ran = sched.get(p.pid)
                if not total and ran is None:
                    continue
                labels = {"job": str(p.job), "rank": str(p.rank), "samples": str(total)}
                if total:
                    labels["stacks"] = str(distinct)
                if p.pod:
                    labels["namespace"] = p.pod.split("/", 1)[0]
                labels.update({f"share_{k.replace(' ', '_').replace('/', '')}": f"{got[k] / total:.3f}"
                               for k in PLACES if got[k]})
                if ran is not None:
                    labels.update({"cpu_wait": f"{ran.cpu_wait:.3f}", "stopped": f"{ran.stopped:.3f}"})
                signals.append(Signal(f"{self.node}/survey/{p.pid}/{p.started}/{ts:.3f}", self.node, Source.PROGRESS,
                                      ts, MetricSample(METRIC, got["collective"] / total if total else 0.0, labels)))
            self.surveys += 1
            with self._lock:
                self._ready.extend(signals)
        finally:
            with self._lock:
                self._busy = False

    def _one(self, proc: TrainingProcess, results: dict[int, tuple[Counter[str], int]]) -> None:
        try:
            results[proc.pid] = main_thread_survey(self.profiler.profile(proc.pid, self.seconds, self.rate), proc.pid)
        except RuntimeError as exc:
            log.debug("survey of rank %s (pid %s) failed: %s", proc.rank, proc.pid, exc)

    def close(self) -> None:
        """Nothing is held open between surveys."""


def _thread(fn: Callable[[], None]) -> object:
    t = threading.Thread(target=fn, name="stack-survey", daemon=True)
    t.start()
    return t
