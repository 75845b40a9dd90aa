"""The detectors' shared view of running jobs: per-rank progress and per-node GPU/NIC metrics.

Pure state fed with records; the detectors read it at ``evaluate(now)``. Memory is
bounded: a fixed window of samples per rank, the latest value per GPU metric.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from analyzer.progress import ProgressEvent
from analyzer.progress_rules import ProgressKind
from collector.signal import MetricSample, Signal

COMPUTE_PHASES = ("forward", "backward", "optimizer")
"""Phases that are this rank's own work (a slow GPU makes them slow)."""
WAIT_PHASES = ("comm_wait", "communication", "comm", "data_wait")
"""Phases spent waiting for others; on a healthy rank they absorb a straggler's delay."""

METRIC_FEATURES: Mapping[str, str] = {
    "DCGM_FI_DEV_GPU_UTIL": "util",
    "nvml_utilization_gpu_percent": "util",
    "DCGM_FI_DEV_SM_CLOCK": "sm_clock",
    "nvml_clocks_sm_mhz": "sm_clock",
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": "throttle",
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": "throttle",
    "nvml_clocks_throttle_reasons": "throttle",
    "DCGM_FI_DEV_GPU_TEMP": "temp",
    "nvml_temperature_celsius": "temp",
    "ib_port_xmit_data_delta": "nic_tx",
}
"""Metric names (DCGM exporter, the agent's NVML and InfiniBand sources) to detector features."""

EXIT_GRACE_S = 5.0
"""A step this soon after its rank's exit was seen, and past its last one, was written before the exit."""
RERUN_AFTER_END_S = 60.0
"""Progress this long after a run ended is a new run of the job (a rerun under the same name)."""


@dataclass(slots=True)
class RankState:
    """What is known about one rank."""

    node: str
    """Node it runs on (latest seen)."""
    last_step: int = -1
    """Highest step reported."""
    last_ts: float = 0.0
    """When the step last advanced."""
    signal_id: str = ""
    """Evidence: the signal of the last advance."""
    times: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    """Per-step own-work seconds (compute phases, else step time), newest last."""
    samples: int = 0
    """Samples appended to `times` so far: a reader that kept the newest ones reads only those added since."""
    edits: int = 0
    """Times `times` lost or replaced samples it had (cleared when phases began, its newest replaced by the hook's
    report of that step): a reader that kept samples reads `times` again."""
    has_phases: bool = False
    """The rank reports phases (the hook): then only phased samples enter `times`, never a log line's."""
    sample_step: int = -1
    """Step of the newest sample in `times`."""
    sample_phased: bool = False
    """Whether that sample came with phases."""
    ranges: deque[tuple[int, int, float, float, float]] = field(default_factory=lambda: deque(maxlen=16))
    """(last step, steps, mean, standard deviation, standard deviation of all its steps) of the own work over each
    summary of hook reports, its slowest step set aside (one hiccup is no measure of the rank), newest last: every
    rank's summaries close at the same steps, so ranks are compared over the same steps."""
    arrivals: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=64))
    """(step, when it was reported), newest last: lock-stepped ranks report a step together, so a
    rank that keeps reporting late is the one the others wait for."""
    exited_at: float | None = None
    """When the rank's container was seen gone (None while it runs)."""
    numbered: bool = False
    """The rank prints numbered steps (a progress bar, a step line): its counted lines are no steps of their own."""
    alive_ts: float = 0.0
    """When the rank last printed a counted line after its numbered steps: no step number, but progress (a Trainer's
    bar reaches a pod's log only when 16 KiB of redraws fill a record, its loss dict every `logging_steps`)."""

    @property
    def heard_ts(self) -> float:
        """When the rank last showed progress: a step, or a counted line of a numbered rank."""
        return max(self.last_ts, self.alive_ts)

    @property
    def basis(self) -> str:
        """What `times` measures: ``compute`` (from phases) or ``step_time``."""
        return "compute" if self.has_phases else "step_time"


