"""The shipped policy, pinned: real rule-pack lines (and detector verdicts) through the analyzer to the plan and
mode the shipped file gives them, for every fault class and every recommended action; shadowing fails at load."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from analyzer.correlate import Correlator
from analyzer.detectors.hang import DETECTOR_ID as HANG
from analyzer.detectors.straggler import DETECTOR_ID as STRAGGLER
from analyzer.escalate import Escalator
from analyzer.pipeline import Analyzer
from analyzer.records import Action, FaultClass, Finding, Incident, Location, Severity
from analyzer.rules import Rule
from collector.signal import Signal
from healer.policy import PlanContext, PolicyConfig, choose_plan
from healer.policy_file import PolicyError, default_policy_path, load_policy, parse_policy
from healer.records import Mode, StepKind
from tests.builders import container, kernel, nccl_timeout

NODE = "gpu-node-07"
T0 = 1_700_000_000.0


def _signal(rule: Rule, example: int = 0) -> Signal:
    line = rule.examples[example]
    if "container" in rule.sources and "kernel" not in rule.sources:
        return container(NODE, line, job="llama", rank=3)
    return kernel(NODE, line)


_ANALYZERS: dict[int, Analyzer] = {}


def _incident(rules: list[Rule], rule_id: str, example: int = 0) -> Incident:
    [rule] = [r for r in rules if r.id == rule_id]
    # One compiled matcher for the module; each incident gets a fresh correlator and escalator.
    if id(rules) not in _ANALYZERS:
        _ANALYZERS[id(rules)] = Analyzer(rules)
    analyzer = _ANALYZERS[id(rules)]
    analyzer.correlator, analyzer.escalator = Correlator(), Escalator(rules)
    analyzer.process([container(NODE, "step 100 loss 2.1", job="llama", rank=3), _signal(rule, example)])
    return max(analyzer.correlator.incidents(), key=lambda i: len(i.findings))


def _detector(fc: FaultClass, rule_id: str, hardware: bool, action: Action, n: int = 1,
              rank: int | None = 3, node: str | None = NODE) -> Incident:
    corr = Correlator()
    for i in range(n):
        corr.add(Finding(f"{rule_id}:llama:{i}", T0 + 60 * i, fc, Severity.WARNING if fc is FaultClass.STRAGGLER
                         else Severity.ERROR, hardware, Location(node=node, rank=rank, job="llama"), rule_id, action,
                         (), "rank 3 on gpu-node-07 is 1.31x slower than the median rank; node: GPU 2 clock throttled"
                         if fc is FaultClass.STRAGGLER else "no progress from rank 3 for 412 s"))
    [inc] = corr.incidents()
    return inc


def _plan(inc: Incident, **ctx: object) -> tuple[str, str]:
    plan = choose_plan(inc, load_policy(), PolicyConfig(), PlanContext(T0 + 120, **ctx))  # type: ignore[arg-type]
    return plan.policy, plan.mode.value


# (rule id of a real line, fault class, hardware, recommended action) -> policy rule/plan, mode
TABLE = [
    ("xid-79", "gpu_lost", True, "replace_node", "gpu-replace/replace-node", "auto"),
    ("nvidia-smi-device-handle", "gpu_lost", True, "reboot_node", "gpu-reboot/reboot-node", "auto"),
    ("xid-48", "gpu_memory", True, "reset_gpu", "gpu-reset/reset-gpu", "auto"),
    ("xid-64", "gpu_memory", True, "reset_gpu", "gpu-reset/reset-gpu", "auto"),
    ("xid-95", "gpu_memory", True, "reset_gpu", "gpu-reset/reset-gpu", "auto"),
    ("xid-74", "nvlink", True, "reset_gpu", "gpu-reset/reset-gpu", "auto"),
    ("xid-119", "gpu_hardware", True, "reset_gpu", "gpu-reset/reset-gpu", "auto"),
    ("xid-120", "gpu_hardware", True, "reset_gpu", "gpu-reset/reset-gpu", "auto"),
    ("xid-154", "gpu_hardware", True, "reset_gpu", "gpu-reset/reset-gpu", "auto"),
    ("xid-13", "app_error", False, "fix_application", "application-fault/notify", "auto"),
    ("xid-14", "gpu_hardware", False, "none", "application-fault/notify", "auto"),
    ("xid-8", "gpu_hardware", False, "restart_job", "application-fault/notify", "auto"),
    ("cuda-oom", "oom_gpu", False, "fix_application", "application-fault/notify", "auto"),
    ("host-oom-killer", "oom_host", False, "fix_application", "application-fault/notify", "auto"),
    ("no-space-left", "storage", False, "notify", "application-fault/notify", "auto"),
    ("nccl-watchdog-timeout", "nccl_timeout", False, "restart_job", "application-fault/notify", "auto"),
    ("nccl-internal-error", "nccl_error", False, "notify", "application-fault/notify", "auto"),
    ("nccl-ib-retry-exceeded", "network", True, "notify", "network-approval/replace-node", "approval"),
    ("mlx5-command-timeout", "network", True, "replace_node", "network-approval/replace-node", "approval"),
    ("xid-136", "nvlink", True, "reset_gpu", "nvlink-reset-approval/reset-gpu", "approval"),
    ("xid-54", "gpu_thermal_power", True, "replace_node", "soft-evidence-approval/replace-node", "approval"),
    ("nvswitch-sxid-fatal", "nvlink", True, "reboot_node", "nvlink-approval/reboot-node", "approval"),
    ("cuda-nvlink-uncorrectable", "nvlink", True, "replace_node", "nvlink-approval/reboot-node", "approval"),
    ("xid-1", "gpu_hardware", True, "replace_node", "hardware-replace-approval/replace-node", "approval"),
    ("pcie-aer-fatal", "pcie", True, "replace_node", "hardware-replace-approval/replace-node", "approval"),
    ("xfs-corruption", "storage", True, "replace_node", "hardware-replace-approval/replace-node", "approval"),
    ("host-edac-ue", "node", True, "replace_node", "hardware-replace-approval/replace-node", "approval"),
    ("host-kernel-panic", "node", True, "reboot_node", "hardware-reboot-approval/reboot-node", "approval"),
    # A node NotReady, or its kubelet no longer posting status, on its own: software until hardware shows.
    ("node-not-ready", "node", False, "notify", "application-fault/notify", "auto"),
    ("kubelet-stopped-posting-status", "node", False, "notify", "application-fault/notify", "auto"),
    # A stalled PLEG (a hung runtime), a kubelet that failed to start (its configuration), no driver loaded
    # under the container hook (an install left undone): software, notify, on their own.
    ("kubelet-pleg-unhealthy", "node", False, "notify", "application-fault/notify", "auto"),
    ("kubelet-failed-to-start", "node", False, "notify", "application-fault/notify", "auto"),
    ("nvidia-driver-not-loaded", "node", False, "notify", "application-fault/notify", "auto"),
    ("pcie-aer-uncorrected-nonfatal", "pcie", True, "reset_gpu", "hardware-reset-approval/reset-gpu", "approval"),
    ("pcie-bandwidth-limited", "pcie", True, "notify", "notify-operator/notify", "auto"),
]


@pytest.mark.parametrize(("rule_id", "fc", "hw", "action", "policy", "mode"), TABLE, ids=[r[0] for r in TABLE])
def test_shipped_policy_table(shipped_rules: list[Rule], rule_id: str, fc: str, hw: bool, action: str,
                              policy: str, mode: str) -> None:
    inc = _incident(shipped_rules, rule_id)
    assert (inc.fault_class.value, inc.hardware, inc.recommended_action.value) == (fc, hw, action)
    assert _plan(inc) == (policy, mode)


def test_detector_rows_of_the_table() -> None:
    hang = _detector(FaultClass.HANG, HANG, False, Action.RESTART_JOB)
    assert _plan(hang) == ("restart-hung-job/restart-job", "auto")
    no_culprit = _detector(FaultClass.HANG, HANG, False, Action.RESTART_JOB, rank=None, node=None)
    assert _plan(no_culprit)[0] == "application-fault/notify"
    slow = _detector(FaultClass.STRAGGLER, STRAGGLER, True, Action.REPLACE_NODE, n=2)
    assert _plan(slow) == ("soft-evidence-approval/replace-node", "approval")
    assert _plan(_detector(FaultClass.STRAGGLER, STRAGGLER, False, Action.NOTIFY)) == \
        ("application-fault/notify", "auto")


def test_table_covers_every_fault_class_and_action() -> None:
    classes = {r[1] for r in TABLE} | {"hang", "straggler"}
    actions = {r[3] for r in TABLE}
    assert classes == {c.value for c in FaultClass}
    assert actions == {a.value for a in Action}


def test_every_shipped_rule_line_gets_auto_node_plans_only_for_unambiguous_gpu_faults(
        shipped_rules: list[Rule]) -> None:
    unambiguous = {"xid-79", "xid-48", "xid-63", "xid-64", "xid-74", "xid-94", "xid-95", "xid-119", "xid-120",
                   "xid-154", "nvidia-smi-device-handle"}
    policy = load_policy()
    for rule in shipped_rules:
        if rule.escalation is not None and rule.recommended_action is Action.NONE:
            continue  # informational below its rate (corrected PCIe/EDAC errors): a finding, no incident
        for i in range(len(rule.examples)):
            inc = _incident(shipped_rules, rule.id, i)
            plan = choose_plan(inc, policy, PolicyConfig(), PlanContext(T0))
            kinds = {s.kind for s in plan.steps}
            if not inc.hardware:
                assert StepKind.CORDON not in kinds, (rule.id, plan.policy)
            if StepKind.CORDON in kinds and plan.mode is Mode.AUTO:
                assert inc.root_finding.rule_id in unambiguous, (rule.id, i, plan.policy)


def test_one_ib_error_12_line_from_one_rank_asks_a_person(shipped_rules: list[Rule]) -> None:
    line = "-worker-1:946:988 [0] transport/net_ib.cc:839 NCCL WARN NET/IB : Got completion with error 12, " \
           "opcode 1, len 0, vendor err 129"  # https://github.com/NVIDIA/nccl/issues/902
    analyzer = Analyzer(shipped_rules)
    analyzer.process([container(NODE, line, job="llama", rank=5)])
    [inc] = analyzer.correlator.incidents()
    plan = choose_plan(inc, load_policy(), PolicyConfig(), PlanContext(T0))
    assert plan.mode is Mode.APPROVAL and not plan.policy.startswith("gpu-")


def test_a_hang_whose_culprit_is_named_restarts_the_job(shipped_rules: list[Rule]) -> None:
    analyzer = Analyzer(shipped_rules)
    analyzer.process([container(f"gpu-node-0{r}", nccl_timeout(r), job="llama", rank=r) for r in range(4)])
    analyzer.correlator.add(Finding(f"{HANG}:llama:1", T0 + 30, FaultClass.HANG, Severity.ERROR, False,
                                    Location(node="gpu-node-02", rank=2, job="llama"), HANG, Action.RESTART_JOB, (),
                                    "no progress from rank 2 for 612 s"))
    [inc] = [i for i in analyzer.correlator.incidents() if i.state.value == "open"]
    plan = choose_plan(inc, load_policy(), PolicyConfig(), PlanContext(T0 + 60, namespace="training"))
    assert [s.kind for s in plan.steps][-2:] == [StepKind.CHECKPOINT, StepKind.RESTART_JOB]
    assert plan.mode is Mode.AUTO and StepKind.CORDON not in {s.kind for s in plan.steps}


def test_operator_opt_in_runs_network_plans_automatically(tmp_path: Path, shipped_rules: list[Rule]) -> None:
    data = yaml.safe_load(default_policy_path().read_text())
    data["automatic"] = ["network"]
    p = parse_policy(data, "opted-in")
    inc = _incident(shipped_rules, "nccl-ib-retry-exceeded")
    plan = choose_plan(inc, p, PolicyConfig(), PlanContext(T0))
    assert plan.mode is Mode.AUTO and "network opted in" in plan.reason


def test_a_rule_an_earlier_rule_shadows_fails_at_load(tmp_path: Path) -> None:
    data = yaml.safe_load(default_policy_path().read_text())
    names = [r["name"] for r in data["rules"]]
    # The order the shipped file used to have: every hang went to notify, IB errors to replace-node.
    data["rules"].insert(0, {"name": "everything-software", "match": {"hardware": False}, "plan": "notify"})
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(PolicyError) as err:
        load_policy(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: rules.") and "'everything-software' (rules.0) comes first" in msg
    assert f"rule {names[names.index('application-fault')]!r} never matches" in msg
