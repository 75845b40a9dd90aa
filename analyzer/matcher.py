"""Rule matching: signals in, findings out (pure)."""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from analyzer.engine import Backend, LineMatch, MultiMatcher
from analyzer.records import Finding, Location
from analyzer.rules import Rule
from collector.signal import DecodedBatch, LogLine, Signal

if TYPE_CHECKING:  # the evaluator imports normalize_pci from here
    from analyzer.metric_eval import SignalEvaluator

_PAYLOAD_TEXT = operator.attrgetter("payload.text")

# torchrun prefixes every line of a rank with "[rank7]:"; the rank is known even when the rule does not ask.
_RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:")
_PCI = re.compile(
    r"^(?:(?P<dom>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{2}):(?P<dev>[0-9a-fA-F]{2})(?:\.[0-7])?$"
)


@functools.lru_cache(maxsize=4096)
def normalize_pci(raw: str) -> str:
    """Canonical PCI id ``dddd:bb:dd`` (NVML's ``00000000:3B:00.0`` and Xid's ``0000:3b:00`` agree).

    Cached: a node has a handful of devices, and their ids come again in line after line.
    """
    m = _PCI.match(raw.strip())
    if not m:
        return raw.strip().lower()
    dom = int(m.group("dom") or "0", 16)
    return f"{dom:04x}:{m.group('bus').lower()}:{m.group('dev').lower()}"


def _int_or_none(raw: str | None) -> int | None:
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def finding_from_match(rule: Rule, signal: Signal, line: LogLine, groups: Mapping[str, str | None]) -> Finding:
    """Build the finding for one matched line: fields come only from matched lines."""
    fields = dict(rule.fields)
    if groups:
        fields.update({k: v for k, v in groups.items() if v is not None})
    pci = normalize_pci(fields["pci"]) if "pci" in fields else None
    rank = _int_or_none(fields.get("rank"))
    if rank is None and line.rank is None and line.text.startswith("[rank"):
        m = _RANK_PREFIX.match(line.text)
        rank = int(m.group(1)) if m else None
    action, severity, hardware = rule.recommended_action, rule.severity, rule.hardware is True
    if rule.decoder is not None:
        row = rule.decoder.decode(fields)
        if row is not None:
            action, severity = row.action, row.severity
            hardware = hardware if row.hardware is None else row.hardware
            fields["decoded_unit"] = row.unit
    if rule.action_from is not None:
        action = rule.action_from.action_for(fields) or action
    return Finding(
        id=f"{rule.id}:{signal.id}",
        ts=signal.ts,
        fault_class=rule.fault_class,
        severity=severity,
        hardware=hardware,
        where=Location(
            node=signal.node, gpu=fields.get("gpu"), pci=pci, port=fields.get("port"),
            rank=rank if rank is not None else line.rank, job=line.job, namespace=line.namespace,
        ),
        rule_id=rule.id,
        recommended_action=action,
        evidence=(signal.id,),
        message=line.text[:500],
        symptom_of=rule.symptom_of,
        fields=fields,
    )


class RegexMatcher:
    """Per-rule regex matcher; every rule is tried on every log line of its sources.

    The naive reference: kept to check the fast engine against and for the benchmark.
    """

    def __init__(self, rules: Sequence[Rule]) -> None:
        self.rules = tuple(rules)

    def match(self, signals: Iterable[Signal]) -> list[Finding]:
        """All findings for the log-line signals of a batch, in signal order."""
        out: list[Finding] = []
        for sig in signals:
            line = sig.payload
            if not isinstance(line, LogLine):
                continue
            for rule in self.rules:
                if not rule.applies_to(sig.source):
                    continue
                m = rule.regex.search(line.text)
                if m:
                    out.append(finding_from_match(rule, sig, line, m.groupdict()))
        return out


class FastMatcher:
    """Same findings as :class:`RegexMatcher`, from one multi-pattern scan per batch.

    With a :class:`SignalEvaluator`, the batch's metric samples and alerts are matched in the
    same step; a batch of log lines only (the common case) pays nothing for it.
    """

    def __init__(self, rules: Sequence[Rule], *, backend: Backend | None = None,
                 signals: SignalEvaluator | None = None) -> None:
        self.rules = tuple(rules)
        self.engine = MultiMatcher(self.rules, backend=backend)
        self.signals = signals

    def match(self, signals: Iterable[Signal]) -> list[Finding]:
        """All findings for the log-line signals of a batch, in signal order (ingest's call into the engine).

        The texts are joined by newlines and encoded once into one buffer (per 1,024 lines), scanned in
        one call; only a hit is mapped back to its signal by its offset, so a signal whose line matches
        nothing costs reading its text and its bytes' share of the scan. A :class:`DecodedBatch` (what
        ``POST /v1/signals`` decodes) brings its texts along, and then not even the text is read per signal.
        """
        others: Sequence[Signal] = ()
        if isinstance(signals, DecodedBatch):
            # As ingest receives it: the decoder kept the texts as it read them, so the batch's objects
            # are not walked again (on a batch no longer in the CPU cache, that walk cost more than the scan).
            if signals.logs is not signals:
                others = signals
            out = self._findings(signals.logs, self.engine.scan(signals.texts))
            if others and self.signals is not None:
                out.extend(self.signals.match(others))
            return out
        logs: Sequence[Signal] = signals if isinstance(signals, list | tuple) else list(signals)
        try:
            # A batch is nearly always all log lines: their texts in one pass (a comprehension reads the
            # slotted fields three times faster than attrgetter). Only a log line has a text, so any
            # other payload raises here and the batch is split by type instead.
            texts: list[str] = [s.payload.text for s in logs]  # type: ignore[union-attr]
        except AttributeError:
            others = logs
            logs = [s for s in logs if isinstance(s.payload, LogLine)]
            texts = list(map(_PAYLOAD_TEXT, logs))
        out = self._findings(logs, self.engine.scan(texts))
        if others and self.signals is not None:
            out.extend(self.signals.match(others))
        return out

    def match_lines(self, logs: Sequence[Signal], lines: bytes) -> list[Finding]:
        """Findings for a batch of log-line signals (nothing else) whose texts arrived as one buffer.

        ``lines``: the texts of ``logs``, in order, joined by newlines (UTF-8), as received. The engine
        scans those bytes as they are, so a line that matches nothing costs no Python step and no
        copy. A buffer that does not hold one line per signal is set aside and the texts are scanned.
        """
        hits = self.engine.scan_lines(lines, len(logs))
        return self.match(logs) if hits is None else self._findings(logs, hits)

    @staticmethod
    def _findings(logs: Sequence[Signal], hits: Iterable[LineMatch]) -> list[Finding]:
        out: list[Finding] = []
        for hit in hits:
            sig = logs[hit.line]
            line = sig.payload
            if isinstance(line, LogLine) and hit.rule.applies_to(sig.source):
                out.append(finding_from_match(hit.rule, sig, line, hit.groups))
        return out
