"""Numbered batches: the agent numbers its batches per process (producer + seq), the service keeps the last
number per producer, so a replayed batch is recognised with one lookup (SQLite and PostgreSQL); unnumbered
batches from older agents are still deduplicated by signal id; lines can be kept as evidence only."""

from __future__ import annotations

import contextlib
import gzip
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from analyzer.pipeline import Analyzer
from analyzer.rules import Rule
from collector.metrics import AgentMetrics
from collector.shipper import Shipper, encode_batch
from collector.spool import DiskSpool
from collector.wire import to_wire
from kmend.store import Store, schema
from tests.agent_helpers import TOKEN, Service
from tests.builders import XID79, container, kernel
from tests.conftest import free_port

T0 = 1_700_000_000.0


def _lines(n: int, start: int = 0) -> list:  # type: ignore[type-arg]
    return [container("gpu-node-01", f"step {i} loss 2.0", job="llm", rank=0, ts=T0 + i) for i in range(start, n)]


@pytest.mark.parametrize("lines", ["all", "evidence"])
def test_a_replayed_numbered_batch_is_recognised_by_its_number(database_url: str, shipped_rules: list[Rule],
                                                               lines: str) -> None:
    store = Store(database_url, lines=lines)
    store.migrate()
    an = Analyzer(shipped_rules)

    def analyse(s):  # type: ignore[no-untyped-def]
        return (*an.process(s), an.correlator.take_merges())

    batch = [*_lines(5), kernel("gpu-node-01", XID79, ts=T0 + 6)]
    first = store.ingest(batch, analyse, origin=("gpu-node-01/a1", 1))
    assert (first.accepted, first.duplicates, len(first.findings)) == (6, 0, 1)
    again = store.ingest(batch, analyse, origin=("gpu-node-01/a1", 1))
    assert (again.accepted, again.duplicates, again.findings, again.incidents) == (0, 6, (), ())
    assert store.ingest(_lines(9, 5), analyse, origin=("gpu-node-01/a1", 2)).accepted == 4
    assert store.ingest(_lines(3), analyse, origin=("gpu-node-01/a1", 1)).accepted == 0  # older than the last
    # Another process of the same agent (a restart) numbers from 1 again under its own name.
    assert store.ingest(_lines(12, 9), analyse, origin=("gpu-node-01/b2", 1)).accepted == 3
    with store.engine.connect() as conn:
        marks = dict(conn.execute(select(schema.producers.c.id, schema.producers.c.seq)).all())
    assert marks == {"gpu-node-01/a1": 2, "gpu-node-01/b2": 1}
    # Every line a row, or only the Xid line its finding names; the row holds the line as the agent sent it.
    assert store.count_signals() == (13 if lines == "all" else 1)
    with store.engine.connect() as conn:
        [body] = conn.execute(select(schema.signals.c.body).where(schema.signals.c.id == batch[-1].id)).scalars()
    assert body == to_wire(batch[-1])
    # An unnumbered batch (an older agent) is still deduplicated by signal id.
    old = _lines(22, 20)
    assert store.ingest(old, analyse).accepted == 2
    assert (store.ingest(old, analyse).accepted, store.ingest(old, analyse).duplicates) == (0, 2)
    store.close()


@contextlib.contextmanager
def _service(tmp_path: Path) -> Iterator[Service]:
    svc = Service(tmp_path, free_port())
    svc.start()
    try:
        yield svc
    finally:
        with contextlib.suppress(AssertionError):
            svc.stop()
        svc.kmend.store.close()


