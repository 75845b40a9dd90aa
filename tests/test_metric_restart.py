"""Counters across a `kmend serve` restart (a real process, stopped and started on the same database): an
increase between the last sample before and the first after is found, and a counter that did not move
is no new increase from zero."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from kmend.store import Store
from tests.agent_helpers import TOKEN
from tests.conftest import free_port
from tests.procs import wait_ready
from tests.test_agent_e2e import Proc

pytestmark = pytest.mark.slow

GPU = {"gpu": "3", "UUID": "GPU-3f809e614-a528-4083-acbf-334600000000", "pci_bus_id": "00000000:5D:00.0",
       "device": "nvidia3", "modelName": "NVIDIA H100 80GB HBM3", "Hostname": "gpu-node-07"}
REMAPPED = "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"
"""Rule gpu-uncorrectable-remapped-rows: its first sample is only a baseline."""
XIDS = "DCGM_EXP_XID_ERRORS_TOTAL"
"""Rule dcgm-xid-count: its first sample counts from zero."""


def _post(url: str, t: float, samples: list[tuple[str, float, dict[str, str]]]) -> None:
    body = {"signals": [
        {"id": f"gpu-node-07/dcgm/{name}/{t}", "node": "gpu-node-07", "source": "dcgm", "ts": t,
         "payload": {"kind": "metric", "name": name, "value": value, "labels": labels}}
        for name, value, labels in samples]}
    r = httpx.post(f"{url}/v1/signals", json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert r.status_code == 200, r.text


def _findings(db: str) -> list[tuple[str, str]]:
    store = Store(db)
    try:
        return [(f.rule_id, f.fields.get("delta", "")) for f in store.findings_in_order()]
    finally:
        store.close()


def test_counters_are_judged_against_their_last_sample_before_the_restart(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'kmend.db'}"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    service = Proc(["serve", "--port", str(port), "--database-url", db, "--cluster", "sim"], tmp_path / "serve.log",
                   {"KMEND_INGEST_TOKEN": TOKEN, "KMEND_SYMPTOM_SETTLE_S": "3600"})
    xid79 = {**GPU, "xid": "79"}
    t0 = time.time() - 120
    try:
        service.start()
        assert service.p is not None
        wait_ready(url, service.p, log=tmp_path / "serve.log")
        _post(url, t0, [(REMAPPED, 0, GPU), (XIDS, 1, xid79)])
        _post(url, t0 + 30, [(REMAPPED, 0, GPU), (XIDS, 1, xid79)])
        assert _findings(db) == [("dcgm-xid-count", "1")]  # one Xid 79 counted from zero, once
        service.stop()

        service.start()
        wait_ready(url, service.p, log=tmp_path / "serve.log")
        # Two rows were remapped while the service was down; the Xid counter did not move.
        _post(url, t0 + 60, [(REMAPPED, 2, GPU), (XIDS, 1, xid79)])
        assert _findings(db) == [("dcgm-xid-count", "1"), ("gpu-uncorrectable-remapped-rows", "2")]
        # And once more after a kill -9: what was stored with the last batch is what counts.
        service.kill()
        service.start()
        wait_ready(url, service.p, log=tmp_path / "serve.log")
        _post(url, t0 + 90, [(REMAPPED, 2, GPU), (XIDS, 2, xid79)])
        assert _findings(db)[2:] == [("dcgm-xid-count", "1")]
    finally:
        service.stop()
