"""The service's healer loop makes only cordons in its rounds: a new plan's checkpoint restore, a checkpoint step asked
again after it waited, and a new node's health check go on in the background, so a second node's Xid 79 is cordoned
while they are held up (here: a resume ConfigMap write or a Job create that blocks until the test lets it go), and
each plan still completes with each change made once."""

from __future__ import annotations

import threading
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from analyzer.records import Incident
from analyzer.rules import Rule
from healer.cluster import TemporaryError
from healer.policy_file import default_policy_path, parse_policy
from healer.records import Plan, PlanState, StepKind, StepState
from kmend.healing import Healing
from tests.builders import XID79, container, kernel
from tests.healing import Harness, incident
from tests.waiting import until

XID48 = ("[ 9271.102911] NVRM: Xid (PCI:0000:18:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double "
         "bit error (DBE) has been detected on GPU in the framebuffer at partition 0, subpartition 0.")
BAD, OTHER = "gpu-node-02", "gpu-node-09"
"""The job's node whose fault starts the slow plan, and the node whose Xid 79 comes while that plan is held up."""
BOUND_S = 10.0
"""How long the second node's cordon may take: a round is milliseconds here, the held-up step holds it forever."""


def _no_state(*_: object) -> None:
    return None


def _harness(tmp: Path, ck: Path, *, restart_on_dbe: bool = False) -> Harness:
    data = yaml.safe_load(default_policy_path().read_text())
    data["defaults"]["drain_grace_s"] = 0
    data["safety"].update({"breaker_max_fraction": 1.0, "max_out_fraction": 1.0})
    if restart_on_dbe:  # an operator's choice: a double-bit error restarts the job from its checkpoint, node kept
        data["rules"].insert(0, {"name": "restart-on-dbe", "match": {"hardware": True, "rule": ["xid-48"]},
                                 "plan": "restart-job"})
    (ck / "checkpoint-50").mkdir(parents=True)
    (ck / "checkpoint-50" / "trainer_state.json").write_text('{"global_step": 50}')
    with zipfile.ZipFile(ck / "checkpoint-50" / "pytorch_model.bin", "w") as z:
        z.writestr("archive/data.pkl", b"x")
    return Harness(tmp, nodes=16, spares=2, job_nodes=4, checkpoint_path=str(ck),
                   policy=parse_policy(data, "test-policy"))


