"""Per-GPU partial drain on the simulated cluster: with the policy's ``drain: gpu``, an incident naming one GPU
evicts only the pods holding it (by their GPU assignment annotation, or every GPU pod that names none), leaves
the pods on the node's healthy GPUs running on the cordoned node, and a node drain is unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from analyzer.rules import Rule
from healer.policy_file import PolicyError, default_policy_path, parse_policy
from healer.records import StepKind, StepState
from tests.builders import XID79, kernel
from tests.healing import Harness, incident

NODE = "gpu-node-09"
XID48 = ("[ 100.0] NVRM: Xid (PCI:0000:18:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit "
         "error (DBE) has been detected on GPU in the framebuffer at partition 5, subpartition 1")


def _pods(h: Harness) -> None:
    w = h.workloads
    w.add_pod("training", "llama-3", node=NODE, gpus=1, labels={"kmend.io/job": "llama"},
              annotations={"kmend.io/gpus": "00000000:18:00.0"})
    w.add_pod("training", "bert-0", node=NODE, gpus=2, labels={"kmend.io/job": "bert"},
              annotations={"kmend.io/gpus": "0000:3b:00.0,0000:5d:00.0"})
    w.add_pod("training", "vc-0", node=NODE, gpus=1, labels={"kmend.io/job": "vc"},
              annotations={"volcano.sh/gpu-index": "4"})  # an index: cannot tell it from the PCI id
    w.add_pod("training", "notebook", node=NODE, gpus=1, labels={"kmend.io/job": "nb"})  # names no GPU
    w.add_pod("training", "exporter", node=NODE, gpus=0, labels={"kmend.io/job": "metrics"})


def test_a_gpu_reset_plan_evicts_only_the_pods_on_that_gpu(shipped_rules: list[Rule], tmp_path: Path) -> None:
    h = Harness(tmp_path)
    _pods(h)
    plan = h.plan(incident(shipped_rules, [kernel(NODE, XID48)]))
    [drain] = [s for s in plan.steps if s.kind is StepKind.DRAIN]
    assert drain.params["scope"] == "gpu" and drain.params["pci"] == "0000:18:00"
    plan = h.run(plan, rounds=5)
    [drain] = [s for s in plan.steps if s.kind is StepKind.DRAIN]
    assert drain.state is StepState.SUCCEEDED, drain.result
    assert "2 pod(s) on its other GPUs keep running" in drain.result
    left = {p.name for p in h.workloads.list_pods(node=NODE)}
    assert left == {"bert-0", "exporter"}
    assert h.cluster.get_node(NODE).unschedulable


def test_an_incident_naming_the_gpu_index_matches_index_annotations(tmp_path: Path) -> None:
    from healer.records import ActionStep, Mode, Plan
    from healer.steps.drain import drain

    h = Harness(tmp_path)
    _pods(h)
    step = ActionStep("p-0", StepKind.DRAIN, NODE, {"scope": "gpu", "gpu": "3", "pci": "", "grace_s": "0",
                                                     "gpu_annotations": "kmend.io/gpus,volcano.sh/gpu-index"})
    out = drain(step, Plan("p", "i", "t", Mode.AUTO, (step,)), h.ctx)
    # vc-0 holds GPU 4, so it stays; the PCI-annotated pods cannot be compared with an index and go.
    assert {p.name for p in h.workloads.list_pods(node=NODE)} == {"vc-0", "exporter"}, out.result


def test_a_node_drain_still_evicts_the_whole_job(shipped_rules: list[Rule], tmp_path: Path) -> None:
    h = Harness(tmp_path)
    plan = h.plan(incident(shipped_rules, [kernel(NODE, XID79)]))
    [drain] = [s for s in plan.steps if s.kind is StepKind.DRAIN]
    assert "scope" not in drain.params


def test_an_unknown_drain_scope_is_refused_with_its_field() -> None:
    import yaml

    data = yaml.safe_load(default_policy_path().read_text())
    data["plans"]["reset-gpu"]["drain"] = "rack"
    with pytest.raises(PolicyError, match=r"plans\.reset-gpu\.drain"):
        parse_policy(data, "p.yaml")
