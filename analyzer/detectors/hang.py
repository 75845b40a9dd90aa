"""Hang detector: a job whose progress stalls beyond max(k x its usual report interval, a floor).

Two shapes, told apart because they point at different culprits:

- **ranks behind**: some ranks stopped a step (or more) before the others. In
  synchronous training the others then wait in the next collective for them, so
  the rank whose last progress is oldest is the culprit.
- **all stalled**: every rank stopped at the same step (a collective that never
  completes). Progress cannot name a rank; GPU utilisation can: busy GPUs with no
  progress are spinning in the collective, an idle GPU among them is the one that
  never joined. Without metrics the finding names only the job, and the Flight
  Recorder or a hardware finding narrows it.

Two stages: a silence that reaches the threshold is a hang unless the freshest
stacks of the job's ranks, taken after its last progress, show it slow rather
than stuck (``stacks.exoneration``: every rank busy in its own work, or the ranks
the others wait for busy loading data, saving a checkpoint, evaluating, reading
files). Then the finding is held, up to `hold_k` x the threshold, and re-judged on
newer stacks; a stopped rank, every rank in a collective, or a rank elsewhere
while the others wait confirms at once. No stacks in time: judged as before.

A job with fewer than `min_steps` progress reports (a Trainer logging every 10 steps that
hangs before step 30, a trainer logging every 100 steps) has little pace to go by: its
threshold comes from what is there (the one or two intervals seen, else the step time the
first report printed, else the floor), and
its stall is called there only when stacks taken in it confirm it (every rank answered,
and a stopped rank, every rank in a collective, or a rank stuck elsewhere while the others
wait: ``confirmed``). Without that, it is called at `first_steps_timeout_s`, a long but
finite bound (start-up and the first steps of a healthy job are slow).

Time comes in as ``now``; nothing here reads a clock.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

from analyzer.detectors import HANG_CAUSES
from analyzer.detectors.book import JobBook, JobState, RankState
from analyzer.records import Action, FaultClass, Finding, Severity, job_location

DETECTOR_ID = "hang-detector"


@dataclass(frozen=True, slots=True)
class HangConfig:
    """Thresholds: adaptive to each job's pace and spread, bounded by the detection target.

    The stall threshold is ``max(k x median interval + z x robust spread, 1.25 x the longest
    healthy gap seen, floor_s)``, but never more than the target ``max(target_k x median,
    target_floor_s)`` less `slack_s` (shipping and evaluation delay): a job whose intervals vary
    a lot, or that had long healthy gaps before, waits longer, but never past the target.
    """

    k: float = 2.4
    """Stall threshold in units of the job's median report interval."""
    floor_s: float = 13.0
    """Never call a hang before this many seconds without progress. For steps up to 5 s this is the whole
    time the 15 s target leaves (less `slack_s`): waiting any less only adds false alarms, since a stall
    of a few seconds and a data-loader hiccup on top make healthy gaps of 12 s."""
    z: float = 6.0
    """Robust spreads (1.4826 x MAD of the intervals) added to k x median."""
    gap_margin: float = 1.25
    """A gap this much longer than the longest healthy gap seen (a stall that later resumed) is a hang."""
    target_k: float = 3.0
    """Detection target in units of the median interval ..."""
    target_floor_s: float = 15.0
    """... and at least this many seconds: the threshold stays below the target."""
    slack_s: float = 2.0
    """Target minus threshold: time to ship the last lines and for the next evaluation."""
    min_steps: int = 3
    """Job steps seen before judging it (start-up, compilation and warm-up are slow)."""
    max_pause_s: float = 1800.0
    """A checkpoint or evaluation announced in the logs suspends detection for at most this long."""
    busy_util: float = 50.0
    """GPU utilisation (%) at or above which a GPU counts as busy."""
    idle_util: float = 10.0
    """GPU utilisation (%) at or below which a GPU counts as idle."""
    suspect_fraction: float = 0.5
    """A job stalled this fraction of its threshold is suspected: evidence (stacks, dumps) is asked for."""
    second_look: float = 0.75
    """A second look (stacks) is asked for at this fraction of the threshold."""
    hold_k: float = 4.0
    """Stacks that show the stalled ranks busy (not stuck) hold the finding at most this many thresholds."""
    first_steps_timeout_s: float = 600.0
    """A job with fewer than `min_steps` reports whose stall no stacks confirm is called hung after this long."""
    first_look_s: float = 30.0
    """A job whose processes run but that printed no progress yet is its threshold this long after it started
    (stacks are asked for at `suspect_fraction` of it): called there when stacks confirm it."""