class Gate:
    """Wraps a method of the world: calls block until ``release`` (after ``fail_first`` temporary errors)."""

    def __init__(self, owner: object, name: str, *, fail_first: int = 0) -> None:
        self.entered = threading.Event()
        self.released = threading.Event()
        self.calls = 0
        real = getattr(owner, name)

        def gated(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.calls <= fail_first:
                raise TemporaryError("503 the server is busy")
            self.entered.set()
            self.released.wait(120)
            return real(*args, **kwargs)

        setattr(owner, name, gated)


@contextmanager
def _loop(h: Harness, heal: Healing, incidents: list[Incident]) -> Iterator[list[BaseException]]:
    """The service's healer loop (detached rounds) over ``incidents``, a round every few milliseconds."""
    stop, errors = threading.Event(), []

    def run() -> None:
        while not stop.is_set():
            try:
                heal.heal_once(list(incidents), _no_state, detach=True)
            except BaseException as exc:  # reported by the test
                errors.append(exc)
                return
            h.clock.advance(0.2)
            stop.wait(0.005)

    thread = threading.Thread(target=run, name="healer-loop", daemon=True)
    thread.start()
    try:
        yield errors
    finally:
        stop.set()
        thread.join(timeout=120)
        assert not thread.is_alive(), "the healer loop did not stop"


def _plan_of(h: Harness, node: str, policy: str) -> Plan | None:
    return next((p for p in h.store.list_plans(node=node) if p.policy.endswith(policy)), None)


def _cordoned(h: Harness, node: str) -> bool:
    return h.cluster.get_node(node).unschedulable


def _second_fault_is_cordoned(h: Harness, rules: list[Rule], incidents: list[Incident], gate: Gate) -> float:
    """Adds an Xid 79 on OTHER while the gate holds a step: the seconds until OTHER is cordoned."""
    until("the slow step to start", gate.entered.is_set)
    t0 = time.monotonic()
    incidents.append(incident(rules, [kernel(OTHER, XID79)]))
    try:
        until(f"{OTHER} cordoned", lambda: _cordoned(h, OTHER), timeout=BOUND_S)
    finally:
        gate.released.set()
    return time.monotonic() - t0


def test_a_new_plans_slow_checkpoint_restore_does_not_hold_back_another_nodes_cordon(
        shipped_rules: list[Rule], tmp_path: Path) -> None:
    h = _harness(tmp_path, tmp_path / "ck", restart_on_dbe=True)
    heal = h.healing()
    gate = Gate(h.workloads, "apply_config_map")  # the resume point, published by the checkpoint step
    incidents = [incident(shipped_rules, [container(BAD, "step 10 loss 2.1", job="llama"), kernel(BAD, XID48)])]
    with _loop(h, heal, incidents) as errors:
        took = _second_fault_is_cordoned(h, shipped_rules, incidents, gate)
        restart = until("the job's restart plan done", lambda: (p := _plan_of(h, BAD, "restart-job")) is not None
                         and p.state is PlanState.SUCCEEDED and p)
        until(f"{OTHER}'s plan at its repair", lambda: (p := _plan_of(h, OTHER, "replace-node")) is not None
               and any(s.kind is StepKind.REPAIR and s.state is StepState.WAITING for s in p.steps))
    assert not errors, errors
    assert took < BOUND_S
    assert [s.kind for s in restart.steps] == [StepKind.EVIDENCE, StepKind.CHECKPOINT, StepKind.RESTART_JOB]
    assert "checkpoint-50" in restart.steps[1].result, restart.steps[1]
    assert gate.calls == 1  # the resume point written once
    assert not _cordoned(h, BAD)  # the operator's policy keeps the node
    # Every rank restarted once, together.
    deleted = sorted(t for o, t in h.world.applied() if o == "delete_pod")
    assert deleted == [f"training/llama-worker-{i}" for i in range(4)], deleted


def test_a_checkpoint_step_asked_again_after_it_waited_does_not_hold_back_another_nodes_cordon(
        shipped_rules: list[Rule], tmp_path: Path) -> None:
    h = _harness(tmp_path, tmp_path / "ck")
    heal = h.healing()
    # The resume point's writes meet a busy server until the step waits (the executor's retries, twice: the first
    # wait is a change it asks again at once); the write when the loop asks the step again is slow.
    refused = 2 * h.executor.max_attempts
    gate = Gate(h.workloads, "apply_config_map", fail_first=refused)
    incidents = [incident(shipped_rules, [container(BAD, "step 10 loss 2.1", job="llama"), kernel(BAD, XID79)])]
    with _loop(h, heal, incidents) as errors:
        took = _second_fault_is_cordoned(h, shipped_rules, incidents, gate)
        first = until(f"{BAD}'s plan at its repair", lambda: (p := _plan_of(h, BAD, "replace-node")) is not None
                       and any(s.kind is StepKind.REPAIR and s.state is StepState.WAITING for s in p.steps) and p)
    assert not errors, errors
    assert took < BOUND_S
    checkpoint = next(s for s in first.steps if s.kind is StepKind.CHECKPOINT)
    assert checkpoint.state is StepState.SUCCEEDED and "checkpoint-50" in checkpoint.result, checkpoint
    assert gate.calls == refused + 1  # one written, after it waited
    assert not any("temporary error" in s.result for s in first.steps), first.steps
    ops = h.world.applied()
    assert ops.count(("cordon", BAD)) == 1 and ops.count(("cordon", OTHER)) == 1, ops
    assert ops.count(("evict_pod", f"training/llama-worker-{BAD[-1]}")) == 1, ops


def test_a_new_nodes_slow_health_check_does_not_hold_back_another_nodes_cordon(
        shipped_rules: list[Rule], tmp_path: Path) -> None:
    h = _harness(tmp_path, tmp_path / "ck")
    heal = h.healing()
    heal.heal_once([], _no_state, detach=True)  # the nodes known at start need no check
    gate = Gate(h.workloads, "create_object")  # the health-check Job
    h.world.cluster.add_node("gpu-node-new")
    incidents: list[Incident] = []
    with _loop(h, heal, incidents) as errors:
        took = _second_fault_is_cordoned(h, shipped_rules, incidents, gate)
        check = until("the new node's health check passed", lambda: next(
            (p for p in h.store.list_plans(node="gpu-node-new") if p.state is PlanState.SUCCEEDED), None))
    assert not errors, errors
    assert took < BOUND_S
    assert gate.calls == 1  # the Job created once
    assert check.policy.startswith("acceptance/") and [s.kind for s in check.steps] == [
        StepKind.TAINT, StepKind.VALIDATE, StepKind.ACCEPT]


IB_ERROR_12 = ("llama-worker-2:946:988 [0] transport/net_ib.cc:839 NCCL WARN NET/IB : Got completion with error 12, "
               "opcode 1, len 0, vendor err 129")
"""A fabric error: a person approves the replace-node plan (network-approval)."""


def test_an_approved_plans_slow_drain_does_not_hold_back_another_nodes_cordon(
        shipped_rules: list[Rule], tmp_path: Path) -> None:
    h = _harness(tmp_path, tmp_path / "ck")
    heal = h.healing()
    gate = Gate(h.workloads, "evict_pod")  # the approved plan's drain: an eviction the server holds
    incidents = [incident(shipped_rules, [container(BAD, IB_ERROR_12, job="llama", rank=2)])]
    approved: list[Plan] = []
    with _loop(h, heal, incidents) as errors:
        waiting = until("the plan awaiting approval", lambda: next(
            (p for p in h.store.list_plans(node=BAD) if p.state is PlanState.AWAITING_APPROVAL), None))
        # The operator's request (the API's thread): it returns once the node is out, not after the drain.
        operator = threading.Thread(target=lambda: approved.append(heal.approve(waiting.id, "ops", _no_state)))
        operator.start()
        took = _second_fault_is_cordoned(h, shipped_rules, incidents, gate)
        operator.join(timeout=60)
        done = until(f"{BAD}'s plan at its repair", lambda: (p := _plan_of(h, BAD, "replace-node")) is not None
                      and any(s.kind is StepKind.REPAIR and s.state is StepState.WAITING for s in p.steps) and p)
    assert not errors, errors
    assert took < BOUND_S
    assert approved and approved[0].state is PlanState.RUNNING and "approved by ops" in approved[0].reason
    assert next(s for s in done.steps if s.kind is StepKind.DRAIN).state is StepState.SUCCEEDED
    assert gate.calls == 1  # the rank on the node evicted once
    ops = h.world.applied()
    assert ops.count(("cordon", BAD)) == 1 and ops.count(("cordon", OTHER)) == 1, ops
