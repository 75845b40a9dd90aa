"""A kubelet whose pod lifecycle loop (PLEG) stalled, a kubelet that failed to start, and a container hook that
finds no NVIDIA driver loaded are software on their own (a hung runtime, the kubelet's configuration, a driver
not installed): notify only, the node never taken out of service; a host hardware line of the same node within
the hour makes the kubelet ones hardware, and a GPU finding on the node is the cause of a missing driver."""

from __future__ import annotations

from pathlib import Path

import pytest

from analyzer.metric_eval import SignalEvaluator
from analyzer.metric_rules import default_metric_rules_dir, load_signal_rules
from analyzer.records import Action
from analyzer.rules import Rule, default_rules_dir, load_rules
from collector.signal import MetricSample, Signal, Source
from kmend.corpus_eval import load_corpus, run_entries
from tests.test_node_not_ready_call import _incidents, _quarantines

CORPUS = Path(__file__).resolve().parent / "corpus"
T0 = 1_700_000_000.0
# https://github.com/kubernetes/kubernetes/issues/45419 (journalctl -u kubelet)
PLEG = ("I0505 13:59:56.872908    2858 kubelet_node_status.go:682] Node became not ready: {Type:Ready Status:False "
        "LastHeartbeatTime:2017-05-05 13:59:56.872865742 +0000 UTC LastTransitionTime:2017-05-05 "
        "13:59:56.872865742 +0000 UTC Reason:KubeletNotReady Message:PLEG is not healthy: pleg was last seen "
        "active 3m7.629592089s ago; threshold is 3m0s}")
# https://github.com/okd-project/okd/issues/1679
FAILED_TO_START = "systemd[1]: Failed to start kubelet.service - Kubernetes Kubelet."
# https://github.com/cedricxie/apollo_perception_ros/issues/20
NO_DRIVER = ("docker: Error response from daemon: OCI runtime create failed: container_linux.go:380: starting "
             "container process caused: process_linux.go:545: container init caused: Running hook #0:: error "
             "running hook: exit status 1, stdout: , stderr: nvidia-container-cli: initialization error: nvml "
             "error: driver not loaded: unknown.")
# https://github.com/radiasoft/devops/issues/134
MCE = "Feb 23 03:28:16 kernel: mce: [Hardware Error]: Machine check events logged"
# https://github.com/ovro-lwa/lwa-issues/issues/117
EDAC_UE = ("[11189.970968] EDAC MC3: 1 UE memory read error on CPU_SrcID#1_MC#1_Chan#2_DIMM#0 (channel:2 slot:0 "
           "page:0xb757589 offset:0x140 grain:32 -  OVERFLOW err_code:0101:0092 socket:1 imc:1 rank:0 bg:3 ba:0 "
           "row:1a1e8 col:180)")
# https://github.com/NVIDIA/NVSentinel/issues/155
FALLEN_OFF = "NVRM: Xid (PCI:0000:b3:00): 79, pid=0, GPU has fallen off the bus."
LINES = {"pleg": PLEG, "failed-to-start": FAILED_TO_START, "driver-not-loaded": NO_DRIVER}
RULES = {"pleg": "kubelet-pleg-unhealthy", "failed-to-start": "kubelet-failed-to-start",
         "driver-not-loaded": "nvidia-driver-not-loaded"}


@pytest.fixture(scope="module")
def rules() -> list[Rule]:
    return load_rules([default_rules_dir()])


@pytest.mark.parametrize("kind", list(LINES))
def test_on_its_own_it_is_software_and_only_notifies(rules: list[Rule], kind: str) -> None:
    [inc] = _incidents(rules, [("gpu-node-07", LINES[kind], T0)])
    assert inc.root_finding.rule_id == RULES[kind]
    assert (inc.fault_class.value, inc.hardware, inc.recommended_action) == ("node", False, Action.NOTIFY)
    assert not _quarantines(inc)


