"""What a real, healthy GPU reports stays silent: an NVML poll of an idle NVIDIA H100 80GB HBM3 (driver 580.159.04)
taken by kmend's own NVML source, and that GPU's `nvidia-smi` / `nvidia-smi -q` output, produce no finding through
the shipped metric and log rules. The idle clock-event bit (0x1) is not a slowdown; every counter is zero."""

from __future__ import annotations

import json
from pathlib import Path

from analyzer.matcher import FastMatcher
from analyzer.metric_eval import SignalEvaluator
from analyzer.metric_rules import default_metric_rules_dir, load_signal_rules
from analyzer.progress_rules import default_progress_rules_dir, load_progress_rules
from analyzer.rules import default_rules_dir, load_rules
from collector.bundle import BundleSource
from collector.signal import MetricSample, Signal, Source
from kmend.bundle_analysis import diagnose_source

GPU = Path(__file__).resolve().parent / "fixtures" / "gpu"


def _poll_signals(rounds: int = 4) -> list[Signal]:
    rows = json.loads((GPU / "h100-healthy-nvml-poll.json").read_text())
    out = []
    for r in range(rounds):  # the same healthy sample, polled every 15 s
        for i, row in enumerate(rows):
            out.append(Signal(f"h100-0/nvml/{r}/{i}", "h100-0", Source.NVML, 1_795_000_000.0 + 15 * r,
                              MetricSample(row["name"], float(row["value"]), dict(row["labels"]))))
    return out


def test_the_real_poll_is_what_the_nvml_source_emits() -> None:
    names = {s.payload.name for s in _poll_signals(1) if isinstance(s.payload, MetricSample)}
    assert {"nvml_remapped_rows_pending", "nvml_clocks_throttle_reasons", "nvml_ecc_uncorrected_volatile",
            "nvml_pcie_replay_total"} <= names
    rules = load_signal_rules([default_metric_rules_dir()])
    watched = {n for r in rules.metric for n in r.metrics}
    assert names & watched, "the shipped metric rules watch none of what a real GPU reports"


def test_a_healthy_h100_poll_produces_no_finding() -> None:
    rules = load_rules([default_rules_dir()])
    evaluator = SignalEvaluator(load_signal_rules([default_metric_rules_dir()]), xid_rules=rules)
    assert FastMatcher(rules, signals=evaluator).match(_poll_signals()) == []


def test_healthy_nvidia_smi_output_produces_no_incident(tmp_path: Path) -> None:
    rules = load_rules([default_rules_dir()])
    for name in ("h100-healthy-nvidia-smi.txt", "h100-healthy-nvidia-smi-q.txt"):
        bundle = tmp_path / name.removesuffix(".txt") / "node-0"
        bundle.mkdir(parents=True)
        (bundle / "nvidia-smi.txt").write_text((GPU / name).read_text())
        incidents = diagnose_source(BundleSource([str(bundle.parent)]), rules, FastMatcher(rules),
                                    load_progress_rules([default_progress_rules_dir()]))
        assert incidents == [], (name, [(i.fault_class, i.root_finding.rule_id) for i in incidents])