@dataclass(slots=True)
class JobState:
    """What is known about one job."""

    ranks: dict[int, RankState] = field(default_factory=dict)
    """Ranks by global rank (-1: a job that logs from one process without a rank)."""
    version: int = 0
    """Steps its ranks advanced so far, counted over all ranks: the detectors judge the job again when it moves,
    also when a late rank catches up without raising the job's highest step."""
    intervals: deque[float] = field(default_factory=lambda: deque(maxlen=256))
    """Recent wall seconds between a rank's consecutive progress reports."""
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=256))
    """Recent per-step seconds as reported (or derived)."""
    max_step: int = -1
    """Highest step any rank reported."""
    paused_at: float | None = None
    """Start of a planned pause (checkpoint, evaluation) still in progress."""
    paused_step: int = -1
    """Step the pause came after; a later step ends it (reports of earlier steps may arrive after the marker)."""
    resume_ts: float = 0.0
    """End of the last planned pause."""
    total: int | None = None
    """Total steps of the run, when printed."""
    steps_seen: int = 0
    """Distinct job steps observed (how much history there is)."""
    ended_at: float | None = None
    """When the run announced its end (end-of-training line, the hook's ``finish()``) or every rank exited."""
    ended_by_exits: bool = False
    """`ended_at` is when every rank known then had exited: a rank heard of later (its node's agent read its
    steps later) may still run, so it reopens the run."""
    run: int = 0
    """Restarts seen under this job name: detectors drop what they kept about an earlier run."""
    cadence_known: bool = False
    """`intervals` were carried over from the run before a restart (the same job steps at the same pace)."""
    world_size: int | None = None
    """Ranks in the run, as its reporters said (None when no one said)."""
    started: dict[int, tuple[str, float]] = field(default_factory=dict)
    """Ranks whose processes were seen running before the job's first report: (node, when), until a step or its
    exit (a job that hangs before its first progress line is known only by these)."""

    @property
    def newest(self) -> float:
        """When the job last showed any sign of progress (a report, the end of a pause; no report: its start)."""
        heard = max((r.heard_ts for r in self.ranks.values()), default=0.0)
        if not self.ranks and self.started:
            heard = max(ts for _, ts in self.started.values())
        return max(heard, self.resume_ts)

    @property
    def finished(self) -> bool:
        """The run reached its last step or said it ended: silence now is the end, not a hang."""
        return self.ended_at is not None or (self.total is not None and self.max_step >= self.total)


