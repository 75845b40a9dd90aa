"""The journal on the healing hot path: a new incident's cordon follows one commit that already holds the plan and
the cordon's intent, and a round reads from the journal only the plans that are due, not every running plan."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import event

from analyzer.pipeline import Analyzer
from analyzer.rules import Rule
from healer.records import PlanState, StepKind, StepState
from kmend.store import Store
from tests.builders import XID79, kernel
from tests.healing import Harness, incident

T0 = 1_700_000_000.0


def _no_state(*_: object) -> None:
    return None


def _statements(store: Store) -> list[str]:
    """Every statement and commit the store's engine sends from now on, in order."""
    seen: list[str] = []
    event.listen(store.engine, "commit", lambda _conn: seen.append("COMMIT"))
    event.listen(store.engine, "before_cursor_execute",
                 lambda _conn, _cur, statement, *_a: seen.append(" ".join(statement.split())))
    return seen


def test_a_new_incidents_cordon_follows_one_journal_commit_that_holds_its_intent(shipped_rules: list[Rule],
                                                                                tmp_path: Path) -> None:
    h = Harness(tmp_path, nodes=100)
    heal = h.healing()
    heal.heal_once([], _no_state)  # the loop's first round: it reads what the journal holds once
    seen = _statements(h.store)
    at_cordon: dict[str, Any] = {}
    cordon = h.cluster.cordon

    def cordon_and_look(node: str) -> None:
        # What a replica starting after a kill -9 at this instant would find: the plan, its cordon running.
        at_cordon["commits"] = seen.count("COMMIT")
        at_cordon["plans"] = Store(h.store.url).list_plans(node=node)
        cordon(node)

    h.cluster.cordon = cordon_and_look  # type: ignore[method-assign]
    heal.heal_once([incident(shipped_rules, [kernel("gpu-node-07", XID79, ts=T0)])], _no_state)
    assert at_cordon["commits"] == 1, seen
    [plan] = at_cordon["plans"]
    assert plan.state is PlanState.RUNNING
    states = {s.kind: s.state for s in plan.steps}
    assert states[StepKind.EVIDENCE] is StepState.SUCCEEDED and states[StepKind.CORDON] is StepState.RUNNING
    # The plan is counted as started by the brakes from that same commit.
    assert h.store.ledger.plans_started_since(T0 - 1, exclude_plan="") == 1
    assert h.world.applied("cordon") == [("cordon", "gpu-node-07")]


def test_a_round_reads_only_the_plans_that_are_due(shipped_rules: list[Rule], tmp_path: Path) -> None:
    h = Harness(tmp_path, nodes=100)
    heal = h.healing()
    nodes = [f"gpu-node-{i:02d}" for i in range(6)]
    analyzer = Analyzer(shipped_rules)
    analyzer.process([kernel(n, XID79, ts=T0 + i) for i, n in enumerate(nodes)])
    for inc in analyzer.correlator.incidents():
        plan = next(p for p in heal.heal_once([inc], _no_state) if p.node == inc.root_cause.node)
        assert next(s for s in plan.steps if s.state is StepState.WAITING).kind is StepKind.REPAIR
    seen = _statements(h.store)
    resumed = 0
    for _ in range(120):  # a minute of rounds every half second, the shipped healer interval
        h.clock.advance(0.5)
        resumed += len(heal.heal_once([], _no_state))
    bodies = [s for s in seen if s.startswith("SELECT plans.body")]
    # The due plans, read together: listing the running plans every round would be 120 reads of 6 plans.
    read = sum(s.split(" IN (", 1)[1].split(")", 1)[0].count("?") for s in bodies)
    assert resumed > 0 and read == resumed and len(bodies) <= resumed, (len(bodies), read, resumed)
