"""Python stack dumps of a stalled job's ranks (``py-spy dump``): which rank is not where the others wait.

In a synchronous job that stopped, every healthy rank sits in a collective (an
all-reduce in ``torch.distributed``, or DDP's gradient sync inside ``backward``)
waiting for the one that never arrived; that one is somewhere else: a data
loader, a deadlocked lock, a sleep, its own code. The node agent captures the
stacks when the service suspects a hang; they arrive here as text, are kept as
evidence (the operator sees where each rank is stuck) and, once they settle,
name the ranks outside the collective. A rank whose process is stopped (state
``T`` in ``/proc/<pid>/stat``: SIGSTOP, a job-control stop, a tracer) runs no
code at all; when some ranks are stopped and the others are not, the stopped
ones are what the others wait for, wherever their stacks say they are.

A rank blocked for good without being stopped (a lock another of its threads holds, a ``queue.get``, a socket
read, a sleep loop waiting for something that never comes) is told from a rank busy in a long call by two looks
some seconds apart: its stack did not move and its process used (almost) no CPU in between (the agent sends the
CPU time with each stack). Such a rank, outside any collective in its own code while every other rank waits in
one at both looks, is ``idle``: what the others wait for, even before the job's first step. A rank outside the
collectives whose CPU time advanced is busy, slow rather than stuck, even when its stack reads the same.

Unless it spins: a rank deadlocked in a busy-wait (``while not flag: pass``) uses a whole CPU and never moves. A
rank busy in a long legitimate computation (decoding data, compiling) passes through many stacks over minutes; a
spin loop shows the same one at every look. A rank whose main thread showed one stack (`SPIN_STACKS`), in its own
code (not delegated), at `spin_looks` looks or more spanning `spin_s` or more (300 s: one long native call, such as a
tokenizer run over a whole dataset on rank 0 while the others wait at a barrier, looks the same for a while), while
every other rank waited in a collective at every look over that span, is ``spinning`` (``StackDetector.spinning``):
what the others wait for.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from analyzer.detectors import HANG_CAUSES
from analyzer.records import Action, FaultClass, Finding, Severity, job_location
from collector.frames import FRAME, in_collective, place

__all__ = ["DETECTOR_ID", "MAX_STACK_CHARS", "StackDetector", "StackSample", "exoneration", "idle_ranks",
           "in_collective", "main_frames", "place"]

DETECTOR_ID = "stack-dump"
MAX_STACK_CHARS = 16384
"""Longer dumps are cut (a process with hundreds of threads); the main thread comes first."""

LOOP_CALLS = 3
"""Frames a wait or poll loop's body may call below the loop's own function (``work.is_completed()``, a store's
key check, a sleep helper) and still be that loop: a training step's frames run far deeper (modules, autograd)."""

IDLE_CPU_FRACTION = 0.01
"""A rank that used less than this share of one CPU between two looks ran no code in between (a blocked process's
helper threads wake now and then); one that used more is busy."""
MIN_APART_S = 2.0
"""Two looks closer than this say nothing about whether a rank runs (a process's CPU time counts in ticks)."""

DELEGATED_FILES = ("torch/_inductor/", "torch/_dynamo/", "triton/", "concurrent/futures/", "multiprocessing/",
                   "subprocess.py")
"""A rank waiting in these waits for work it handed to other processes (a compile's worker pool, a process pool,
a child command): their CPU time is not its own, so its own standing still says nothing."""

MAX_WAIT_S = 3600.0
"""Stacks of a job that is neither called hung nor progressing this long after are dropped."""

SPIN_STACKS = 1
"""Distinct stacks a spinning rank may show over its looks: one, the same frames at the same lines every time (a
loader dominated by one or two long C calls shows the same two stacks at a few looks in a row often enough)."""

_THREAD = re.compile(r'^Thread (?P<id>\S+) \((?P<state>[^)]*)\): "(?P<name>[^"]*)"')


