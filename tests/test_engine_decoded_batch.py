"""Ingest's own batches: what ``POST /v1/signals`` decodes (the agent's encoder, the service's decoder) carries its
texts to the engine, and the findings are the reference matcher's, with repeated lines, lines that held a newline,
non-ASCII lines, metric samples in the batch and batches the engine scans in several blocks."""

from __future__ import annotations

import gzip
import random
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest

from analyzer.engine import _BLOCK
from analyzer.matcher import FastMatcher, RegexMatcher
from analyzer.metric_eval import SignalEvaluator
from analyzer.metric_rules import load_signal_rules
from analyzer.packs import default_metric_rules_dir
from analyzer.records import Finding
from analyzer.rules import Rule
from collector.shipper import encode_batch
from collector.signal import DecodedBatch, LogLine, MetricSample, Signal, Source
from healer.notify import LogNotifier
from kmend.api.signal_decode import decode_fast
from kmend.app import create_app
from kmend.demo import serve_in_thread
from kmend.settings import Settings
from kmend.wiring import make_kmend
from sim.cluster import build_cluster

NOISE = ["step 10 | loss 1.25", "NCCL INFO Connected all rings", "[  12.5] audit: type=1400", ""]


def _texts(rules: list[Rule], seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    examples = [ex for r in rules for ex in r.examples]
    out: list[str] = []
    for _ in range(n):
        x = rng.random()
        if x < 0.1:
            out.append(rng.choice(examples))
        elif x < 0.13 and out:
            out.append(out[-1])  # the same line again, as a crash loop prints it
        elif x < 0.15:
            out.append(rng.choice(examples).replace(" ", "\n", 1))  # a folded record that kept its newline
        elif x < 0.17:
            out.append(rng.choice(examples) + " — ü")
        else:
            out.append(rng.choice(NOISE))
    return out


def _decoded(signals: list[Signal]) -> DecodedBatch:
    decoded = decode_fast(gzip.decompress(encode_batch(signals, producer="agent-1", seq=1)))
    assert decoded is not None
    return decoded[0]


@pytest.mark.parametrize("seed", range(2))
def test_a_decoded_batch_gives_the_reference_findings(shipped_rules: list[Rule], seed: int) -> None:
    texts = _texts(shipped_rules, seed, 1000 if seed == 0 else 2 * _BLOCK + 17)
    signals = [Signal(id=f"n1:{i}", node="node-a", source=Source.KERNEL if i % 2 else Source.CONTAINER,
                      ts=1.0 + i, payload=LogLine(text=t, rank=i % 8)) for i, t in enumerate(texts)]
    batch = _decoded(signals)
    assert batch.texts == tuple(texts) and list(batch) == signals
    want = RegexMatcher(shipped_rules).match(signals)
    assert len({f.evidence for f in want}) > 50
    assert FastMatcher(shipped_rules).match(batch) == want


def test_a_batch_with_metric_samples_keeps_its_log_texts_apart(shipped_rules: list[Rule]) -> None:
    xid = next(r.examples[0] for r in shipped_rules if r.id == "xid-79")
    signals = [
        Signal(id="m0", node="node-a", source=Source.DCGM, ts=1.0,
               payload=MetricSample("DCGM_FI_DEV_XID_ERRORS", 79.0, {"gpu": "0"})),
        Signal(id="l1", node="node-a", source=Source.KERNEL, ts=2.0, payload=LogLine(text=xid)),
        Signal(id="m2", node="node-a", source=Source.DCGM, ts=3.0,
               payload=MetricSample("DCGM_FI_DEV_XID_ERRORS", 79.0, {"gpu": "1"})),
        Signal(id="l3", node="node-a", source=Source.KERNEL, ts=4.0, payload=LogLine(text=xid)),
    ]
    batch = _decoded(signals)
    assert batch.texts == (xid, xid) and [s.id for s in batch.logs] == ["l1", "l3"]
    metric_rules = load_signal_rules([default_metric_rules_dir()])
    got = FastMatcher(shipped_rules, signals=SignalEvaluator(metric_rules, xid_rules=shipped_rules)).match(batch)
    plain = FastMatcher(shipped_rules, signals=SignalEvaluator(metric_rules, xid_rules=shipped_rules)).match(signals)
    assert got == plain
    assert {f.evidence[0] for f in got} >= {"l1", "l3", "m0", "m2"}


def test_a_batch_and_texts_that_disagree_in_number_are_refused() -> None:
    sig = Signal(id="a", node="n", source=Source.KERNEL, ts=1.0, payload=LogLine(text="x"))
    with pytest.raises(ValueError, match="2 texts for 1 log signals"):
        DecodedBatch([sig], ["x", "y"])


def test_ingest_hands_the_engine_the_batch_the_decoder_built(tmp_path: Path, shipped_rules: list[Rule]) -> None:
    """Through a real ``kmend serve`` app: the agent's numbered, gzipped body reaches the matcher with its texts."""
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim", healer_interval_s=0.05)
    kmend = make_kmend(settings, cluster=build_cluster(2), notifier=LogNotifier())
    seen: list[Sequence[Signal]] = []
    match = kmend.analyzer.matcher.match

    def recording(signals: Sequence[Signal]) -> list[Finding]:
        seen.append(signals)
        return match(signals)

    kmend.analyzer.matcher.match = recording  # type: ignore[method-assign]
    xid = next(r.examples[0] for r in shipped_rules if r.id == "xid-79")
    texts = [f"step {i} loss 2.0" for i in range(50)] + [xid]
    signals = [Signal(id=f"gpu-node-00/k/{i}", node="gpu-node-00", source=Source.KERNEL, ts=1_700_000_000.0 + i,
                      payload=LogLine(text=t)) for i, t in enumerate(texts)]
    body = encode_batch(signals, producer="gpu-node-00/a1", seq=1)
    try:
        with serve_in_thread(create_app(kmend, settings)) as url, httpx.Client(base_url=url, timeout=10) as client:
            r = client.post("/v1/signals", content=body,
                            headers={"content-type": "application/json", "content-encoding": "gzip"})
            assert r.status_code == 200, r.text
            assert r.json()["accepted"] == len(texts)
        [batch] = seen
        assert isinstance(batch, DecodedBatch) and batch.texts == tuple(texts)
        assert "xid-79" in {f.rule_id for f in kmend.store.findings_in_order()}
    finally:
        kmend.store.close()