class HangDetector:
    """Emits one hang finding per stall episode of a job."""

    id = DETECTOR_ID

    def __init__(self, book: JobBook, config: HangConfig | None = None) -> None:
        self.book = book
        self.config = config or HangConfig()
        self._reported: dict[str, tuple[int, float]] = {}
        self._held: dict[str, tuple[int, float, str]] = {}
        self.exonerate: Callable[[str, float], str | None] = lambda job, since: None
        """For a job silent since a time: why its freshest stacks show it slow, not stuck (None: they don't)."""
        self.confirmed: Callable[[str, float], bool | None] = lambda job, since: None
        """For a job silent since a time: whether stacks of every rank, taken since, show it stuck (None: no stack
        of it was taken since)."""
        self.idle: Callable[[str, float], tuple[int, str, str] | None] = lambda job, since: None
        """For a job silent since a time: the rank two looks taken since show blocked in its own code while its
        peers wait in a collective, as (rank, node, what the stacks show); None when they show none."""

    def forget(self, job: str) -> None:
        """Drop what is kept about a job that left the book."""
        self._reported.pop(job, None)
        self._held.pop(job, None)

    def carry(self, old: str, new: str) -> None:
        """A job now kept under another key (a bare name that took its namespace): its stall reported under the
        old key is not reported again under the new one."""
        if old in self._reported and new not in self._reported:
            self._reported[new] = self._reported[old]

    def early(self, job: JobState) -> bool:
        """Too few reports to know the job's pace: its stall is called early only when stacks confirm it."""
        return job.steps_seen < self.config.min_steps and not (job.cadence_known and job.steps_seen)

    def threshold(self, job: JobState) -> float | None:
        """Seconds without progress that make a hang for this job (for an `early` one: when stacks confirm it);
        None before its first report."""
        cfg = self.config
        if not job.steps_seen:
            return cfg.first_look_s if job.started else None
        # One report per rank: no interval yet, but the step time it printed is the least the next one takes.
        gaps = list(job.intervals) or list(job.step_times)
        if not gaps:
            return min(cfg.floor_s, cfg.target_floor_s - cfg.slack_s)
        med = statistics.median(gaps)
        spread = 1.4826 * statistics.median(abs(g - med) for g in gaps)
        cap = max(cfg.target_k * med, cfg.target_floor_s) - cfg.slack_s
        want = max(cfg.k * med + cfg.z * spread, cfg.gap_margin * max(gaps), cfg.floor_s)
        return max(min(want, cap), min(cfg.floor_s, cap))

    def suspects(self, now: float) -> list[tuple[str, float]]:
        """Jobs stalled past `suspect_fraction` of their threshold, with when progress stopped: gather evidence."""
        out = []
        for name, job in self.book.jobs.items():
            thr = self.threshold(job)
            if thr is None or job.finished or not (job.ranks or job.started) or self._paused(job, now):
                continue
            newest = job.newest
            if now - newest >= self.config.suspect_fraction * thr:
                out.append((name, newest))
        return out

    def evidence_round(self, name: str, now: float) -> int:
        """Which look at the job's current silence evidence is wanted for: 0 the first (at `suspect_fraction`
        of the threshold), 1 a second at `second_look` of it (its stacks arrive before the threshold: a running
        job's have moved), then one more every half threshold while stacks hold the finding."""
        job = self.book.jobs.get(name)
        thr = self.threshold(job) if job is not None else None
        if job is None or thr is None or not (job.ranks or job.started):
            return 0
        newest = job.newest
        held = self._held.get(name)
        if held is not None and held[:2] == (job.run, newest):
            return 2 + int(max(now - newest - thr, 0.0) // (0.5 * thr))
        return 1 if now - newest >= self.config.second_look * thr else 0

    def verdict(self, name: str, since: float) -> bool | None:
        """For evidence taken at `since`: True once the stall it was taken in is called a hang, False when the
        job progressed (or ended) after it, None while undecided."""
        job = self.book.jobs.get(name)
        if job is None or job.finished or not (job.ranks or job.started):
            return False
        newest = job.newest
        if newest > since:
            return False
        return True if self._reported.get(name) == (job.run, newest) else None

    def reported(self, name: str) -> bool:
        """Whether the job's current silence was called a hang."""
        job = self.book.jobs.get(name)
        return job is not None and self._reported.get(name) == (job.run, job.newest)

    def _paused(self, job: JobState, now: float) -> bool:
        return job.paused_at is not None and now - job.paused_at < self.config.max_pause_s

    def evaluate(self, now: float) -> list[Finding]:
        """Hang findings for jobs stalled at `now` (each episode reported once)."""
        out: list[Finding] = []
        for name, job in self.book.jobs.items():
            f = self._judge(name, job, now)
            if f is not None:
                out.append(f)
        return out

    def _judge(self, name: str, job: JobState, now: float) -> Finding | None:
        if job.finished or not (job.ranks or job.started):
            return None
        if self._paused(job, now):
            return None
        thr = self.threshold(job)
        if thr is None:
            return None
        newest = job.newest  # read without a dict of every rank's: every job is judged every evaluation
        if now - newest < thr:
            self._reported.pop(name, None)  # progressing: a later stall is a new episode
            self._held.pop(name, None)
            return None
        if self._reported.get(name) == (job.run, newest):
            return None
        exited = sorted(r for r, st in job.ranks.items() if r >= 0 and st.exited_at is not None)
        early = self.early(job)
        bound = self.config.hold_k * thr
        if early:
            bound = max(self.config.first_steps_timeout_s, bound)
        if not exited and (now - newest < bound or not job.steps_seen):
            # Before its first report a job is in start-up (loading, compiling) for as long as its recent stacks
            # show it running: those of the last two thresholds (looks come every half threshold while held).
            why = self.exonerate(name, newest if now - newest < bound else max(newest, now - 2 * thr))
            if why is not None:
                self._held[name] = (job.run, newest, why)
                return None
        if early and not exited:
            stuck = self.confirmed(name, newest)
            if not stuck and (now - newest < bound or (stuck is None and not job.steps_seen)):
                # Too few reports to call a silence without stacks that show the job stuck; before the first
                # report, not without any stack at all (a job whose lines no progress rule reads is no hang).
                return None
        held = self._held.pop(name, None)
        self._reported[name] = (job.run, newest)
        interval = statistics.median(job.intervals) if job.intervals else 0.0
        behind = self._behind(job)
        fields = {
            "stalled_s": f"{now - newest:.1f}", "threshold_s": f"{thr:.1f}",
            "median_interval_s": f"{interval:.3f}", "last_step": str(job.max_step),
            "ranks": str(sum(1 for r in job.ranks if r >= 0) or len(job.started)),
        }
        if job.step_times:
            fields["median_step_s"] = f"{statistics.median(job.step_times):.3f}"
        if early:
            fields["reports"] = str(job.steps_seen)
        culprit: tuple[int, RankState] | None = None
        gpu_node: str | None = None
        if held is not None and held[:2] == (job.run, newest):
            fields["held_by_stacks"] = held[2][:500]
            fields["held_for_s"] = f"{now - newest - thr:.1f}"
        if exited:
            mode = "rank_exited"
            culprit = (exited[0], job.ranks[exited[0]])
            fields["exited_ranks"] = ",".join(map(str, exited[:32]))
            fields["culprit_rank"] = str(exited[0])
        elif behind:
            mode = "ranks_behind"
            first = min(behind, key=lambda r: (max(job.ranks[r].heard_ts, job.resume_ts), r))
            culprit = (first, job.ranks[first])
            fields["behind_ranks"] = ",".join(str(r) for r in sorted(behind)[:32])
            fields["culprit_rank"] = str(first)
        else:
            mode = "all_stalled"
            gpu_node, gpu_rank, busy = self._idle_gpu(name, job, newest)
            if busy is not None:
                fields["busy_gpus"] = busy
            if gpu_node is not None:
                fields["idle_gpu_node"] = gpu_node
                if gpu_rank is not None:
                    culprit = (gpu_rank, job.ranks[gpu_rank])
                    fields["culprit_rank"] = str(gpu_rank)
        fields["mode"] = mode
        fields["run"] = str(job.run)
        where = job_location(name)
        evidence: tuple[str, ...] = ()
        idle = self.idle(name, newest) if culprit is None and gpu_node is None else None
        if idle is not None:
            where = job_location(name, node=idle[1], rank=idle[0])
            fields["culprit_rank"] = str(idle[0])
            fields["idle_rank"] = idle[2][:500]
            if job.steps_seen:
                msg = (f"job {name}: every rank stalled at step {job.max_step} for {now - newest:.0f} s "
                       f"(threshold {thr:.0f} s); {idle[2]}")
            else:
                msg = (f"job {name}: no progress line {now - newest:.0f} s after its {len(job.started)} rank "
                       f"process(es) started (threshold {thr:.0f} s); {idle[2]}")
        elif culprit is not None:
            rank, st = culprit
            where = job_location(name, node=st.node, rank=rank)
            evidence = (st.signal_id,) if st.signal_id else ()
            msg = (f"job {name} made no progress for {now - newest:.0f} s (threshold {thr:.0f} s); rank {rank} on "
                   f"{st.node} stopped first, at step {st.last_step}")
            if mode == "rank_exited":
                msg = (f"job {name} made no progress for {now - newest:.0f} s (threshold {thr:.0f} s); the container "
                       f"of rank {rank} on {st.node} exited at step {st.last_step} and the others wait for it")
        elif gpu_node is not None:
            where = job_location(name, node=gpu_node)
            msg = (f"job {name} made no progress for {now - newest:.0f} s (threshold {thr:.0f} s) with GPUs busy "
                   f"in a collective; {gpu_node} has an idle GPU")
        elif not job.steps_seen:
            msg = (f"job {name}: no progress line {now - newest:.0f} s after its {len(job.started)} rank process(es) "
                   f"started (threshold {thr:.0f} s); it hangs before its first step")
        else:
            msg = (f"job {name}: every rank stalled at step {job.max_step} for {now - newest:.0f} s "
                   f"(threshold {thr:.0f} s); a collective never completed")
        return Finding(
            id=f"{DETECTOR_ID}:{name}:{newest:.3f}", ts=now, fault_class=FaultClass.HANG, severity=Severity.ERROR,
            hardware=False, where=where, rule_id=DETECTOR_ID, recommended_action=Action.RESTART_JOB,
            evidence=evidence, message=msg, symptom_of=HANG_CAUSES, fields=fields,
        )

    @staticmethod
    def _behind(job: JobState) -> list[int]:
        # Behind means a lower step. When every rank logged the same last step, which one logged it a
        # little earlier is ordinary jitter (log buffering, scheduling), not who stopped the job.
        ranked = [r for r in job.ranks if r >= 0]
        if len(ranked) < 2:
            return []
        top = max(job.ranks[r].last_step for r in ranked)
        behind = [r for r in ranked if job.ranks[r].last_step < top]
        # A majority "behind" is no culprit: it is the few ahead that are odd (or the logs lag).
        return behind if len(behind) * 2 <= len(ranked) else []

    def _idle_gpu(self, name: str, job: JobState, since: float) -> tuple[str | None, int | None, str | None]:
        """An idle GPU among busy ones on the job's nodes, sampled after progress stopped."""
        cfg = self.config
        busy = idle = 0
        idle_at: list[tuple[str, str]] = []
        for node in sorted(self.book.nodes_of(name)):
            for dev, feats in self.book.gpu.get(node, {}).items():
                sample = feats.get("util")
                if sample is None or sample[0] < since:
                    continue
                if sample[1] >= cfg.busy_util:
                    busy += 1
                elif sample[1] <= cfg.idle_util:
                    idle += 1
                    idle_at.append((node, dev))
        if busy + idle == 0:
            return None, None, None
        summary = f"{busy}/{busy + idle}"
        nodes = {n for n, _ in idle_at}
        if len(nodes) != 1 or busy < 3 * idle:
            return None, None, summary
        node = next(iter(nodes))
        # One rank per GPU with local rank = GPU index (torchrun's default): the idle GPU's rank.
        local = sorted(r for r, s in job.ranks.items() if r >= 0 and s.node == node)
        gpus = [d for n, d in idle_at]
        rank = None
        if len(gpus) == 1 and gpus[0].isdigit() and int(gpus[0]) < len(local):
            rank = local[int(gpus[0])]
        return node, rank, summary
