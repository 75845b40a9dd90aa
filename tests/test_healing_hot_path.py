"""The healer's hot path: a new incident's node is cordoned before plans already under way are asked again, every
node of a batch is out before any plan drains or asks for a repair, waiting plans back off (and go on at once when
their request is answered), new work interrupts a round of resumes, and the Lease is written on its renewal period,
not on every round."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from analyzer.rules import Rule
from healer.lease import LeaderElector, LeaseRecord
from healer.records import PlanState, StepKind, StepState
from sim.cluster import SimCluster
from tests.builders import XID79, kernel
from tests.healing import Clock, Harness, incident

T0 = 1_700_000_000.0


def _no_state(*_: object) -> None:
    return None


def _record(cluster: SimCluster, calls: list[tuple[str, str]], *names: str) -> None:
    """Log every call of these Cluster methods, in order, with the node it was about."""
    for name in names:
        method: Callable[..., Any] = getattr(cluster, name)

        def logged(node: str, *args: Any, _method: Callable[..., Any] = method, _name: str = name,
                   **kwargs: Any) -> Any:
            calls.append((_name, node))
            return _method(node, *args, **kwargs)

        setattr(cluster, name, logged)


def _waiting_plans(h: Harness, rules: list[Rule], nodes: list[str]) -> None:
    heal = h.healing()
    for i, node in enumerate(nodes):
        touched = heal.heal_once([incident(rules, [kernel(node, XID79, ts=T0 + i)])], _no_state)
        plan = next(p for p in touched if p.node == node)
        assert plan.state is PlanState.RUNNING
        assert next(s for s in plan.steps if s.state is StepState.WAITING).kind is StepKind.REPAIR


def test_a_new_incident_is_cordoned_before_plans_under_way_are_asked_again(shipped_rules: list[Rule],
                                                                           tmp_path: Path) -> None:
    h = Harness(tmp_path, nodes=100)
    old = [f"gpu-node-{i:02d}" for i in range(8)]
    _waiting_plans(h, shipped_rules, old)
    heal = h.healing()
    h.clock.advance(60)  # every waiting plan is due again
    calls: list[tuple[str, str]] = []
    _record(h.cluster, calls, "get_node", "cordon")
    heal.heal_once([incident(shipped_rules, [kernel("gpu-node-50", XID79, ts=T0 + 60)])], _no_state)
    cordon = calls.index(("cordon", "gpu-node-50"))
    asked = [i for i, (_, node) in enumerate(calls) if node in old]
    assert asked, "the plans under way were resumed in the same round"
    assert cordon < min(asked), calls[: cordon + 1]


def test_every_node_of_a_batch_is_out_before_any_plan_drains_or_asks_for_a_repair(shipped_rules: list[Rule],
                                                                                  tmp_path: Path) -> None:
    h = Harness(tmp_path, nodes=100)
    nodes = [f"gpu-node-{i:02d}" for i in range(8)]
    incidents = [incident(shipped_rules, [kernel(n, XID79, ts=T0 + i)]) for i, n in enumerate(nodes)]
    plans = h.healing().heal_once(incidents, _no_state)
    assert {p.node for p in plans} == set(nodes)
    ops = [a["op"] for a in h.world.actions]
    last_quarantine = max(i for i, op in enumerate(ops) if op.startswith("emit_event KmendQuarantine"))
    first_repair = min(i for i, op in enumerate(ops) if op.startswith("emit_event KmendRepairRequested"))
    assert last_quarantine < first_repair, ops
    assert sorted(t for op, t in h.world.applied() if op == "cordon") == nodes


def test_plans_waiting_on_a_repair_back_off_and_go_on_once_it_is_answered(shipped_rules: list[Rule],
                                                                          tmp_path: Path) -> None:
    h = Harness(tmp_path, nodes=100)
    old = [f"gpu-node-{i:02d}" for i in range(5)]
    _waiting_plans(h, shipped_rules, old)
    heal = h.healing()
    calls: list[tuple[str, str]] = []
    _record(h.cluster, calls, "get_node")
    for _ in range(240):  # two minutes of rounds every half second, the shipped healer interval
        h.clock.advance(0.5)
        heal.heal_once([], _no_state)
    asks = {n: sum(1 for _, node in calls if node == n) for n in old}
    # Each resume reads the node a couple of times; asked every round it would be 240 resumes per plan.
    assert all(0 < a <= 30 for a in asks.values()), asks
    h.answer_repairs()
    [request] = [p for p in h.store.list_plans(node="gpu-node-00")]
    heal.answer("gpu-node-00", next(s.id for s in request.steps if s.kind is StepKind.REPAIR), "done", "repaired")
    h.clock.advance(0.5)
    touched = {p.node: p for p in heal.heal_once([], _no_state)}
    assert "gpu-node-00" in touched
    repair = next(s for s in touched["gpu-node-00"].steps if s.kind is StepKind.REPAIR)
    assert repair.state is StepState.SUCCEEDED


def test_new_work_interrupts_a_round_of_resumes_after_the_first(shipped_rules: list[Rule], tmp_path: Path) -> None:
    h = Harness(tmp_path, nodes=100)
    _waiting_plans(h, shipped_rules, [f"gpu-node-{i:02d}" for i in range(6)])
    heal = h.healing()
    h.clock.advance(60)
    touched = heal.heal_once([], _no_state, interrupted=lambda: True)
    assert len(touched) == 1  # one plan goes on, so that none waits forever; the rest wait for the next round
    assert len(heal.heal_once([], _no_state)) == 5


class _CountingLeases:
    """An in-memory Lease store that counts writes."""

    def __init__(self) -> None:
        self.lease: LeaseRecord | None = None
        self.writes = 0

    def get(self, namespace: str, name: str) -> LeaseRecord | None:
        return self.lease

    def create(self, lease: LeaseRecord) -> LeaseRecord:
        self.writes += 1
        self.lease = lease
        return lease

    def update(self, lease: LeaseRecord) -> LeaseRecord:
        self.writes += 1
        self.lease = lease
        return lease


def test_the_lease_is_written_on_its_renewal_period_not_on_every_round() -> None:
    clock = Clock()
    leases = _CountingLeases()
    elector = LeaderElector(leases, namespace="kmend-system", name="kmend", identity="a", duration_s=15, clock=clock)
    for _ in range(100):  # ten seconds of rounds, as often as new incidents wake the healer
        assert elector.tick()
        clock.advance(0.1)
    assert 3 <= leases.writes <= 6  # acquired, then renewed every 2 s
    assert elector.is_leader()


class _SlowWebhook:
    """A notifier whose receiver answers slowly; it logs what it was told into the call log."""

    def __init__(self, calls: list[tuple[str, str]]) -> None:
        self.calls = calls

    def notify(self, payload: dict[str, Any]) -> None:
        self.calls.append(("notify", str(payload.get("event"))))


def test_the_cordon_comes_before_any_announcement(shipped_rules: list[Rule], tmp_path: Path) -> None:
    h = Harness(tmp_path, nodes=100)
    calls: list[tuple[str, str]] = []
    _record(h.cluster, calls, "cordon")
    h.ctx = replace(h.ctx, notifier=_SlowWebhook(calls))
    h.healing().heal_once([incident(shipped_rules, [kernel("gpu-node-07", XID79, ts=T0)])], _no_state)
    assert calls[0] == ("cordon", "gpu-node-07"), calls
    assert ("notify", "plan_created") in calls


def test_a_cordon_decision_reads_the_quarantined_nodes_not_the_whole_fleet(shipped_rules: list[Rule],
                                                                           tmp_path: Path) -> None:
    h = Harness(tmp_path, nodes=100)
    listed: list[str] = []
    list_nodes = h.cluster.list_nodes

    def counting(labels: dict[str, str] | None = None) -> Any:
        listed.append("selected" if labels else "all")
        return list_nodes(labels)

    h.cluster.list_nodes = counting  # type: ignore[method-assign]
    incidents = [incident(shipped_rules, [kernel(f"gpu-node-{i:02d}", XID79, ts=T0 + i)]) for i in range(8)]
    h.healing().heal_once(incidents, _no_state)
    assert len(h.world.applied("cordon")) == 8
    # Eight breaker decisions read the labelled nodes; the fleet is counted once (and once more for acceptance).
    assert listed.count("selected") == 8 and listed.count("all") <= 2, listed
