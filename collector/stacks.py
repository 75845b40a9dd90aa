"""Evidence from a stuck job's processes: Python stacks (``py-spy dump``) and a Flight Recorder dump on demand.

When the service suspects a hang it opens a ``stack_dump`` request for each node of
the job (``GET /v1/nodes/{node}/requests``). The agent answers while the job is
still stuck, before any plan restarts it:

- it finds the job's training processes on the node: processes whose environment
  has ``RANK`` (torchrun, DeepSpeed and Lightning launchers set it) and whose job
  is the requested one (``collector.processes``: its pod, ``KMEND_JOB``, torchrun's
  run id). A DataLoader worker inherits its parent's ``RANK``; only the topmost
  process of a rank is dumped;
- it runs ``py-spy dump --pid`` on each (the agent needs host PID namespace and
  ``SYS_PTRACE``) and posts the text to ``POST /v1/stacks`` with the process's
  state: a stopped process (``T`` in ``/proc/<pid>/stat``) cannot be paused by
  py-spy, so it is read without pausing (``--nonblocking``: it runs no code, so
  its memory holds still), and being stopped is itself the strongest evidence;
- with each stack it sends the process's CPU time (``utime + stime`` of ``/proc/<pid>/stat``, read just
  before the dump): two looks whose stacks are the same tell a rank blocked for good (a lock, a queue, a socket:
  no CPU used in between) from one busy in a single long call (CPU used);
- where the process set ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE`` (with
  ``TORCH_NCCL_TRACE_BUFFER_SIZE`` > 0), ProcessGroupNCCL reads the FIFO
  ``<value><rank>.pipe``; writing to it makes the rank write its Flight Recorder
  dump to ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>``, which the Flight Recorder
  source uploads. The FIFO is reached through ``/proc/<pid>/root``.

Then it answers the request ``done`` (or ``failed``, with why).
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import httpx

from collector.node_requests import Answer, NodeRequest
from collector.processes import ProcessFinder, TrainingProcess, read_stat
from collector.sources.base import Clock, Poll

log = logging.getLogger(__name__)

KIND = "stack_dump"
"""Request kind the service opens on a suspected hang."""
MAX_STACK_BYTES = 256 * 1024
"""Larger dumps are cut before upload (the service caps them too)."""
MAX_PARALLEL_DUMPS = 8
"""py-spy runs at most this many at once (a node's ranks: one per GPU)."""
__all__ = ["KIND", "ProcessFinder", "PySpyDumper", "StackDumper", "StackRequestResponder", "TrainingProcess",
           "cpu_seconds", "poke_flight_recorder"]


def is_of_job(proc: TrainingProcess, job: str) -> bool:
    """Whether `proc` is a rank of `job`: a bare name, or ``namespace/job`` matched against the process's pod."""
    if job in proc.names or proc.job == job:
        return True
    ns, sep, name = job.partition("/")
    # A process whose pod is not known here (off-cluster, no pod directory) is matched by the job's name.
    return bool(sep) and name in proc.names and (proc.pod is None or proc.pod.split("/", 1)[0] == ns)


def cpu_seconds(proc_root: Path, pid: int) -> float | None:
    """CPU time a process has used, user and system (``utime + stime`` of ``/proc/<pid>/stat``), in seconds; None
    when it is gone or unreadable."""
    stat = read_stat(proc_root / str(pid))
    return None if stat is None else stat.cpu_s


class StackDumper(Protocol):
    """Captures one process's Python stack.

    Guarantees: returns the dump's text, or raises ``RuntimeError`` with why it could not.
    """

    def dump(self, pid: int, *, stopped: bool = False) -> str:
        """The stack of every thread of `pid`, as text (`stopped`: the process is stopped, not running)."""
        ...


class PySpyDumper:
    """``py-spy dump --pid`` (the process is paused for the few milliseconds it takes).

    py-spy pauses a process through ptrace and fails on one that a signal already stopped;
    a stopped process is read as it is (``--nonblocking``). A process can be traced by one tracer at
    a time: a second py-spy on it fails (``EPERM``), so dumps of one process (a first and a second
    look at a hang, each answered on its own thread) are taken one after the other.
    """

    def __init__(self, binary: str = "py-spy", *, timeout_s: float = 20.0) -> None:
        self.binary = binary
        self.timeout_s = timeout_s
        self._mutex = threading.Lock()
        self._busy: dict[int, tuple[threading.Lock, int]] = {}
        """pid -> (its lock, callers holding or waiting for it); dropped when the last one is done."""

    def dump(self, pid: int, *, stopped: bool = False) -> str:
        """The stack of every thread of `pid`, as text."""
        with self._mutex:
            one, users = self._busy.get(pid) or (threading.Lock(), 0)
            self._busy[pid] = (one, users + 1)
        try:
            with one:
                return self._dump(pid, stopped)
        finally:
            with self._mutex:
                _, users = self._busy[pid]
                if users == 1:
                    del self._busy[pid]
                else:
                    self._busy[pid] = (one, users - 1)

    def _dump(self, pid: int, stopped: bool) -> str:
        argv = [self.binary, "dump", "--pid", str(pid)] + (["--nonblocking"] if stopped else [])
        try:
            done = subprocess.run(argv, capture_output=True,
                                  timeout=self.timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"py-spy failed on pid {pid}: {exc}") from exc
        if done.returncode != 0:
            raise RuntimeError(f"py-spy failed on pid {pid}: {done.stderr.decode(errors='replace')[:300]}")
        return done.stdout.decode(errors="replace")


def poke_flight_recorder(proc_root: Path, pid: int, pipe: str) -> bool:
    """Ask a rank for its Flight Recorder dump through its FIFO; False when nobody reads it."""
    path = proc_root / str(pid) / "root" / pipe.lstrip("/")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno not in (errno.ENXIO, errno.ENOENT):
            log.warning("cannot open Flight Recorder pipe %s: %s", path, exc)
        return False
    try:
        os.write(fd, b"1\n")
    finally:
        os.close(fd)
    return True


class StackRequestResponder:
    """Polls the node's requests like a source and answers ``stack_dump`` ones (returns no signals)."""

    name = "stacks"

    def __init__(self, *, url: str, node: str, finder: ProcessFinder, dumper: StackDumper,
                 token: str | None = None, client: httpx.Client | None = None, interval_s: float = 1.0,
                 clock: Clock) -> None:
        self.base = url.rstrip("/")
        self.node = node
        self.finder = finder
        self.dumper = dumper
        self.interval_s = interval_s
        self.clock = clock
        self._client = client or httpx.Client(timeout=10.0)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._next = 0.0
        self._looking = threading.Lock()
        self.captured = 0
        """Stacks uploaded since start."""

    def poll(self) -> Poll:
        """Answer pending stack requests (at most every `interval_s`)."""
        now = self.clock()
        if now < self._next:
            return Poll(signals=[], cursors={})
        self._next = now + self.interval_s
        try:
            resp = self._client.get(f"{self.base}/v1/nodes/{self.node}/requests", headers=self._headers)
            resp.raise_for_status()
            requests = [r for r in resp.json().get("requests", []) if r.get("kind") == KIND]
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("node requests unavailable: %s", exc)
            return Poll(signals=[], cursors={})
        errors = 0
        for req in requests:
            state, message = self.answer(str(req.get("params", {}).get("job", "")))
            errors += state == "failed"
            try:
                self._client.post(f"{self.base}/v1/nodes/{self.node}/requests/{req['id']}",
                                  json={"state": state, "message": message[:2000]}, headers=self._headers)
            except httpx.HTTPError:
                log.debug("could not answer request %s; it is asked again", req.get("id"))
        return Poll(signals=[], cursors={}, errors=errors)

    def answer(self, job: str) -> tuple[str, str]:
        """Capture and upload the stacks of `job`'s processes here; (state, message) for the request.

        One look at a time: py-spy pauses a process through ptrace, which shows as the tracing stop (``t``) in its
        state, so a look that read the states while another look's dumps ran would take the ranks it paused for
        stopped ones."""
        with self._looking:
            return self._answer(job)

    def _answer(self, job: str) -> tuple[str, str]:
        procs = [p for p in self.finder.find() if is_of_job(p, job)]
        if not procs:
            return "failed", f"no process of job {job!r} on {self.node} (RANK in its environment, job by its pod, " \
                             f"KMEND_JOB or TORCHELASTIC_RUN_ID)"
        poked = sum(1 for p in procs if p.pipe and poke_flight_recorder(self.finder.proc_root, p.pid, p.pipe))
        # Every rank is looked at at once and the stacks are sent only when all are in: the service judges a
        # job's stacks once they stop arriving, and one slow dump (a stopped process, a loaded node) between two
        # uploads would have it judge the job from part of its ranks.
        cpu = {p.pid: cpu_seconds(self.finder.proc_root, p.pid) for p in procs}
        with ThreadPoolExecutor(max_workers=min(len(procs), MAX_PARALLEL_DUMPS)) as pool:
            looks = list(pool.map(self._look, procs))
        problems = [why for _, _, why in looks if why]
        sent = 0
        for p, text, _ in looks:
            if text is None:
                continue
            params: dict[str, str | int | float] = {"job": job, "rank": p.rank, "node": self.node, "pid": p.pid}
            if p.state:
                params["state"] = p.state
            if (used := cpu[p.pid]) is not None:
                params["cpu_s"] = used
            try:
                resp = self._client.post(f"{self.base}/v1/stacks", headers=self._headers, params=params,
                                         content=text.encode()[:MAX_STACK_BYTES])
                resp.raise_for_status()
                sent += 1
            except httpx.HTTPError as exc:
                problems.append(f"upload of rank {p.rank} failed: {exc}")
        self.captured += sent
        msg = f"{sent} stack(s) of {len(procs)} process(es); {poked} Flight Recorder dump(s) requested"
        if problems:
            msg += "; " + "; ".join(problems[:3])
        return ("done" if sent else "failed"), msg

    def _look(self, p: TrainingProcess) -> tuple[TrainingProcess, str | None, str]:
        """(the process, its stack text or None, why it could not be read or "")."""
        try:
            return p, self.dumper.dump(p.pid, stopped=p.stopped), ""
        except RuntimeError as exc:
            if not p.stopped:
                return p, None, str(exc)
            # Where it stopped is unknown, but that it stopped is the evidence that matters.
            return p, f"Process {p.pid}: stopped; no stack ({str(exc)[:200]})\n", str(exc)

    # As a handler of the node-request runner (``collector.node_requests``): one request, its own thread.
    kind = KIND

    def run(self, request: NodeRequest, stop: threading.Event) -> Answer:
        """Capture and upload the stacks of the request's job."""
        state, message = self.answer(str(request.params.get("job", "")))
        return Answer(state, message)

    def resume(self, request: NodeRequest) -> Answer:
        # Stacks are read, never changed: taking them again after a restart is harmless, and current.
        return self.run(request, threading.Event())

    def close(self) -> None:
        """Close the HTTP client."""
        self._client.close()
