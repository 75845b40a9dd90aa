"""Stragglers from the node agents' stack surveys: the rank the others wait for.

A synchronous job's ranks log each step together, however slow one of them is when its
slowness lies before the gradient all-reduce. The agents' surveys (``collector.survey``)
say where each rank's main thread spent its sampled time. A healthy job's ranks look
alike; when one rank is slow, its peers spend the difference waiting in the collective,
and it spends it elsewhere (its own code, its data loader, a starved CPU). A rank is a
straggler when, in `persistence` surveys in a row, its share outside the collectives and
the healthy busy places (checkpoint, evaluation) is at least `ratio` times its peers'
median and `min_gap` above every peer's, while its peers spend at least `peers_wait` of their time
in collectives. Ranks need `min_samples` samples in a survey to count; a job that is not
progressing (a hang is the hang detector's) or has finished is not judged.

A rank slowed from outside (CPU contention, a CPU quota, something stopping and continuing it) runs the same code as
its peers, only less of the time, so its stack samples look like theirs. The surveys also say how much of the window
each rank's main thread could not run (``collector.sched``: stopped, or runnable and waiting for a CPU); a rank whose
share of that is `ratio` times its peers' median and `held_gap` above every peer's, while its peers wait in the
collectives, is named the same way (a rank stopped nearly the whole window is a hang, the hang detector's).

A job that prints no progress (a progress bar that draws nothing without a terminal) has no step in the book; it is
judged from the surveys alone, by the same rules, while they show it running
rather than hung: every peer of the rank judged showed at least `min_stacks` distinct main-thread stacks in its
survey, some of its samples in the collectives and at least `min_outside` of them out of them (it enters and leaves
them: a hung job's peers sit in one collective, one stack, every sample). Surveys from agents that do not count
stacks leave such a job unjudged, and so does a silence the hang detector called a hang (``hung``). A run that has
printed steps and stopped is not judged in its silence (as before): it may be hanging, and a rank stopped partway
through a survey's window looks held back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from statistics import median

from analyzer.detectors.book import JobBook
from analyzer.records import Action, FaultClass, Finding, Severity, job_location
from collector.signal import MetricSample, Signal
from collector.survey import METRIC

DETECTOR_ID = "straggler-detector"
"""The straggler detector's id: the policy treats a straggler alike whatever named it."""
_BUSY = ("share_checkpoint", "share_evaluation")
"""Places where a rank is busy with work its peers wait for by design (checkpoint writes, evaluation)."""


@dataclass(frozen=True, slots=True)
class SurveyConfig:
    """Thresholds for naming a straggler from stack surveys."""

    min_samples: int = 40
    """Samples a rank needs in a survey."""
    ratio: float = 2.0
    """The rank's share outside collectives, over its peers' median."""
    min_gap: float = 0.15
    """... and at least this much above the highest of its peers' (absolute share)."""
    peers_wait: float = 0.3
    """Median share of the peers' time in collectives (they wait for the slow one)."""
    persistence: int = 2
    """Surveys in a row that must agree."""
    max_age_s: float = 60.0
    """A rank's survey older than this is not compared."""
    idle_s: float = 30.0
    """A job whose progress is older than this is not judged (stalled or gone)."""
    held_gap: float = 0.25
    """A rank's share of the window it could not run must be at least this much above every peer's (wider than
    `min_gap`: on a loaded machine the run-queue wait of healthy ranks differs by 0.1-0.2 from survey to survey)."""
    max_stopped: float = 0.9
    """A rank stopped at least this share of a survey is not a straggler: it hardly runs (the hang detector's)."""
    min_stacks: int = 2
    """In a job with no recent progress, the distinct main-thread stacks each peer's survey must show (a peer of a
    hung job shows one: the collective it sits in)."""
    min_outside: float = 0.004
    """... and the least share of its samples out of the collectives, to show it leaves them as well as enters them
    (one sample of a default survey's 200: a peer waiting for a rank that sleeps 0.1 s a step is out 1-3 %)."""