@pytest.mark.parametrize("hw_line", [MCE, EDAC_UE], ids=["mce", "edac-ue"])
@pytest.mark.parametrize("kind", ["pleg", "failed-to-start"])
def test_a_host_hardware_line_of_the_same_node_makes_it_hardware(rules: list[Rule], kind: str, hw_line: str) -> None:
    incidents = _incidents(rules, [("gpu-node-07", LINES[kind], T0), ("gpu-node-07", hw_line, T0 + 600)])
    [escalated] = [f for i in incidents for f in i.findings if "escalated" in f.fields]
    assert escalated.rule_id == RULES[kind]
    assert escalated.hardware is True and escalated.recommended_action is Action.NOTIFY
    if hw_line is MCE:  # machine-check events alone only notify: nothing here takes the node out
        assert not any(_quarantines(i) for i in incidents)


@pytest.mark.parametrize("kind", ["pleg", "failed-to-start"])
def test_hardware_on_another_node_or_hours_away_leaves_it_software(rules: list[Rule], kind: str) -> None:
    incidents = _incidents(rules, [("gpu-node-07", LINES[kind], T0), ("gpu-node-08", MCE, T0 + 60),
                                   ("gpu-node-07", MCE, T0 + 4 * 3600)])
    assert not [f for i in incidents for f in i.findings if "escalated" in f.fields]
    [inc] = [i for i in incidents if i.root_finding.rule_id == RULES[kind]]
    assert inc.hardware is False


def test_a_lost_gpu_on_the_node_is_the_cause_of_the_missing_driver(rules: list[Rule]) -> None:
    incidents = _incidents(rules, [("gpu-node-07", FALLEN_OFF, T0), ("gpu-node-07", NO_DRIVER, T0 + 30)])
    [inc] = [i for i in incidents if "nvidia-driver-not-loaded" in {f.rule_id for f in i.findings}]
    assert (inc.root_finding.rule_id, inc.fault_class.value, inc.hardware) == ("xid-79", "gpu_lost", True)


def test_the_development_threads_with_software_causes_get_the_software_call() -> None:
    # containerd/cri#1014: containerd stopped answering after a hard reboot (PLEG 66 h; the kubelet's own line
    # that its runtime calls time out is the cause, the PLEG line its symptom); okd#1679: the kubelet exited at
    # start on its configuration; apollo_perception_ros#20: no NVIDIA driver on the host.
    wanted = {"containerd-cri-1014-runtime-down-pleg-66h": "cri-sandbox-call-timeout",
              "okd-1679-kubelet-failed-to-start": "kubelet-failed-to-start",
              "apollo-20-nvml-driver-not-loaded": "nvidia-driver-not-loaded"}
    entries = [e for e in load_corpus(CORPUS) if e.id in wanted]
    assert {e.split for e in entries} == {"dev"} and len(entries) == len(wanted)
    for o in run_entries(entries, [default_rules_dir()]):
        assert o.rule == wanted[o.entry.id]
        assert (o.fault_class, o.hardware, o.quarantine) == (o.entry.fault_class, False, False), o.entry.id


def test_a_node_flapping_ready_is_software_as_a_steady_not_ready(rules: list[Rule]) -> None:
    # kubernetes#45419: nodes flapping Ready/NotReady on PLEG relists; the alert of the same symptom is no hardware.
    ev = SignalEvaluator(load_signal_rules([default_metric_rules_dir()]), xid_rules=rules)
    labels = {"alertname": "KubeNodeReadinessFlapping", "status": "firing", "node": "gpu-node-07"}
    (f,) = ev.match([Signal("alert/flapping", "gpu-node-07", Source.ALERT, T0,
                            MetricSample("KubeNodeReadinessFlapping", 1.0, labels))])
    assert (f.rule_id, f.fault_class.value, f.hardware, f.recommended_action) == (
        "alert-kube-node-flapping", "node", False, Action.NOTIFY)
