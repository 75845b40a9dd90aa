"""Host lines caused by the workload or the node's software, and a hardware one, diagnosed on the corpus path.

Each excerpt is a development-half corpus excerpt (tests/corpus/round15a-*.yaml) that the rules
of 3f18621 got wrong: an out-of-memory kernel panic called broken hardware and a node to
reboot, a full /dev/shm called a full checkpoint disk, and a BMC's uncorrectable machine
check, a kernel general protection fault and a kubelet whose runtime calls time out reported
as nothing at all. Each runs as `kmend eval corpus` runs it: written where a bundle holds its
source's lines, through the shipped rules, the top incident judged.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from analyzer.corpus import Outcome, parse_entries
from analyzer.records import Action, FaultClass
from analyzer.rules import default_rules_dir
from kmend.corpus_eval import run_entries

CORPUS = Path(__file__).parent / "corpus"


def _run(family: str, entry_id: str) -> Outcome:
    path = CORPUS / f"{family}.yaml"
    [entry] = [e for e in parse_entries(yaml.safe_load(path.read_text()), str(path)) if e.id == entry_id]
    assert entry.split == "dev"  # rules are written from development excerpts only
    [result] = run_entries([entry], [default_rules_dir()])
    return result


@pytest.mark.parametrize("entry_id", [
    "xiangshan-doc-9-panic-oom-no-killable",   # Out of memory and no killable processes
    "pislide-os-54-panic-deadlocked-on-memory",  # System is deadlocked on memory
])
def test_an_out_of_memory_panic_is_host_memory_not_hardware(entry_id: str) -> None:
    o = _run("round15a-oom", entry_id)
    assert (o.fault_class, o.hardware, o.rule) == (FaultClass.OOM_HOST, False, "oom-panic-nothing-to-kill")
    assert not o.quarantine


def test_a_full_dev_shm_is_host_memory_not_a_full_disk() -> None:
    o = _run("round15a-oom", "eslam-20-torch-shm-unable-to-write-enospc")
    assert (o.fault_class, o.hardware, o.rule) == (FaultClass.OOM_HOST, False, "torch-shm-file-write-failed")


def test_a_bmc_uncorrectable_machine_check_takes_the_node_out() -> None:
    o = _run("round15a-node", "osm-ops-89-ipmi-sel-uncorrectable-mce")
    assert (o.fault_class, o.hardware, o.action) == (FaultClass.NODE, True, Action.REPLACE_NODE)


@pytest.mark.parametrize(("entry_id", "rule_id"), [
    ("k8s-dp-941-gpf-nvidia-uvm-ioctl-reboot", "kernel-general-protection-fault"),
    ("rancher-21178-kubelet-runtime-deadline-exceeded", "cri-sandbox-call-timeout"),
])
def test_node_software_faults_are_reported_as_software(entry_id: str, rule_id: str) -> None:
    o = _run("round15a-node", entry_id)
    assert (o.fault_class, o.hardware, o.rule) == (FaultClass.NODE, False, rule_id)
