"""The service path (a batch's log signals matched as one buffer) finds what each line matched alone finds, and what
the reference matcher (every rule's regex on every line) finds, on a realistic batch: real lines from the corpus and
the rules' examples with multi-byte UTF-8, carriage returns, NULs, very long lines and lines that hold a newline."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import yaml

from analyzer.engine import Backend, MultiMatcher, NaiveMatcher, available_backends
from analyzer.matcher import FastMatcher, RegexMatcher
from analyzer.pipeline import Analyzer
from analyzer.rules import Rule
from collector.signal import LogLine, Signal, Source

CORPUS = Path(__file__).parent / "corpus"
XID79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus."


def _corpus_lines() -> list[tuple[str, Source]]:
    out: list[tuple[str, Source]] = []
    for path in sorted(CORPUS.glob("*.yaml")):
        for entry in yaml.safe_load(path.read_text())["entries"]:
            src = Source.KERNEL if entry.get("source") in ("kernel", "syslog") else Source.CONTAINER
            out.extend((ln, src) for ln in entry["text"].splitlines() if ln.strip())
    return out


def _batch(rules: list[Rule], seed: int, n: int) -> list[Signal]:
    rng = random.Random(seed)
    real = _corpus_lines()
    examples = [(ex, Source.KERNEL if i % 2 else Source.CONTAINER)
                for i, ex in enumerate(ex for r in rules for ex in r.examples)]
    texts: list[tuple[str, Source]] = []
    for _ in range(n):
        text, src = rng.choice(real if rng.random() < 0.6 else examples)
        x = rng.random()
        if x < 0.08:
            text = f"{text} — GPU 温度 ✓ ü"  # multi-byte UTF-8 after the fault
        elif x < 0.14:
            text = "é " + text  # and before it: every later byte offset shifts
        elif x < 0.2:
            text += "\r"  # a CRLF line as a container runtime passes it on
        elif x < 0.24:
            text = text.replace(" ", "\r", 1)
        elif x < 0.28:
            text = text[: len(text) // 2] + "\x00" + text[len(text) // 2:]
        elif x < 0.3:
            text = "x" * 60_000 + " " + text  # a very long line, the fault at its end
        elif x < 0.32:
            text = text + " " + "y" * 60_000
        elif x < 0.34:
            text = text.replace(" ", "\n", 1)  # a record that kept a newline
        texts.append((text, src))
    texts += [(XID79.replace(": 79", ":\n79"), Source.KERNEL), (XID79 + "\nsecond half", Source.KERNEL),
              ("step 1\n" + XID79, Source.KERNEL), ("\n", Source.CONTAINER), ("", Source.CONTAINER)]
    rng.shuffle(texts)
    return [Signal(id=f"n1:{i}", node="node-a", source=src, ts=1.0 + i,
                   payload=LogLine(text=t, job="train", namespace="ml", rank=i % 8))
            for i, (t, src) in enumerate(texts)]


@pytest.mark.parametrize("seed", range(2))
def test_the_service_path_finds_what_each_line_alone_finds(shipped_rules: list[Rule], seed: int) -> None:
    batch = _batch(shipped_rules, seed, 1000)
    matcher = FastMatcher(shipped_rules)
    got = matcher.match(batch)
    alone = [f for sig in batch for f in matcher.match([sig])]
    reference = RegexMatcher(shipped_rules).match(batch)
    assert len(reference) > 300
    assert {f.fault_class for f in reference} >= {"gpu_hardware", "nccl_error", "oom_gpu"}
    assert got == alone
    assert got == reference


@pytest.mark.parametrize("backend", available_backends(), ids=str)
def test_a_record_holding_a_newline_is_read_as_the_reference_reads_it(shipped_rules: list[Rule],
                                                                      backend: Backend) -> None:
    # The newline is not a space: ": \n79" is not the Xid line's ": 79", whatever else the batch holds.
    texts = ["step 1", XID79.replace(": 79", ":\n79"), "step 2", XID79 + "\nsecond half",
             "RuntimeError: CUDA error: an illegal memory access was encountered\nCUDA kernel errors"]
    batch = [Signal(id=f"s{i}", node="n", source=Source.CONTAINER if i == 4 else Source.KERNEL, ts=1.0 + i,
                    payload=LogLine(text=t)) for i, t in enumerate(texts)]
    engine, naive = MultiMatcher(shipped_rules, backend=backend), NaiveMatcher(shipped_rules)
    for lines in (texts, texts[:2], texts[3:]):
        assert [(h.line, h.rule.id, dict(h.groups)) for h in engine.scan(lines)] == [
            (h.line, h.rule.id, dict(h.groups)) for h in naive.scan(lines)]
    found, _ = Analyzer(shipped_rules, backend=backend).process(batch)
    assert [(f.rule_id, f.evidence) for f in found][:1] == [("xid-79", ("s3",))]
    assert {f.evidence for f in found} == {("s3",), ("s4",)}

