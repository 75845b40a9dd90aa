"""Acceptance before work: nodes released after repair, new nodes and nodes that register tainted run the
health-check Job under kmend.io/unvalidated:NoSchedule; a pass lifts the taint, a failure keeps it; results and
lemon verdicts per node in GET /v1/nodes."""

from __future__ import annotations

from pathlib import Path

import yaml

from healer.cluster import Taint
from healer.keys import UNVALIDATED_TAINT_KEY, VALIDATED_AT
from healer.records import PlanState, StepKind
from healer.steps.repair import render_health_check
from healer.workloads import ObjectKey
from kmend.wiring import default_health_check_template
from sim.workloads import UNHEALTHY_ANNOTATION
from tests.healing import Harness
from tests.test_runbook_api import OP, _serve


def _no_state(*_: object) -> None:
    return None


def test_a_node_released_after_repair_takes_no_work_until_the_health_check_passes(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    heal = h.healing()
    heal.heal_once([], _no_state)  # the fleet as it is now is trusted
    heal.quarantine("gpu-node-06", "alice", "bad DIMM")
    heal.release("gpu-node-06", "alice")  # the operator says it is repaired
    node = h.cluster.get_node("gpu-node-06")
    assert node.taint(UNVALIDATED_TAINT_KEY) == Taint(UNVALIDATED_TAINT_KEY, "repaired", "NoSchedule")
    [check] = [p for p in heal.heal_once([], _no_state) if p.policy == "acceptance/repaired"]
    assert check.state is PlanState.SUCCEEDED, check.reason
    job = h.workloads.get_object(ObjectKey("batch/v1", "Job", "kmend-system", check.steps[1].outputs["job"]))
    assert job is not None and "dcgmi diag -r 2" in str(job["spec"]["template"]["spec"]["containers"][0]["args"])
    node = h.cluster.get_node("gpu-node-06")
    assert node.taint(UNVALIDATED_TAINT_KEY) is None and VALIDATED_AT in node.annotations
    assert heal.heal_once([], _no_state) == []  # checked once


def test_new_and_self_tainted_nodes_are_checked_and_a_failure_keeps_them_out(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    heal = h.healing()
    heal.heal_once([], _no_state)
    h.cluster.add_node("gpu-node-99", labels={"nvidia.com/gpu.present": "true"})
    h.cluster.add_node("gpu-node-98")
    h.cluster.patch_node_metadata("gpu-node-98", annotations={UNHEALTHY_ANNOTATION: "true"})
    h.cluster.add_taint("gpu-node-03", Taint(UNVALIDATED_TAINT_KEY, "new", "NoSchedule"))  # kubelet flag
    plans = {p.node: p for p in heal.heal_once([], _no_state)}
    assert set(plans) == {"gpu-node-99", "gpu-node-98", "gpu-node-03"}
    assert plans["gpu-node-99"].state is PlanState.SUCCEEDED and plans["gpu-node-03"].state is PlanState.SUCCEEDED
    assert plans["gpu-node-98"].state is PlanState.FAILED
    assert "failed on gpu-node-98" in plans["gpu-node-98"].steps[1].result
    assert h.cluster.get_node("gpu-node-98").taint(UNVALIDATED_TAINT_KEY) is not None
    assert h.cluster.get_node("gpu-node-99").taint(UNVALIDATED_TAINT_KEY) is None
    assert heal.heal_once([], _no_state) == []  # a failed node waits for an operator
    assert heal.node_records()["gpu-node-98"]["validation"]["state"] == "failed"


def test_the_health_check_job_runs_the_configured_checks() -> None:
    job = render_health_check(default_health_check_template().read_text(), name="kmend-validate-1",
                              namespace="kmend-system", node="gpu-node-05", image="dcgm:1", plan="plan-1",
                              checks={"dcgm_level": "3", "nccl_min_busbw_gbps": "180", "ib_loopback": "true"})
    script = job["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert "dcgmi diag -r 3" in script and 'floor="180"' in script and "all_reduce_perf -b 1G" in script
    assert 'if [ "true" = "true" ]' in script and "ib_write_bw -d" in script
    assert "{{" not in yaml.safe_dump(job)


def test_nodes_api_reports_validation_and_lemon_nodes(tmp_path: Path) -> None:
    with _serve(tmp_path) as s:
        s.client.post("/v1/nodes/gpu-node-06/quarantine", json={"reason": "x"}, headers=OP)
        s.client.post("/v1/nodes/gpu-node-06/release", headers=OP)

        def checked() -> object:
            n = s.client.get("/v1/nodes", headers=OP).json()["nodes"]["gpu-node-06"]
            return n if (n["validation"] or {}).get("state") == "succeeded" else None
        node = s.wait(checked)
        assert node["state"] == "healthy" and node["lemon"] is None and node["faults_in_window"] == 0
        assert [x.kind for x in s.kmend.store.get_plan(node["validation"]["plan"]).steps] == [  # type: ignore[union-attr]
            StepKind.TAINT, StepKind.VALIDATE, StepKind.ACCEPT]
