"""Values no store can hold are refused at the edge, on SQLite and PostgreSQL; the good ones still land.

The choice, per route: ``/v1/signals`` (the agent's own format) refuses a batch whole with a
422 naming the field and the agent quarantines it, never retrying; Fluent Bit and Alertmanager
batches keep their good records and name the bad ones in a 200 answer, because those senders
retry a whole flush on any error.
"""

from __future__ import annotations

import gzip
import json
import math
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from collector.fluentbit import FluentBitOptions, render_config
from collector.metrics import AgentMetrics
from collector.shipper import Shipper
from collector.signal import LogLine, MetricSample, Signal, Source
from collector.spool import DiskSpool
from collector.wire import to_wire
from tests.builders import XID79, kernel
from tests.hostile import Served, serve, wait_for

XID_KMSG = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."


def _gpu_lost(s: Served, node: str) -> dict[str, Any] | None:
    return next((i for i in s.incidents() if i["root_cause"]["node"] == node and i["fault_class"] == "gpu_lost"),
                None)


def _raw(s: Served, doc: str) -> httpx.Response:
    return s.client.post("/v1/signals", content=doc.encode(), headers={"Content-Type": "application/json"})


def _signal_json(node: str = "gpu-node-01", ts: str = "1795000000.5", value: str | None = None,
                 text: str = "hello") -> str:
    # Written by hand: json.dumps cannot write the bare Infinity, NaN and 1e309 a hostile sender can.
    payload = '{"kind": "metric", "name": "DCGM_FI_DEV_GPU_TEMP", "value": ' + value + "}" if value \
        else json.dumps({"kind": "log", "text": text})
    return ('{"signals": [{"id": "x/1", "node": ' + json.dumps(node) + ', "source": "kernel", "ts": ' + ts
            + ', "payload": ' + payload + "}]}")


@pytest.mark.parametrize(("doc", "field"), [
    (_signal_json(ts="Infinity"), "signals.0.ts"),
    (_signal_json(ts="1e309"), "signals.0.ts"),
    (_signal_json(ts="NaN"), "signals.0.ts"),
    (_signal_json(value="NaN"), "signals.0.payload.metric.value"),
    (_signal_json(value="-Infinity"), "signals.0.payload.metric.value"),
    (_signal_json(node="n" * 10_000), "signals.0.node"),
    (_signal_json(node="gpu-node-01\x00"), "signals.0.node"),
    (_signal_json(node="GPU_Node_01"), "signals.0.node"),
    (_signal_json(node="a" * 64 + ".example"), "signals.0.node"),
    (_signal_json(text="Xid 79\x00"), "signals.0.payload.log.text"),
])
def test_a_signal_the_store_cannot_hold_is_refused_naming_the_field(
        tmp_path: Path, database_url: str, doc: str, field: str) -> None:
    with serve(tmp_path, database_url=database_url) as s:
        assert s.post([kernel("gpu-node-01", XID79, ts=time.time())]).status_code == 200  # before
        r = _raw(s, doc)
        assert r.status_code == 422, r.text[:300]
        assert field in r.json()["detail"]
        assert s.post([kernel("gpu-node-03", XID79, ts=time.time())]).status_code == 200  # after
        wait_for(lambda: _gpu_lost(s, "gpu-node-01") and _gpu_lost(s, "gpu-node-03"))
        assert all(i["opened_at"] is not None and math.isfinite(i["opened_at"]) for i in s.incidents())


def test_fluent_bit_keeps_the_good_records_and_names_the_bad(tmp_path: Path, database_url: str) -> None:
    good = {"priority": 4, "sequence": 1, "msg": XID_KMSG, "node": "gpu-node-04"}
    records = [
        good,
        dict(good, sequence=2, node="n" * 10_000),
        dict(good, sequence=3, node="gpu-node-05\x00"),
        dict(good, sequence=4, node="gpu-node-06", date=1e309),  # date read as infinity: server time instead
        dict(good, sequence=5, node="gpu-node-07", msg=XID_KMSG + "\x00\x00"),  # NUL in a log line: kept visibly
    ]
    body = "\n".join(json.dumps(r) for r in records).encode()
    with serve(tmp_path, database_url=database_url) as s:
        r = s.client.post("/v1/ingest/fluentbit", content=gzip.compress(body), headers={"Content-Encoding": "gzip"})
        assert r.status_code == 200, r.text[:300]
        out = r.json()
        assert (out["accepted"], out["rejected"]) == (3, 2)
        assert [(p["record"], p["problem"].split(":")[0]) for p in out["problems"]] == [(1, "node"), (2, "node")]
        for node in ("gpu-node-04", "gpu-node-06", "gpu-node-07"):
            wait_for(lambda n=node: _gpu_lost(s, n))  # type: ignore[misc]
        assert "kmend_ingest_rejected_records_total{route=\"fluentbit\"} 2.0" in s.client.get("/metrics").text


