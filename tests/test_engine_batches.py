"""Batch scanning on the service path: line attribution of hits at batch and block edges in batches
mixing ASCII, non-ASCII and empty lines, and identical findings from every backend, the naive matcher
and FastMatcher on signals."""

from __future__ import annotations

import random

import pytest

from analyzer.engine import _BLOCK, Backend, MultiMatcher, NaiveMatcher, available_backends
from analyzer.matcher import FastMatcher, RegexMatcher
from analyzer.pipeline import Analyzer
from analyzer.rules import Rule, default_rules_dir, load_rules
from collector.signal import LogLine, MetricSample, Signal, Source

XID = "NVRM: Xid (PCI:0000:44:00): 79, GPU has fallen off the bus"
OOM = "[rank3]: RuntimeError: CUDA error: an illegal memory access was encountered"


@pytest.fixture(scope="module")
def rules() -> list[Rule]:
    return load_rules([default_rules_dir()])


def _mixed_batch(rules: list[Rule], seed: int, n: int = 3000) -> list[str]:
    rng = random.Random(seed)
    faults = [ex for r in rules for ex in r.examples]
    noise = ["", "step 10 | loss 1.25", "NCCL INFO Connected all rings", "journal: é ü — …", "x"]
    return [rng.choice(faults) if rng.random() < 0.05 else rng.choice(noise) for _ in range(n)]


@pytest.mark.parametrize("seed", range(4))
def test_every_backend_gives_the_naive_matchers_hits(rules: list[Rule], seed: int) -> None:
    lines = _mixed_batch(rules, seed, 2 * _BLOCK + 500)
    # Faults in the first and last line (offset 0, end of the buffer) and on both sides of block edges.
    lines[0], lines[-1] = XID, OOM
    lines[_BLOCK - 1], lines[_BLOCK], lines[2 * _BLOCK - 1] = OOM, XID + " é", XID
    want = [(h.line, h.rule.id) for h in NaiveMatcher(rules).scan(lines)]
    assert want[0] == (0, "xid-79") and want[-1][0] == len(lines) - 1
    for backend in available_backends():
        got = [(h.line, h.rule.id) for h in MultiMatcher(rules, backend=backend).scan(lines)]
        assert got == want, backend


def test_a_batch_of_only_empty_lines_and_one_fault(rules: list[Rule]) -> None:
    lines = ["", "", XID, ""]
    for backend in available_backends():
        assert [(h.line, h.rule.id) for h in MultiMatcher(rules, backend=backend).scan(lines)] == [(2, "xid-79")]


def _signals(lines: list[str]) -> list[Signal]:
    return [Signal(id=f"s{i}", node=f"n{i % 3}", source=Source.KERNEL if i % 2 else Source.CONTAINER, ts=float(i),
                   payload=LogLine(text=ln, job="j1" if i % 5 else None)) for i, ln in enumerate(lines)]


@pytest.mark.parametrize("backend", [*available_backends()], ids=str)
def test_fast_matcher_equals_the_regex_matcher_with_metrics_mixed_in(rules: list[Rule], backend: Backend) -> None:
    sigs = _signals(_mixed_batch(rules, 9, 1500))
    metric = Signal(id="m", node="n0", source=Source.NVML, ts=1.0, payload=MetricSample(name="x", value=1.0))
    for batch in (sigs, [metric, *sigs[:700], metric, *sigs[700:]], tuple(sigs)):
        got = FastMatcher(rules, backend=backend).match(batch)
        assert got == RegexMatcher(rules).match(batch)
        assert got


def test_analyzer_learns_each_jobs_nodes_from_a_batch(rules: list[Rule]) -> None:
    analyzer = Analyzer(rules)
    analyzer.findings(_signals(["noise"] * 10))
    assert analyzer.correlator.jobs_on("n1") == frozenset({"j1"})
    assert analyzer.correlator.jobs_on("n0") == frozenset({"j1"})
