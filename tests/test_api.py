"""HTTP API end to end on a real server: signals in → incident → node quarantined in SimCluster."""

from __future__ import annotations

import contextlib
import gzip
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from collector.wire import to_wire
from healer.notify import LogNotifier
from kmend.app import create_app
from kmend.demo import serve_in_thread
from kmend.service import Kmend
from kmend.settings import Settings
from kmend.wiring import make_kmend
from sim.cluster import SimCluster, build_cluster
from tests.builders import XID13, XID79, container, kernel, nccl_timeout

T0 = 1_700_000_000.0


class Served:
    def __init__(self, client: httpx.Client, kmend: Kmend, cluster: SimCluster, notifier: LogNotifier) -> None:
        self.client, self.kmend, self.cluster, self.notifier = client, kmend, cluster, notifier

    def post(self, signals: list[Any], **kw: Any) -> httpx.Response:
        return self.client.post("/v1/signals", json={"signals": [to_wire(s) for s in signals]}, **kw)

    def wait(self, pred: Any, timeout: float = 10.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = pred()
            if got:
                return got
            time.sleep(0.05)
        raise AssertionError("condition not reached in time")


@contextlib.contextmanager
def _serve(tmp_path: Path, **settings_kw: Any) -> Iterator[Served]:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim", healer_interval_s=0.05,
                        symptom_settle_s=0.2, **settings_kw)
    cluster = build_cluster(8)
    notifier = LogNotifier()
    kmend = make_kmend(settings, cluster=cluster, notifier=notifier)
    with serve_in_thread(create_app(kmend, settings)) as url, httpx.Client(base_url=url, timeout=10) as client:
        yield Served(client, kmend, cluster, notifier)
    kmend.store.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    with _serve(tmp_path) as s:
        yield s


def test_xid79_and_timeouts_become_one_incident_and_the_node_is_quarantined(served: Served) -> None:
    nodes = [f"gpu-node-0{i}" for i in range(4)]
    r = served.post([container(n, "iteration 1", rank=i * 8, ts=T0) for i, n in enumerate(nodes)])
    assert r.status_code == 200 and r.json()["accepted"] == 4
    served.post([kernel("gpu-node-02", XID79, ts=T0 + 10)])
    served.post([container(n, nccl_timeout(i * 8 + g), rank=i * 8 + g, ts=T0 + 610)
                 for i, n in enumerate(nodes) for g in range(8)])

    [summary] = served.client.get("/v1/incidents").json()["incidents"]
    assert summary["fault_class"] == "gpu_lost" and summary["root_cause"]["node"] == "gpu-node-02"
    served.wait(lambda: served.client.get(f"/v1/incidents/{summary['id']}").json()["state"] == "remediating")
    full = served.client.get(f"/v1/incidents/{summary['id']}").json()
    assert len(full["findings"]) == 33
    [plan] = full["plans"]
    assert [(s["kind"], s["state"]) for s in plan["steps"][:6]] == [
        ("evidence", "succeeded"), ("cordon", "succeeded"), ("taint", "succeeded"), ("label", "succeeded"),
        ("condition", "succeeded"), ("event", "succeeded")]

    nodes = served.client.get("/v1/nodes").json()["nodes"]
    node = nodes["gpu-node-02"]
    assert node["state"] == "quarantined" and node["cordoned"]
    assert "kmend.io/fault=gpu_lost:NoSchedule" in node["taints"]
    assert node["conditions"]["KmendHealthy"] == "False"
    assert node["conditions"]["KmendFault"] == "True", "the NPD-style problem condition is True while faulted"
    assert [k for k, v in nodes.items() if v["cordoned"]] == ["gpu-node-02"]
    events = [e for e in served.cluster.events if e.node == "gpu-node-02" and e.reason == "KmendQuarantine"]
    assert len(events) == 1 and summary["id"] in events[0].message


def test_application_fault_notifies_and_cordons_nothing(served: Served) -> None:
    served.post([container(f"gpu-node-0{i}", "iteration 3", job="buggy") for i in range(8)])
    served.post([kernel(f"gpu-node-0{i}", XID13, ts=T0 + i) for i in range(8)])
    served.wait(lambda: served.notifier.sent)
    time.sleep(0.3)
    assert not any(n.unschedulable for n in served.cluster.list_nodes())
    [inc] = served.client.get("/v1/incidents").json()["incidents"]
    assert inc["fault_class"] == "app_error" and inc["hardware"] is False and inc["root_cause"]["job"] == "buggy"


