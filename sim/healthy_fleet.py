"""A fleet of healthy training jobs for the detectors' false-alarm rate, fast enough for tens of thousands of job-hours.

Each job's timeline is drawn with numpy at the job level (a synchronous job's ranks all finish a step when
the slowest arrives): step times with jitter, data-loader stalls, unannounced stalls, announced checkpoint and
evaluation pauses, a restart from a checkpoint (pods replaced, steps go back), and the end (the trainer's end
line, or the pods deleted). The kinds of jobs are those the real-job tests run (a plain DDP loop logging every
optimizer step, a Hugging Face Trainer logging every few steps, a Lightning bar, a hook job with phases) and
larger jobs with 1-20 s steps.

The real detectors (``DetectorSuite``, fed as the service's leader feeds them) judge each job at every moment
a finding is possible, not every second: a hang threshold is never below ``min(max(k x median, floor),
max(target_k x median, target_floor) - slack)`` of the job's recent report intervals (``HangConfig``), and
within one silence the verdict only moves towards "hang" until a pause, end or exit line arrives, so each
silence that reaches that bound is replayed, with the reports before it that fill the job book's interval
window, and judged at the instant before each such line in it and at its last instant. The end of every job
is judged 10 minutes after it. A silence shorter than the bound cannot be called a hang, so this counts the
hang findings a run evaluated every instant would give (``tests/test_healthy_fleet.py`` compares the two);
only the run number in a finding differs, counted from the replayed window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from analyzer.detectors.hang import HangConfig
from analyzer.detectors.stacks import StackSample
from analyzer.detectors.suite import DetectorSuite
from analyzer.progress import ProgressEvent
from analyzer.progress_rules import ProgressKind
from analyzer.records import Finding
from sim.fleet_stacks import capture_delay, picture, text


@dataclass(frozen=True, slots=True)
class JobKind:
    """One kind of training job."""

    name: str
    """What it stands for."""
    world: int
    """Ranks."""
    step_s: float
    """Median step time."""
    report_every: int
    """Steps between progress reports (a Trainer's ``logging_steps``)."""
    phases: bool = False
    """Reports come from the hook with compute and wait phases."""


KINDS = (
    JobKind("plain DDP loop, a line per optimizer step (tests/jobs/tiny_ddp.py)", 4, 0.1, 1),
    JobKind("Hugging Face Trainer, logging_steps=10", 2, 0.25, 10),
    JobKind("Lightning progress bar, a redraw per batch", 4, 0.2, 1),
    JobKind("hook job with phases", 8, 1.0, 1, phases=True),
    JobKind("LLM, 2 s steps", 8, 2.0, 1),
    JobKind("LLM, 5 s steps", 8, 5.0, 1),
    JobKind("LLM, 10 s steps", 8, 10.0, 1),
    JobKind("LLM, 20 s steps", 8, 20.0, 1),
)
"""The fleet's mix, drawn uniformly."""


@dataclass(slots=True)
class Timeline:
    """One job's progress reports (job level) and lifecycle markers."""

    kind: JobKind
    """The kind of job."""
    ts: np.ndarray
    """Report times (seconds from the job's start), increasing."""
    step: np.ndarray
    """Step each report names (goes back once after a restart)."""
    step_time: np.ndarray
    """Mean step seconds over the steps each report covers."""
    markers: list[tuple[float, ProgressKind, int]] = field(default_factory=list)
    """(time, PAUSE / END / EXIT, step): announced pauses, the end line, every rank's exit."""
    end_ts: float = 0.0
    """When the run ended (the end line or the pods gone)."""
    base: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Per step: compute seconds."""
    loader: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Per step: seconds one rank's data loader stalled (0: none)."""
    stall: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Per step: seconds of an unannounced stall on one rank (0: none)."""
    extra: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Per report: seconds of announced pause or restart before its steps."""


def draw_job(rng: np.random.Generator, kind: JobKind, hours: float, *, restart: bool, deleted: bool,
             stall_at: float | None = None, stall_s: float = 0.0) -> Timeline:
    """A healthy job of `kind` for about `hours`; `stall_at` (fraction of the run) adds one unannounced stall."""
    n = max(int(hours * 3600 / kind.step_s), 4 * kind.report_every)
    base = kind.step_s * rng.lognormal(0.0, 0.03, n)
    # Data-loader stalls: 0.2 % of rank-steps, +0.5-5 s; the step ends when the slowest rank arrives.
    hit = rng.random(n) < 1 - (1 - 0.002) ** kind.world
    loader = np.zeros(n)
    loader[hit] = rng.uniform(0.5, 5.0, int(hit.sum()))
    # Unannounced stalls (garbage collection, a slow shard): 1-6 s in 30 % of half-hours.
    stall = np.zeros(n)
    per = max(int(1800 / kind.step_s), 1)
    for h in range(0, n, per):
        if rng.random() < 0.3:
            stall[min(n - 1, h + int(rng.integers(per)))] += rng.uniform(1.0, 6.0)
    if stall_at is not None:
        stall[int(stall_at * (n - 1))] += stall_s
    steps = base + loader + stall
    k = kind.report_every
    reports = n // k
    per_report = steps[: reports * k].reshape(reports, k)
    gap = per_report.sum(axis=1)
    step_time = per_report.mean(axis=1)
    step = (np.arange(reports) + 1) * k
    markers: list[tuple[float, ProgressKind, int]] = []
    # Announced pauses: a checkpoint every 30 min (30-300 s), an evaluation every hour (20-180 s); the pause
    # line follows the report before it, and the next report comes after the pause.
    t = np.cumsum(gap)
    pause_after: list[tuple[int, float]] = []
    for every, lo, hi in ((1800.0, 30.0, 300.0), (3600.0, 20.0, 180.0)):
        for mark in np.arange(every, float(t[-1]), every):
            i = int(np.searchsorted(t, mark))
            if i < reports - 1:
                pause_after.append((i, float(rng.uniform(lo, hi))))
    extra = np.zeros(reports)
    for i, dur in pause_after:
        extra[i + 1] += dur
    if restart:
        # Pods replaced: torchrun prints its death-signal line (an end line) on the SIGTERM, every rank's
        # process is gone 1-30 s later, and new pods resume 10-30 reports back 1-3 minutes later.
        b = int(rng.integers(reports // 4, 3 * reports // 4))
        back = int(rng.integers(10, 31))
        step[b:] -= back * k
        extra[b] += rng.uniform(60.0, 180.0)
    ts = np.cumsum(gap + extra)
    for i, _ in pause_after:
        markers.append((float(ts[i]) + 0.01, ProgressKind.PAUSE, int(step[i])))
    if restart:
        markers += _terminated(rng, float(ts[b - 1]), int(step[b - 1]))
    if deleted:  # kubectl delete: as for the restart, and no new pods
        markers += _terminated(rng, float(ts[-1]), int(step[-1]))
        end = markers[-1][0]
    else:
        end = float(ts[-1]) + 0.5
        markers.append((end, ProgressKind.END, int(step[-1])))
    markers.sort(key=lambda m: m[0])
    return Timeline(kind, ts, step, step_time, markers, end, base, loader, stall, extra)


def _terminated(rng: np.random.Generator, last: float, step: int) -> list[tuple[float, ProgressKind, int]]:
    """Pods deleted after the report at `last`: the death-signal line at once, the processes gone 1-30 s later."""
    told = last + float(rng.uniform(0.1, 2.0))
    return [(told, ProgressKind.END, step), (told + float(rng.uniform(1.0, 30.0)), ProgressKind.EXIT, step)]


def _bound(cfg: HangConfig, med: float) -> float:
    """The least hang threshold a job with this median report interval can have (``HangDetector.threshold``)."""
    cap = max(cfg.target_k * med, cfg.target_floor_s) - cfg.slack_s
    return min(max(cfg.k * med, cfg.floor_s), cap)


def candidates(tl: Timeline, cfg: HangConfig) -> list[int]:
    """Indices of the silences (after report i) long enough that a hang finding is possible."""
    gaps = np.diff(tl.ts)
    least = _bound(cfg, 0.0) - 0.5  # per-rank report times differ from the job's by milliseconds
    window = math.ceil(256 / tl.kind.world) + 2
    idx = np.nonzero(gaps >= least)[0]
    if not len(idx):
        return []
    # The median of the intervals before each (what the book's window holds), all at once.
    padded = np.concatenate([np.full(window, np.nan), gaps])
    before = padded[idx[:, None] + np.arange(window)]
    med = np.zeros(len(idx))
    some = ~np.all(np.isnan(before), axis=1)
    med[some] = np.nanmedian(before[some], axis=1)
    # 0.9 x the median: the ranks' own intervals differ from the job's by their log-flush offsets.
    bound = np.array([_bound(cfg, 0.9 * m) for m in med]) - 0.5
    return [int(i) for i in idx[gaps[idx] >= bound]]


def _events(tl: Timeline, job: str, lo: int, hi: int, t_end: float, rng: np.random.Generator,
            node_of: list[str]) -> list[ProgressEvent]:
    """Every rank's reports lo..hi (inclusive) and the markers up to `t_end`, in time order."""
    world = tl.kind.world
    # When each rank's line is written after the step: milliseconds, never past its next line (one process
    # writes its lines in order).
    offs = np.minimum(rng.exponential(0.01, (hi - lo + 1, world)), min(0.05, 0.3 * tl.kind.step_s))
    speed = 1.0 + rng.normal(0.0, 0.005, world)
    evs: list[ProgressEvent] = []
    at = (tl.ts[lo:hi + 1, None] + offs).tolist()
    times = tl.step_time[lo:hi + 1].tolist()
    steps = tl.step[lo:hi + 1].tolist()
    speeds = speed.tolist()
    step_kind = ProgressKind.STEP
    for st, step, when in zip(times, steps, at, strict=True):
        for r in range(world):
            phases = {"compute": st * 0.8 * speeds[r], "comm_wait": st * 0.2} if tl.kind.phases else {}
            evs.append(ProgressEvent(job, r, node_of[r], when[r], step_kind, step, step_time=st, phases=phases,
                                     namespace="fleet"))
    start = float(tl.ts[lo])
    for ts, kind, step in tl.markers:
        if start <= ts < t_end:
            ranks = range(world) if kind is ProgressKind.EXIT else (0,)
            evs += [ProgressEvent(job=job, rank=r, node=node_of[r], ts=ts, kind=kind, step=step, namespace="fleet")
                    for r in ranks]
    evs.sort(key=lambda e: e.ts)
    return evs


def judge(tl: Timeline, job: str, rng: np.random.Generator, cfg: HangConfig | None = None,
          ) -> tuple[list[Finding], int]:
    """Every detector finding the job raises, and how many moments were judged.

    Within a silence the verdict only moves towards "hang" until a marker (a pause line, the end line, an
    exit) arrives, so each long silence is judged at the instant before each of its markers and at its
    last instant (the job's end: 10 minutes after it).
    """
    cfg = cfg or HangConfig()
    node_of = [f"{job}-node-{r // 8}" for r in range(tl.kind.world)]
    window = math.ceil(256 / tl.kind.world) + 2
    last = len(tl.ts) - 1
    marks: dict[int, list[tuple[float, ProgressKind]]] = {}
    for ts, kind, _ in tl.markers:
        marks.setdefault(int(np.searchsorted(tl.ts, ts, side="right")) - 1, []).append((ts, kind))
    least = _bound(cfg, 0.0) - 0.5
    moments: list[tuple[int, float, bool]] = []
    for i in [*candidates(tl, cfg), last]:
        end = float(tl.ts[i + 1]) - 0.001 if i < last else tl.end_ts + 600.0
        here = marks.get(i, [])
        moments += [(i, ts - 0.001, False) for ts, _ in here if ts - float(tl.ts[i]) >= least]
        # After the end line or an exit, or inside an announced pause shorter than `max_pause_s`, the verdict
        # rests on that marker (the threshold is not consulted): the reports just before it are enough.
        pauses = [ts for ts, kind in here if kind is ProgressKind.PAUSE]
        short = any(kind is not ProgressKind.PAUSE for _, kind in here) or (
            bool(pauses) and end - pauses[0] < cfg.max_pause_s)
        moments.append((i, end, short))
    found: list[Finding] = []
    for i, at, short in moments:
        suite = DetectorSuite(hang=cfg)
        evs = _events(tl, job, max(0, i - (4 if short else window)), i, at, rng, node_of)
        suite.observe_digest(evs, [], evs[-1].ts)
        found += with_stacks(suite, tl, job, node_of, at)
        found += suite.evaluate(at)
    return found, len(moments)


def look(suite: DetectorSuite, tl: Timeline, job: str, m: int) -> tuple[float, float, int] | None:
    """Look `m` at the job's current silence: (when the service asks, when the stacks arrive, the report the
    silence follows); None before the job has a threshold. The first look is asked at `suspect_fraction` of the
    threshold, the second at `second_look` of it, look m >= 2 at the threshold plus m - 2 half thresholds (while
    stacks hold the finding)."""
    state = suite.book.jobs.get(suite.book.key_for("fleet", job))
    thr = suite.hang.threshold(state) if state is not None else None
    if state is None or thr is None or not state.ranks:
        return None
    newest = max(max(r.last_ts for r in state.ranks.values()), state.resume_ts)
    i = int(np.searchsorted(tl.ts, newest, side="right")) - 1
    cfg = suite.hang.config
    ask = newest + (cfg.suspect_fraction * thr if m == 0 else cfg.second_look * thr if m == 1
                    else thr + 0.5 * (m - 2) * thr)
    return ask, ask + capture_delay(i * 64 + m), i


def add_stacks(suite: DetectorSuite, tl: Timeline, job: str, node_of: list[str], m: int) -> None:
    """The stacks of look `m` at the job's current silence, if it was still silent when they were taken."""
    got = look(suite, tl, job, m)
    if got is None:
        return
    _, at, i = got
    if i + 1 >= len(tl.ts) or at >= tl.ts[i + 1]:
        return  # progress came first: the agent found it running again (or the job is gone)
    k = tl.kind.report_every
    frames = picture(tl.kind.world, float(tl.extra[i + 1]), (tl.base, tl.loader, tl.stall), (i + 1) * k,
                     at - float(tl.ts[i]))
    for r, fr in frames.items():
        suite.add_stack(f"fleet/{job}", StackSample(rank=r, node=node_of[r], pid=1000 + r, text=text(1000 + r, fr)),
                        at)


def with_stacks(suite: DetectorSuite, tl: Timeline, job: str, node_of: list[str], until: float) -> list[Finding]:
    """Every look at the job's current silence that arrives by `until`, judged when it arrives (a newer look
    that confirms a hang can follow one that held it); the findings up to the last arrival."""
    found: list[Finding] = []
    key = suite.book.key_for("fleet", job)
    m = 0
    while (got := look(suite, tl, job, m)) is not None:
        ask, at, _ = got
        if at > until:
            break
        if m >= 2:
            found += suite.evaluate(ask)
            if suite.evidence_round(key, ask) != m:
                break  # reported or progressing: no newer look is asked for
        if m >= 1:
            found += suite.evaluate(at - 0.001)  # the verdict on the looks before this one
        add_stacks(suite, tl, job, node_of, m)
        found += suite.evaluate(at)
        m += 1
    return found


def run_fleet(job_hours: float, seed: int, *, stall_s: float = 0.0) -> tuple[float, int, list[Finding], dict[str, int]]:
    """Healthy jobs until `job_hours`; returns (hours, jobs, findings, how many of each situation were judged).

    `stall_s` > 0 gives the first job one unannounced stall that long, mid-run (a check that the screen
    lets a real hang through)."""
    rng = np.random.default_rng(seed)
    cfg = HangConfig()
    hours = 0.0
    jobs = 0
    found: list[Finding] = []
    seen = {"silences_judged": 0, "announced_pauses": 0, "restarts": 0, "finished": 0, "deleted": 0}
    while hours < job_hours:
        kind = KINDS[int(rng.integers(len(KINDS)))]
        restart = bool(rng.random() < 0.2)
        deleted = bool(rng.random() < 0.2)
        stall = 0.5 if stall_s > 0 and jobs == 0 else None
        tl = draw_job(rng, kind, float(rng.uniform(1.0, 8.0)), restart=restart, deleted=deleted, stall_at=stall,
                      stall_s=stall_s)
        got, judged = judge(tl, f"healthy-{seed}-{jobs}", rng, cfg)
        found += got
        seen["silences_judged"] += judged
        seen["announced_pauses"] += sum(1 for m in tl.markers if m[1] is ProgressKind.PAUSE)
        seen["restarts"] += restart
        seen["deleted" if deleted else "finished"] += 1
        hours += tl.end_ts / 3600
        jobs += 1
        by_kind = f"hours: {kind.name}"
        seen[by_kind] = seen.get(by_kind, 0) + round(tl.end_ts / 3600)
    return hours, jobs, found, seen
