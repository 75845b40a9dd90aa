"""The detectors as one unit: signals in (progress, metrics), findings out at ``evaluate(now)``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from analyzer.detectors.book import JobBook
from analyzer.detectors.flight_recorder import Dump, FlightRecorderDetector, RankDump, SettledJob, load_dump
from analyzer.detectors.hang import HangConfig, HangDetector
from analyzer.detectors.stacks import (
    StackDetector,
    StackSample,
    exoneration,
    idle_message,
    idle_ranks,
    main_frames,
    place,
)
from analyzer.detectors.straggler import StragglerConfig, StragglerDetector
from analyzer.detectors.survey import SurveyDetector
from analyzer.detectors.witnesses import WitnessDetector
from analyzer.progress import ProgressEvent, ProgressExtractor
from analyzer.progress_rules import ProgressRule
from analyzer.records import Finding
from collector.signal import MetricSample, Signal

_T = TypeVar("_T")


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:300]}"


@dataclass(frozen=True, slots=True)
class DetectorFailure:
    """One detector (or one job's data in it) failed; the others went on."""

    detector: str
    """Detector id (``hang``, ``straggler``, ``flight-recorder``)."""
    error: str
    """What went wrong (exception type and message), for the log."""
    job: str = ""
    """The job whose data it was judging, when known."""


class DetectorSuite:
    """Progress extraction, the shared job book, and the hang, straggler, Flight Recorder, timeout-witness,
    stack-dump and stack-survey detectors."""

    def __init__(self, progress_rules: Sequence[ProgressRule] = (), *, hang: HangConfig | None = None,
                 straggler: StragglerConfig | None = None, flight_recorder_settle_s: float = 10.0,
                 forget_after_s: float = 86400.0) -> None:
        self.extractor = ProgressExtractor(progress_rules)
        self.book = JobBook()
        self.hang = HangDetector(self.book, hang)
        self.straggler = StragglerDetector(self.book, straggler)
        self.flight_recorder = FlightRecorderDetector(settle_s=flight_recorder_settle_s)
        self.witnesses = WitnessDetector(self.book)
        self.stacks = StackDetector()
        self.survey = SurveyDetector(self.book)
        self.hang.exonerate = self._exonerate
        self.hang.confirmed = self._confirmed
        self.hang.idle = self._idle
        self.survey.hung = self.hang.reported
        self.forget_after_s = forget_after_s
        """A job silent this long is dropped from memory (its hang, if any, was reported long before)."""
        self.watermark = 0.0
        """Latest signal time seen (event time: replayed traces judge by their own clock)."""
        self._failures: list[DetectorFailure] = []

    def observe(self, signals: Sequence[Signal]) -> list[ProgressEvent]:
        """Feed a batch; returns the progress events found (findings come from ``evaluate``)."""
        events = self.extractor.extract(signals)
        for ev in events:
            self.book.observe_progress(ev)
        self._drop_merged()
        for sig in signals:
            if isinstance(sig.payload, MetricSample):
                self.book.observe_metric(sig)
                self.survey.observe(sig)
            if sig.ts > self.watermark:
                self.watermark = sig.ts
        return events

    def observe_pods(self, placements: Iterable[tuple[str, str]], ts: float) -> None:
        """(job key, node) pairs a batch's lines showed: a job a reporter named bare on a node takes the namespace
        its pods there name (``namespace/job`` keys; bare keys say nothing)."""
        for key, node in placements:
            ns, sep, name = key.partition("/")
            if sep:
                self.book.observe_pod_job(node, ns, name, ts)
        self._drop_merged()

    def observe_digest(self, events: Sequence[ProgressEvent], metrics: Sequence[Signal], newest: float) -> None:
        """Progress events and detector metrics another replica extracted from its batch (see ``observe``)."""
        for ev in events:
            self.book.observe_progress(ev)
        self._drop_merged()
        for sig in metrics:
            self.book.observe_metric(sig)
            self.survey.observe(sig)
        if newest > self.watermark:
            self.watermark = newest

    def observe_findings(self, findings: Sequence[Finding]) -> None:
        """Rule findings of a batch: collective-timeout lines say which ranks were left waiting."""
        self.witnesses.observe(list(findings))

    def add_stack(self, job: str, sample: StackSample, ts: float) -> None:
        """Keep one rank's Python stack dump (captured by the node agent on a suspected hang)."""
        job = self._key(job)
        state = self.book.jobs.get(job)
        ranks = sum(1 for r in state.ranks if r >= 0) if state else 0
        known = {r: st.node for r, st in state.ranks.items() if r >= 0} if state else {}
        self.stacks.add(job, sample, ts, ranks=ranks, known=known)
        self.watermark = max(self.watermark, ts)

    def _exonerate(self, job: str, since: float) -> str | None:
        """Why the stacks taken since the job's last progress show it slow rather than hung (None: they don't)."""
        state = self.book.jobs.get(job)
        ranks = (sum(1 for r in state.ranks if r >= 0) or len(state.started)) if state else 0
        if self.stacks.spinning(job, since, ranks):
            return None  # busy in the same place for minutes while the others wait: stuck, not slow
        return exoneration(self.stacks.fresh(job, since), ranks, self.stacks.earlier(job, since),
                           self.stacks.apart(job))

    def _ranks(self, job: str) -> int:
        """The job's ranks as its reports and started processes tell them (at least one)."""
        state = self.book.jobs.get(job)
        return max(sum(1 for r in state.ranks if r >= 0) or len(state.started), 1) if state else 1

    def _idle(self, job: str, since: float) -> tuple[int, str, str] | None:
        """The rank that two looks taken since the job's last progress show blocked for good in its own code while
        its peers wait in a collective (``idle_ranks``): (rank, node, what the stacks show); None when none."""
        fresh = self.stacks.fresh(job, since)
        idle = idle_ranks(fresh, self._ranks(job), self.stacks.earlier(job, since), self.stacks.apart(job))
        if idle:
            return idle[0], fresh[idle[0]].node, idle_message(fresh, idle)
        spin = self.stacks.spinning(job, since, self._ranks(job))
        return (spin[0], fresh[spin[0]].node, self.stacks.spin_message(job, spin[0])) if spin else None

    def _confirmed(self, job: str, since: float) -> bool | None:
        """Whether stacks taken since the job's last progress show it stuck: every rank answered, and a process is
        stopped, or two looks found the job where it was and in a hang's shape (``exoneration``: none); None when
        no stack of it was taken since."""
        state = self.book.jobs.get(job)
        ranks = self._ranks(job)
        fresh = self.stacks.fresh(job, since)
        if not fresh:
            return None
        if len(fresh) < ranks:
            return False
        if any(s.stopped for s in fresh.values()):
            return True
        if self.stacks.spinning(job, since, ranks):
            return True
        if state is None or not state.steps_seen:
            # Start-up has ranks waiting at a barrier for one still importing or compiling (a compile's wait loop
            # does not move): before the first report only a stopped process, or one that two looks found idle
            # (same stack, no CPU used) in its own code while the others wait, is a hang at the first look.
            return self._idle(job, since) is not None
        earlier = self.stacks.earlier(job, since)
        if len(earlier) < ranks or exoneration(fresh, ranks, earlier, self.stacks.apart(job)) is not None:
            return False
        # Every rank in a collective, twice, is a hang only for a job whose pace is known: a first step of tens of
        # seconds spends most of them in backward's all-reduce too. A rank stuck elsewhere is a hang either way.
        return bool(state and (state.intervals or state.step_times)) or any(
            place(main_frames(s.text)) != "collective" for s in fresh.values())

    def _key(self, job: str) -> str:
        """The book's key for a job an agent or operator named as ``namespace/job`` or by its bare name."""
        ns, sep, name = job.partition("/")
        return self.book.key_for(ns, name) if sep else self.book.key_for(None, job)

    def end_job(self, job: str, ts: float) -> None:
        """The job's pods are done (the API says so): its silence from now on is no hang."""
        state = self.book.jobs.get(job)
        if state is not None and (state.ended_at is None or state.ended_by_exits):
            state.ended_at, state.ended_by_exits = state.ended_at or ts, False

    def suspects(self, now: float) -> list[tuple[str, list[str], float]]:
        """Jobs that look stalled (with their nodes and the time of their last progress): where to capture evidence."""
        return [(job, sorted(self.book.nodes_of(job)), since) for job, since in self.hang.suspects(now)]

    def evidence_round(self, job: str, now: float) -> int:
        """0 for the first evidence asked for in a job's silence; 1, 2, ... for newer stacks while they hold it."""
        return self.hang.evidence_round(job, now)

    def add_flight_recorder_dump(self, job: str, rank: int, node: str, data: bytes, ts: float,
                                 source: str = "") -> None:
        """Parse (safely) and keep one rank's Flight Recorder dump; raises DumpError on a bad one."""
        self.add_checked_dump(job, rank, node, load_dump(data), ts, source)

    def add_checked_dump(self, job: str, rank: int, node: str, dump: Dump, ts: float, source: str = "") -> None:
        """Keep one rank's dump already read by ``load_dump`` (callers parse it outside their locks)."""
        self.flight_recorder.add(self._key(job), RankDump(rank=rank, node=node, doc=dump, source=source), ts)
        self.watermark = max(self.watermark, ts)

    def take_settled_dumps(self, now: float) -> list[SettledJob]:
        """Jobs whose dumps are ready to be judged, removed from the detector (cheap)."""
        return self.flight_recorder.take_settled(now)

    def judge_dumps(self, settled: Sequence[SettledJob]) -> list[Finding]:
        """Judge settled dumps (the heavy part; touches only failure records). One bad job never stops the rest."""
        out: list[Finding] = []
        for job in settled:
            try:
                f = self.flight_recorder.judge(job)
            except Exception as exc:  # one job's data must not stop the others: recorded, then dropped
                self._failures.append(DetectorFailure(self.flight_recorder.id, _why(exc), job.job))
                continue
            if f is not None:
                out.append(f)
        return out

    def evaluate(self, now: float, judged: Sequence[Finding] | None = None) -> list[Finding]:
        """Every detector's findings at `now`; each finding is emitted once.

        `judged` are Flight Recorder findings the caller judged from ``take_settled_dumps``
        (outside its lock); dumps settled since are judged here. A detector that raises is
        recorded in ``take_failures`` and the others still run.
        """
        found = self._guarded("hang", lambda: self.hang.evaluate(now))
        found += self._guarded("straggler", lambda: self.straggler.evaluate(now))
        self._failures.extend(DetectorFailure("straggler", why, job) for job, why in self.straggler.failures)
        self.straggler.failures.clear()
        found += self._guarded("witnesses", lambda: self.witnesses.evaluate(now))
        found += self._guarded("stacks", lambda: self.stacks.evaluate(now, self.hang.verdict))
        found += self._guarded("survey", lambda: self.survey.evaluate(now))
        for job in self.book.expire(now, self.forget_after_s):
            self.forget(job)
        fr = list(judged or ())
        fr += self.judge_dumps(self._guarded(self.flight_recorder.id, lambda: self.take_settled_dumps(now)))
        for f in fr:
            if self.flight_recorder.first_report(f):
                found.append(self._placed(f))
        return found

    def _drop_merged(self) -> None:
        """Bare job keys the book folded into their namespaced job: what the detectors kept under them goes
        (the step counters stay: they belong to the reporter, which goes on naming no namespace)."""
        for job, into in self.book.merged:
            # A stall already reported under the bare name is the same episode under the namespaced one.
            self.hang.carry(job, into)
            for detector in (self.hang, self.straggler, self.flight_recorder, self.witnesses, self.stacks,
                             self.survey):
                detector.forget(job)
        self.book.merged.clear()

    def forget(self, job: str) -> None:
        """A job left the book (silent for `forget_after_s`): every detector drops what it kept about it."""
        for detector in (self.extractor, self.hang, self.straggler, self.flight_recorder, self.witnesses,
                         self.stacks, self.survey):
            detector.forget(job)

    def take_failures(self) -> list[DetectorFailure]:
        """Failures since the last call (the service logs and counts them)."""
        out, self._failures = self._failures, []
        return out

    def _guarded(self, detector: str, run: Callable[[], list[_T]]) -> list[_T]:
        try:
            return run()
        except Exception as exc:  # isolation: the other detectors still run this round
            self._failures.append(DetectorFailure(detector, _why(exc)))
            return []

    def _placed(self, f: Finding) -> Finding:
        # A rank that wrote no dump has no node in the dumps; its progress reports know it.
        if f.where.node is None and f.where.rank is not None and f.where.job is not None:
            job = self.book.jobs.get(self.book.key_for(f.where.namespace, f.where.job))
            st = job.ranks.get(f.where.rank) if job else None
            if st is not None:
                return replace(f, where=replace(f.where, node=st.node))
        return f