def test_malformed_batch_is_rejected_whole_with_the_field_named(served: Served) -> None:
    good = to_wire(kernel("gpu-node-01", XID79))
    bad = to_wire(container("gpu-node-01", "x"))
    del bad["payload"]["text"]
    r = served.client.post("/v1/signals", json={"signals": [good, bad]})
    assert r.status_code == 422
    assert "signals.1.payload.log.text" in r.json()["detail"]
    assert served.kmend.store.count_signals() == 0
    r = served.client.post("/v1/signals", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422


def test_a_progress_samples_world_size_reaches_the_detectors_and_a_bad_one_is_named(served: Served) -> None:
    from collector.signal import ProgressSample, Signal, Source

    sample = Signal("gpu-node-01/progress/w/0/1", "gpu-node-01", Source.PROGRESS, T0,
                    ProgressSample("elastic", 0, 1, 0.5, world_size=4))
    assert served.post([sample]).status_code == 200
    assert served.kmend.detectors.book.jobs["elastic"].world_size == 4
    bad = to_wire(sample)
    bad["id"], bad["payload"]["world_size"] = "gpu-node-01/progress/w/0/2", 0
    r = served.client.post("/v1/signals", json={"signals": [bad]})
    assert r.status_code == 422 and "signals.0.payload.progress.world_size" in r.json()["detail"]


def test_redelivered_signals_are_accepted_and_ignored(served: Served) -> None:
    batch = [kernel("gpu-node-05", XID79, ts=T0)]
    first = served.post(batch).json()
    again = served.post(batch).json()
    assert (first["accepted"], first["findings"]) == (1, 1)
    assert (again["accepted"], again["duplicates"], again["findings"]) == (0, 1, 0)


def test_gzip_batches_are_accepted(served: Served) -> None:
    body = gzip.compress(json.dumps({"signals": [to_wire(kernel("gpu-node-04", XID79))]}).encode())
    r = served.client.post("/v1/signals", content=body,
                           headers={"content-encoding": "gzip", "content-type": "application/json"})
    assert r.status_code == 200 and r.json()["findings"] == 1


def test_metrics_health_and_readiness(served: Served) -> None:
    served.post([kernel("gpu-node-01", XID79), container("gpu-node-01", "iteration 9")])
    served.wait(lambda: served.cluster.get_node("gpu-node-01").unschedulable)
    served.wait(lambda: "kmend_healer_actions_total" in served.client.get("/metrics").text
                and 'kind="event"' in served.client.get("/metrics").text)
    text = served.client.get("/metrics").text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples[("kmend_ingest_signals_total", (("source", "kernel"),))] == 1
    assert samples[("kmend_analyzer_findings_total", (("fault_class", "gpu_lost"),))] == 1
    assert samples[("kmend_incidents_open", (("fault_class", "gpu_lost"),))] == 1
    assert samples[("kmend_healer_actions_total", (("kind", "cordon"), ("result", "succeeded")))] == 1
    assert samples[("kmend_nodes_quarantined", ())] == 1
    assert served.client.get("/healthz").json() == {"status": "ok"}
    ready = served.client.get("/readyz").json()
    assert ready["status"] == "ok" and ready["rules"] >= 5


def test_ingest_token_is_enforced_when_set(tmp_path: Path) -> None:
    with _serve(tmp_path, ingest_token="s3cret") as s:
        batch = [kernel("gpu-node-01", XID79)]
        assert s.post(batch).status_code == 401
        assert s.post(batch, headers={"authorization": "Bearer wrong"}).status_code == 401
        assert s.post(batch, headers={"authorization": "Bearer s3cret"}).status_code == 200


def test_state_survives_a_restart(tmp_path: Path) -> None:
    with _serve(tmp_path) as s:
        s.post([container("gpu-node-03", nccl_timeout(0), rank=0, ts=T0 + 600)])
        first = s.client.get("/v1/incidents").json()["incidents"]
    with _serve(tmp_path) as s:
        # The cause arrives after the restart and still adopts the earlier symptoms.
        s.post([kernel("gpu-node-03", XID79, ts=T0)])
        [inc] = s.client.get("/v1/incidents").json()["incidents"]
        assert inc["id"] == first[0]["id"] and inc["fault_class"] == "gpu_lost"
        s.wait(lambda: s.cluster.get_node("gpu-node-03").unschedulable)
