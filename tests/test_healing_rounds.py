"""Healer rounds and node views stay cheap with hundreds of open incidents: a round whose plans the hourly rate
limit holds back reads and asks none of them (a constant number of store queries), they go on once the hour's
budget frees up, and the node records read every plan and step in a constant number of queries."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import event

from analyzer.pipeline import Analyzer
from analyzer.records import Incident
from analyzer.rules import Rule
from healer.policy_file import default_policy_path, parse_policy
from healer.records import LOCAL_STEPS, PlanState, StepState
from kmend.store import Store
from tests.builders import XID13, kernel
from tests.healing import Harness

LIMIT = 3


def _no_state(*_: object) -> None:
    return None


@contextmanager
def _statements(store: Store) -> Iterator[list[str]]:
    """Every SQL statement the store's engine sends while the block runs."""
    seen: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        seen.append(statement)

    event.listen(store.engine, "before_cursor_execute", count)
    try:
        yield seen
    finally:
        event.remove(store.engine, "before_cursor_execute", count)


def _harness(tmp: Path) -> Harness:
    data = yaml.safe_load(default_policy_path().read_text())
    data["defaults"]["drain_grace_s"] = 0
    data["safety"]["max_plans_per_hour"] = LIMIT
    return Harness(tmp, nodes=8, policy=parse_policy(data, "test-policy"))


def _app_faults(rules: list[Rule], n: int, t0: float) -> list[Incident]:
    """One application-fault incident (Xid 13: notify only) on each of n nodes."""
    analyzer = Analyzer(rules)
    analyzer.process([kernel(f"gpu-node-{i:04d}", XID13, ts=t0 + i) for i in range(n)])
    return analyzer.correlator.active()


def test_a_round_of_rate_limited_plans_costs_a_constant_number_of_queries(tmp_path: Path,
                                                                           shipped_rules: list[Rule]) -> None:
    h = _harness(tmp_path)
    heal = h.healing()
    incidents = _app_faults(shipped_rules, 60, h.clock() - 60)
    assert len(incidents) == 60
    heal.heal_once(incidents, _no_state)
    plans = h.store.list_plans()
    assert len(plans) == 60
    assert sum(p.state is PlanState.SUCCEEDED for p in plans) == LIMIT  # the rest wait for the hour's budget
    for _ in range(3):
        h.clock.advance(5)
        with _statements(h.store) as seen:
            heal.heal_once(incidents, _no_state)
        assert len(seen) <= 3, seen
    assert sum(p.state is PlanState.SUCCEEDED for p in h.store.list_plans()) == LIMIT
    # Once the hour has passed, the held plans go on: the budget again, no more.
    h.clock.advance(3600)
    heal.heal_once(incidents, _no_state)
    assert sum(p.state is PlanState.SUCCEEDED for p in h.store.list_plans()) == 2 * LIMIT


def test_a_held_plan_changed_elsewhere_is_asked_again_at_the_next_resync(tmp_path: Path,
                                                                         shipped_rules: list[Rule]) -> None:
    h = _harness(tmp_path)
    heal = h.healing()
    incidents = _app_faults(shipped_rules, LIMIT + 1, h.clock() - 60)
    heal.heal_once(incidents, _no_state)
    [held] = [p for p in h.store.list_plans() if p.state is PlanState.RUNNING]
    # Another writer journals its first acting step done: the plan has acted, the rate limit no longer holds it.
    first = next(s for s in held.steps if s.state is StepState.PENDING and s.kind not in LOCAL_STEPS)
    h.store.save_step(held.id, replace(first, state=StepState.SUCCEEDED))
    h.clock.advance(heal.resync_s + 1)
    heal.heal_once(incidents, _no_state)
    assert h.store.get_plan(held.id).state is PlanState.SUCCEEDED  # type: ignore[union-attr]


def test_node_records_read_every_plan_in_a_constant_number_of_queries(tmp_path: Path,
                                                                       shipped_rules: list[Rule]) -> None:
    h = _harness(tmp_path)
    heal = h.healing()
    incidents = _app_faults(shipped_rules, 40, h.clock() - 60)
    heal.heal_once(incidents, _no_state)
    with _statements(h.store) as seen:
        records = heal.node_records()
    assert len(seen) <= 3, seen
    assert set(records) == {f"gpu-node-{i:04d}" for i in range(40)}
    assert all(r["faults_in_window"] == 0 and r["validation"] is None for r in records.values())
