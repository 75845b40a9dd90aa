"""The agent's own NVML, DCGM and InfiniBand sources feed the shipped metric rules: the names and
labels the collectors emit are the ones the rules watch, and findings name the GPU or the port."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from analyzer.metric_eval import SignalEvaluator
from analyzer.metric_rules import default_metric_rules_dir, load_signal_rules
from analyzer.rules import Rule
from collector.sources.dcgm import DcgmSource, parse_scrape
from collector.sources.ib import IbSysfsSource
from collector.sources.nvml import NvmlSource
from collector.sources.nvml_fake import FakeGpu, FakeNvml

FIXTURES = Path(__file__).parent / "fixtures" / "agent"


@pytest.fixture
def ev(shipped_rules: list[Rule]) -> SignalEvaluator:
    return SignalEvaluator(load_signal_rules([default_metric_rules_dir()]), xid_rules=shipped_rules)


def test_dcgm_exporter_counters_survive_the_scrape_and_fire() -> None:
    names = {s.name for s in parse_scrape((FIXTURES / "dcgm-exporter.txt").read_text())}
    # Declared `counter` by the exporter; the text parser used to rename them and the source dropped them.
    assert {"DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
            "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"} <= names


def test_dcgm_source_scrape_to_findings(ev: SignalEvaluator) -> None:
    text = (FIXTURES / "dcgm-exporter.txt").read_text()
    src = DcgmSource(node="gpu-node-07", fetch=lambda: text, clock=lambda: 50.0)
    found = ev.match(src.poll().signals)
    xid = [f for f in found if f.rule_id == "dcgm-xid-last"]
    assert xid and xid[0].fault_class.value == "gpu_lost" and xid[0].where.gpu == "0"
    assert xid[0].where.pci == "0000:3b:00" and xid[0].where.node == "gpu-node-07"


def test_nvml_source_to_findings(ev: SignalEvaluator) -> None:
    gpu = FakeGpu("GPU-aaaa", "00000000:3B:00.0", remapped_rows=(0, 0, 0, 1))
    fake = FakeNvml([gpu, FakeGpu("GPU-bbbb", "00000000:5E:00.0")])
    now = [10.0]
    src = NvmlSource(node="gpu-node-07", load=lambda: fake, clock=lambda: now[0], interval=15)
    fake.inject_xid(1, 79)
    found = {(f.rule_id, f.where.gpu, f.fault_class.value) for f in ev.match(src.poll().signals)}
    assert ("gpu-row-remap-failure", "0", "gpu_memory") in found
    assert ("nvml-xid-event", "1", "gpu_lost") in found
    gpu.ecc[(1, 0)] = 3  # uncorrected, volatile
    now[0] += 15
    again = ev.match(src.poll().signals)
    dbe = [f for f in again if f.rule_id == "gpu-ecc-dbe-volatile"]
    assert [(f.where.gpu, f.fields["delta"]) for f in dbe] == [("0", "3")]
    assert not [f for f in again if f.rule_id == "gpu-row-remap-failure"], "a failure still set is not news"


def test_ib_sysfs_source_to_findings(tmp_path: Path, ev: SignalEvaluator) -> None:
    root = tmp_path / "infiniband"
    shutil.copytree(FIXTURES / "ib", root)
    now = [100.0]
    src = IbSysfsSource(node="gpu-node-07", root=root, interval=10, clock=lambda: now[0])
    assert ev.match(src.poll().signals) == [], "counters already non-zero at start are history"
    counter = root / "mlx5_1/ports/1/counters/link_downed"
    counter.write_text(f"{int(counter.read_text()) + 2}\n")
    now[0] += 10
    (f,) = ev.match(src.poll().signals)
    assert (f.rule_id, f.where.port, f.fields["delta"]) == ("ib-link-downed", "mlx5_1/1", "2")


def test_an_ib_port_that_leaves_active_is_found_once_and_a_port_down_from_the_start_is_not(
        tmp_path: Path, ev: SignalEvaluator) -> None:
    """A port that goes from ACTIVE to DOWN (its cable pulled, its switch port disabled: phys_state Disabled) takes a
    training rail away; a port DOWN since the agent first read it (disabled on purpose, unused) is not news."""
    root = tmp_path / "infiniband"
    shutil.copytree(FIXTURES / "ib", root)
    now = [100.0]
    src = IbSysfsSource(node="gpu-node-07", root=root, interval=10, clock=lambda: now[0])
    port = root / "mlx5_0/ports/1"

    def poll() -> list[tuple[str, str | None, str, str]]:
        now[0] += 10
        return [(f.rule_id, f.where.port, f.fields["previous"], f.fields["value"])
                for f in ev.match(src.poll().signals) if f.rule_id.startswith("ib-port")]

    assert poll() == []  # mlx5_1 is DOWN / Disabled from the first read on
    (port / "state").write_text("1: DOWN\n")
    (port / "phys_state").write_text("3: Disabled\n")
    assert poll() == [("ib-port-left-active", "mlx5_0/1", "4", "1")]
    assert poll() == [] and poll() == []  # still down: one finding for the episode
    (port / "state").write_text("4: ACTIVE\n")
    (port / "phys_state").write_text("5: LinkUp\n")
    assert poll() == []
    (port / "state").write_text("2: INIT\n")  # it flaps again
    assert poll() == [("ib-port-left-active", "mlx5_0/1", "4", "2")]