class JobBook:
    """Jobs, ranks and node metrics, updated from progress events and metric signals."""

    def __init__(self, *, window: int = 64) -> None:
        self.window = window
        self.jobs: dict[str, JobState] = {}
        self._namespaced: dict[str, set[str]] = {}
        """Job name -> the ``namespace/job`` keys it is kept under."""
        self.gpu: dict[str, dict[str, dict[str, tuple[float, float]]]] = {}
        """node -> gpu (or NIC port) -> feature -> (ts, value), latest only."""
        self.merged: list[tuple[str, str]] = []
        """(bare key, namespaced key) of jobs folded into their namespaced job since the detectors last dropped what
        they kept of them."""
        self._pod_ns: dict[tuple[str, str], tuple[str | None, float]] = {}
        """(node, job) -> the namespace the job's pods there named in their lines (None: more than one), first seen."""
        self._prune_at = 0.0

    def observe_progress(self, ev: ProgressEvent) -> None:
        """Fold one progress event in (idempotent for repeated or older steps)."""
        if ev.namespace and ev.job in self.jobs and _runs_on(self.jobs[ev.job], ev.node):
            self._adopt(ev.job, f"{ev.namespace}/{ev.job}")
        if ev.kind is ProgressKind.START:
            self._start(ev)
            return
        if ev.kind is ProgressKind.EXIT:
            # A process or container of a job that reported no progress here is no job to keep.
            if (known := self.jobs.get(self.key_for(ev.namespace, ev.job, node=ev.node))) is not None:
                self._exit(known, ev)
            elif ev.namespace is None:
                # A reporter that knows no namespace (an older agent, a process outside any pod) ends the
                # rank of that job name in whichever namespace that rank runs on this node.
                for key, state in self.jobs.items():
                    if key.endswith(f"/{ev.job}") and (r := state.ranks.get(ev.rank)) is not None \
                            and r.node == ev.node:
                        self._exit(state, ev)
            return
        key = f"{ev.namespace}/{ev.job}" if ev.namespace else self.key_for(None, ev.job, node=ev.node)
        job = self.jobs.get(key)
        if job is None:  # not setdefault: a JobState (two deques) per event was a sixth of ingest time
            job = self.jobs[key] = JobState()
            if key != ev.job:
                self._namespaced.setdefault(ev.job, set()).add(key)
        if ev.kind is ProgressKind.END:
            job.ended_at, job.ended_by_exits = max(job.ended_at or ev.ts, ev.ts), False
            return
        if ev.kind is ProgressKind.STEP and ev.step is not None and (rank := job.ranks.get(ev.rank)) is not None:
            # A Hugging Face Trainer prints its bar's step every step and a loss dict (which numbers none) every
            # `logging_steps`: the dicts' count would read as the steps going back, a restart each time.
            if ev.counted and rank.numbered:
                if ev.ts > rank.heard_ts:  # progress all the same: silence counts from here
                    if rank.heard_ts > 0:
                        job.intervals.append(ev.ts - rank.heard_ts)
                    rank.alive_ts = ev.ts
                return
            if not ev.counted and not rank.numbered:
                rank.numbered = True
                rank.last_step = -1  # the steps counted so far were no step numbers
        if ev.kind is ProgressKind.STEP and ev.step is not None and _restarted(job, ev):
            job = self._restart(key, job)
        if ev.world_size is not None and ev.kind is ProgressKind.STEP:
            if job.world_size is not None and ev.world_size != job.world_size:
                return  # a late report from the run before the world changed
            job.world_size = ev.world_size
        if ev.kind is ProgressKind.PAUSE:
            if job.paused_at is None:
                job.paused_at = ev.ts
                job.paused_step = ev.step if ev.step is not None else job.max_step
            return
        if ev.kind is ProgressKind.RESUME:
            job.paused_at = None
            job.resume_ts = max(job.resume_ts, ev.ts)
            return
        if ev.step is None:
            return
        job.started.clear()  # reports from now on
        if job.ended_by_exits and ev.rank not in job.ranks:
            job.ended_at, job.ended_by_exits = None, False  # a rank not heard of when the others exited
        rank = job.ranks.get(ev.rank)
        if rank is None:
            rank = job.ranks[ev.rank] = RankState(node=ev.node, times=deque(maxlen=self.window),
                                                  numbered=not ev.counted)
        rank.node = ev.node
        if ev.total is not None:
            job.total = ev.total
        if ev.step <= rank.last_step:
            self._refine(rank, ev)
            return
        if rank.last_step >= 0 and ev.ts >= rank.last_ts:
            gap = ev.ts - rank.last_ts
            steps = ev.step - rank.last_step
            job.intervals.append(ev.ts - rank.heard_ts if ev.ts >= rank.heard_ts else gap)
            derived = gap / steps
        else:
            derived = None
        self._sample(rank, ev, derived)
        step_time = ev.step_time if ev.step_time is not None else derived
        if step_time is not None:
            job.step_times.append(step_time)
        rank.arrivals.append((ev.step, ev.ts))
        rank.last_step = ev.step
        job.version += 1
        rank.last_ts = max(rank.last_ts, ev.ts)
        rank.signal_id = ev.signal_id
        if ev.step > job.max_step:
            job.steps_seen += 1
            job.max_step = ev.step
        if ev.step > job.paused_step:
            job.paused_at = None  # a step after the one the pause followed: the pause is over

    def observe_pod_job(self, node: str, namespace: str, job: str, ts: float) -> None:
        """A line from a pod of `job` in `namespace` on `node` (any line with the pod's identity, a rule line too):
        a reporter on that node that names the job without a namespace is reporting that namespaced job."""
        key = (node, job)
        seen = self._pod_ns.get(key)
        if seen is not None and seen[0] == namespace:
            return
        self._pod_ns[key] = (namespace if seen is None else None, ts)
        if seen is None and job in self.jobs and _runs_on(self.jobs[job], node):
            self._adopt(job, f"{namespace}/{job}")

    def _start(self, ev: ProgressEvent) -> None:
        """A rank's process seen running: a job not heard of yet is kept as started, so that a hang before its
        first progress line is judged (a job already reporting, or over, is left as it is)."""
        key = f"{ev.namespace}/{ev.job}" if ev.namespace else self.key_for(None, ev.job, node=ev.node)
        job = self.jobs.get(key)
        if job is None:
            job = self.jobs[key] = JobState()
            if key != ev.job:
                self._namespaced.setdefault(ev.job, set()).add(key)
        if job.ranks or job.ended_at is not None:
            return
        job.started.setdefault(ev.rank, (ev.node, ev.ts))

    @staticmethod
    def _exit(job: JobState, ev: ProgressEvent) -> None:
        if job.started.pop(ev.rank, None) is not None and not job.started and not job.ranks:
            job.ended_at, job.ended_by_exits = ev.ts, True  # every process that started ended before a report
        rank = job.ranks.get(ev.rank)
        if rank is None:
            return
        rank.exited_at = ev.ts
        if all(r.exited_at is not None for r in job.ranks.values()):
            job.ended_by_exits = job.ended_by_exits or job.ended_at is None
            job.ended_at = max(job.ended_at or ev.ts, ev.ts)  # every container is gone: deleted or done

    def _restart(self, name: str, old: JobState) -> JobState:
        """A new run of the job: fresh ranks and steps, the pace it kept before."""
        new = self.jobs[name] = JobState(run=old.run + 1)
        new.intervals.extend(old.intervals)
        new.step_times.extend(old.step_times)
        new.cadence_known = bool(old.intervals)
        return new

    @staticmethod
    def _sample(rank: RankState, ev: ProgressEvent, derived: float | None) -> None:
        own, basis = _own_time(ev, derived)
        if own is None:
            return
        phased = basis == "compute"
        if not phased and rank.has_phases:
            return  # the hook reports this rank's steps; a log line's time would mix two measures
        if phased and not rank.has_phases:
            rank.times.clear()  # from now on, own work only
            rank.has_phases = True
            rank.edits += 1
        rank.times.append(own)
        rank.samples += 1
        rank.sample_step, rank.sample_phased = ev.step if ev.step is not None else -1, phased
        if phased and ev.phases_sd and ev.step is not None and (got := _own_range(ev)) is not None:
            rank.ranges.append((ev.step, *got))

    def _refine(self, rank: RankState, ev: ProgressEvent) -> None:
        # The hook's report of a step whose log line (or a later step's) came first: its phases
        # measure this rank's own work, so it still counts.
        if not ev.phases or ev.step is None or ev.step < rank.sample_step:
            return
        if ev.step == rank.sample_step:
            if rank.sample_phased:
                return  # already have it
            if rank.times:
                rank.times.pop()
                rank.edits += 1
        self._sample(rank, ev, None)

    def observe_metric(self, sig: Signal) -> None:
        """Keep the latest value of the GPU/NIC metrics the detectors use."""
        p = sig.payload
        if not isinstance(p, MetricSample):
            return
        feature = METRIC_FEATURES.get(p.name)
        if feature is None:
            return
        dev = p.labels.get("gpu") or p.labels.get("device", "") + "/" + p.labels.get("port", "")
        self.gpu.setdefault(sig.node, {}).setdefault(dev, {})[feature] = (sig.ts, p.value)

    def nodes_of(self, job: str) -> set[str]:
        """Nodes the job's ranks run on."""
        state = self.jobs.get(job)
        return {r.node for r in state.ranks.values()} | {n for n, _ in state.started.values()} if state else set()

    def key_for(self, namespace: str | None, job: str, *, node: str | None = None) -> str:
        """The key `job` is kept under: ``namespace/job``, or the bare name when no namespace is known.

        Reporters that know no namespace (older agents, a hook outside any pod) are matched by name to
        the namespace whose job has ranks on their `node`, else to the only namespace that has the job.
        """
        if namespace:
            key = f"{namespace}/{job}"
            return key if key in self.jobs or job not in self.jobs else job
        if job in self.jobs:
            return job
        if node is not None and (seen := self._pod_ns.get((node, job))) is not None and seen[0]:
            return f"{seen[0]}/{job}"  # the namespace the job's pods on this node named in their lines
        keys = self._namespaced.get(job)
        if keys is None:
            return job
        if node is not None and len(keys) > 1:
            here = [k for k in keys if k in self.jobs and _runs_on(self.jobs[k], node)]
            if len(here) == 1:
                return here[0]
        return next(iter(keys)) if len(keys) == 1 else job

    def _adopt(self, bare: str, key: str) -> None:
        """A job a reporter without namespace named, whose ranks run where the namespaced reporter's do, is
        that namespaced job (a hook outside the pod's view beside the agent): one job, under the namespaced key."""
        old = self.jobs.pop(bare)
        self.merged.append((bare, key))
        into = self.jobs.get(key)
        if into is None:
            self.jobs[key] = old
            _, _, name = key.partition("/")
            self._namespaced.setdefault(name, set()).add(key)
            return
        for r, st in old.ranks.items():
            mine = into.ranks.get(r)
            if mine is None or st.last_step > mine.last_step:
                into.ranks[r] = st
        if not into.intervals:
            into.intervals.extend(old.intervals)
            into.step_times.extend(old.step_times)
        if old.max_step > into.max_step:
            into.max_step = old.max_step
        into.steps_seen = max(into.steps_seen, old.steps_seen)
        into.total = into.total if into.total is not None else old.total
        into.world_size = into.world_size if into.world_size is not None else old.world_size

    def forget(self, job: str) -> None:
        """Drop a job (it was deleted or restarted under the same name)."""
        self.jobs.pop(job, None)
        self._unindex(job)

    def _unindex(self, key: str) -> None:
        _, sep, name = key.partition("/")
        keys = self._namespaced.get(name) if sep else None
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._namespaced[name]

    def expire(self, now: float, idle_s: float) -> list[str]:
        """Drop jobs with no progress for `idle_s` (finished, deleted or long dead); returns their names."""
        gone = [name for name, job in self.jobs.items() if (job.ranks or job.started) and now - job.newest > idle_s]
        for name in gone:
            del self.jobs[name]
            self._unindex(name)
        if now >= self._prune_at:  # pods' namespaces not heard of for as long
            self._pod_ns = {k: v for k, v in self._pod_ns.items() if now - v[1] <= idle_s}
            self._prune_at = now + idle_s / 10
        return gone


