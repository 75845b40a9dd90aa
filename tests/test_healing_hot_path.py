"""The healer's hot path: a new incident's node is cordoned before plans already under way are asked again, every
node of a batch is out before any plan drains or asks for a repair, waiting plans back off (and go on at once when
their request is answered), new work interrupts a round of resumes, and the Lease is written on its renewal period,
not on every round."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from analyzer.pipeline import Analyzer
from analyzer.records import Incident
from analyzer.rules import Rule
from healer.lease import LeaderElector, LeaseRecord
from healer.records import PlanState, StepKind, StepState
from sim.cluster import SimCluster
from tests.builders import XID79, kernel
from tests.healing import Clock, Harness, fast_policy, incident

T0 = 1_700_000_000.0


def _no_state(*_: object) -> None:
    return None


def _xids(rules: list[Rule], nodes: list[str]) -> list[Incident]:
    """One Xid 79 incident per node, from one analyzer (building one per incident compiles the rules each time)."""
    analyzer = Analyzer(rules)
    analyzer.process([kernel(n, XID79, ts=T0 + i) for i, n in enumerate(nodes)])
    incidents = analyzer.correlator.incidents()
    assert sorted(i.root_cause.node for i in incidents) == sorted(nodes)
    return incidents


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
    by_node = {i.root_cause.node: i for i in _xids(rules, nodes)}
    for node in nodes:
        touched = heal.heal_once([by_node[node]], _no_state)
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
    incidents = _xids(shipped_rules, nodes)
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
    incidents = _xids(shipped_rules, [f"gpu-node-{i:02d}" for i in range(8)])
    h.healing().heal_once(incidents, _no_state)
    assert len(h.world.applied("cordon")) == 8
    # Eight breaker decisions read the labelled nodes; the fleet is counted once (and once more for acceptance).
    assert listed.count("selected") == 8 and listed.count("all") <= 2, listed


def _slow_writes(cluster: SimCluster, seconds: float) -> None:
    """Every node write takes ``seconds``, as a round trip to a distant API server does."""
    for name in ("cordon", "add_taint", "patch_node_metadata", "set_condition", "emit_event"):
        method: Callable[..., Any] = getattr(cluster, name)

        def slow(*args: Any, _method: Callable[..., Any] = method, **kwargs: Any) -> Any:
            time.sleep(seconds)
            return _method(*args, **kwargs)

        setattr(cluster, name, slow)


def test_a_batch_of_nodes_is_quarantined_in_parallel(shipped_rules: list[Rule], tmp_path: Path) -> None:
    h = Harness(tmp_path, nodes=100)
    _slow_writes(h.cluster, 0.1)
    cordoned: list[float] = []
    cordon = h.cluster.cordon

    def timed(node: str) -> None:
        cordon(node)
        cordoned.append(time.monotonic())

    h.cluster.cordon = timed  # type: ignore[method-assign]
    incidents = _xids(shipped_rules, [f"gpu-node-{i:02d}" for i in range(8)])
    heal = h.healing()
    start = time.monotonic()
    heal.heal_once(incidents, _no_state)
    assert len(cordoned) == 8
    # One after another, the last cordon would come after seven quarantines of five 0.1 s writes each (3.5 s).
    assert cordoned[-1] - start < 2.5, cordoned[-1] - start


def test_plans_quarantining_in_parallel_still_stop_at_the_breaker(shipped_rules: list[Rule], tmp_path: Path) -> None:
    h = Harness(tmp_path, nodes=100)  # 10 % of 100 GPU nodes: the eleventh quarantine trips the breaker
    _slow_writes(h.cluster, 0.02)
    incidents = _xids(shipped_rules, [f"gpu-node-{i:02d}" for i in range(16)])
    plans = h.healing().heal_once(incidents, _no_state)
    assert len(h.world.applied("cordon")) == 10
    assert sum(p.state is PlanState.BLOCKED for p in plans) == 6
    assert h.store.ledger.breaker().tripped


def test_a_plan_waiting_on_its_drain_is_asked_every_second_not_backed_off(shipped_rules: list[Rule],
                                                                          tmp_path: Path) -> None:
    h = Harness(tmp_path, nodes=16, job_nodes=4, policy=fast_policy(drain_grace_s=30))
    heal = h.healing()
    node = h.workloads.list_pods(namespace="training")[0].node
    [plan] = heal.heal_once(_xids(shipped_rules, [node]), _no_state)
    assert next(s for s in plan.steps if s.state is StepState.WAITING).kind is StepKind.DRAIN
    asked = 0
    for _ in range(40):  # twenty seconds of rounds every half second: the job is down while its pods drain
        h.clock.advance(0.5)
        asked += any(p.id == plan.id for p in heal.heal_once([], _no_state))
    assert asked >= 15, asked


def test_a_round_reads_only_the_waiting_plans_that_are_due(shipped_rules: list[Rule], tmp_path: Path) -> None:
    h = Harness(tmp_path, nodes=100)
    nodes = [f"gpu-node-{i:02d}" for i in range(8)]  # below the breaker
    _waiting_plans(h, shipped_rules, nodes)
    heal = h.healing()
    heal.heal_once([], _no_state)  # a new process asks each waiting plan once, then backs off
    read: list[str] = []
    get_plan, list_plans = h.store.get_plan, h.store.list_plans

    def counted_get(plan_id: str) -> Any:
        read.append(plan_id)
        return get_plan(plan_id)

    def counted_list(**kwargs: Any) -> Any:
        out = list_plans(**kwargs)
        read.extend(p.id for p in out)
        return out

    h.store.get_plan = counted_get  # type: ignore[method-assign]
    h.store.list_plans = counted_list  # type: ignore[method-assign]
    for _ in range(20):  # ten seconds of rounds (each ingested batch with an incident also wakes one)
        h.clock.advance(0.5)
        heal.heal_once([], _no_state)
    # Reading every running plan and its journal on every round was 8 plans x 20 rounds; the plans waiting
    # on a repair are due a few times in ten seconds, and only those are read.
    assert len(read) <= 4 * len(nodes), len(read)
