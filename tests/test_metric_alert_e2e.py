"""End to end through `kmend serve` and `kmend agent` as processes: DCGM exporter scrapes and an
Alertmanager v4 webhook become incidents naming the node, the GPU and whether it is hardware."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.agent_helpers import TOKEN
from tests.conftest import free_port
from tests.procs import wait_ready
from tests.test_agent_e2e import Proc, wait_for

pytestmark = pytest.mark.slow

# What dcgm-exporter prints (label set of its default configuration); Hostname is the node.
_LABELS = ('gpu="{gpu}",UUID="GPU-{gpu}f809e614-a528-4083-acbf-334600000000",pci_bus_id="00000000:{bus}:00.0",'
           'device="nvidia{gpu}",modelName="NVIDIA H100 80GB HBM3",Hostname="gpu-node-07",'
           'DCGM_FI_DRIVER_VERSION="550.54.15"')


def exporter_text(scrape: int) -> str:
    """The exporter's page at its n-th scrape: healthy first, then Xid 79 on GPU 3 and DBEs on GPU 5."""
    faulty = scrape > 0
    g3, g5 = _LABELS.format(gpu=3, bus="5D"), _LABELS.format(gpu=5, bus="9A")
    xid = (f'DCGM_FI_DEV_XID_ERRORS{{{g3},err_code="79",err_msg="GPU has fallen off the bus"}} 79' if faulty
           else f'DCGM_FI_DEV_XID_ERRORS{{{g3},err_code="0",err_msg="No Error"}} 0')
    return "\n".join([
        "# HELP DCGM_FI_DEV_SM_CLOCK SM clock frequency (in MHz).",
        "# TYPE DCGM_FI_DEV_SM_CLOCK gauge",
        f"DCGM_FI_DEV_SM_CLOCK{{{g3}}} 1980",
        f"DCGM_FI_DEV_SM_CLOCK{{{g5}}} 1980",
        "# HELP DCGM_FI_DEV_XID_ERRORS Value of the last XID error encountered.",
        "# TYPE DCGM_FI_DEV_XID_ERRORS gauge",
        xid,
        f'DCGM_FI_DEV_XID_ERRORS{{{g5},err_code="0",err_msg="No Error"}} 0',
        "# HELP DCGM_FI_DEV_ECC_DBE_VOL_TOTAL Total number of double-bit volatile ECC errors.",
        "# TYPE DCGM_FI_DEV_ECC_DBE_VOL_TOTAL counter",
        f"DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{{{g3}}} 0",
        f"DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{{{g5}}} {2 if faulty else 0}",
        "# HELP DCGM_FI_DEV_PCIE_REPLAY_COUNTER Total number of PCIe retries.",
        "# TYPE DCGM_FI_DEV_PCIE_REPLAY_COUNTER counter",
        f"DCGM_FI_DEV_PCIE_REPLAY_COUNTER{{{g3}}} 0",
        f"DCGM_FI_DEV_PCIE_REPLAY_COUNTER{{{g5}}} 0",
        "",
    ])


class _Exporter(BaseHTTPRequestHandler):
    scrapes = 0

    def do_GET(self) -> None:
        body = exporter_text(type(self).scrapes).encode()
        type(self).scrapes += 1
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def exporter() -> Iterator[str]:
    handler = type("Exporter", (_Exporter,), {"scrapes": 0})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()


