"""Why a rule did or did not fire on an event: what ``kmend rules test`` prints (pure).

A log line shows the rules that matched, the fields their patterns extracted and the
finding they make; a line nothing matched shows the rules whose example lines are
nearest to it (word overlap to shortlist, then difflib's similarity ratio). Progress
rules are tried too, so a trainer's step line can be debugged the same way. Metric
samples and alerts go through the same evaluator as the service, in order, so a series
of samples shows deltas and consecutive counts.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from analyzer.matcher import finding_from_match
from analyzer.metric_eval import SignalEvaluator, exposition
from analyzer.metric_rules import Condition, MetricRule, SignalRules
from analyzer.progress_rules import ProgressRule
from analyzer.records import Finding
from analyzer.rules import Rule
from collector.signal import LogLine, MetricSample, Signal, Source

_WORD = re.compile(r"[a-z][a-z0-9_]{2,}")
_SHORTLIST = 25


def _words(text: str) -> frozenset[str]:
    return frozenset(_WORD.findall(text.lower()))


def finding_view(f: Finding) -> dict[str, Any]:
    """A finding as the CLI shows it."""
    w = f.where
    return {
        "rule_id": f.rule_id, "fault_class": f.fault_class.value, "hardware": f.hardware,
        "recommended_action": f.recommended_action.value, "severity": f.severity.value,
        "where": {k: v for k, v in (("node", w.node), ("gpu", w.gpu), ("pci", w.pci), ("port", w.port),
                                    ("rank", w.rank), ("job", w.job), ("namespace", w.namespace)) if v is not None},
        "fields": dict(f.fields), "message": f.message,
    }


def _describe(rule: MetricRule) -> str:
    c = rule.condition
    if c is Condition.INCREASED:
        why = f"increase by >= {rule.min_delta:g} since the previous sample of the series"
        if rule.min_rate_per_minute is not None:
            why += f" at >= {rule.min_rate_per_minute:g}/min"
        return why + (" (the first sample counts from 0)" if rule.baseline == "zero" else
                      " (the first sample is only a baseline)")
    if c is Condition.EQUALS:
        what = "value in " + ", ".join(f"{v:g}" for v in sorted(rule.values))
    elif c is Condition.BITS_ANY:
        what = f"any bit of {rule.mask:#x} set"
    else:
        what = f"value {'>' if c is Condition.ABOVE else '<'} {rule.threshold:g}"
    return what + (f" for {rule.for_samples} consecutive samples" if rule.for_samples > 1 else "") + \
        ("" if rule.every_sample else ", once per episode")


class RuleTester:
    """Explains events one at a time, keeping metric state between them."""

    def __init__(self, rules: Sequence[Rule], *, progress_rules: Sequence[ProgressRule] = (),
                 signal_rules: SignalRules | None = None) -> None:
        self.rules = tuple(rules)
        self.progress_rules = sorted(progress_rules, key=lambda r: r.priority)
        self.evaluator = SignalEvaluator(signal_rules or SignalRules(), xid_rules=self.rules)
        self._vocab = [(r, [(_words(ex), ex) for ex in r.examples]) for r in self.rules]

    def explain(self, sig: Signal, *, source_given: bool) -> dict[str, Any]:
        """What the rules make of one event."""
        p = sig.payload
        if isinstance(p, LogLine):
            return self.log(sig, p, source_given=source_given)
        if isinstance(p, MetricSample) and sig.source is Source.ALERT:
            return self.alert(sig, p)
        if isinstance(p, MetricSample):
            return self.metric(sig, p)
        return {"kind": "other", "event": repr(p), "matches": [], "notes": ["not a log line, metric or alert"]}

    def log(self, sig: Signal, line: LogLine, *, source_given: bool) -> dict[str, Any]:
        """Matched rules with their extracted fields, or the nearest rules; and progress extraction."""
        matches: list[dict[str, Any]] = []
        notes: list[str] = []
        for rule in self.rules:
            m = rule.regex.search(line.text)
            if m is None:
                continue
            if source_given and not rule.applies_to(sig.source):
                notes.append(f"{rule.id} matches but only looks at {', '.join(sorted(rule.sources))} lines")
                continue
            groups: dict[str, str | None] = {k: v for k, v in m.groupdict().items() if v is not None}
            matches.append({"rule_id": rule.id, "pack": rule.pack, "sources": sorted(rule.sources) or ["any"],
                            "extracted": groups, "finding": finding_view(finding_from_match(rule, sig, line, groups))})
            if rule.benign_when is not None:
                notes.append(f"{rule.id} is silent when a line matching {' or '.join(rule.benign_when.patterns)!r} "
                             f"comes within {rule.benign_when.window:g}s on the same node: {rule.benign_when.why}")
        for rule in self.rules:
            if rule.benign_when is not None and rule.benign_when.regex.search(line.text) is not None:
                notes.append(f"benign context for {rule.id} within {rule.benign_when.window:g}s on this node: "
                             f"{rule.benign_when.why}")
        out: dict[str, Any] = {"kind": "log", "source": sig.source.value, "event": line.text, "matches": matches}
        if not matches:
            out["nearest"] = self.nearest(line.text)
        out["progress"] = [
            {"rule_id": r.id, "kind": r.kind.value, "extracted": {k: v for k, v in asdict(x).items() if v is not None}}
            for r in self.progress_rules if (x := r.extract(line.text)) is not None
        ]
        if notes:
            out["notes"] = notes
        return out

    def nearest(self, text: str, n: int = 3) -> list[dict[str, Any]]:
        """The rules whose examples look most like the line."""
        words = _words(text)
        scored: list[tuple[float, Rule, str]] = []
        for rule, examples in self._vocab:
            best = max(((len(words & w) / (len(words | w) or 1), ex) for w, ex in examples), key=lambda t: t[0])
            scored.append((best[0], rule, best[1]))
        shortlist = sorted(scored, key=lambda t: -t[0])[:_SHORTLIST]
        ranked: list[tuple[float, Rule, str]] = []
        for overlap, rule, _ in shortlist:
            ratio, example = max((difflib.SequenceMatcher(None, text, ex, autojunk=False).ratio(), ex)
                                 for ex in rule.examples)
            ranked.append(((overlap + ratio) / 2, rule, example))
        ranked.sort(key=lambda t: -t[0])
        return [{"rule_id": r.id, "score": round(s, 3), "example": ex, "pattern": r.pattern}
                for s, r, ex in ranked[:n]]

    def metric(self, sig: Signal, sample: MetricSample) -> dict[str, Any]:
        """Findings of one sample, given the samples explained before it."""
        found = self.evaluator.match([sig])
        watching = self.evaluator.watching(sample.name)
        out: dict[str, Any] = {
            "kind": "metric", "source": sig.source.value, "node": sig.node,
            "event": exposition(sample),
            "matches": [{"rule_id": f.rule_id, "extracted": dict(f.fields), "finding": finding_view(f)}
                        for f in found],
        }
        if not found:
            out["notes"] = [f"{r.id}: needs {_describe(r)}" for r in watching] or \
                [f"no metric rule watches {sample.name}"]
        return out

    def alert(self, sig: Signal, sample: MetricSample) -> dict[str, Any]:
        """The alert rule a firing alert maps to (resolved alerts never make findings)."""
        labels = {"alertname": sample.name, **sample.labels}
        f = self.evaluator.alert_finding(sig, sample)
        out: dict[str, Any] = {"kind": "alert", "node": sig.node,
                               "event": f"{sample.name} ({labels.get('status', 'firing')})", "matches": []}
        if f is not None:
            out["matches"] = [{"rule_id": f.rule_id, "extracted": dict(f.fields), "finding": finding_view(f)}]
        elif sample.value <= 0:
            out["notes"] = ["resolved: no finding"]
        else:
            rule = self.evaluator.alert_rule(labels)
            out["notes"] = [f"no alert rule names {sample.name!r}" if rule is None else "no finding"]
        return out
