"""`kmend rules test` as a subprocess: matched rule, extracted fields and finding for log lines,
metric samples (Prometheus text and JSON) and Alertmanager webhooks; nearest rules; progress."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import REPO

# The NVRM line in the format the xid packs are written from.
XID79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."
MEGATRON = (" iteration      100/  500000 | consumed samples:         3200 | elapsed time per iteration (ms): 512.3 |"
            " learning rate: 1.500E-04 | global batch size:    32 | lm loss: 7.123E+00 |")


def kmend(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kmend.cli", "rules", "test", *args], cwd=REPO, input=stdin,
                          capture_output=True, text=True, timeout=60)


def events(*args: str, stdin: str | None = None) -> list[dict[str, Any]]:
    out = kmend(*args, "--json", stdin=stdin)
    assert out.returncode == 0, out.stderr
    result: list[dict[str, Any]] = json.loads(out.stdout)["events"]
    return result


def test_log_line_shows_rule_extracted_fields_and_finding() -> None:
    (ev,) = events(XID79, "--source", "kernel")
    (m,) = ev["matches"]
    assert m["rule_id"] == "xid-79" and m["extracted"] == {"pci": "0000:3b:00", "xid": "79"}
    f = m["finding"]
    assert (f["fault_class"], f["hardware"], f["recommended_action"]) == ("gpu_lost", True, "replace_node")
    text = kmend(XID79).stdout
    assert "matched xid-79: gpu_lost hardware=yes action=replace_node" in text and "pci=0000:3b:00" in text


def test_unmatched_line_names_the_nearest_rules_and_progress_is_extracted(tmp_path: Path) -> None:
    near_miss = XID79.replace("Xid", "Xld")
    f = tmp_path / "lines.log"
    f.write_text(f"{near_miss}\n{MEGATRON}\n")
    miss, step = events("--file", str(f))
    assert miss["matches"] == [] and miss["nearest"][0]["rule_id"] == "xid-79"
    assert step["matches"] == []
    (p,) = [p for p in step["progress"] if p["rule_id"].startswith("megatron")]
    assert p["extracted"]["step"] == 100 and p["extracted"]["total"] == 500000


def test_source_restriction_is_reported() -> None:
    (ev,) = events(XID79, "--source", "container")
    assert ev["matches"] == [] and any("xid-79" in n for n in ev["notes"])


def test_metric_series_from_exporter_text_shows_delta(tmp_path: Path) -> None:
    g = 'gpu="5",UUID="GPU-b",pci_bus_id="00000000:9A:00.0",Hostname="gpu-node-07"'
    f = tmp_path / "scrapes.prom"
    f.write_text("# TYPE DCGM_FI_DEV_ECC_DBE_AGG_TOTAL counter\n"
                 f"DCGM_FI_DEV_ECC_DBE_AGG_TOTAL{{{g}}} 4\n"
                 f"DCGM_FI_DEV_ECC_DBE_AGG_TOTAL{{{g}}} 4\n"
                 f"DCGM_FI_DEV_ECC_DBE_AGG_TOTAL{{{g}}} 6\n")
    first, same, grew = events("--file", str(f))
    assert first["matches"] == [] and "baseline" in first["notes"][0]
    assert same["matches"] == []
    (m,) = grew["matches"]
    assert m["rule_id"] == "gpu-ecc-dbe-aggregate" and m["extracted"]["delta"] == "2"
    assert m["finding"]["where"] == {"node": "gpu-node-07", "gpu": "5", "pci": "0000:9a:00"}


def test_metric_sample_as_json_and_unwatched_metric() -> None:
    sample = {"name": "nvml_remapped_rows_failure", "value": 1, "labels": {"gpu": "2", "uuid": "GPU-x"}}
    (ev,) = events(json.dumps(sample))
    assert ev["matches"][0]["finding"]["fault_class"] == "gpu_memory"
    (quiet,) = events('DCGM_FI_DEV_FB_USED{gpu="0"} 1024')
    assert quiet["matches"] == [] and quiet["notes"] == ["no metric rule watches DCGM_FI_DEV_FB_USED"]


def test_alertmanager_webhook_firing_and_resolved() -> None:
    body = {"version": "4", "status": "firing", "receiver": "kmend", "groupKey": "{}", "alerts": [
        {"status": "firing", "labels": {"alertname": "KubeNodeNotReady", "node": "gpu-node-09"},
         "annotations": {}, "startsAt": "2026-11-21T10:00:00Z", "endsAt": "0001-01-01T00:00:00Z"},
        {"status": "resolved", "labels": {"alertname": "GPUECCDoubleBitError", "Hostname": "gpu-node-11"},
         "annotations": {}, "startsAt": "2026-11-21T09:00:00Z", "endsAt": "2026-11-21T09:10:00Z"}]}
    firing, resolved = events("--file", "-", stdin=json.dumps(body))
    assert firing["matches"][0]["rule_id"] == "alert-kube-node-not-ready"
    assert firing["matches"][0]["finding"]["where"]["node"] == "gpu-node-09"
    assert resolved["matches"] == [] and resolved["notes"] == ["resolved: no finding"]


def test_bad_input_is_one_line() -> None:
    out = kmend('{"neither": 1}')
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "webhook" in out.stderr