def _runs_on(job: JobState, node: str) -> bool:
    """Whether a rank of the job runs on `node`."""
    return any(r.node == node for r in job.ranks.values())


def _restarted(job: JobState, ev: ProgressEvent) -> bool:
    """A step that begins a new run: after the end, after the rank's container exited, or a step back in time."""
    step = ev.step if ev.step is not None else -1
    rank = job.ranks.get(ev.rank)
    # After the end, reports of the last steps may land just after the end line (other ranks, or the
    # Trainer's tqdm bar printing its final count again): a step below this rank's last one, or any step
    # long after the end, is a new run.
    if job.ended_at is not None and ev.ts > job.ended_at and (
            ev.ts > job.ended_at + RERUN_AFTER_END_S or (rank is not None and step < rank.last_step)):
        return True
    # The number of ranks changed (an elastic restart, the job resubmitted at another size): reported after
    # everything the old run reported, it is a new run even where the steps go on from where they were.
    if (ev.world_size is not None and job.world_size is not None and ev.world_size != job.world_size
            and job.ranks and ev.ts > max(r.last_ts for r in job.ranks.values())):
        return True
    if rank is None:
        return False
    # Its container or process ended: a later step is a new run, unless it continues the old one at
    # once (a line written before the exit that was stamped just after it).
    if rank.exited_at is not None and ev.ts > rank.exited_at and (
            step <= rank.last_step or ev.ts > rank.exited_at + EXIT_GRACE_S):
        return True
    # A rank's own reports arrive in order: a lower step reported later than its last one is a
    # resumption from a checkpoint (a late report of an older step carries an older time).
    return step < rank.last_step and ev.ts > rank.last_ts