def webhook(now: datetime) -> dict[str, Any]:
    """An Alertmanager v4 notification: one firing node-NotReady alert, one resolved GPU ECC alert."""
    start = now.isoformat().replace("+00:00", "Z")
    firing = {
        "status": "firing",
        "labels": {"alertname": "KubeNodeNotReady", "condition": "Ready", "node": "gpu-node-09",
                   "severity": "warning", "status": "true", "namespace": "monitoring"},
        "annotations": {"description": "gpu-node-09 has been unready for more than 15 minutes.",
                        "runbook_url": "https://runbooks.prometheus-operator.dev/runbooks/kubernetes/kubenodenotready",
                        "summary": "Node is not ready."},
        "startsAt": start, "endsAt": "0001-01-01T00:00:00Z",
        "generatorURL": "http://prometheus:9090/graph?g0.expr=kube_node_status_condition",
        "fingerprint": "a1b2c3d4e5f60718",
    }
    resolved = {
        "status": "resolved",
        "labels": {"alertname": "GPUECCDoubleBitError", "Hostname": "gpu-node-11", "gpu": "2",
                   "UUID": "GPU-b0c1d2e3-0000-1111-2222-333344445555", "severity": "critical"},
        "annotations": {"summary": "GPU 2 has double-bit ECC errors"},
        "startsAt": start, "endsAt": start,
        "generatorURL": "http://prometheus:9090/graph", "fingerprint": "0f1e2d3c4b5a6978",
    }
    return {"receiver": "kmend", "status": "firing", "alerts": [firing, resolved],
            "groupLabels": {"alertname": "KubeNodeNotReady"}, "commonLabels": {}, "commonAnnotations": {},
            "externalURL": "http://alertmanager:9093", "version": "4",
            "groupKey": '{}:{alertname="KubeNodeNotReady"}', "truncatedAlerts": 0}


def test_dcgm_scrapes_and_alerts_become_incidents(tmp_path: Path, exporter: str) -> None:
    (tmp_path / "token").write_text(TOKEN + "\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    service = Proc(["serve", "--port", str(port), "--database-url", f"sqlite:///{tmp_path / 'kmend.db'}",
                    "--cluster", "sim"], tmp_path / "service.log",
                   {"KMEND_INGEST_TOKEN": TOKEN, "KMEND_READER_TOKEN": "reader-token",
                    "KMEND_SYMPTOM_SETTLE_S": "3600"})
    (tmp_path / "pods").mkdir()
    agent = Proc(["agent", "--node", "gpu-node-07", "--service-url", url, "--token-file", str(tmp_path / "token"),
                  "--state-dir", str(tmp_path / "state"), "--pods-root", str(tmp_path / "pods"), "--kernel", "off",
                  "--ib-root", str(tmp_path / "no-ib"), "--no-nvml", "--no-pod-labels", "--dcgm-url", exporter,
                  "--metrics-interval", "0.3", "--poll-interval", "0.1", "--flush-interval", "0.2",
                  "--status-port", "0"], tmp_path / "agent.log", {})

    def incidents() -> list[dict[str, Any]]:
        body: list[dict[str, Any]] = httpx.get(f"{url}/v1/incidents", timeout=5,
                                               headers={"Authorization": "Bearer reader-token"}).json()["incidents"]
        return body

    try:
        service.start()
        assert service.p is not None
        wait_ready(url, service.p, log=tmp_path / "service.log")
        agent.start()
        wait_for(lambda: len(incidents()) >= 2, 120, "incidents from the DCGM scrapes")
        resp = httpx.post(f"{url}/v1/alerts/alertmanager", json=webhook(datetime.now(UTC)),
                          headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        assert resp.status_code == 200, resp.text
        assert resp.json()["findings"] == 1, "the firing alert is a finding, the resolved one is not"
        wait_for(lambda: len(incidents()) >= 3, 60, "incident from the alert")
        time.sleep(1.0)  # later scrapes repeat the same values: they must not open more incidents
        found = incidents()
    finally:
        agent.stop()
        service.stop()

    got = {(i["fault_class"], i["root_cause"]["node"], i["root_cause"]["gpu"], i["hardware"],
            i["recommended_action"]) for i in found}
    assert got == {
        ("gpu_lost", "gpu-node-07", "3", True, "replace_node"),
        ("gpu_memory", "gpu-node-07", "5", True, "reset_gpu"),
        ("node", "gpu-node-09", None, False, "notify"),
    }
    assert not [i for i in found if i["root_cause"]["node"] == "gpu-node-11"], "a resolved alert opens nothing"
    gpu5 = next(i for i in found if i["root_cause"]["gpu"] == "5")
    assert gpu5["root_cause"]["pci"] == "0000:9a:00"