@dataclass(slots=True)
class _Rank:
    node: str
    ts: float
    outside: float
    collective: float
    samples: int
    where: str
    signal_id: str
    """Evidence: the survey sample."""
    stacks: int | None = None
    """Distinct main-thread stacks in the survey; None: the agent did not count them."""
    held: float | None = None
    """Share of the window the rank could not run (stopped or waiting for a CPU); None: not measured."""
    stopped: float = 0.0
    """Share of the window it was stopped."""
    streak: int = 0
    counted: float = 0.0
    """Time of the survey last counted in `streak`."""
    open_ts: float | None = None
    """When the reported episode began (one finding per episode)."""


class SurveyDetector:
    """Names the rank of a job its peers wait for, from the agents' stack surveys."""

    def __init__(self, book: JobBook, config: SurveyConfig | None = None) -> None:
        self.book = book
        self.config = config or SurveyConfig()
        self._jobs: dict[str, dict[int, _Rank]] = {}
        """Per job key, each rank's latest survey."""
        self.hung: Callable[[str], bool] = lambda job: False
        """Whether the hang detector called the job's current silence a hang (it is not judged then)."""

    def observe(self, sig: Signal) -> None:
        """Keep a rank's latest survey (``kmend_rank_stack_share`` samples; others are ignored)."""
        p = sig.payload
        if not isinstance(p, MetricSample) or p.name != METRIC:
            return
        labels = p.labels
        job, rank = labels.get("job"), labels.get("rank", "")
        if not job or not rank.isdigit():
            return
        key = self.book.key_for(labels.get("namespace") or None, job, node=sig.node)
        busy = sum(_share(labels, k) for k in _BUSY)
        outside = max(0.0, 1.0 - p.value - busy)
        places = {k[6:].replace("_", " "): _share(labels, k) for k in labels if k.startswith("share_")}
        where = max((k for k in places if k != "collective"), key=lambda k: places[k], default="code")
        ranks = self._jobs.setdefault(key, {})
        old = ranks.get(int(rank))
        samples = labels.get("samples", "0")
        new = _Rank(sig.node, sig.ts, outside, p.value, int(samples) if samples.isdigit() else 0, where, sig.id)
        stacks = labels.get("stacks", "")
        new.stacks = int(stacks) if stacks.isdigit() else None
        if "cpu_wait" in labels or "stopped" in labels:
            new.stopped = _share(labels, "stopped")
            new.held = min(_share(labels, "cpu_wait") + new.stopped, 1.0)
        if old is not None:
            new.streak, new.counted, new.open_ts = old.streak, old.counted, old.open_ts
        ranks[int(rank)] = new

    def evaluate(self, now: float) -> list[Finding]:
        """Straggler findings for ranks flagged in `persistence` surveys in a row (once per episode)."""
        cfg = self.config
        out = []
        for key in list(self._jobs):
            state = self.book.jobs.get(key)
            if state is None or state.finished:
                del self._jobs[key]
                continue
            last = max((r.last_ts for r in state.ranks.values()), default=0.0)
            fresh = {r: s for r, s in self._jobs[key].items() if now - s.ts <= cfg.max_age_s}
            ranks = {r: s for r, s in fresh.items() if s.samples >= cfg.min_samples}
            # Judged from the surveys alone only while the run has printed no step: a run whose steps stopped may be
            # hanging (a rank stopped partway through a survey looks held back), which is the hang detector's.
            idle = now - last > cfg.idle_s
            silent = idle and not state.steps_seen
            if len(fresh) < 2 or not ranks or (idle and (state.steps_seen or self.hung(key))):
                continue
            for r, s in fresh.items():
                if s.ts <= s.counted:
                    continue  # no new survey of this rank since it was last counted
                s.counted = s.ts
                peers = [p for q, p in ranks.items() if q != r]
                if not peers:
                    continue
                if silent and not self._running([p for q, p in fresh.items() if q != r]):
                    s.streak, s.open_ts = 0, None  # no progress, and no sign that the job runs: not judged
                    continue
                ref, wait = median(p.outside for p in peers), median(p.collective for p in peers)
                # It stands alone: two ranks that both work while the rest wait are a role (a pipeline
                # stage, rank 0's logging), not a straggler.
                flagged = (r in ranks and wait >= cfg.peers_wait and s.outside >= cfg.ratio * ref
                           and s.outside - max(p.outside for p in peers) >= cfg.min_gap)
                held = self._held(s, [p for q, p in fresh.items() if q != r], wait)
                s.streak = s.streak + 1 if flagged or held is not None else 0
                if not flagged and held is None:
                    s.open_ts = None
                    continue
                if s.streak < cfg.persistence or s.open_ts is not None:
                    continue
                s.open_ts = s.ts
                out.append(self._finding(key, r, s, ref, wait, len(fresh), now, None if flagged else held, silent))
        return out

    def _running(self, others: list[_Rank]) -> bool:
        """Whether the surveys of a rank's peers show them running: each entered and left the collectives in its
        window, through `min_stacks` distinct stacks (never from an agent that does not count them)."""
        cfg = self.config
        return all(p.stacks is not None and p.stacks >= cfg.min_stacks and p.samples >= cfg.min_samples
                   and p.collective > 0.0 and 1.0 - p.collective >= cfg.min_outside for p in others)

    def _held(self, s: _Rank, others: list[_Rank], wait: float) -> float | None:
        """The peers' median share of the window they could not run, when `s` could not run far more of it than every
        one of them while they waited in the collectives (None: it could run as they did, or it was not measured)."""
        cfg = self.config
        peers = [p.held for p in others if p.held is not None]
        if s.held is None or not peers or wait < cfg.peers_wait or s.stopped >= cfg.max_stopped:
            return None
        ref = median(peers)
        return ref if s.held >= cfg.ratio * ref and s.held - max(peers) >= cfg.held_gap else None

    def _finding(self, job: str, rank: int, s: _Rank, ref: float, wait: float, ranks: int, now: float,
                 held: float | None, silent: bool = False) -> Finding:
        fields = {"basis": "stacks", "outside_share": f"{s.outside:.3f}", "peers_outside_share": f"{ref:.3f}",
                  "peers_collective_share": f"{wait:.3f}", "where": s.where, "samples": str(s.samples),
                  "surveys": str(s.streak), "ranks_surveyed": str(ranks)}
        if not s.samples:
            del fields["outside_share"]  # its stacks could not be sampled (stopped when the survey began)
        if silent:
            fields["progress"] = "none recent: judged from the surveys alone"
        if s.held is not None:
            fields.update({"held_share": f"{s.held:.3f}", "stopped_share": f"{s.stopped:.3f}"})
        if held is None:
            because = (f"spent {s.outside:.0%} of its sampled time outside the collectives (mostly in {s.where}) "
                       f"while its peers waited in them {wait:.0%} of theirs (outside {ref:.0%})")
        else:
            fields.update({"where": "stopped" if 2 * s.stopped >= (s.held or 0.0) else "waiting for a CPU",
                           "peers_held_share": f"{held:.3f}"})
            because = (f"could not run {s.held or 0.0:.0%} of the time (stopped {s.stopped:.0%}, the rest waiting "
                       f"for a CPU; its peers {held:.0%}) while they waited in the collectives {wait:.0%} of theirs")
        return Finding(
            id=f"{DETECTOR_ID}:{job}:{rank}:stacks:{s.open_ts:.3f}", ts=now, fault_class=FaultClass.STRAGGLER,
            severity=Severity.WARNING, hardware=False, where=job_location(job, node=s.node, rank=rank),
            rule_id=DETECTOR_ID, recommended_action=Action.NOTIFY, fields=fields, evidence=(s.signal_id,),
            message=f"rank {rank} on {s.node} {because}, in {s.streak} stack surveys in a row: the others wait for it",
        )

    def forget(self, job: str) -> None:
        """Drop what was kept about `job`."""
        self._jobs.pop(job, None)


def _share(labels: Mapping[str, str], key: str) -> float:
    try:
        return float(labels.get(key, "0") or 0)
    except ValueError:
        return 0.0
