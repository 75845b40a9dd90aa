"""Metric and alert rules: each condition, benign samples, load-time validation, bounded state,
and the service and `kmend analyze` turning NVML/DCGM/IB samples and alerts into findings."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from analyzer.correlate import Correlator
from analyzer.metric_eval import SignalEvaluator
from analyzer.metric_rules import SignalRules, default_metric_rules_dir, load_signal_rules
from analyzer.pipeline import Analyzer
from analyzer.records import Action, FaultClass
from analyzer.rules import Rule, RuleError
from collector.exposition import exposition_samples
from collector.signal import LogLine, MetricSample, Signal, Source
from kmend.service import Kmend
from kmend.settings import Settings
from kmend.wiring import make_kmend
from sim.cluster import build_cluster
from tests.agent_helpers import Service
from tests.conftest import REPO
from tests.test_alertmanager import _wait, alertmanager, service  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def shipped() -> SignalRules:
    return load_signal_rules([default_metric_rules_dir()])


@pytest.fixture
def ev(shipped: SignalRules, shipped_rules: list[Rule]) -> SignalEvaluator:
    return SignalEvaluator(shipped, xid_rules=shipped_rules)


def sample(name: str, value: float, ts: float, node: str = "gpu-node-07", source: Source = Source.DCGM,
           **labels: str) -> Signal:
    return Signal(f"{node}/{source}/{name}/{sorted(labels.items())}/{ts}", node, source, ts,
                  MetricSample(name, value, labels))


def series(ev: SignalEvaluator, name: str, values: list[float], *, every: float = 15.0,
           source: Source = Source.DCGM, **labels: str) -> list[list[Any]]:
    """Findings per sample of one series."""
    return [ev.match([sample(name, v, i * every, source=source, **labels)]) for i, v in enumerate(values)]


GPU3 = {"gpu": "3", "UUID": "GPU-3c9a2f1e", "pci_bus_id": "00000000:5D:00.0", "Hostname": "gpu-node-07"}


def test_counter_increase_carries_delta_value_and_gpu(ev: SignalEvaluator) -> None:
    out = series(ev, "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", [1, 1, 3], **GPU3)
    assert [len(o) for o in out] == [0, 0, 1], "the first sample is a baseline; unchanged counts are silent"
    f = out[2][0]
    assert (f.fault_class, f.hardware, f.recommended_action) == (FaultClass.GPU_MEMORY, True, Action.RESET_GPU)
    assert f.fields["delta"] == "2" and f.fields["value"] == "3" and f.fields["previous"] == "1"
    assert (f.where.node, f.where.gpu, f.where.pci) == ("gpu-node-07", "3", "0000:5d:00")
    assert f.fields["uuid"] == "GPU-3c9a2f1e" and "GPU 3" in f.message


def test_counter_reset_counts_from_zero(ev: SignalEvaluator) -> None:
    out = series(ev, "ib_link_downed", [5, 0, 1], source=Source.IB, device="mlx5_0", port="1")
    assert [len(o) for o in out] == [0, 0, 1]
    assert out[2][0].where.port == "mlx5_0/1" and out[2][0].fault_class is FaultClass.NETWORK


def test_volatile_dbe_counts_from_zero_and_zero_stays_silent(ev: SignalEvaluator) -> None:
    assert series(ev, "nvml_ecc_uncorrected_volatile", [0, 0, 0], source=Source.NVML, gpu="1") == [[], [], []]
    hit = series(ev, "nvml_ecc_uncorrected_volatile", [4], source=Source.NVML, gpu="2")
    assert hit[0][0].fields["delta"] == "4", "volatile DBEs since driver load are news at the first sample"


def test_rate_threshold(ev: SignalEvaluator) -> None:
    slow = series(ev, "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", [10, 11, 12], gpu="0")
    assert slow == [[], [], []], "4 replays a minute is under DCGM's 8"
    fast = series(ev, "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", [10, 20], gpu="1")
    assert fast[1][0].fault_class is FaultClass.PCIE and fast[1][0].fields["delta"] == "10"


def test_gauge_threshold_needs_consecutive_samples_and_fires_once(ev: SignalEvaluator) -> None:
    out = series(ev, "DCGM_FI_DEV_GPU_TEMP", [91, 92, 80, 91, 92, 93, 94, 95, 96], gpu="4")
    assert [len(o) for o in out] == [0, 0, 0, 0, 0, 0, 1, 0, 0], "4 in a row, once per episode"
    assert out[6][0].fault_class is FaultClass.GPU_THERMAL_POWER and out[6][0].fields["value"] == "94"


def test_bit_mask_condition(ev: SignalEvaluator) -> None:
    power_cap = series(ev, "nvml_clocks_throttle_reasons", [4, 4, 4, 4, 5], source=Source.NVML, gpu="0")
    assert power_cap == [[]] * 5
    hw = series(ev, "nvml_clocks_throttle_reasons", [0x40, 0x44, 0x20, 0x60], source=Source.NVML, gpu="1")
    assert [f.rule_id for f in hw[3]] == ["gpu-thermal-slowdown"]


def test_value_equals_and_label_matchers(ev: SignalEvaluator) -> None:
    assert series(ev, "nvml_remapped_rows_pending", [0, 0], source=Source.NVML, gpu="0") == [[], []]
    pending = series(ev, "nvml_remapped_rows_pending", [0, 1, 1], source=Source.NVML, gpu="5")
    assert [len(o) for o in pending] == [0, 1, 0] and pending[1][0].recommended_action is Action.RESET_GPU
    warn = series(ev, "DCGM_EXP_GPU_HEALTH_STATUS", [10, 10], gpu="0", health_watch="MEM",
                  health_error_code="DCGM_FR_VOLATILE_SBE_DETECTED")
    assert warn == [[], []], "a health warning (SBE) is not a failure"
    fail = series(ev, "DCGM_EXP_GPU_HEALTH_STATUS", [20], gpu="0", health_watch="NVLINK",
                  health_error_code="DCGM_FR_NVLINK_DOWN")
    assert fail[0][0].rule_id == "dcgm-health-nvlink"
    assert fail[0][0].fields["health_error_code"] == "DCGM_FR_NVLINK_DOWN"


@pytest.mark.parametrize(("code", "fault_class", "hardware", "action"), [
    (79, FaultClass.GPU_LOST, True, Action.REPLACE_NODE),
    (74, FaultClass.NVLINK, True, Action.RESET_GPU),
    (48, FaultClass.GPU_MEMORY, True, Action.RESET_GPU),
    (13, FaultClass.APP_ERROR, False, Action.FIX_APPLICATION),
])
def test_xid_value_classified_like_the_kernel_line(ev: SignalEvaluator, code: int, fault_class: FaultClass,
                                                    hardware: bool, action: Action) -> None:
    out = series(ev, "DCGM_FI_DEV_XID_ERRORS", [0, code], **GPU3)
    f = out[1][0]
    assert (f.fault_class, f.hardware, f.recommended_action) == (fault_class, hardware, action)
    assert f.fields["xid"] == str(code) and f.fields["classified_by"] == f"xid-{code}"


def test_last_xid_gauge_fires_on_change_not_on_every_scrape(ev: SignalEvaluator) -> None:
    out = series(ev, "DCGM_FI_DEV_XID_ERRORS", [0, 79, 79, 79, 43, 43], gpu="0")
    assert [len(o) for o in out] == [0, 1, 0, 0, 1, 0]


def test_nvml_xid_events_each_count(ev: SignalEvaluator) -> None:
    out = series(ev, "nvml_xid", [13, 13], source=Source.NVML, gpu="2", uuid="GPU-x", pci="00000000:3B:00.0")
    assert [len(o) for o in out] == [1, 1]


def test_dcgm_blank_values_are_ignored(ev: SignalEvaluator) -> None:
    assert series(ev, "DCGM_FI_DEV_MEMORY_TEMP", [9.223372036854776e18] * 5, gpu="1") == [[]] * 5


def alert(name: str, status: str = "firing", **labels: str) -> Signal:
    return Signal(f"alert/{name}/{status}", labels.get("node", "gpu-node-07"), Source.ALERT, 100.0,
                  MetricSample(name, 1.0 if status == "firing" else 0.0, {"alertname": name, "status": status,
                                                                          **labels}))


def test_alert_rules(ev: SignalEvaluator) -> None:
    (f,) = ev.match([alert("KubeNodeNotReady", node="gpu-node-09", condition="Ready")])
    assert (f.fault_class, f.where.node, f.hardware, f.recommended_action) == (
        FaultClass.NODE, "gpu-node-09", False, Action.NOTIFY), "NotReady alone: software, a person looks"
    (npd,) = ev.match([alert("KubeNodeCondition", condition="ReadonlyFilesystem")])
    assert npd.fault_class is FaultClass.STORAGE and npd.hardware
    (xid,) = ev.match([alert("GpuXidError", gpu="3", pci="00000000:3B:00.0", err_code="79")])
    assert (xid.fault_class, xid.where.gpu, xid.where.pci) == (FaultClass.GPU_LOST, "3", "0000:3b:00")
    assert ev.match([alert("GPUECCDoubleBitError", status="resolved", gpu="1")]) == [], "resolved: nothing"
    assert ev.match([alert("Watchdog")]) == [], "an alert no rule names: nothing"


def test_state_is_bounded(shipped: SignalRules) -> None:
    ev = SignalEvaluator(shipped, max_series=10, stale_s=100.0)
    for i in range(50):
        ev.match([sample("ib_symbol_error", 0, 1.0, source=Source.IB, device=f"mlx5_{i}", port="1")])
    assert len(ev) == 10
    ev.match([sample("ib_symbol_error", 0, 500.0, source=Source.IB, device="mlx5_new", port="1")])
    assert len(ev) == 1, "series not seen for stale_s of signal time are forgotten"


def test_volatile_labels_do_not_split_a_series(ev: SignalEvaluator) -> None:
    ev.match([sample("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", 4, 0.0, gpu="1", pod="a")])
    out = ev.match([sample("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", 5, 15.0, gpu="1", pod="b")])
    assert [f.fields["delta"] for f in out] == ["1"], "the pod using the GPU changed, the GPU did not"


def test_exporter_counters_keep_their_names() -> None:
    text = ("# HELP DCGM_FI_DEV_PCIE_REPLAY_COUNTER Total number of PCIe retries.\n"
            "# TYPE DCGM_FI_DEV_PCIE_REPLAY_COUNTER counter\n"
            'DCGM_FI_DEV_PCIE_REPLAY_COUNTER{gpu="0",UUID="GPU-a"} 100\n')
    assert [s.name for s in exposition_samples(text)] == ["DCGM_FI_DEV_PCIE_REPLAY_COUNTER"]


# -- load-time validation ----------------------------------------------------------------

GOOD: dict[str, Any] = {
    "id": "my-rule", "description": "d", "metrics": ["nvml_xid"], "condition": "above", "threshold": 0,
    "fault_class": "gpu_hardware", "severity": "error", "hardware": True, "recommended_action": "notify",
    "examples": [{"samples": ['nvml_xid{gpu="0"} 79']}], "references": ["https://example.org/x"],
}


def write(tmp_path: Path, doc: dict[str, Any]) -> Path:
    p = tmp_path / "pack.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


@pytest.mark.parametrize(("change", "field", "problem"), [
    ({"threshold": None}, "metric_rules", "needs a threshold"),
    ({"condition": "rising"}, "condition", "Input should be"),
    ({"condition": "left", "threshold": None}, "metric_rules", "condition 'left' needs values"),
    ({"labels": {"gpu": "(?=0)"}}, "labels.gpu", "backtracking"),
    ({"examples": [{"samples": ['nvml_xid{gpu="0"} 0']}]}, "examples[0]", "does not fire"),
    ({"examples": [{"samples": ['DCGM_FI_DEV_GPU_TEMP{gpu="0"} 99']}]}, "examples[0]", "not one of the rule"),
    ({"counter_examples": [{"samples": ['nvml_xid{gpu="0"} 13']}]}, "counter_examples[0]", "fires"),
    ({"references": ["a thread somewhere"]}, "references", "not a URL"),
    ({"colour": "red"}, "colour", "Extra inputs"),
])
def test_bad_metric_rule_names_file_id_and_field(tmp_path: Path, change: dict[str, Any], field: str,
                                                 problem: str) -> None:
    rule = {k: v for k, v in (GOOD | change).items() if v is not None}
    path = write(tmp_path, {"metric_rules": [rule]})
    with pytest.raises(RuleError) as err:
        load_signal_rules([path])
    assert err.value.path == str(path) and err.value.rule_id == "my-rule"
    assert err.value.field.startswith(field) and problem in str(err.value)


def test_bad_alert_rule_and_duplicate_ids(tmp_path: Path) -> None:
    bad = {"id": "a1", "description": "d", "names": ["X"], "fault_class": "node", "severity": "error",
           "hardware": True, "recommended_action": "notify", "examples": [{"alertname": "Y"}],
           "references": ["https://example.org"]}
    with pytest.raises(RuleError, match=r"rule 'a1': field 'examples\[0\]': does not match"):
        load_signal_rules([write(tmp_path, {"alert_rules": [bad]})])
    good = bad | {"examples": [{"alertname": "X"}]}
    with pytest.raises(RuleError, match="field 'id': duplicate"):
        load_signal_rules([write(tmp_path, {"alert_rules": [good, good]})])
    with pytest.raises(RuleError, match="'metric_rules' and/or 'alert_rules'"):
        load_signal_rules([write(tmp_path, {"rules": []})])


def test_shipped_packs_cover_the_signals_the_collectors_emit(shipped: SignalRules) -> None:
    watched = {m for r in shipped.metric for m in r.metrics}
    for name in ("DCGM_FI_DEV_XID_ERRORS", "nvml_xid", "DCGM_FI_DEV_ROW_REMAP_FAILURE", "nvml_remapped_rows_pending",
                 "DCGM_FI_DEV_RETIRED_DBE", "nvml_retired_pages_sbe", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
                 "nvml_ecc_uncorrected_aggregate", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
                 "nvml_nvlink_crc_flit_errors_total", "nvml_nvlink_replay_errors_total",
                 "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", "ib_link_downed", "ib_symbol_error",
                 "ib_port_rcv_errors", "ib_excessive_buffer_overrun_errors", "nvml_clocks_throttle_reasons",
                 "DCGM_FI_DEV_THERMAL_VIOLATION", "DCGM_EXP_GPU_HEALTH_STATUS"):
        assert name in watched, name
    assert all(r.references for r in (*shipped.metric, *shipped.alert))


# -- through the service and `kmend analyze` ----------------------------------------------

def test_service_ingest_turns_metrics_and_alerts_into_incidents(tmp_path: Path) -> None:
    kmend: Kmend = make_kmend(Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim",
                                       symptom_settle_s=3600), cluster=build_cluster(4))
    kmend.start()
    try:
        node = "node-1"
        base = {"gpu": "2", "UUID": "GPU-a", "pci_bus_id": "00000000:3B:00.0"}
        kmend.ingest([sample("DCGM_FI_DEV_ROW_REMAP_FAILURE", 0, 1.0, node=node, **base)])
        assert kmend.ingest([sample("DCGM_FI_DEV_ROW_REMAP_FAILURE", 0, 16.0, node=node, **base)]).findings == ()
        out = kmend.ingest([sample("DCGM_FI_DEV_ROW_REMAP_FAILURE", 1, 31.0, node=node, **base),
                            alert("KubeNodeNotReady", node="node-2")])
        assert sorted(f.rule_id for f in out.findings) == ["alert-kube-node-not-ready", "gpu-row-remap-failure"]
        incs = {(i.fault_class, i.root_cause.node, i.root_cause.gpu) for i in kmend.analyzer.correlator.incidents()}
        assert incs == {(FaultClass.GPU_MEMORY, node, "2"), (FaultClass.NODE, "node-2", None)}
    finally:
        kmend.store.close()


def test_kmend_analyze_reads_exporter_scrapes_and_webhook_bodies(tmp_path: Path) -> None:
    node = tmp_path / "gpu-node-07"
    node.mkdir()
    g = 'gpu="5",UUID="GPU-b",pci_bus_id="00000000:9A:00.0",device="nvidia5",Hostname="gpu-node-07"'
    (node / "dcgm.prom").write_text(
        "# HELP DCGM_FI_DEV_ECC_DBE_VOL_TOTAL Total number of double-bit volatile ECC errors.\n"
        "# TYPE DCGM_FI_DEV_ECC_DBE_VOL_TOTAL counter\n"
        f"DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{{{g}}} 0\n"
        f"DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{{{g}}} 3\n")
    (tmp_path / "alertmanager.json").write_text(json.dumps({
        "version": "4", "status": "firing", "receiver": "kmend", "groupKey": "{}", "alerts": [
            {"status": "firing", "labels": {"alertname": "NodeFilesystemAlmostOutOfSpace",
                                            "instance": "gpu-node-08:9100", "mountpoint": "/", "severity": "critical"},
             "annotations": {}, "startsAt": "2026-11-21T10:00:00Z", "endsAt": "0001-01-01T00:00:00Z"},
            {"status": "resolved", "labels": {"alertname": "KubeNodeNotReady", "node": "gpu-node-09"},
             "annotations": {}, "startsAt": "2026-11-21T09:00:00Z", "endsAt": "2026-11-21T09:30:00Z"}]}))
    out = subprocess.run([sys.executable, "-m", "kmend.cli", "analyze", str(tmp_path), "--format", "json",
                          "--exit-zero"], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    got = {(i["fault_class"], i["root_cause"]["node"], i["root_cause"]["gpu"], i["hardware"])
           for i in json.loads(out.stdout)["incidents"]}
    assert got == {("gpu_memory", "gpu-node-07", "5", True), ("storage", "gpu-node-08", None, False)}


def test_real_alertmanager_alerts_open_incidents_and_resolving_opens_none(
        alertmanager: str, service: Service) -> None:  # noqa: F811  (the fixtures imported above)
    starts = (datetime.now(UTC) - timedelta(seconds=5)).isoformat().replace("+00:00", "Z")
    alerts = [
        {"labels": {"alertname": "GpuXidError", "severity": "critical", "Hostname": "gpu-node-07", "gpu": "3",
                    "UUID": "GPU-b9f9e81b-bee7-34bc-af17-132ef6592740", "pci_bus_id": "00000000:3B:00.0",
                    "err_code": "79"}, "annotations": {"summary": "Xid 79 on GPU 3"}, "startsAt": starts},
        {"labels": {"alertname": "NodeFilesystemAlmostOutOfSpace", "instance": "gpu-node-08:9100",
                    "mountpoint": "/", "severity": "critical"}, "annotations": {}, "startsAt": starts},
    ]
    assert httpx.post(f"{alertmanager}/api/v2/alerts", json=alerts).status_code == 200

    def incidents() -> set[tuple[str, str | None, str | None]]:
        return {(i.fault_class.value, i.root_cause.node, i.root_cause.gpu)
                for i in service.kmend.analyzer.correlator.incidents()}

    _wait(lambda: len(incidents()) == 2)
    assert incidents() == {("gpu_lost", "gpu-node-07", "3"), ("storage", "gpu-node-08", None)}
    ends = datetime.now(UTC).isoformat().replace("+00:00", "Z")
    assert httpx.post(f"{alertmanager}/api/v2/alerts", json=[a | {"endsAt": ends} for a in alerts]).status_code == 200
    # Alert samples are not stored as rows: the ingest counter says when the resolved notifications arrived.
    registry = service.kmend.metrics.registry
    _wait(lambda: (registry.get_sample_value("kmend_ingest_signals_total", {"source": "alert"}) or 0) >= 4)
    assert len(service.kmend.store.findings_in_order()) == 2, "resolved notifications make no findings"


def test_a_redelivered_batch_gives_the_same_findings_and_late_samples_none(ev: SignalEvaluator) -> None:
    first = sample("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", 4, 0.0, gpu="1")
    grew = sample("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", 6, 15.0, gpu="1")
    ev.match([first])
    once = ev.match([grew])
    again = ev.match([grew])  # the store rolled the batch back; the agent sends it again
    assert [f.id for f in once] == [f.id for f in again] and once[0].fields["delta"] == "2"
    assert ev.match([sample("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", 5, 10.0, gpu="1")]) == []
    temps = [sample("DCGM_FI_DEV_GPU_TEMP", 95, float(t), gpu="6") for t in range(4)]
    assert len(ev.match(temps)) == 1 and len(ev.match(temps[-1:])) == 1


def test_dcgm_xid_and_the_kernel_line_of_the_same_gpu_are_one_incident(shipped: SignalRules,
                                                                      shipped_rules: list[Rule]) -> None:
    analyzer = Analyzer(shipped_rules, correlator=Correlator(),
                        signals=SignalEvaluator(shipped, xid_rules=shipped_rules))
    kern = Signal("gpu-node-07/kernel/1", "gpu-node-07", Source.KERNEL, 100.0,
                  LogLine("NVRM: Xid (PCI:0000:5d:00): 79, pid=1234, GPU has fallen off the bus."))
    analyzer.process([kern, sample("DCGM_FI_DEV_XID_ERRORS", 79, 101.0, **GPU3),
                      sample("DCGM_FI_DEV_XID_ERRORS", 0, 102.0, gpu="4", pci_bus_id="00000000:9A:00.0")])
    (inc,) = analyzer.correlator.incidents()
    assert sorted(f.rule_id for f in inc.findings) == ["dcgm-xid-last", "xid-79"]
    assert (inc.fault_class, inc.root_cause.pci) == (FaultClass.GPU_LOST, "0000:5d:00")
