"""Hostile request bodies: bounded while read on every route, records capped, deep JSON is a 4xx."""

from __future__ import annotations

import gzip
import json
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.builders import XID79, kernel
from tests.hostile import Served, serve, wait_for

MB = 1024 * 1024
KMSG = {"priority": 4, "sequence": 1202, "msg": "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."}


def _chunks(total: int, size: int = MB) -> Iterator[bytes]:
    sent = 0
    while sent < total:
        yield b"[" * size if sent == 0 else b" " * size
        sent += size


def _xid_incident(s: Served, node: str) -> dict[str, Any] | None:
    return next((i for i in s.incidents() if i["root_cause"]["node"] == node and i["fault_class"] == "gpu_lost"),
                None)


@pytest.mark.parametrize("route", ["/v1/signals", "/v1/ingest/fluentbit", "/v1/alerts/alertmanager",
                                   "/v1/flight-recorder?job=j&rank=0&node=gpu-node-01"])
def test_a_body_past_the_limit_is_refused_as_it_arrives_without_holding_it(tmp_path: Path, route: str) -> None:
    with serve(tmp_path, max_batch_bytes=MB) as s:
        s.post([kernel("gpu-node-01", XID79, ts=time.time())])  # before
        tracemalloc.start()
        try:
            # Streamed without a Content-Length: only counting while reading can stop it.
            r = s.client.post(route, content=_chunks(48 * MB), headers={"Content-Type": "application/json"})
            status = r.status_code
        except httpx.TransportError:
            status = 413  # the server answered and closed while the client was still sending
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert status == 413
        assert peak < 16 * MB, f"peak {peak / MB:.0f} MB while refusing a 48 MB body"
        declared = s.client.post(route, content=b"x" * (MB + 1))
        assert declared.status_code == 413 and "KMEND_MAX_BATCH_BYTES" in declared.json()["detail"]
        s.post([kernel("gpu-node-03", XID79, ts=time.time())])  # after
        wait_for(lambda: _xid_incident(s, "gpu-node-01") and _xid_incident(s, "gpu-node-03"))


def test_fluent_bit_records_are_capped_in_both_body_forms(tmp_path: Path) -> None:
    with serve(tmp_path, max_records=1000) as s:
        lines = ("\n".join(json.dumps(dict(KMSG, sequence=i, node="gpu-node-02")) for i in range(1001))).encode()
        r = s.client.post("/v1/ingest/fluentbit", content=gzip.compress(lines), headers={"Content-Encoding": "gzip"})
        assert r.status_code == 422 and "records: more than 1000 records" in r.json()["detail"]
        # A million tiny records is 3 MB of JSON: refused after the 1,001st, never built.
        t = time.perf_counter()
        r = s.client.post("/v1/ingest/fluentbit", content=b"[" + b",".join([b"{}"] * 1_000_000) + b"]")
        assert r.status_code == 422 and "records: more than 1000" in r.json()["detail"]
        assert time.perf_counter() - t < 5
        r = s.client.post("/v1/ingest/fluentbit", content=b"[" + json.dumps(dict(KMSG, node="gpu-node-04")).encode()
                          + b", 7]")
        assert r.status_code == 422 and "records[1] is not a JSON object" in r.json()["detail"]
        ok = s.client.post("/v1/ingest/fluentbit", content=json.dumps(dict(KMSG, node="gpu-node-04")).encode())
        assert ok.status_code == 200 and ok.json()["accepted"] == 1  # after: a normal flush still lands
        wait_for(lambda: _xid_incident(s, "gpu-node-04"))


@pytest.mark.parametrize(("route", "body"), [
    ("/v1/ingest/fluentbit", b"[" * 100_000 + b"]" * 100_000),
    ("/v1/ingest/fluentbit", b'{"log": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("/v1/ingest/fluentbit", b'[{"log": ' + b"[" * 100_000 + b"]" * 100_000 + b"}]"),
    ("/v1/signals", b'{"signals": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("/v1/alerts/alertmanager", b'{"alerts": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
])
def test_deeply_nested_json_is_a_client_error_not_a_500(tmp_path: Path, route: str, body: bytes) -> None:
    with serve(tmp_path) as s:
        r = s.client.post(route, content=body, headers={"Content-Type": "application/json"})
        assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
        assert s.client.get("/healthz").status_code == 200
