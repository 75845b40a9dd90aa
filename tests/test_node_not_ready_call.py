"""A node NotReady, or a kubelet that stopped posting its status, is no hardware fault on its own (the
development threads show a wedged runtime, CNI or kubelet far more often): the node is never taken out of
service for it; a host hardware line of the same node within the hour makes it hardware, still for a person."""

from __future__ import annotations

from pathlib import Path

import pytest

from analyzer.pipeline import Analyzer
from analyzer.records import Action, Incident
from analyzer.rules import Rule, default_rules_dir, load_rules
from healer.policy import PlanContext, PolicyConfig, choose_plan
from healer.policy_file import load_policy
from healer.records import StepKind
from kmend.corpus_eval import load_corpus, run_entries
from tests.builders import kernel

CORPUS = Path(__file__).resolve().parent / "corpus"
T0 = 1_700_000_000.0
# https://github.com/microsoft/pai/issues/4589 (kubectl get nodes)
NOT_READY = "p100     NotReady   <none>   17h   v1.15.11"
# https://github.com/kubernetes/kubernetes/issues/36273 (kubectl describe node)
STOPPED_POSTING = ("  Ready \t\tUnknown \tThu, 03 Nov 2016 12:18:28 +0000 \tThu, 03 Nov 2016 12:19:12 +0000 "
                   "\tNodeStatusUnknown \t\tKubelet stopped posting node status.")
# https://github.com/radiasoft/devops/issues/134
MCE = "Feb 23 03:28:16 kernel: mce: [Hardware Error]: Machine check events logged"
# https://github.com/ovro-lwa/lwa-issues/issues/117
EDAC_UE = ("[11189.970968] EDAC MC3: 1 UE memory read error on CPU_SrcID#1_MC#1_Chan#2_DIMM#0 (channel:2 slot:0 "
           "page:0xb757589 offset:0x140 grain:32 -  OVERFLOW err_code:0101:0092 socket:1 imc:1 rank:0 bg:3 ba:0 "
           "row:1a1e8 col:180)")


@pytest.fixture(scope="module")
def rules() -> list[Rule]:
    return load_rules([default_rules_dir()])


def _incidents(rules: list[Rule], lines: list[tuple[str, str, float]]) -> list[Incident]:
    analyzer = Analyzer(rules)
    analyzer.process([kernel(node, text, ts) for node, text, ts in lines])
    return list(analyzer.correlator.incidents())


def _quarantines(inc: Incident) -> bool:
    plan = choose_plan(inc, load_policy(), PolicyConfig(), PlanContext(T0 + 120))
    return bool({s.kind for s in plan.steps} & {StepKind.CORDON, StepKind.TAINT, StepKind.DRAIN, StepKind.REPAIR})


@pytest.mark.parametrize("line", [NOT_READY, STOPPED_POSTING], ids=["not-ready", "stopped-posting"])
def test_on_its_own_it_is_software_and_only_notifies(rules: list[Rule], line: str) -> None:
    [inc] = _incidents(rules, [("gpu-node-07", line, T0)])
    assert (inc.fault_class.value, inc.hardware, inc.recommended_action) == ("node", False, Action.NOTIFY)
    assert not _quarantines(inc)


@pytest.mark.parametrize("hw_line", [MCE, EDAC_UE], ids=["mce", "edac-ue"])
@pytest.mark.parametrize("line", [NOT_READY, STOPPED_POSTING], ids=["not-ready", "stopped-posting"])
def test_a_host_hardware_line_of_the_same_node_makes_it_hardware(rules: list[Rule], line: str, hw_line: str) -> None:
    incidents = _incidents(rules, [("gpu-node-07", line, T0), ("gpu-node-07", hw_line, T0 + 600)])
    [escalated] = [f for i in incidents for f in i.findings if "escalated" in f.fields]
    assert escalated.hardware is True and escalated.recommended_action is Action.NOTIFY
    assert escalated.fields["escalated"] in ("with host-mce", "with host-edac-ue")
    if hw_line is MCE:  # machine-check events alone only notify: nothing here takes the node out
        assert not any(_quarantines(i) for i in incidents)


def test_hardware_on_another_node_or_hours_away_leaves_it_software(rules: list[Rule]) -> None:
    incidents = _incidents(rules, [("gpu-node-07", NOT_READY, T0), ("gpu-node-08", MCE, T0 + 60),
                                   ("gpu-node-07", MCE, T0 + 4 * 3600)])
    assert not [f for i in incidents for f in i.findings if "escalated" in f.fields]
    [inc] = [i for i in incidents if i.root_finding.rule_id == "node-not-ready"]
    assert inc.hardware is False


def test_the_development_threads_with_software_causes_get_the_software_call() -> None:
    # deepops#355: NotReady because the CNI was not ready; kubernetes#53207: a wedged CRI stopped the status.
    wanted = {"deepops-355-node-notready-cni", "k8s-53207-kubelet-status-wedged-cri"}
    entries = [e for e in load_corpus(CORPUS) if e.id in wanted]
    assert {e.split for e in entries} == {"dev"} and len(entries) == 2
    for o in run_entries(entries, [default_rules_dir()]):
        assert o.rule in ("node-not-ready", "kubelet-stopped-posting-status")
        assert (o.fault_class, o.hardware, o.quarantine) == (o.entry.fault_class, False, False), o.entry.id
