"""Analyzer pipeline: rule examples, findings, and folding into incidents with a root cause."""

from __future__ import annotations

import pytest

from analyzer.correlate import Correlator
from analyzer.pipeline import Analyzer
from analyzer.records import Action, FaultClass
from analyzer.rules import Rule
from collector.signal import LogLine, Signal, Source
from tests.builders import XID13, XID79, container, kernel, nccl_timeout

T0 = 1_700_000_000.0


def _example_signal(rule: Rule, line: str) -> Signal:
    src = Source.KERNEL if "kernel" in rule.sources else Source.CONTAINER
    return Signal("ex/1", "node-a", src, T0, LogLine(line))


def test_every_example_produces_its_rules_finding(shipped_rules: list[Rule]) -> None:
    analyzer = Analyzer(shipped_rules)
    generic = {r.id for r in shipped_rules if r.generic}
    for rule in shipped_rules:
        for line in rule.examples:
            ids = {f.rule_id for f in analyzer.findings([_example_signal(rule, line)])}
            # A catch-all's example that a specific rule also matches is that rule's finding.
            taken = rule.generic and bool(ids - generic)
            assert rule.id in ids or taken, f"{rule.id} missed its example {line!r}"


def test_no_counter_example_produces_that_rules_finding(shipped_rules: list[Rule]) -> None:
    analyzer = Analyzer(shipped_rules)
    for rule in shipped_rules:
        for line in rule.counter_examples:
            ids = {f.rule_id for f in analyzer.findings([_example_signal(rule, line)])}
            assert rule.id not in ids, f"{rule.id} fired on counter-example {line!r}"


def test_xid79_finding_names_node_and_pci(shipped_rules: list[Rule]) -> None:
    [f] = Analyzer(shipped_rules).findings([kernel("gpu-7", XID79)])
    assert (f.fault_class, f.hardware, f.recommended_action) == (FaultClass.GPU_LOST, True, Action.REPLACE_NODE)
    assert f.where.node == "gpu-7" and f.where.pci == "0000:3b:00"
    assert f.fields["xid"] == "79"


def test_nccl_timeout_extracts_rank_seq_and_op(shipped_rules: list[Rule]) -> None:
    [f] = Analyzer(shipped_rules).findings([container("gpu-1", nccl_timeout(13, seq=77))])
    assert f.where.rank == 13 and f.fields["seq"] == "77" and f.fields["op"] == "ALLREDUCE"
    assert FaultClass.GPU_LOST in f.symptom_of


@pytest.mark.parametrize("cause_first", [True, False])
def test_xid79_then_timeouts_on_every_rank_is_one_incident_rooted_at_that_node(
    shipped_rules: list[Rule], cause_first: bool
) -> None:
    analyzer = Analyzer(shipped_rules)
    nodes = [f"gpu-{i}" for i in range(8)]
    cause = [kernel("gpu-5", XID79, ts=T0)]
    symptoms = [container(n, nccl_timeout(r * 8 + g), rank=r * 8 + g, ts=T0 + 600 + g)
                for r, n in enumerate(nodes) for g in range(8)]
    batches = [cause, symptoms] if cause_first else [symptoms, cause]
    for batch in batches:
        analyzer.process(batch)
    incidents = analyzer.correlator.incidents()
    assert len(incidents) == 1
    [inc] = incidents
    assert inc.fault_class is FaultClass.GPU_LOST and inc.hardware
    assert inc.root_cause.node == "gpu-5" and inc.root_cause.job == "job-a"
    assert inc.recommended_action is Action.REPLACE_NODE
    assert len(inc.findings) == 65 and inc.root_finding.rule_id == "xid-79"


def test_timeouts_without_a_cause_are_one_nccl_incident_for_the_job(shipped_rules: list[Rule]) -> None:
    analyzer = Analyzer(shipped_rules)
    analyzer.process([container(f"gpu-{r // 8}", nccl_timeout(r), rank=r, ts=T0 + r) for r in range(16)])
    [inc] = analyzer.correlator.incidents()
    assert inc.fault_class is FaultClass.NCCL_TIMEOUT
    assert inc.root_cause.job == "job-a" and inc.root_cause.node is None