@dataclass(frozen=True, slots=True)
class StackSample:
    """One rank's Python stack, as ``py-spy dump`` printed it."""

    rank: int
    """Global rank of the process."""
    node: str
    """Node it runs on."""
    pid: int
    """Process id on that node."""
    text: str
    """The dump (py-spy's text output)."""
    source: str = ""
    """Evidence id."""
    state: str = ""
    """The process's state letter from ``/proc/<pid>/stat`` when the agent sent it (``T``: stopped)."""
    cpu_s: float | None = None
    """CPU time (user + system seconds) the process had used when its stack was taken; None from an agent that
    does not send it."""

    @property
    def stopped(self) -> bool:
        """The process was stopped (not running, not waiting) when its stack was taken."""
        return self.state in ("T", "t")


def main_frames(text: str) -> list[str]:
    """The frames (innermost first) of the main thread, else of the first thread, as ``func (file:line)``."""
    threads: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        t = _THREAD.match(line)
        if t:
            threads.append((t.group("name"), []))
            continue
        f = FRAME.match(line)
        if f and threads:
            threads[-1][1].append(line.strip())
    if not threads:
        return []
    main = [fr for name, fr in threads if name == "MainThread"]
    return main[0] if main else threads[0][1]


def _frame_key(frame: str) -> tuple[str, str, str]:
    m = FRAME.match("    " + frame)
    return (m.group("func"), m.group("file"), m.group("line") or "") if m else (frame, "", "")


def moved(before: list[str], after: list[str]) -> bool:
    """Whether a main thread ran on between two looks (frames innermost first, as `main_frames` gives them).

    A thread spinning in a wait or poll loop (``while not work.is_completed(): time.sleep(...)``, a busy check of
    a store key) is caught at other lines of the loop's function, or inside a shallow call of its body, at each
    look: that is no progress. It moved when a frame outside that loop's function changed (its caller's call
    site, the loop left), when the frames below that function differ deeply (a training step's modules and
    autograd), or when it is in another `place` (from its data loader into its own code)."""
    if before == after:
        return False
    if place(before) != place(after):
        return True
    a = [_frame_key(f) for f in reversed(before)]  # outermost first
    b = [_frame_key(f) for f in reversed(after)]
    same = 0
    while same < min(len(a), len(b)) and a[same][:2] == b[same][:2]:
        same += 1
    if same == 0 or a[:same - 1] != b[:same - 1]:
        return True  # another function at the bottom, or a caller at another call site: the loop was left
    return max(len(a), len(b)) - same > LOOP_CALLS


def cpu_used(before: StackSample, after: StackSample, apart_s: float | None) -> float | None:
    """Share of one CPU the rank's process used between two looks `apart_s` seconds apart (None: unknown, the
    agent sent no CPU time, the looks too close, or another process under the same rank)."""
    if (before.cpu_s is None or after.cpu_s is None or apart_s is None or apart_s < MIN_APART_S
            or before.pid != after.pid or before.node != after.node):
        return None
    return max(after.cpu_s - before.cpu_s, 0.0) / apart_s


def collective_frame(frames: list[str]) -> str | None:
    """The innermost frame of a thread waiting on its peers that is in a collective (for the operator)."""
    for fr in frames:
        if in_collective([fr]):
            return fr
    return None


def idle_ranks(stacks: Mapping[int, StackSample], ranks: int, previous: Mapping[int, StackSample],
               apart: Mapping[int, float]) -> list[int]:
    """Ranks blocked for good while their peers wait for them: at two looks (`previous`, then `stacks`, `apart`
    seconds apart per rank) in their own code (``code``, no collective and no `BUSY_PLACES` place, not waiting on
    other processes: `DELEGATED_FILES`) with a stack that did not move and CPU time that did not advance, while
    every other rank waits in a collective at both.
    Empty unless every one of the `ranks` answered both looks and at least one rank waits."""
    if ranks <= 0 or len(stacks) < ranks or any(r not in previous for r in stacks):
        return []
    if any(s.stopped for s in stacks.values()):
        return []
    now = {r: main_frames(s.text) for r, s in stacks.items()}
    then = {r: main_frames(s.text) for r, s in previous.items()}
    waiting = [r for r in now if place(now[r]) == "collective" and place(then[r]) == "collective"]
    idle = [r for r in now if r not in waiting]
    if not waiting or not idle:
        return []
    for r in idle:
        used = cpu_used(previous[r], stacks[r], apart.get(r))
        if (place(now[r]) != "code" or place(then[r]) != "code" or moved(then[r], now[r]) or used is None
                or used >= IDLE_CPU_FRACTION or _delegated(now[r])):
            return []
    return sorted(idle)


