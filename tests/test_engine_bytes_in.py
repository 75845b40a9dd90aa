"""The bytes-in path of ingest: a batch's lines received as one buffer are matched as they are, with the
same matches, fields and findings as the list of lines, on every backend; a buffer that does not hold one
line per signal (a line with a newline in it) is set aside, and the batch is still matched."""

from __future__ import annotations

import pytest

from analyzer.engine import Backend, MultiMatcher, NaiveMatcher, available_backends
from analyzer.matcher import FastMatcher
from analyzer.pipeline import Analyzer
from analyzer.rules import Rule
from collector.signal import LogLine, Signal, Source
from tests.test_engine_fast_paths import _mix


def _ids(hits: list) -> list[tuple[int, str, dict[str, str]]]:  # type: ignore[type-arg]
    return [(h.line, h.rule.id, dict(h.groups)) for h in hits]


@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("ascii_only", [True, False])
def test_a_received_buffer_gives_the_naive_matchers_matches(
        shipped_rules: list[Rule], backend: Backend, ascii_only: bool) -> None:
    lines = [ln.replace("\n", " ") for ln in _mix(shipped_rules, 7, 1500)]
    if ascii_only:
        lines = [ln.encode("ascii", "replace").decode() for ln in lines]
    lines = [ln.encode("utf-8", "replace").decode() for ln in lines]
    data = "\n".join(lines).encode("utf-8")
    want = _ids(NaiveMatcher(shipped_rules).scan(lines))
    got = MultiMatcher(shipped_rules, backend=backend).scan_lines(data, len(lines))
    assert got is not None
    assert _ids(got) == want
    assert len(want) > 100


def test_a_buffer_with_another_number_of_lines_is_refused(shipped_rules: list[Rule]) -> None:
    engine = MultiMatcher(shipped_rules)
    line = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus."
    assert engine.scan_lines(f"{line}\nmore".encode(), 3) is None
    assert engine.scan_lines(f"{line}\nmore".encode(), 1) is None
    assert engine.scan_lines(b"", 0) == []
    hits = engine.scan_lines(f"ok\n{line}".encode(), 2)
    assert hits is not None and [(h.line, h.rule.id) for h in hits] == [(1, "xid-79")]


def _signals(texts: list[str]) -> list[Signal]:
    return [Signal(id=f"s{i}", node="node-a", source=Source.KERNEL if i % 2 else Source.CONTAINER, ts=1.0 + i,
                   payload=LogLine(text=t, job="train", rank=i % 8)) for i, t in enumerate(texts)]


def test_ingest_gets_the_same_findings_from_the_received_bytes(shipped_rules: list[Rule]) -> None:
    texts = [ln.replace("\n", " ") for ln in _mix(shipped_rules, 11, 2500)]
    texts = [t.encode("utf-8", "replace").decode() for t in texts]
    signals = _signals(texts)
    matcher = FastMatcher(shipped_rules)
    want = matcher.match(signals)
    assert len(want) > 100
    assert matcher.match_lines(signals, "\n".join(texts).encode()) == want


def test_a_line_holding_a_newline_is_still_matched_from_a_buffer(shipped_rules: list[Rule]) -> None:
    # A folded event kept its newline: the buffer then holds one line more than the batch has signals.
    texts = ["step 1", "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.\nsecond half",
             "Out of memory: Killed process 4242 (python3) total-vm:1000kB"]
    signals = _signals(texts)
    matcher = FastMatcher(shipped_rules)
    got = matcher.match_lines(signals, "\n".join(texts).encode())
    assert [(f.rule_id, f.evidence) for f in got] == [(f.rule_id, f.evidence) for f in matcher.match(signals)]
    assert {f.evidence[0] for f in got} >= {"s1"}


def test_the_analyzer_takes_the_received_bytes_of_a_batch(shipped_rules: list[Rule]) -> None:
    texts = ["step 1", "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.", "step 2"]
    signals = _signals(texts)
    found, incidents = Analyzer(shipped_rules).process(signals, lines="\n".join(texts).encode())
    assert [(f.rule_id, f.evidence) for f in found] == [("xid-79", ("s1",))]
    assert len(incidents) == 1 and incidents[0].hardware