def test_the_agent_numbers_its_batches_and_a_replayed_body_is_taken_once(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path / "spool", max_bytes=10_000_000)
    port = free_port()
    shipper = Shipper(url=f"http://127.0.0.1:{port}", token=TOKEN, spool=spool, metrics=AgentMetrics(),
                      timeout=2.0, max_backoff=0.0, producer="gpu-node-01/p1")
    # The service is away (nothing was sent): two batches are spooled, numbered in order.
    assert shipper.deliver(_lines(3)) == [] and shipper.deliver(_lines(6, 3)) == []
    spooled = []
    while (b := spool.peek()) is not None:
        spooled.append(json.loads(gzip.decompress(spool.read(b))))
        spool.pop(b)
    assert [(d["producer"], len(d["signals"])) for d in spooled] == [("gpu-node-01/p1", 3)] * 2
    assert spooled[0]["seq"] < spooled[1]["seq"]
    svc = Service(tmp_path, port)
    svc.start()
    try:
        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Encoding": "gzip",
                   "Content-Type": "application/json"}
        body = encode_batch(_lines(4), producer="gpu-node-01/p1", seq=7)
        with httpx.Client(base_url=svc.url, headers=headers) as c:
            assert c.post("/v1/signals", content=body).json()["accepted"] == 4
            # The answer was lost and the agent sends the same body again: nothing is analysed twice.
            assert c.post("/v1/signals", content=body).json() == {"accepted": 0, "duplicates": 4, "findings": 0,
                                                                  "incidents": []}
            bad = encode_batch(_lines(1), producer="gpu-node-01/p1", seq=None)
            raw = json.loads(gzip.decompress(bad)) | {"producer": "gpu-node-01/p1"}
            r = c.post("/v1/signals", json=raw, headers={"Content-Encoding": "identity"})
            assert r.status_code == 422 and "producer and seq come together" in r.text
        assert shipper.deliver(_lines(9, 6)) == []  # numbered below the 7 taken above: a replay
        assert svc.kmend.metrics.registry.get_sample_value("kmend_ingest_duplicate_signals_total") == 7
    finally:
        svc.stop()
        svc.kmend.store.close()


def test_a_batch_whose_answer_was_lost_is_spooled_whole_with_its_number(tmp_path: Path) -> None:
    # A server that reads the request and hangs up without answering: the batch may have been taken.
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)

        def hang_up() -> None:
            conn, _ = srv.accept()
            conn.recv(1 << 20)
            conn.close()

        t = threading.Thread(target=hang_up)
        t.start()
        spool = DiskSpool(tmp_path / "spool", max_bytes=10_000_000)
        shipper = Shipper(url=f"http://127.0.0.1:{srv.getsockname()[1]}", token=TOKEN, spool=spool,
                          metrics=AgentMetrics(), timeout=5.0, max_backoff=0.0, producer="gpu-node-01/p1")
        batch = [*_lines(3), kernel("gpu-node-01", XID79, ts=T0 + 4)]
        assert shipper.deliver(batch) == []
        t.join(10)
    [doc] = [json.loads(gzip.decompress(spool.read(b))) for b in [spool.peek()] if b is not None]
    assert (doc["seq"], len(doc["signals"])) == (1, 4)  # the same number: its replay is recognised


def test_a_replay_is_answered_from_its_number_without_decoding_its_signals(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import kmend.api.signals as ingest_api

    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Encoding": "gzip", "Content-Type": "application/json"}
    body = encode_batch([*_lines(2000), kernel("gpu-node-01", XID79, ts=T0 + 3000)], producer="gpu-node-01/p9", seq=3)
    with _service(tmp_path) as svc, httpx.Client(base_url=svc.url, headers=headers, timeout=60) as c:
        first = c.post("/v1/signals", content=body).json()
        assert (first["accepted"], first["findings"]) == (2001, 1)
        decoded: list[int] = []
        real = ingest_api.decode_fast
        monkeypatch.setattr(ingest_api, "decode_fast", lambda b: decoded.append(1) or real(b))
        analysed: list[int] = []
        process = svc.kmend.analyzer.process
        monkeypatch.setattr(svc.kmend.analyzer, "process", lambda s: analysed.append(1) or process(s))
        for seq in (3, 2):  # the same batch again, and an older one
            again = c.post("/v1/signals", content=encode_batch(_lines(2000), producer="gpu-node-01/p9", seq=seq)
                           if seq == 2 else body).json()
            assert again == {"accepted": 0, "duplicates": 2000 + (seq == 3), "findings": 0, "incidents": []}
        # Neither was decoded into signals nor analysed: the number alone answered it.
        assert decoded == [] and analysed == []
        assert svc.kmend.metrics.registry.get_sample_value("kmend_ingest_duplicate_signals_total") == 4001
        # The next number is taken in full, and a replay whose body is not a numbered batch still gets its 422.
        assert c.post("/v1/signals", content=encode_batch(_lines(5), producer="gpu-node-01/p9", seq=4)
                      ).json()["accepted"] == 5
        assert decoded == [1] and analysed == [1]
        r = c.post("/v1/signals", json={"signals": [{"id": "x"}], "producer": "gpu-node-01/p9", "seq": "x"},
                   headers={"Content-Encoding": "identity"})
        assert r.status_code == 422 and "seq" in r.text