def _delegated(frames: list[str]) -> bool:
    return any(part in fr for fr in frames for part in DELEGATED_FILES)


def idle_message(stacks: Mapping[int, StackSample], idle: list[int]) -> str:
    """``rank N idle in <frame> while its peers wait in <collective>``, for the first of the `idle` ranks."""
    s = stacks[idle[0]]
    frames = main_frames(s.text)
    peers = sorted(r for r in stacks if r not in idle)
    waits = next((f for r in peers if (f := collective_frame(main_frames(stacks[r].text)))), "a collective")
    return (f"rank {s.rank} on {s.node} idle in {frames[0] if frames else 'no Python frame'} while its peers "
            f"({','.join(map(str, peers[:8]))}) wait in {waits}")


def exoneration(stacks: Mapping[int, StackSample], ranks: int,
                previous: Mapping[int, StackSample] | None = None,
                apart: Mapping[int, float] | None = None) -> str | None:
    """Why stacks taken in a silence show a slow job rather than a hung one, or None (they confirm a hang).

    Confirms: a stack missing for one of the `ranks`, a stopped process, every rank waiting in a collective
    (no one left to finish it), or a rank outside the collectives in code of no `BUSY_PLACES` place while others
    wait for it (stuck in a sleep, a lock, a loop: the culprit as the stack-dump finding names it). Exonerates:
    no rank waits on a peer (each runs its own code), or the ranks the others wait for are all busy in a
    `BUSY_PLACES` place (in synchronous training the peers of a rank whose data loader is slow wait in the
    next all-reduce within one step: that is what a slow step looks like, too). Stacks that would confirm
    exonerate all the same when an earlier look in the same silence (`previous`, `apart` seconds before) saw a
    rank elsewhere: a hung job's stacks stay as they are, a running one's move (a rank spinning in a wait loop has
    not moved: `moved`); or when a rank outside the collectives used CPU in between (`IDLE_CPU_FRACTION` of one):
    busy in one long call, the same stack at both looks.
    """
    if ranks <= 0 or len(stacks) < ranks or any(s.stopped for s in stacks.values()):
        return None
    if previous and len(previous) >= ranks:
        ran = sorted(r for r, s in stacks.items()
                     if r in previous and moved(main_frames(previous[r].text), main_frames(s.text)))
        if ran:
            return f"rank(s) {','.join(map(str, ran[:8]))} moved between two looks"
        busy = sorted(r for r, s in stacks.items()
                      if r in previous and place(main_frames(s.text)) != "collective"
                      and (used := cpu_used(previous[r], s, (apart or {}).get(r))) is not None
                      and used >= IDLE_CPU_FRACTION)
        if busy:
            return f"rank(s) {','.join(map(str, busy[:8]))} outside the collectives used CPU between two looks"
    where = {r: place(main_frames(s.text)) for r, s in stacks.items()}
    outside = {r: p for r, p in where.items() if p != "collective"}
    if not outside:
        return None
    if len(outside) == len(where):
        return "no rank waits in a collective: " + _places(outside)
    if all(p != "code" for p in outside.values()):
        return _places(outside) + "; the others wait for them in a collective"
    return None


def _places(where: Mapping[int, str]) -> str:
    by: dict[str, list[int]] = {}
    for r, p in sorted(where.items()):
        by.setdefault(p, []).append(r)
    return ", ".join(f"rank(s) {','.join(map(str, rs[:8]))} in {p}" for p, rs in by.items())