def test_alertmanager_keeps_the_alerts_it_can_store(tmp_path: Path, database_url: str) -> None:
    alert = {"status": "firing", "labels": {"alertname": "GpuFellOff", "node": "gpu-node-02"},
             "annotations": {}, "startsAt": "2026-11-21T10:00:00Z", "fingerprint": "a1"}
    bad = dict(alert, labels={"alertname": "GpuFellOff", "node": "x" * 10_000}, fingerprint="a2")
    nul = dict(alert, labels={"alertname": "Gpu\x00", "node": "gpu-node-03"}, fingerprint="a3")
    with serve(tmp_path, database_url=database_url) as s:
        r = s.client.post("/v1/alerts/alertmanager", json={"version": "4", "alerts": [alert, bad, nul]})
        assert r.status_code == 200, r.text[:300]
        assert (r.json()["accepted"], r.json()["rejected"]) == (1, 2)


def test_a_future_time_takes_the_server_clock_and_keeps_the_sent_one(tmp_path: Path, database_url: str) -> None:
    with serve(tmp_path, database_url=database_url) as s:
        future = time.time() + 10 * 365 * 86400
        assert s.post([kernel("gpu-node-02", XID79, ts=future)]).status_code == 200
        inc = wait_for(lambda: _gpu_lost(s, "gpu-node-02"))
        assert inc["opened_at"] < time.time() + 1
        with s.kmend.store.engine.connect() as conn:
            from sqlalchemy import text
            body = conn.execute(text("SELECT body FROM signals")).scalar_one()
        body = json.loads(body) if isinstance(body, str) else body
        assert body["sent_ts"] == pytest.approx(future) and body["ts"] < time.time() + 1


def test_the_agent_quarantines_a_refused_batch_and_ships_the_next(tmp_path: Path) -> None:
    with serve(tmp_path) as s:
        metrics = AgentMetrics()
        spool = DiskSpool(tmp_path / "spool")
        shipper = Shipper(url=s.url, spool=spool, metrics=metrics)
        bad = Signal("n/1", "Bad_Node", Source.KERNEL, time.time(), LogLine(XID_KMSG))
        shipper.deliver([bad])  # 422 whole: quarantined, not spooled for retry
        assert len(spool) == 0 and len(list(spool.quarantine_dir.iterdir())) == 1
        nul = Signal("gpu-node-05/k/1", "gpu-node-05", Source.KERNEL, time.time(), LogLine(XID_KMSG + "\x00"))
        metric = Signal("gpu-node-05/m/1", "gpu-node-05", Source.DCGM, time.time(), MetricSample("temp", 70.0))
        shipper.deliver([nul, metric])  # NUL in a read line is cleaned on the node: the batch lands
        assert len(spool) == 0
        wait_for(lambda: _gpu_lost(s, "gpu-node-05"))
        rejected = metrics.dropped.labels("rejected")._value.get()
        assert rejected == 1
        shipper.close()


def test_the_agent_keeps_a_batch_for_later_only_on_answers_that_can_change(tmp_path: Path) -> None:
    answers = iter([409, 503, 429, 200])

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(next(answers), json={})

    metrics = AgentMetrics()
    spool = DiskSpool(tmp_path / "spool")
    clock = [0.0]
    shipper = Shipper(url="http://kmend", spool=spool, metrics=metrics, client=httpx.Client(
        transport=httpx.MockTransport(handler)), clock=lambda: clock[0])
    sig = Signal("n/1", "gpu-node-01", Source.KERNEL, 1.0, LogLine("x"))
    shipper.deliver([sig])  # 409: refused for good, quarantined
    assert len(spool) == 0 and len(list(spool.quarantine_dir.iterdir())) == 1
    shipper.deliver([sig])  # 503: kept
    assert len(spool) == 1
    clock[0] += 100
    shipper.replay()  # 429: still kept
    assert len(spool) == 1
    clock[0] += 100
    assert shipper.replay() and len(spool) == 0


def test_fluent_bit_never_retries_a_flush_forever() -> None:
    doc = render_config(FluentBitOptions(), container_patterns=["Xid"], kernel_patterns=["Xid"])
    limit = doc["pipeline"]["outputs"][0]["retry_limit"]
    assert isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit <= 100


def test_wire_round_trip_is_unchanged_for_good_signals() -> None:
    sig = Signal("n/1", "gpu-node-01", Source.KERNEL, 1.0, LogLine("Xid 79"))
    assert to_wire(sig)["node"] == "gpu-node-01" and "sent_ts" not in to_wire(sig)


def test_the_agent_refuses_to_start_with_a_node_name_kubernetes_could_not_have() -> None:
    from pydantic import ValidationError

    from kmend.commands.agent import AgentSettings

    with pytest.raises(ValidationError, match="NODE_NAME"):
        AgentSettings(node="GPU_Node_01")
    assert AgentSettings(node="gpu-node-01.example.internal").node == "gpu-node-01.example.internal"
