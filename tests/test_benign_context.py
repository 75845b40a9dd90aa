"""Benign context (`benign_when`): a line on the same node near a finding makes it no fault, in `kmend analyze`,
in live ingest and through the agent's prefilter; a rule's context is validated when its pack loads."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from analyzer.explain import RuleTester
from analyzer.pipeline import Analyzer
from analyzer.records import FaultClass
from analyzer.rules import RuleError, default_rules_dir, load_pack, load_rules
from collector.signal import LogLine, Signal, Source
from kmend.commands.agent import AgentSettings, build_prefilter
from tests.analyze_helpers import analyze_bundle
from tests.conftest import free_port

RULES = load_rules([default_rules_dir()])

# `systemctl restart kube*` on CentOS 7 (https://github.com/kubernetes/kubernetes/issues/68782).
RESTART = """\
Sep 18 18:10:28 k8s-253 systemd: Stopping Kubernetes Kube-Proxy Server...
Sep 18 18:10:28 k8s-253 systemd: Stopping Kubernetes Kubelet Server...
Sep 18 18:10:28 k8s-253 systemd: Stopped Kubernetes Kube-Proxy Server.
Sep 18 18:10:28 k8s-253 systemd: kubelet.service: main process exited, code=exited, status=1/FAILURE
Sep 18 18:10:28 k8s-253 systemd: Stopped Kubernetes Kubelet Server.
Sep 18 18:10:28 k8s-253 systemd: Unit kubelet.service entered failed state.
Sep 18 18:10:28 k8s-253 systemd: kubelet.service failed.
"""
# A kubelet that cannot start, restarted by systemd itself: "Stopped" and "Started", never "Stopping"
# (https://github.com/kubernetes/minikube/issues/5690).
CRASH_LOOP = """\
Oct 22 05:17:19 localhost.localdomain systemd[1]: kubelet.service: Scheduled restart job, restart counter is at 557.
Oct 22 05:17:19 localhost.localdomain systemd[1]: Stopped kubelet: The Kubernetes Node Agent.
Oct 22 05:17:19 localhost.localdomain systemd[1]: Started kubelet: The Kubernetes Node Agent.
Oct 22 05:17:19 localhost.localdomain systemd[1]: kubelet.service: Main process exited, code=exited, status=203/EXEC
Oct 22 05:17:19 localhost.localdomain systemd[1]: kubelet.service: Failed with result 'exit-code'.
"""
STOPPING = "Stopping Kubernetes Kubelet Server..."
EXITED = "kubelet.service: main process exited, code=exited, status=1/FAILURE"
# Fabric manager failing (https://github.com/akash-network/website/pull/632) on a host whose health checker
# reports no NVSwitch (https://github.com/leptonai/gpud/pull/906).
FM_FAILED = ("Nov 05 13:55:26 node1 systemd[1]: nvidia-fabricmanager.service: Control process exited, "
             "code=exited, status=1/FAILURE")
NO_NVSWITCH = "✔ NVSwitch not detected, skipping fabric manager check"



def test_a_requested_kubelet_restart_is_no_incident_in_kmend_analyze(tmp_path: Path) -> None:
    assert analyze_bundle(tmp_path, "syslog", RESTART, RULES) == []


def test_a_kubelet_crash_loop_still_opens_a_node_incident(tmp_path: Path) -> None:
    incidents = analyze_bundle(tmp_path, "syslog", CRASH_LOOP, RULES)
    assert [i.fault_class for i in incidents] == [FaultClass.NODE]
    assert incidents[0].root_finding.rule_id == "kubelet-crash-loop"


def _line(node: str, ts: float, text: str, n: int) -> Signal:
    return Signal(id=f"{node}:{n}", node=node, source=Source.KERNEL, ts=ts, payload=LogLine(text=text))


def test_live_ingest_remembers_context_across_batches_per_node_within_the_window() -> None:
    analyzer = Analyzer(RULES)
    # The stop request arrives in one batch, the exit in the next: still a deliberate restart.
    assert analyzer.process([_line("a", 100.0, STOPPING, 1)]) == ([], [])
    found, changed = analyzer.process([_line("a", 101.0, EXITED, 2)])
    assert found == [] and changed == []
    # Another node's stop request explains nothing here, and the same node's, minutes before, nothing either.
    found, _ = analyzer.process([_line("b", 102.0, EXITED, 3)])
    assert [f.rule_id for f in found] == ["kubelet-crash-loop"]
    found, _ = analyzer.process([_line("a", 400.0, EXITED, 4)])
    assert [f.rule_id for f in found] == ["kubelet-crash-loop"]


def test_fabric_manager_failing_where_no_nvswitch_is_reported_is_no_incident() -> None:
    analyzer = Analyzer(RULES)
    found, _ = analyzer.process([_line("a", 100.0, FM_FAILED, 1)])
    assert [f.fault_class for f in found] == [FaultClass.NVLINK]
    # The health checker's report ten minutes before: the host has no fabric to manage.
    analyzer.process([_line("b", 1000.0, NO_NVSWITCH, 2)])
    assert analyzer.process([_line("b", 1600.0, FM_FAILED, 3)]) == ([], [])


def test_context_after_the_finding_in_the_same_batch_counts() -> None:
    analyzer = Analyzer(RULES)
    found, changed = analyzer.process([_line("a", 100.0, EXITED, 1), _line("a", 100.5, STOPPING, 2)])
    assert found == [] and changed == []


def test_the_agent_prefilter_ships_context_lines(tmp_path: Path) -> None:
    settings = AgentSettings(node="gpu-3", state_dir=tmp_path / "state", pods_root=tmp_path / "pods", kernel="off",
                             ib_root=tmp_path / "no-ib", nvml=False, pod_labels=False, process_exits=False,
                             service_url=f"http://127.0.0.1:{free_port()}")
    prefilter = build_prefilter(settings)
    assert prefilter is not None
    assert prefilter.matches("Sep 18 18:10:28 k8s-253 systemd: Stopping Kubernetes Kubelet Server...")
    assert prefilter.matches(NO_NVSWITCH)


def _pack(tmp_path: Path, benign_when: dict[str, Any]) -> Path:
    rule = {
        "id": "kubelet-exit", "description": "kubelet exited", "pattern": r"kubelet\.service: main process exited",
        "fault_class": "node", "severity": "error", "hardware": False, "recommended_action": "notify",
        "examples": [EXITED], "references": ["https://github.com/kubernetes/kubernetes/issues/68782"],
        "benign_when": benign_when,
    }
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"rules": [rule]}), encoding="utf-8")
    return path


@pytest.mark.parametrize(("benign_when", "field"), [
    ({"context": ["Stopping kubelet"], "window": 30, "why": "a deliberate stop",
      "examples": [STOPPING]}, "benign_when.examples[0]"),
    ({"context": [r"(a)\1"], "window": 30, "why": "a deliberate stop", "examples": [STOPPING]},
     "benign_when.context[0]"),
    ({"context": ["Stopping"], "window": 30, "why": "a deliberate stop", "examples": [STOPPING],
      "counter_examples": ["Stopping NVIDIA fabric manager service..."]}, "benign_when.counter_examples[0]"),
    ({"context": ["Stopping"], "window": 0, "why": "a deliberate stop", "examples": [STOPPING]},
     "benign_when.window"),
    ({"context": ["Stopping"], "window": 30, "why": "a deliberate stop"}, "benign_when.examples"),
])
def test_a_bad_benign_context_fails_the_pack_naming_the_field(tmp_path: Path, benign_when: dict[str, Any],
                                                               field: str) -> None:
    with pytest.raises(RuleError, match=re.escape(f"field '{field}'")):
        load_pack(_pack(tmp_path, benign_when))


def test_rules_test_says_which_context_silences_a_rule_and_what_a_context_line_is_for() -> None:
    tester = RuleTester(RULES)
    exit_out = tester.explain(_line("a", 1.0, EXITED, 1), source_given=False)
    assert [m["rule_id"] for m in exit_out["matches"]] == ["kubelet-crash-loop"]
    assert any("kubelet-crash-loop is silent when" in n and "30s" in n for n in exit_out["notes"])
    stop_out = tester.explain(_line("a", 1.0, STOPPING, 2), source_given=False)
    assert stop_out["matches"] == [] and any("benign context for kubelet-crash-loop" in n for n in stop_out["notes"])