@dataclass(slots=True)
class _Run:
    """Looks in a row that found one rank's main thread in the same few stacks."""

    pid: int
    """The process looked at."""
    first: float
    """When the first of them arrived."""
    last: float
    """When the latest arrived."""
    looks: int
    """How many there were."""
    stacks: set[tuple[str, ...]]
    """The distinct main-thread stacks they showed (at most `SPIN_STACKS`)."""
    cpu_s: float | None
    """The process's CPU time at the first of them (None: not sent)."""


class StackDetector:
    """Keeps a job's stack dumps as they arrive and judges them once they settle."""

    id = DETECTOR_ID

    def __init__(self, *, settle_s: float = 3.0, spin_s: float = 300.0, spin_looks: int = 6) -> None:
        self.settle_s = settle_s
        self.spin_s = spin_s
        """A rank whose stack stays this long (and `spin_looks` looks) where it is while its peers wait spins."""
        self.spin_looks = spin_looks
        self._runs: dict[str, dict[int, _Run]] = {}
        """Per job and rank, the looks in a row that found its main thread in the same few stacks."""
        self._waiting: dict[str, dict[int, float]] = {}
        """Per job and rank, when the looks in a row that found it waiting in a collective began."""
        self._stacks: dict[str, dict[int, StackSample]] = {}
        self._last: dict[str, float] = {}
        self._expected: dict[str, int] = {}
        self._taken: dict[str, dict[int, float]] = {}
        self._before: dict[str, dict[int, tuple[StackSample, float]]] = {}
        self._known: dict[str, dict[int, str]] = {}

    def fresh(self, job: str, since: float) -> dict[int, StackSample]:
        """The job's kept stacks that arrived after `since` (taken in the silence that began then)."""
        taken = self._taken.get(job, {})
        return {r: s for r, s in self._stacks.get(job, {}).items() if taken.get(r, -1.0) > since}

    def earlier(self, job: str, since: float) -> dict[int, StackSample]:
        """Each rank's stack from the look before the freshest, when both arrived after `since`."""
        return {r: s for r, (s, ts) in self._before.get(job, {}).items() if ts > since}

    def apart(self, job: str) -> dict[int, float]:
        """Seconds between each rank's freshest stack and the one before it (ranks with two kept)."""
        taken = self._taken.get(job, {})
        return {r: taken[r] - ts for r, (_, ts) in self._before.get(job, {}).items() if r in taken}

    def forget(self, job: str) -> None:
        """Drop the stacks kept for a job that left the book."""
        for kept in (self._stacks, self._last, self._expected, self._taken, self._before, self._known, self._runs,
                     self._waiting):
            kept.pop(job, None)

    def add(self, job: str, sample: StackSample, ts: float, *, ranks: int = 0,
            known: Mapping[int, str] | None = None) -> None:
        """Keep one rank's stack (a newer one of the same rank replaces it); `ranks`: how many the job has;
        `known`: the job's ranks with the node each last reported from (who should have sent a stack)."""
        if known:
            self._known[job] = dict(known)
        kept = self._stacks.setdefault(job, {})
        if sample.rank in kept:
            self._before.setdefault(job, {})[sample.rank] = (kept[sample.rank], self._taken[job][sample.rank])
        kept[sample.rank] = sample
        self._taken.setdefault(job, {})[sample.rank] = ts
        frames = tuple(main_frames(sample.text))
        runs = self._runs.setdefault(job, {})
        run = runs.get(sample.rank)
        waits = place(list(frames)) == "collective" and not sample.stopped
        if run is None or run.pid != sample.pid or (frames not in run.stacks and len(run.stacks) >= SPIN_STACKS):
            runs[sample.rank] = _Run(sample.pid, ts, ts, 1, {frames}, sample.cpu_s)
        else:
            run.stacks.add(frames)
            run.last, run.looks = ts, run.looks + 1
        waiting = self._waiting.setdefault(job, {})
        if not waits:
            waiting.pop(sample.rank, None)
        else:
            waiting.setdefault(sample.rank, ts)
        self._last[job] = max(self._last.get(job, ts), ts)
        if ranks:
            self._expected[job] = ranks

    def spinning(self, job: str, since: float, ranks: int) -> list[int]:
        """Ranks of `job` spinning since `since` while their peers wait for them: each at `spin_looks` looks or more
        spanning `spin_s` or more, all taken after `since`, found in at most `SPIN_STACKS` distinct stacks in its own
        code (no collective, no busy place, not waiting on other processes), while every other one of the `ranks`
        waited in a collective at every look since that span began. Empty unless all `ranks` answered."""
        stacks, runs, taken = self._stacks.get(job, {}), self._runs.get(job, {}), self._taken.get(job, {})
        if ranks <= 0 or len(stacks) < ranks or any(s.stopped for s in stacks.values()):
            return []
        out = []
        for r, run in runs.items():
            if (r not in stacks or run.looks < self.spin_looks or run.last - run.first < self.spin_s
                    or run.first <= since or taken.get(r) != run.last):
                continue
            frames = [list(fr) for fr in run.stacks]
            if any(place(fr) != "code" or _delegated(fr) for fr in frames):
                continue
            waiting = self._waiting.get(job, {})
            peers = [q for q in stacks if q != r]
            # A look's stacks arrive one rank after another, within `settle_s`.
            if peers and all(q in waiting and waiting[q] <= run.first + self.settle_s for q in peers):
                out.append(r)
        return sorted(out)

    def spin_message(self, job: str, rank: int) -> str:
        """``rank N spinning in <frame> (...) while its peers wait in <collective>``, for a `spinning` rank."""
        stacks, run = self._stacks[job], self._runs[job][rank]
        s = stacks[rank]
        frames = main_frames(s.text)
        peers = sorted(r for r in stacks if r != rank)
        waits = next((f for r in peers if (f := collective_frame(main_frames(stacks[r].text)))), "a collective")
        span = run.last - run.first
        used = (f", {max(s.cpu_s - run.cpu_s, 0.0) / span:.0%} of a CPU" if s.cpu_s is not None
                and run.cpu_s is not None and span > 0 else "")
        return (f"rank {rank} on {s.node} spinning in {frames[0] if frames else 'no Python frame'} (the same "
                f"{'stack' if len(run.stacks) == 1 else f'{len(run.stacks)} stacks'} at {run.looks} looks over "
                f"{span:.0f} s{used}) while its peers ({','.join(map(str, peers[:8]))}) wait in {waits}")

    def evaluate(self, now: float, hung: Callable[[str, float], bool | None]) -> list[Finding]:
        """Findings for jobs whose stacks settled (stopped arriving `settle_s` ago, or all in) and that hang.

        When every rank that sent a stack waits in a collective and the ranks that sent none are at most half
        of the job, those are named: the rank the others wait for is among them.

        Stacks are asked for when a job is only suspected: they become a finding once
        `hung(job, since)` says the stall was called a hang, and are dropped when it says
        the job made progress after they were taken (None: not decided yet).
        """
        out: list[Finding] = []
        for job in list(self._stacks):
            got = self._stacks[job]
            complete = len(got) >= self._expected.get(job, 1 << 30)
            if not complete and now - self._last[job] < self.settle_s:
                continue
            verdict = hung(job, self._last[job])
            if verdict is None and now - self._last[job] < MAX_WAIT_S:
                continue
            apart = self.apart(job)
            del self._stacks[job]
            self._runs.pop(job, None)
            self._waiting.pop(job, None)
            self._expected.pop(job, None)
            self._taken.pop(job, None)
            before = {r: s for r, (s, _) in self._before.pop(job, {}).items()}
            known = self._known.pop(job, {})
            last = self._last.pop(job)
            if verdict:
                idle = idle_ranks(got, len(got), before, apart) if not set(known) - set(got) else []
                out.append(self._finding(job, got, max(now, last), known, idle))
        return out

    def _finding(self, job: str, stacks: Mapping[int, StackSample], ts: float,
                 known: Mapping[int, str] | None = None, idle: list[int] | None = None) -> Finding:
        frames = {r: main_frames(s.text) for r, s in stacks.items()}
        missing = sorted(set(known or {}) - set(stacks))
        waiting = sorted(r for r, fr in frames.items() if in_collective(fr) and not stacks[r].stopped)
        elsewhere = sorted(r for r in frames if r not in waiting)
        stopped = sorted(r for r, s in stacks.items() if s.stopped)
        if stopped and len(stopped) < len(stacks):
            culprits = stopped
        else:
            culprits = elsewhere if waiting and len(elsewhere) * 2 <= len(frames) else []
        summary = "; ".join(f"{r}: {fr[0] if fr else '?'}" for r, fr in sorted(frames.items())[:32])
        fields = {"ranks_dumped": ",".join(map(str, sorted(frames)[:64])),
                  "waiting_in_collective": ",".join(map(str, waiting[:64])),
                  "elsewhere": ",".join(map(str, elsewhere[:64])), "innermost_frames": summary[:4000]}
        if stopped:
            fields["stopped_ranks"] = ",".join(map(str, stopped[:64]))
        if missing:
            fields["no_stack"] = ",".join(map(str, missing[:64]))
        where = job_location(job)
        if not culprits and waiting and not elsewhere and missing and len(missing) * 2 <= len(missing) + len(frames):
            # Every rank that answered waits for a peer: the one it waits for is among the ranks whose node sent
            # no stack (its agent, or the node itself, is not answering either).
            rank = missing[0]
            node = (known or {}).get(rank)
            nodes = sorted({n for r in missing if (n := (known or {}).get(r))})
            where = job_location(job, node=node, rank=rank)
            fields["culprit_rank"] = str(rank)
            on = ",".join(nodes[:4]) or "an unknown node"
            msg = (f"job {job}: rank(s) {','.join(map(str, missing[:8]))} on {on} sent no stack while every rank "
                   f"that did ({','.join(map(str, waiting[:8]))}) waits in a collective")
        elif culprits:
            s = stacks[culprits[0]]
            where = job_location(job, node=s.node, rank=s.rank)
            fields["culprit_rank"] = str(s.rank)
            fields["culprit_stack"] = s.text[:MAX_STACK_CHARS]
            top = frames[s.rank][0] if frames[s.rank] else "no Python frame"
            if idle and s.rank in idle:
                fields["idle_ranks"] = ",".join(map(str, idle[:64]))
                msg = f"job {job}: " + idle_message(stacks, idle)
            elif s.stopped:
                others = [r for r in sorted(stacks) if r not in stopped]
                msg = (f"job {job}: the process of rank {s.rank} on {s.node} (pid {s.pid}) is stopped (state "
                       f"{s.state}, at {top}) while rank(s) {','.join(map(str, others[:8]))} run")
            else:
                msg = (f"job {job}: rank {s.rank} on {s.node} is not in a collective (at {top}) while "
                       f"rank(s) {','.join(map(str, waiting[:8]))} wait in one")
        else:
            first = min(stacks)
            fields["example_stack"] = stacks[first].text[:MAX_STACK_CHARS]
            how = "every rank waits in a collective" if waiting and not elsewhere else "no rank stands out"
            msg = f"job {job}: stacks of {len(stacks)} rank(s): {how}"
        return Finding(
            id=f"{DETECTOR_ID}:{job}:{ts:.3f}", ts=ts, fault_class=FaultClass.HANG, severity=Severity.ERROR,
            hardware=False, where=where, rule_id=DETECTOR_ID, recommended_action=Action.RESTART_JOB,
            evidence=tuple(s.source for s in stacks.values() if s.source), message=msg,
            symptom_of=HANG_CAUSES, fields=fields,
        )
