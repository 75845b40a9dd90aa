"""Fabric manager as it logs on real hosts: its failure on a host whose NVSwitch driver has no switch to report
is no incident (while CUDA refusing to start on such a host still is), and its own log's NVSwitch errors and
topology abort are NVLink findings with the action each calls for."""

from __future__ import annotations

from pathlib import Path

import pytest

from analyzer.pipeline import Analyzer
from analyzer.records import Action, FaultClass
from analyzer.rules import default_rules_dir, load_rules
from collector.signal import LogLine, Signal, Source
from kmend.commands.agent import AgentSettings, build_prefilter
from tests.analyze_helpers import analyze_bundle
from tests.conftest import free_port

RULES = load_rules([default_rules_dir()])

# Fabric manager's start-up query on a host without NVSwitch, as journalctl shows it
# (https://github.com/leptonai/gpud/blob/10852ec54ce8ef02d39661c85964af42b77f9de6/components/accelerator/nvidia/
# fabric-manager/log_matcher_test.go), and systemd recording the service's exit
# (https://github.com/akash-network/website/pull/632).
NOTHING_TO_DO = ("Nov 05 13:55:26 node1 nv-fabricmanager[1929729]: request to query NVSwitch device information from "
                 "NVSwitch driver failed with error:WARNING Nothing to do [NV_WARN_NOTHING_TO_DO]")
FM_FAILED = ("Nov 05 13:55:26 node1 systemd[1]: nvidia-fabricmanager.service: Control process exited, "
             "code=exited, status=1/FAILURE")
# CUDA refusing to start because the GPUs never joined their fabric (https://github.com/wilicc/gpu-burn/issues/92).
CUDA_802 = "Nov 05 13:58:02 node1 gpu_burn[4242]:   what():  Error (gpu_burn-drv.cpp:298): system not yet initialized"


def test_fabric_manager_exiting_because_no_nvswitch_exists_is_no_incident(tmp_path: Path) -> None:
    assert analyze_bundle(tmp_path, "syslog", f"{NOTHING_TO_DO}\n{FM_FAILED}\n", RULES) == []


def test_fabric_manager_exiting_without_that_reason_is_still_an_nvlink_incident(tmp_path: Path) -> None:
    incidents = analyze_bundle(tmp_path, "syslog", f"{FM_FAILED}\n", RULES)
    assert [i.fault_class for i in incidents] == [FaultClass.NVLINK]


def test_cuda_refusing_to_start_on_such_a_host_is_still_an_incident(tmp_path: Path) -> None:
    # A Blackwell baseboard without NVLSM prints the same start-up line; there CUDA then fails, and that is reported.
    incidents = analyze_bundle(tmp_path, "syslog", f"{NOTHING_TO_DO}\n{FM_FAILED}\n{CUDA_802}\n", RULES)
    assert [i.fault_class for i in incidents] == [FaultClass.NVLINK]
    assert incidents[0].root_finding.rule_id == "cuda-system-not-initialized"


# fabricmanager.log spellings, from the lines gpud matches
# (https://github.com/leptonai/gpud/blob/469453fb45657f1d6efbcf2b054559890731200c/components/accelerator/nvidia/
# fabric-manager/log_matcher.go).
@pytest.mark.parametrize(("line", "rule_id", "action"), [
    ("[Jul 23 2024 07:53:55] [ERROR] [tid 841] detected NVSwitch fatal error 20034 on fid 0 on NVSwitch pci bus id "
     "00000000:86:00.0 physical id 3 port 33", "fabricmanager-nvswitch-fatal", Action.REBOOT_NODE),
    ("[Jul 09 2024 18:14:07] [ERROR] [tid 12727] detected NVSwitch non-fatal error 12028 on fid 0 on NVSwitch pci bus "
     "id 00000000:86:00.0 physical id 3 port 61", "fabricmanager-nvswitch-nonfatal", Action.NOTIFY),
    ("[Sep 17 2024 06:01:46] [ERROR] [tid 1230079] failed to find the GPU handle 5410063385821516767 in the multicast "
     "team request setup 6130285411925746235.", "fabricmanager-multicast-gpu-missing", Action.RESET_GPU),
    ("detected number of NVSwitches don't match with any supported system topology, aborting fabric manager",
     "fabricmanager-topology-mismatch", Action.REBOOT_NODE),
])
def test_fabric_manager_log_errors_are_nvlink_findings(line: str, rule_id: str, action: Action) -> None:
    found, _ = Analyzer(RULES).process([Signal(id="n:1", node="n", source=Source.CONTAINER, ts=1.0,
                                               payload=LogLine(text=line))])
    assert [(f.rule_id, f.fault_class, f.recommended_action) for f in found] == [(rule_id, FaultClass.NVLINK, action)]


def test_the_agent_prefilter_ships_the_no_nvswitch_line(tmp_path: Path) -> None:
    settings = AgentSettings(node="gpu-3", state_dir=tmp_path / "state", pods_root=tmp_path / "pods", kernel="off",
                             ib_root=tmp_path / "no-ib", nvml=False, pod_labels=False, process_exits=False,
                             service_url=f"http://127.0.0.1:{free_port()}")
    prefilter = build_prefilter(settings)
    assert prefilter is not None
    assert prefilter.matches(NOTHING_TO_DO)
