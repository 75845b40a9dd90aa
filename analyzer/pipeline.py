"""Analyzer facade: signals in, changed incidents out (pure, stateful, replayable)."""

from __future__ import annotations

import operator
from collections.abc import Sequence

from analyzer.context import ContextGate
from analyzer.correlate import Correlator
from analyzer.detectors.suite import DetectorSuite
from analyzer.digest import BatchDigest, detector_metrics
from analyzer.engine import Backend
from analyzer.escalate import Escalator
from analyzer.matcher import FastMatcher
from analyzer.metric_eval import SignalEvaluator
from analyzer.records import SEVERITY_RANK, Action, Finding, Incident, Severity
from analyzer.rules import Rule
from collector.signal import LogLine, ProgressSample, Signal

_PAYLOAD = operator.attrgetter("payload")
_JOB = operator.attrgetter("namespace", "job")
_NODE = operator.attrgetter("node")
_TS = operator.attrgetter("ts")


def _placements(signals: Sequence[Signal]) -> set[tuple[str, str]]:
    """(job key, node) pairs a batch shows, each once (the key is ``namespace/job`` when the namespace is known).

    A batch is thousands of log lines from a few pods: collecting the distinct pairs in C and
    recording each once costs far less than a Python step per signal.
    """
    payloads = list(map(_PAYLOAD, signals))
    if set(map(type, payloads)) <= {LogLine, ProgressSample}:
        pairs = set(zip(map(_JOB, payloads), map(_NODE, signals), strict=True))
    else:
        pairs = {((p.namespace, p.job), s.node) for s, p in zip(signals, payloads, strict=True)
                 if isinstance(p, LogLine | ProgressSample)}
    return {(f"{ns}/{job}" if ns else job, node) for (ns, job), node in pairs if job}


def strongest_per_signal(found: Sequence[Finding], generic: frozenset[str] = frozenset()) -> list[Finding]:
    """One finding per evidence signal: a specific rule's over a catch-all's (``generic``: rule ids),
    then the most severe, then the first in rule order."""
    best: dict[str, tuple[tuple[bool, int], Finding]] = {}
    for f in found:
        key = f.evidence[0] if f.evidence else f.id
        r = (f.rule_id not in generic, SEVERITY_RANK[f.severity])
        if key not in best or r > best[key][0]:
            best[key] = (r, f)
    return [f for _, f in best.values()]


def drop_shadowed_generic(found: Sequence[Finding], generic: frozenset[str]) -> list[Finding]:
    """The findings less a catch-all's on a signal a specific rule also matched (the specific one names the cause)."""
    specific = {f.evidence[0] for f in found if f.evidence and f.rule_id not in generic}
    return [f for f in found if f.rule_id not in generic or not f.evidence or f.evidence[0] not in specific]