def _own_range(ev: ProgressEvent) -> tuple[int, float, float, float] | None:
    """A summary's own work over its steps: (steps, mean, standard deviation) with each phase's slowest step set
    aside when its largest value came with it, and the standard deviation over all its steps (None: its phases'
    spreads do not tell it)."""
    own = ["compute"] if "compute" in ev.phases else [k for k in COMPUTE_PHASES if k in ev.phases]
    if not own or any(k not in ev.phases_sd for k in own):
        return None
    n, mean, var, full = ev.samples, 0.0, 0.0, 0.0
    trim = n > 2 and all(k in ev.phases_peak for k in own)
    for k in own:
        m, sd = ev.phases[k], ev.phases_sd[k]
        full += sd * sd
        if trim:
            peak = ev.phases_peak[k]
            total, squares = m * n - peak, (sd * sd + m * m) * n - peak * peak
            m = total / (n - 1)
            sd = max(squares / (n - 1) - m * m, 0.0) ** 0.5
        mean += m
        var += sd * sd
    return (n - 1 if trim else n), mean, var ** 0.5, full ** 0.5


def _own_time(ev: ProgressEvent, derived: float | None) -> tuple[float | None, str]:
    ph = ev.phases
    if ph:
        if "compute" in ph:
            return ph["compute"], "compute"
        own = [ph[k] for k in COMPUTE_PHASES if k in ph]
        if own:
            return sum(own), "compute"
        wait = sum(ph[k] for k in WAIT_PHASES if k in ph)
        total = ev.step_time if ev.step_time is not None else derived
        if total is not None and wait:
            return max(total - wait, 0.0), "compute"
    return (ev.step_time if ev.step_time is not None else derived), "step_time"
