"""Benign context: lines near a finding, on the same node, that make it no fault at all.

A rule's ``benign_when`` names context lines (systemd's ``Stopping ... kubelet`` around a
kubelet exit is a deliberate restart; a host that reports no NVSwitch has no fabric for fabric
manager to manage). A finding of that rule is dropped when such a line on its node lies within
the window, before it (in this batch or an earlier one) or after it (in the same batch: a bundle's
tick, an agent's flush). Time comes only from the signals, so a replay gives the same answer.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Sequence

from analyzer.records import Finding
from analyzer.rules import BenignContext, Rule
from collector.signal import LogLine, Signal

_KEEP = 8
"""Context sightings remembered per rule and node (the newest)."""
_PAYLOAD = operator.attrgetter("payload")
_TEXT = operator.attrgetter("text")


class ContextGate:
    """Drops findings whose rule's benign context was seen near them on the same node."""

    def __init__(self, rules: Sequence[Rule]) -> None:
        self._ctx: dict[str, BenignContext] = {r.id: r.benign_when for r in rules if r.benign_when is not None}
        self._seen: dict[tuple[str, str], list[float]] = defaultdict(list)

    @property
    def active(self) -> bool:
        """Whether any rule names a benign context (else the gate costs nothing)."""
        return bool(self._ctx)

    def filter(self, signals: Sequence[Signal], found: list[Finding]) -> list[Finding]:
        """The findings that no benign context explains; remembers this batch's context lines."""
        if not self._ctx:
            return found
        self._observe(signals)
        if not found:
            return found
        return [f for f in found if not self.explains(f)]

    def lines_of(self, texts: Sequence[str]) -> set[int]:
        """Indices of the context lines among ``texts`` (a bundle reader keeps them beside the rules' hits)."""
        if not self._ctx or not texts:
            return set()
        joined = "\n".join(texts)
        hits: set[int] = set()
        for ctx in self._ctx.values():
            if ctx.regex.search(joined) is not None:
                hits.update(i for i, t in enumerate(texts) if ctx.regex.search(t) is not None)
        return hits

    def explains(self, f: Finding) -> bool:
        """Whether a remembered context line on the finding's node lies within its rule's window."""
        ctx = self._ctx.get(f.rule_id)
        if ctx is None or f.where.node is None:
            return False
        return any(abs(ts - f.ts) <= ctx.window for ts in self._seen.get((f.rule_id, f.where.node), ()))

    def _observe(self, signals: Sequence[Signal]) -> None:
        if not signals:
            return
        payloads = list(map(_PAYLOAD, signals))
        if set(map(type, payloads)) == {LogLine}:
            texts: list[str] = list(map(_TEXT, payloads))
            nodes = None
        else:
            picked = [(s.node, p.text, s.ts) for s, p in zip(signals, payloads, strict=True) if isinstance(p, LogLine)]
            texts = [t for _, t, _ in picked]
            nodes = picked
        if not texts:
            return
        # One pass over the batch per rule in C (a pattern that starts with a literal is a memchr scan, an
        # alternation of several rules' patterns is not); lines are looked at one by one only on a hit.
        joined = "\n".join(texts)
        for rid, ctx in self._ctx.items():
            if ctx.regex.search(joined) is None:
                continue
            for i, t in enumerate(texts):
                if ctx.regex.search(t) is not None:
                    node, ts = (signals[i].node, signals[i].ts) if nodes is None else (nodes[i][0], nodes[i][2])
                    seen = self._seen[(rid, node)]
                    seen.append(ts)
                    del seen[:-_KEEP]
