"""Policy file: the shipped default loads through the real loader; bad files fail with file and field;
opt-outs, held nodes and cooldowns narrow a plan; a manual uncordon cancels kmend's plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from analyzer.records import Action, FaultClass, Severity
from analyzer.rules import Rule
from healer.policy import PlanContext, PolicyConfig, choose_plan
from healer.policy_file import Facts, PolicyError, default_policy_path, load_policy, parse_policy
from healer.records import Mode, PlanState, StepKind
from tests.builders import XID79, kernel
from tests.healing import Harness, incident


def test_shipped_default_loads_and_routes_faults() -> None:
    p = load_policy()
    lost = Facts(FaultClass.GPU_LOST, Severity.CRITICAL, True, Action.REPLACE_NODE, {}, "j", "xid-79")
    assert p.choose(lost).plan == "replace-node"
    assert p.choose(Facts(FaultClass.APP_ERROR, Severity.ERROR, False, Action.FIX_APPLICATION)).plan == "notify"
    rule = p.choose(Facts(FaultClass.NETWORK, Severity.ERROR, True, Action.REPLACE_NODE, {}, None, "ibv-call-failed"))
    assert rule.plan == "replace-node" and rule.mode is Mode.APPROVAL
    assert p.safety.breaker_max_fraction == 0.10


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d["rules"][1]["match"].update(fault_class=["gpu_melted"]), "rules.1.match.fault_class.0"),
    (lambda d: d["rules"][0].update(plan="nope"), "rules.0.plan: rule 'gpu-replace' names plan 'nope'"),
    (lambda d: d["plans"]["notify"].update(steps=["drain"]), "plans.notify.steps"),
    (lambda d: d["safety"].update(breaker_max_fraction=2), "safety.breaker_max_fraction"),
    (lambda d: d["rules"][0].update(mode="yolo"), "rules.0.mode"),
    (lambda d: d.update(colour="blue"), "colour"),
])
def test_bad_policy_fails_with_file_and_field(tmp_path: Path, edit: object, message: str) -> None:
    data = yaml.safe_load(default_policy_path().read_text())
    edit(data)  # type: ignore[operator]
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(PolicyError) as err:
        load_policy(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)


def test_unreadable_policy_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text("rules: [\n")
    with pytest.raises(PolicyError, match=r"p\.yaml: not valid YAML"):
        load_policy(tmp_path / "p.yaml")
    with pytest.raises(PolicyError, match="cannot read"):
        load_policy(tmp_path / "missing.yaml")
    with pytest.raises(PolicyError, match="x: plans: Field required"):
        parse_policy({"rules": [{"name": "a", "plan": "b"}]}, "x")


def test_opt_out_held_node_and_cooldown_narrow_the_plan(shipped_rules: list[Rule]) -> None:
    inc = incident(shipped_rules, [kernel("gpu-node-03", XID79)])
    p = load_policy()
    out = choose_plan(inc, p, PolicyConfig(), PlanContext(0.0, opted_out="node gpu-node-03 has kmend.io/managed=false"))
    assert [s.kind for s in out.steps] == [StepKind.NOTIFY] and "managed=false" in out.reason
    held = choose_plan(inc, p, PolicyConfig(), PlanContext(0.0, node_held_by="plan-x"))
    assert [s.kind for s in held.steps] == [StepKind.NOTIFY]
    cool = choose_plan(inc, p, PolicyConfig(), PlanContext(0.0, in_cooldown=True))
    assert cool.mode is Mode.APPROVAL and cool.steps[1].kind is StepKind.CORDON
    assert choose_plan(inc, p, PolicyConfig(dry_run=True), PlanContext(0.0)).mode is Mode.DRY_RUN


def test_manual_uncordon_cancels_the_plan_for_that_node(shipped_rules: list[Rule], tmp_path: Path) -> None:
    h = Harness(tmp_path)
    plan = h.run(h.plan(incident(shipped_rules, [kernel("gpu-node-05", XID79)])), rounds=2)
    assert plan.state is PlanState.RUNNING  # waiting for the repair
    h.cluster.uncordon("gpu-node-05")  # an operator with kubectl
    plan = h.executor.execute(plan)
    assert plan.state is PlanState.CANCELLED and "uncordoned by hand" in plan.reason


def test_shipped_health_check_template_renders_a_job_pinned_to_the_node() -> None:
    from healer.steps.repair import render_health_check
    from kmend.wiring import default_health_check_template

    job = render_health_check(default_health_check_template().read_text(), name="kmend-validate-1",
                              namespace="kmend-system", node="gpu-node-05", image="dcgm:1", plan="plan-1")
    spec = job["spec"]["template"]["spec"]
    assert job["kind"] == "Job" and job["metadata"]["labels"]["kmend.io/health-check"] == "gpu-node-05"
    assert spec["nodeName"] == "gpu-node-05" and spec["tolerations"] == [{"operator": "Exists"}]
    assert spec["containers"][0]["image"] == "dcgm:1" and job["spec"]["backoffLimit"] == 0