def test_fault_on_a_node_of_another_job_does_not_absorb_this_jobs_timeouts(shipped_rules: list[Rule]) -> None:
    analyzer = Analyzer(shipped_rules)
    analyzer.process([container("gpu-9", "step 1", job="job-b")])
    analyzer.process([kernel("gpu-9", XID79, ts=T0)])
    analyzer.process([container("gpu-1", nccl_timeout(3), job="job-a", rank=3, ts=T0 + 600)])
    classes = sorted(i.fault_class.value for i in analyzer.correlator.incidents())
    assert classes == ["gpu_lost", "nccl_timeout"]


def test_fleet_wide_xid13_from_one_job_is_one_application_incident(shipped_rules: list[Rule]) -> None:
    analyzer = Analyzer(shipped_rules)
    nodes = [f"gpu-{i}" for i in range(16)]
    analyzer.process([container(n, "iteration 10", job="buggy-job") for n in nodes])
    analyzer.process([kernel(n, XID13, ts=T0 + i) for i, n in enumerate(nodes)])
    [inc] = analyzer.correlator.incidents()
    assert inc.fault_class is FaultClass.APP_ERROR and not inc.hardware
    assert inc.recommended_action is Action.FIX_APPLICATION
    assert inc.root_cause.job == "buggy-job" and len(inc.findings) == 16


def test_cuda_oom_is_an_application_fault(shipped_rules: list[Rule]) -> None:
    line = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 22.78 GiB. GPU 0 has a total "
            "capacity of 31.47 GiB of which 12.73 GiB is free.")
    _, [inc] = Analyzer(shipped_rules).process([container("gpu-2", line, rank=4)])
    assert inc.fault_class is FaultClass.OOM_GPU and not inc.hardware
    assert inc.recommended_action is Action.FIX_APPLICATION


def test_refolding_the_same_finding_is_idempotent(shipped_rules: list[Rule]) -> None:
    analyzer = Analyzer(shipped_rules)
    sig = kernel("gpu-3", XID79)
    analyzer.process([sig])
    analyzer.process([sig])
    [inc] = analyzer.correlator.incidents()
    assert len(inc.findings) == 1


def test_the_same_fault_a_day_later_is_a_new_incident(shipped_rules: list[Rule]) -> None:
    corr = Correlator(window_s=1200)
    analyzer = Analyzer(shipped_rules, correlator=corr)
    analyzer.process([kernel("gpu-3", XID79, ts=T0)])
    analyzer.process([kernel("gpu-3", XID79, ts=T0 + 86400)])
    assert len(corr.incidents()) == 2


def test_benign_lines_produce_nothing(shipped_rules: list[Rule]) -> None:
    benign = [
        "tj5-sc-ai-h800r-dev01:533:1765 [2] NCCL INFO 16 coll channels, 0 collnet channels, 16 nvls channels",
        "[rank0]:  iteration      100/  500000 | consumed samples: 102400 | elapsed time per iteration (ms): 1201.3",
        "NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  570.158.01  Release Build",
    ]
    analyzer = Analyzer(shipped_rules)
    found, incidents = analyzer.process([container("gpu-1", b) for b in benign] + [kernel("gpu-1", benign[2])])
    assert found == [] and incidents == []


def test_a_live_cluster_needs_a_job_or_node_link_but_a_bundle_does_not(shipped_rules: list[Rule]) -> None:
    for bundle, expected in ((False, 2), (True, 1)):
        analyzer = Analyzer(shipped_rules, correlator=Correlator(bundle=bundle))
        analyzer.process([kernel("gpu-7", XID79, ts=T0)])
        analyzer.process([container("gpu-2", nccl_timeout(5), job=None, rank=5, ts=T0 + 600)])
        assert len(analyzer.correlator.incidents()) == expected


def test_corrected_pcie_errors_below_their_rate_open_no_incident(shipped_rules: list[Rule]) -> None:
    # Real lines (geerlingguy/raspberry-pi-pcie-devices#64): corrected-only AER is recorded, not raised.
    line = ("pcieport 0000:00:1d.0: PCIe Bus Error: severity=Corrected, type=Physical Layer, "
            "id=00e8(Receiver ID)")
    analyzer = Analyzer(shipped_rules)
    found, incidents = analyzer.process([kernel("gpu-2", line, ts=T0)])
    assert [f.rule_id for f in found] == ["pcie-aer-corrected"] and incidents == []
    # A storm on one port (100 within a minute) is a marginal link: the escalation opens one.
    _, incidents = analyzer.process([kernel("gpu-2", line, ts=T0 + 0.5 * i) for i in range(1, 101)])
    assert [(i.fault_class, i.recommended_action) for i in incidents] == [(FaultClass.PCIE, Action.NOTIFY)]
