"""Analyzer facade: signals in, changed incidents out (pure, stateful, replayable)."""

from __future__ import annotations

from collections.abc import Sequence

from analyzer.correlate import Correlator
from analyzer.detectors.suite import DetectorSuite
from analyzer.engine import Backend
from analyzer.escalate import Escalator
from analyzer.matcher import FastMatcher
from analyzer.records import Finding, Incident
from analyzer.rules import Rule
from collector.signal import LogLine, ProgressSample, Signal


class Analyzer:
    """Matches rules on signal batches and folds the findings into incidents."""

    def __init__(
        self, rules: Sequence[Rule], *, correlator: Correlator | None = None, backend: Backend | None = None,
        detectors: DetectorSuite | None = None,
    ) -> None:
        self.rules = tuple(rules)
        self.matcher = FastMatcher(self.rules, backend=backend)
        self.escalator = Escalator(self.rules)
        self.correlator = correlator or Correlator()
        self.detectors = detectors

    def findings(self, signals: Sequence[Signal]) -> list[Finding]:
        """Findings of a batch, escalations included, without folding (learns job placement, feeds the detectors)."""
        for sig in signals:
            p = sig.payload
            if isinstance(p, LogLine | ProgressSample) and p.job:
                self.correlator.observe_placement(p.job, sig.node)
        if self.detectors is not None:
            self.detectors.observe(signals)
        found = self.matcher.match(signals)
        return found + self.escalator.observe_all(found)

    def process(self, signals: Sequence[Signal]) -> tuple[list[Finding], list[Incident]]:
        """Findings of a batch and the incidents they created or changed."""
        found = self.findings(signals)
        return found, self.correlator.add_all(found)

    def evaluate(self, now: float) -> tuple[list[Finding], list[Incident]]:
        """The detectors' verdicts at `now` (hang, straggler, Flight Recorder), folded like rule findings."""
        found = self.detectors.evaluate(now) if self.detectors is not None else []
        return found, self.correlator.add_all(found)
