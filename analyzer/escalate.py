"""Escalation: repeats on one device turn an application-side fault into a hardware finding.

Xid 13 once is a bug in the job's kernel; Xid 13 again and again on the same GPU, across
restarts, is the GPU. Xid 48 alone needs a GPU reset; with Xid 63/64 on the same GPU the
memory is failing. The counting lives here, not in the patterns, and time comes only
from the findings, so replaying a log gives the same answer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import replace

from analyzer.records import Finding
from analyzer.rules import EscalationSpec, Rule

_Key = tuple[str | None, ...]


def _device_key(per: str, f: Finding) -> _Key:
    w = f.where
    if per == "node":
        return (w.node,)
    if per == "port":
        return (w.node, w.port)
    return (w.node, w.pci or w.gpu)


class Escalator:
    """Watches findings of rules that carry an ``escalation`` and emits the escalated findings."""

    def __init__(self, rules: Sequence[Rule]) -> None:
        self._specs: dict[str, EscalationSpec] = {r.id: r.escalation for r in rules if r.escalation}
        self._companion_of: dict[str, list[str]] = defaultdict(list)
        for rid, spec in self._specs.items():
            for other in spec.together_with:
                self._companion_of[other].append(rid)
        self._counted: dict[tuple[str, _Key], list[Finding]] = defaultdict(list)
        self._latest: dict[tuple[str, _Key], Finding] = {}
        self._emitted: set[str] = set()

    def observe_all(self, findings: Iterable[Finding]) -> list[Finding]:
        """Escalated findings caused by these findings, in order."""
        out: list[Finding] = []
        for f in findings:
            out.extend(self.observe(f))
        return out

    def observe(self, f: Finding) -> list[Finding]:
        """Escalated findings caused by one finding (none most of the time)."""
        out: list[Finding] = []
        spec = self._specs.get(f.rule_id)
        if spec is not None:
            key = _device_key(spec.per, f)
            self._latest[(f.rule_id, key)] = f
            if spec.count >= 2:
                out.extend(self._repeat(spec, key, f))
            for other in spec.together_with:
                partner = self._latest.get((other, _device_key(spec.per, f)))
                if partner is not None and abs(partner.ts - f.ts) <= spec.window:
                    out.extend(self._emit(spec, f, (partner,), f"with {other}"))
        for rid in self._companion_of.get(f.rule_id, ()):
            owner_spec = self._specs[rid]
            owner = self._latest.get((rid, _device_key(owner_spec.per, f)))
            if owner is not None and abs(owner.ts - f.ts) <= owner_spec.window:
                out.extend(self._emit(owner_spec, owner, (f,), f"with {f.rule_id}"))
        return out

    def _repeat(self, spec: EscalationSpec, key: _Key, f: Finding) -> list[Finding]:
        seen = self._counted[(f.rule_id, key)]
        # Several lines of one event (one per SM or channel) count once.
        if seen and abs(f.ts - seen[-1].ts) < spec.min_gap:
            return []
        seen.append(f)
        seen[:] = [s for s in seen if f.ts - s.ts <= spec.window]
        if len(seen) < spec.count:
            return []
        earlier = tuple(seen[:-1])
        seen.clear()
        return self._emit(spec, f, earlier, f"{spec.count} times within {spec.window:g}s on one {spec.per}")

    def _emit(self, spec: EscalationSpec, f: Finding, others: tuple[Finding, ...], why: str) -> list[Finding]:
        fid = f"{f.id}:escalated"
        if fid in self._emitted:
            return []
        self._emitted.add(fid)
        evidence = tuple(dict.fromkeys(e for g in (*others, f) for e in g.evidence))
        return [replace(
            f, id=fid, fault_class=spec.fault_class or f.fault_class, hardware=spec.hardware,
            recommended_action=spec.recommended_action, severity=spec.severity,
            evidence=evidence, symptom_of=frozenset(),
            fields={**f.fields, "escalated": why},
        )]