class Analyzer:
    """Matches rules on signal batches and folds the findings into incidents."""

    def __init__(
        self, rules: Sequence[Rule], *, correlator: Correlator | None = None, backend: Backend | None = None,
        detectors: DetectorSuite | None = None, signals: SignalEvaluator | None = None,
        matcher: FastMatcher | None = None, one_finding_per_signal: bool = False,
    ) -> None:
        self.rules = tuple(rules)
        # A folded multi-line event (an AER dump, a traceback) is one signal and must be one finding.
        self.one_finding_per_signal = one_finding_per_signal
        self._generic = frozenset(r.id for r in self.rules if r.generic)
        # Metric and alert rules keep per-series state: the caller owns it, so it outlives a rebuild.
        # A compiled matcher without that state can be shared by analyzers of many small bundles.
        self.matcher = matcher or FastMatcher(self.rules, backend=backend, signals=signals)
        self.escalator = Escalator(self.rules)
        # Findings that context on their node explains (a deliberate kubelet restart) are dropped.
        self.context = ContextGate(self.rules)
        # Informational rules that escalate on a rate (corrected PCIe/EDAC errors): one line below
        # the rate is recorded as a finding but opens no incident; only the escalation does.
        self._below_rate = frozenset(
            r.id for r in self.rules
            if r.escalation is not None and r.escalation.count >= 2
            and r.severity is Severity.INFO and r.recommended_action is Action.NONE
        )
        self.correlator = correlator or Correlator()
        self.detectors = detectors

    def _one_cause_per_signal(self, found: list[Finding]) -> list[Finding]:
        """The findings with a catch-all's dropped where a specific rule matched the same signal; with
        ``one_finding_per_signal``, only the strongest of each signal."""
        if len(found) < 2:
            return found
        if self.one_finding_per_signal:
            return strongest_per_signal(found, self._generic)
        return drop_shadowed_generic(found, self._generic) if self._generic else found

    def findings(self, signals: Sequence[Signal], *, lines: bytes | None = None) -> list[Finding]:
        """Findings of a batch, escalations included, without folding (learns job placement, feeds the detectors).

        ``lines``: for a batch of log lines only, their texts as received, joined by newlines (see
        :meth:`FastMatcher.match_lines`).
        """
        if signals:
            # One time per batch (its newest record): a batch spans seconds, placements expire in minutes.
            ts = max(map(_TS, signals))
            placed = _placements(signals)
            for job, node in placed:
                self.correlator.observe_placement(job, node, ts)
            if self.detectors is not None:
                self.detectors.observe_pods(placed, ts)
        if self.detectors is not None:
            self.detectors.observe(signals)
        found = self.matcher.match(signals) if lines is None else self.matcher.match_lines(signals, lines)
        if self.context.active:
            found = self.context.filter(signals, found)
        found = self._one_cause_per_signal(found)
        if self.detectors is not None and found:
            self.detectors.observe_findings(found)
        return found + self.escalator.observe_all(found)

    def process(self, signals: Sequence[Signal], *, lines: bytes | None = None,
                ) -> tuple[list[Finding], list[Incident]]:
        """Findings of a batch and the incidents they created or changed (``lines``: see :meth:`findings`)."""
        found = self.findings(signals, lines=lines)
        below = self._below_rate
        folded = [f for f in found if f.rule_id not in below or f.severity is not Severity.INFO] if below else found
        return found, self.correlator.add_all(folded)

    def evaluate(self, now: float, judged: Sequence[Finding] | None = None) -> tuple[list[Finding], list[Incident]]:
        """The detectors' verdicts at `now` (hang, straggler, Flight Recorder), folded like rule findings.

        `judged`: Flight Recorder findings judged by the caller off its lock (see DetectorSuite).
        """
        found = self.detectors.evaluate(now, judged) if self.detectors is not None else []
        return found, self.correlator.add_all(found)

    def digest(self, signals: Sequence[Signal]) -> BatchDigest:
        """A replica's half of ``findings``: rules, metric series and progress extraction, no correlation.

        Escalation, placements, the job book and the correlator are the leader's (``fold``).
        """
        found = self.matcher.match(signals)
        if self.context.active:
            found = self.context.filter(signals, found)
        found = self._one_cause_per_signal(found)
        newest = max(map(_TS, signals)) if signals else 0.0
        progress = self.detectors.extractor.extract(signals) if self.detectors is not None else []
        return BatchDigest(tuple(found), tuple(sorted(_placements(signals))), newest, tuple(progress),
                           detector_metrics(list(signals)), newest)

    def fold(self, digest: BatchDigest) -> tuple[list[Finding], list[Incident]]:
        """The leader's half: a replica's digest into placements, detectors, escalation and incidents."""
        for job, node in digest.placements:
            self.correlator.observe_placement(job, node, digest.placed_at)
        if self.detectors is not None:
            self.detectors.observe_pods(digest.placements, digest.placed_at)
            self.detectors.observe_digest(digest.progress, digest.metrics, digest.newest)
            for st in digest.stacks:
                self.detectors.add_stack(st.job, st.sample, st.ts)
            for d in digest.dumps:
                self.detectors.add_checked_dump(d.job, d.rank, d.node, d.dump, d.ts, source=d.source)
            if digest.findings:
                self.detectors.observe_findings(digest.findings)
        found = list(digest.findings)
        found += self.escalator.observe_all(found)
        below = self._below_rate
        folded = [f for f in found if f.rule_id not in below or f.severity is not Severity.INFO] if below else found
        return found, self.correlator.add_all(folded)
