"""Analyzer facade: signals in, changed incidents out (pure, stateful, replayable)."""

from __future__ import annotations

from collections.abc import Sequence

from analyzer.correlate import Correlator
from analyzer.detectors.suite import DetectorSuite
from analyzer.matcher import RegexMatcher
from analyzer.records import Finding, Incident
from analyzer.rules import Rule
from collector.signal import LogLine, ProgressSample, Signal


class Analyzer:
    """Matches rules on signal batches and folds the findings into incidents."""

    def __init__(self, rules: Sequence[Rule], *, correlator: Correlator | None = None,
                 detectors: DetectorSuite | None = None) -> None:
        self.rules = tuple(rules)
        self.matcher = RegexMatcher(self.rules)
        self.correlator = correlator or Correlator()
        self.detectors = detectors

    def findings(self, signals: Sequence[Signal]) -> list[Finding]:
        """Findings of a batch, without folding (also learns job placement and feeds the detectors)."""
        for sig in signals:
            p = sig.payload
            if isinstance(p, LogLine | ProgressSample) and p.job:
                self.correlator.observe_placement(p.job, sig.node)
        if self.detectors is not None:
            self.detectors.observe(signals)
        return self.matcher.match(signals)

    def process(self, signals: Sequence[Signal]) -> tuple[list[Finding], list[Incident]]:
        """Findings of a batch and the incidents they created or changed."""
        found = self.findings(signals)
        return found, self.correlator.add_all(found)

    def evaluate(self, now: float) -> tuple[list[Finding], list[Incident]]:
        """The detectors' verdicts at `now` (hang, straggler, Flight Recorder), folded like rule findings."""
        found = self.detectors.evaluate(now) if self.detectors is not None else []
        return found, self.correlator.add_all(found)
