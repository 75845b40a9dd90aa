"""`kmend policy explain` on incidents from `kmend analyze --format json` and the API; `kmend policy check`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kmend.cli import main

IB12 = ("-worker-1:946:988 [0] transport/net_ib.cc:839 NCCL WARN NET/IB : Got completion with error 12, opcode 1, "
        "len 0, vendor err 129")  # https://github.com/NVIDIA/nccl/issues/902


def test_explain_names_the_matching_rule_and_why_earlier_ones_were_rejected(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "worker.log").write_text(IB12 + "\n")
    assert main(["analyze", "--format", "json", "--exit-zero", "--node", "gpu-node-03",
                 str(tmp_path / "worker.log")]) == 0
    (tmp_path / "inc.json").write_text(capsys.readouterr().out)
    assert main(["policy", "explain", str(tmp_path / "inc.json")]) == 0
    out = capsys.readouterr().out
    # One IB retry-exceeded line is notify-level evidence (three on a node within an hour escalate).
    assert "reject gpu-replace: recommended_action notify not in [replace_node]" in out
    assert "reject application-fault: hardware is true, the rule wants false" in out
    assert "MATCH  network-approval: plan replace-node, mode approval" in out
    assert out.rstrip().endswith("=> rule 'network-approval': plan replace-node, mode approval")


def test_explain_reads_the_api_shape_and_reports_an_evidence_wait(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    finding = {"id": "straggler-detector:llama:3:100", "ts": 100.0, "fault_class": "straggler", "severity": "warning",
               "hardware": True, "where": {"node": "gpu-node-02", "rank": 3, "job": "llama"},
               "rule_id": "straggler-detector", "recommended_action": "replace_node", "evidence": [],
               "message": "rank 3 on gpu-node-02 is 1.31x slower than the median rank"}
    inc = {"id": "inc-1", "state": "open", "fault_class": "straggler", "severity": "warning", "hardware": True,
           "recommended_action": "replace_node", "root_cause": {"node": "gpu-node-02", "rank": 3, "job": "llama"},
           "findings": [finding]}
    (tmp_path / "inc.json").write_text(json.dumps(inc))
    assert main(["policy", "explain", str(tmp_path / "inc.json")]) == 0
    out = capsys.readouterr().out
    assert "rule 'soft-evidence-approval': plan replace-node, mode approval" in out
    assert "no plan yet: rule 'soft-evidence-approval' needs 2 straggler findings, the incident has 1" in out


def test_bad_input_and_a_shadowing_policy_are_one_line_errors(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.json").write_text(json.dumps({"incidents": [{"fault_class": "gpu_melted"}]}))
    assert main(["policy", "explain", str(tmp_path / "bad.json")]) == 2
    assert "bad.json: incidents.0.fault_class: Input should be" in capsys.readouterr().err
    (tmp_path / "p.yaml").write_text("plans: {notify: {steps: [notify]}}\nrules:\n"
                                     "  - {name: all, match: {}, plan: notify}\n"
                                     "  - {name: hangs, match: {fault_class: [hang]}, plan: notify}\n")
    assert main(["policy", "check", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err
    assert "rules.1: rule 'hangs' never matches: rule 'all' (rules.0) comes first" in err
    assert main(["policy", "check"]) == 0
