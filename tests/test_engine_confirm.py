"""A hit's confirmation (the rule's RE2 pattern anchored at the line's start behind a lazy loop) extracts
exactly what an unanchored search of the rule's regex extracts, on every shipped rule's examples and
counter-examples placed mid-line, twice on a line and cut short; and the service and file paths give the
reference matcher's findings on the benchmark's own log mix."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from analyzer.confirm import Confirmer
from analyzer.engine import Backend, MultiMatcher, NaiveMatcher, available_backends
from analyzer.matcher import FastMatcher, RegexMatcher
from analyzer.rules import Rule
from collector.signal import LogLine, Signal, Source

_SPEC = importlib.util.spec_from_file_location("bench_rules", Path(__file__).resolve().parent.parent / "bench/rules.py")
assert _SPEC is not None and _SPEC.loader is not None
BENCH = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(BENCH)  # the benchmark's own mix, not a copy of it

HYPERSCAN = Backend.HYPERSCAN in available_backends()


def _variants(rule: Rule) -> list[str]:
    lines = [*rule.examples, *rule.counter_examples]
    out: list[str] = []
    for ln in lines:
        out += [ln, "2026-11-25T10:00:00Z node kernel: " + ln, ln + " " + ln, "x" * 300 + ln, ln[: len(ln) // 2]]
    return [v for v in out if v.isascii() and "\n" not in v]


def test_the_anchored_confirmation_extracts_what_a_search_extracts(shipped_rules: list[Rule]) -> None:
    checked = 0
    for rule in shipped_rules:
        confirm = Confirmer(rule)
        for line in _variants(rule):
            m = rule.regex.search(line)
            want = None if m is None else {k: v for k, v in m.groupdict().items() if v is not None}
            assert confirm.ascii(line.encode("ascii")) == want, (rule.id, line)
            checked += 1
    assert checked > 2000


@pytest.mark.skipif(not HYPERSCAN, reason="hyperscan not installed")
def test_the_benchmark_mix_gives_the_reference_findings(shipped_rules: list[Rule]) -> None:
    lines, _ = BENCH.generate(shipped_rules, 150_000, seed=3)
    # The benchmark's mix holds about one fault line in a thousand: add every rule's first example, spread out.
    for i, rule in enumerate(shipped_rules):
        lines.insert((i * 7919) % len(lines), rule.examples[0])
    signals = [Signal(id=f"s{k}", node="n", source=Source.KERNEL if k % 3 else Source.CONTAINER, ts=float(k),
                      payload=LogLine(text=ln)) for k, ln in enumerate(lines)]
    want = RegexMatcher(shipped_rules).match(signals)
    fast = FastMatcher(shipped_rules, backend=Backend.HYPERSCAN)
    got = [f for i in range(0, len(signals), 1000) for f in fast.match(signals[i:i + 1000])]
    assert len(want) > len(shipped_rules) // 2  # rules whose sources the signal is not from stay silent
    assert got == want
    engine = MultiMatcher(shipped_rules, backend=Backend.HYPERSCAN)
    data = "\n".join(lines).encode()
    by_line = [(data.count(b"\n", 0, b.start), b.rule.id, dict(b.groups)) for b in engine.scan_buffer(data)]
    assert by_line == [(h.line, h.rule.id, dict(h.groups)) for h in NaiveMatcher(shipped_rules).scan(lines)]
