"""Two replicas on one real PostgreSQL: a reject sent to the replica that does not lead, while the leader's run of the
plan is part way (its condition write held), stops the leader's run before its next step, as a reject on the leader
does; no later write of the leader overwrites the decision, and the plan's unfinished steps end."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from healer.records import PlanState, StepState
from kmend.service import Kmend
from sim.cluster import SimCluster
from tests.builders import XID79, kernel
from tests.test_healing_background import Gate
from tests.test_replicas import two_replicas
from tests.waiting import until

pytestmark = pytest.mark.postgres

NODE = "gpu-node-01"


@pytest.fixture
def replicas(fresh_postgres_url: str) -> Iterator[tuple[Kmend, Kmend, SimCluster]]:
    with two_replicas(fresh_postgres_url) as (a, b, _, cluster):
        yield a, b, cluster


def test_a_reject_sent_to_the_other_replica_stops_the_leaders_run_before_its_next_step(
        replicas: tuple[Kmend, Kmend, SimCluster]) -> None:
    a, b, cluster = replicas
    gate = Gate(cluster, "set_condition")  # the leader's quarantine is held at its condition write
    a.ingest([kernel(NODE, XID79, ts=1_700_000_000.0)])
    assert a.replicas is not None and a.replicas.tail() == 1
    errors: list[BaseException] = []

    def lead() -> None:
        try:
            a.heal_once()
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    leader = threading.Thread(target=lead, daemon=True)
    leader.start()
    try:
        until("the leader's condition write held", gate.entered.is_set)
        [plan] = b.store.list_plans(node=NODE)
        rejected = b.healing.reject(plan.id, "alice")  # the replica that does not lead takes the call
        assert rejected.state is PlanState.REJECTED
        # While the leader's write is still in flight, the plan says so: not that kmend restarted.
        held = next(s for s in rejected.steps if s.kind.value == "condition")
        assert held.state is StepState.INTERRUPTED and "restarted" not in held.result, held
        assert "ran on the leader" in held.result and "rejected by alice" in held.result, held
    finally:
        gate.released.set()
    leader.join(60)
    assert not leader.is_alive() and not errors, errors
    after = a.store.get_plan(plan.id)
    assert after is not None and after.state is PlanState.REJECTED and "rejected by alice" in after.reason, after
    # The write in flight was made; no later step ran (no Event, no drain), and none is left to run.
    assert not [e for e in cluster.events if e.node == NODE], cluster.events
    assert not [s for s in after.steps if s.state in (StepState.PENDING, StepState.WAITING, StepState.RUNNING)], after
    condition = next(s for s in after.steps if s.kind.value == "condition")
    assert condition.state is StepState.SUCCEEDED, condition
    calls = gate.calls
    a.heal_once()  # later rounds leave it as it is
    again = a.store.get_plan(plan.id)
    assert again is not None and again.state is PlanState.REJECTED and again.steps == after.steps
    assert gate.calls == calls and not [e for e in cluster.events if e.node == NODE]
