"""Escalation and folding in the analyzer: application-side Xids stay the job's fault unless
one GPU repeats them; Xid 48 with 63/64 on the same GPU means failing memory."""

from __future__ import annotations

import pytest

from analyzer.pipeline import Analyzer
from analyzer.records import Action, FaultClass
from analyzer.rules import Rule, default_rules_dir, load_rules
from collector.signal import LogLine, Signal, Source

XID13 = ("NVRM: Xid (PCI:0000:{bus}:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception "
         "on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter")


@pytest.fixture(scope="module")
def rules() -> list[Rule]:
    return load_rules([default_rules_dir()])


def kernel(node: str, text: str, ts: float, n: int) -> Signal:
    return Signal(id=f"{node}:kernel:{n}", node=node, source=Source.KERNEL, ts=ts, payload=LogLine(text=text))


def placed(analyzer: Analyzer, job: str, nodes: list[str]) -> Analyzer:
    for node in nodes:
        analyzer.correlator.observe_placement(job, node)
    return analyzer


def test_fleet_wide_xid13_from_one_job_is_one_application_incident(rules: list[Rule]) -> None:
    nodes = [f"gpu-{i:02d}" for i in range(12)]
    analyzer = placed(Analyzer(rules), "buggy-job", nodes)
    sigs = [kernel(n, XID13.format(bus="3b"), 1000.0 + i, i) for i, n in enumerate(nodes)]
    findings, _ = analyzer.process(sigs)
    assert {f.rule_id for f in findings} == {"xid-13"}, "no escalation: no GPU repeated"
    [inc] = analyzer.correlator.incidents()
    assert (inc.fault_class, inc.hardware, inc.recommended_action) == (
        FaultClass.APP_ERROR, False, Action.FIX_APPLICATION)
    assert inc.root_cause.job == "buggy-job" and len(inc.findings) == 12


def test_the_same_gpu_repeating_xid13_becomes_a_hardware_finding(rules: list[Rule]) -> None:
    analyzer = placed(Analyzer(rules), "job-a", ["gpu-07"])
    # Three separate faults an hour apart at most, each a burst of two lines (one event).
    sigs = [kernel("gpu-07", XID13.format(bus="3b"), t, n)
            for n, t in enumerate([100.0, 100.2, 900.0, 900.1, 1700.0, 1700.3])]
    findings, _ = analyzer.process(sigs)
    escalated = [f for f in findings if "escalated" in f.fields]
    assert len(escalated) == 1
    [e] = escalated
    assert (e.fault_class, e.hardware, e.recommended_action) == (
        FaultClass.GPU_HARDWARE, True, Action.REPLACE_NODE)
    assert e.where.node == "gpu-07" and e.where.pci == "0000:3b:00" and len(e.evidence) == 3
    hw = [i for i in analyzer.correlator.incidents() if i.hardware]
    assert [i.root_cause.pci for i in hw] == ["0000:3b:00"]


def test_a_burst_of_lines_from_one_event_does_not_escalate(rules: list[Rule]) -> None:
    analyzer = Analyzer(rules)
    sigs = [kernel("gpu-07", XID13.format(bus="3b"), 100.0 + i * 0.01, i) for i in range(20)]
    findings, _ = analyzer.process(sigs)
    assert not [f for f in findings if "escalated" in f.fields]


def test_xid48_with_row_remap_failure_on_the_same_gpu_means_replace(rules: list[Rule]) -> None:
    xid48 = next(ex for r in rules if r.id == "xid-48" for ex in r.examples)
    xid64 = "NVRM: Xid (PCI:0000:07:00): 64, pid=1896, Row Remapper: Failed to remap row"
    alone, _ = Analyzer(rules).process([kernel("n1", xid48, 10.0, 0)])
    assert [f.recommended_action for f in alone] == [Action.RESET_GPU]
    both, _ = Analyzer(rules).process([kernel("n1", xid48, 10.0, 0), kernel("n1", xid64, 12.0, 1)])
    assert Action.REPLACE_NODE in {f.recommended_action for f in both if f.rule_id == "xid-48"}


def test_xid45_folds_under_the_fault_that_caused_it(rules: list[Rule]) -> None:
    xid79 = "NVRM: Xid (PCI:0000:dc:00): 79, GPU has fallen off the bus."
    xid45 = ("kernel: NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001 "
             "caused by previous Xid 79")
    analyzer = Analyzer(rules)
    analyzer.process([kernel("n1", xid79, 10.0, 0), kernel("n1", xid45, 11.0, 1)])
    [inc] = analyzer.correlator.incidents()
    assert inc.fault_class is FaultClass.GPU_LOST
    assert [f.rule_id for f in inc.findings] == ["xid-79", "xid-45"]
