"""Alertmanager → /v1/alerts/alertmanager with the real Alertmanager binary on loopback, and label mapping."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from collector.alertmanager import AlertIn, alert_to_signal, node_of
from collector.signal import MetricSample
from tests.agent_helpers import TOKEN, Service
from tests.conftest import free_port
from tests.procs import ALERTMANAGER
from tests.procs import alertmanager as run_alertmanager


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    svc = Service(tmp_path, free_port())
    svc.start()
    yield svc
    svc.stop()
    svc.kmend.store.close()


@pytest.fixture
def alertmanager(tmp_path: Path, service: Service) -> Iterator[str]:
    if ALERTMANAGER is None:
        pytest.skip("prometheus-alertmanager is not installed (.ci/run installs it)")
    config = {
        "route": {"receiver": "kmend", "group_by": ["alertname", "Hostname", "gpu"],
                  "group_wait": "100ms", "group_interval": "1s", "repeat_interval": "1h"},
        "receivers": [{"name": "kmend", "webhook_configs": [{
            "url": f"{service.url}/v1/alerts/alertmanager", "send_resolved": True,
            "http_config": {"authorization": {"type": "Bearer", "credentials": TOKEN}},
        }]}],
    }
    with run_alertmanager(tmp_path, config, free_port()) as url:
        yield url


def _wait(pred: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError("condition not reached")


LABELS = {"alertname": "GpuXidError", "severity": "critical", "Hostname": "gpu-node-07", "gpu": "3",
          "UUID": "GPU-b9f9e81b-bee7-34bc-af17-132ef6592740", "pci_bus_id": "00000000:3B:00.0",
          "err_code": "79"}


def test_real_alertmanager_delivers_firing_then_resolved(alertmanager: str, service: Service) -> None:
    starts = datetime.now(UTC) - timedelta(seconds=5)
    alert = {"labels": LABELS, "annotations": {"summary": "Xid 79 on GPU 3"},
             "startsAt": starts.isoformat().replace("+00:00", "Z")}
    assert httpx.post(f"{alertmanager}/api/v2/alerts", json=[alert]).status_code == 200
    _wait(lambda: len(service.stored("alert")) >= 1)
    firing = service.stored("alert")[0]
    assert firing["node"] == "gpu-node-07"
    payload = firing["body"]["payload"]
    assert payload["name"] == "GpuXidError" and payload["value"] == 1.0
    assert payload["labels"]["gpu"] == "3" and payload["labels"]["pci"] == "00000000:3B:00.0"
    assert payload["labels"]["uuid"].startswith("GPU-b9f9") and payload["labels"]["summary"] == "Xid 79 on GPU 3"
    alert["endsAt"] = datetime.now(UTC).isoformat().replace("+00:00", "Z")
    assert httpx.post(f"{alertmanager}/api/v2/alerts", json=[alert]).status_code == 200
    _wait(lambda: any(s["body"]["payload"]["value"] == 0.0 for s in service.stored("alert")))
    statuses = sorted(s["body"]["payload"]["labels"]["status"] for s in service.stored("alert"))
    assert statuses == ["firing", "resolved"]


def test_webhook_resend_is_idempotent_and_version_checked(service: Service) -> None:
    body = {"version": "4", "groupKey": "{}:{alertname=\"GpuXidError\"}", "status": "firing",
            "receiver": "kmend", "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {},
            "externalURL": "http://am:9093", "truncatedAlerts": 0,
            "alerts": [{"status": "firing", "labels": LABELS, "annotations": {},
                        "startsAt": "2026-11-21T10:00:00.123456789Z", "endsAt": "0001-01-01T00:00:00Z",
                        "generatorURL": "http://prometheus/graph", "fingerprint": "c1a3b2f4d5e6a7b8"}]}
    headers = {"Authorization": f"Bearer {TOKEN}"}
    url = f"{service.url}/v1/alerts/alertmanager"
    assert httpx.post(url, json=body, headers=headers).json()["accepted"] == 1
    assert httpx.post(url, json=body, headers=headers).json()["duplicates"] == 1
    assert httpx.post(url, json=body | {"version": "3"}, headers=headers).status_code == 422
    assert httpx.post(url, json=body).status_code == 401


@pytest.mark.parametrize(("labels", "node"), [
    ({"node": "a", "instance": "b:9400"}, "a"),
    ({"kubernetes_node": "k"}, "k"),
    ({"Hostname": "h"}, "h"),
    ({"instance": "gpu-node-1:9400"}, "gpu-node-1"),
    ({"instance": "[fd00::1]:9400"}, "[fd00::1]:9400"),
    ({"alertname": "x"}, None),
])
def test_node_from_labels(labels: dict[str, str], node: str | None) -> None:
    assert node_of(labels) == node


def test_alert_without_node_uses_default_or_is_skipped() -> None:
    alert = AlertIn(status="resolved", labels={"alertname": "NodeDown"}, startsAt="2026-11-21T10:00:00Z",
                    endsAt="2026-11-21T10:05:00Z", fingerprint="f")
    assert alert_to_signal(alert, default_node=None, now=1.0) is None
    sig = alert_to_signal(alert, default_node="n9", now=1.0)
    assert sig is not None and sig.node == "n9" and sig.ts == 1_795_255_500.0
    assert isinstance(sig.payload, MetricSample) and sig.payload.value == 0.0
