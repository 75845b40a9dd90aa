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
from healer.records import DISRUPTIVE_STEPS, PlanState, StepState, has_disrupted
from kmend.store import Store
from tests.builders import XID79, kernel
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
    # The hourly budget alone holds plans back here (not the breaker's share of the fleet).
    data["safety"].update({"max_plans_per_hour": LIMIT, "breaker_max_fraction": 1.0, "max_out_fraction": 1.0})
    return Harness(tmp, nodes=64, policy=parse_policy(data, "test-policy"))


def _lost_gpus(rules: list[Rule], n: int, t0: float) -> list[Incident]:
    """A lost GPU (Xid 79: an automatic node plan) on each of n nodes."""
    analyzer = Analyzer(rules)
    analyzer.process([kernel(f"gpu-node-{i:02d}", XID79, ts=t0 + i) for i in range(n)])
    return analyzer.correlator.active()


def _disrupted(h: Harness) -> int:
    return sum(has_disrupted(p.steps) for p in h.store.list_plans())


def _later_rounds(tmp: Path, rules: list[Rule], n: int) -> tuple[Harness, Any, list[Incident], list[int]]:
    """n lost GPUs healed once, then three later rounds: the statements each round sent."""
    h = _harness(tmp)
    heal = h.healing()
    incidents = _lost_gpus(rules, n, h.clock() - 60)
    assert len(incidents) == n
    heal.heal_once(incidents, _no_state)
    assert len(h.store.list_plans()) == n
    assert _disrupted(h) == LIMIT  # the rest wait for the hour's budget
    counts = []
    for _ in range(3):
        h.clock.advance(5)
        with _statements(h.store) as seen:
            heal.heal_once(incidents, _no_state)
        counts.append(len(seen))
    return h, heal, incidents, counts


def test_a_round_of_rate_limited_plans_costs_a_constant_number_of_queries(tmp_path: Path,
                                                                           shipped_rules: list[Rule]) -> None:
    # The plans that run cost what they cost; the 56 held ones cost nothing more than the one held plan did.
    (tmp_path / "few").mkdir()
    (tmp_path / "many").mkdir()
    _, _, _, few = _later_rounds(tmp_path / "few", shipped_rules, LIMIT + 1)
    h, heal, incidents, many = _later_rounds(tmp_path / "many", shipped_rules, 60)
    assert many == few
    assert _disrupted(h) == LIMIT
    # Once the hour has passed, the held plans go on: the budget again, no more.
    h.clock.advance(3600)
    heal.heal_once(incidents, _no_state)
    assert _disrupted(h) == 2 * LIMIT


def test_a_held_plan_changed_elsewhere_is_asked_again_at_the_next_resync(tmp_path: Path,
                                                                         shipped_rules: list[Rule]) -> None:
    h = _harness(tmp_path)
    heal = h.healing()
    incidents = _lost_gpus(shipped_rules, LIMIT + 1, h.clock() - 60)
    heal.heal_once(incidents, _no_state)
    [held] = [p for p in h.store.list_plans() if not has_disrupted(p.steps)]
    # Another writer journals its cordon done: the plan has disrupted, the rate limit no longer holds it.
    first = next(s for s in held.steps if s.state is StepState.PENDING and s.kind in DISRUPTIVE_STEPS)
    h.store.save_step(held.id, replace(first, state=StepState.SUCCEEDED))
    before = {s.id: s.state for s in h.store.get_plan(held.id).steps}  # type: ignore[union-attr]
    h.clock.advance(heal.resync_s + 1)
    heal.heal_once(incidents, _no_state)
    after = h.store.get_plan(held.id)
    # Asked again: here it finds its node uncordoned (the cordon was only journaled) and stops, as it should.
    assert after is not None and (after.state is not PlanState.RUNNING
                                  or {s.id: s.state for s in after.steps} != before), after


def test_node_records_read_every_plan_in_a_constant_number_of_queries(tmp_path: Path,
                                                                       shipped_rules: list[Rule]) -> None:
    h = _harness(tmp_path)
    heal = h.healing()
    incidents = _lost_gpus(shipped_rules, 40, h.clock() - 60)
    heal.heal_once(incidents, _no_state)
    with _statements(h.store) as seen:
        records = heal.node_records()
    assert len(seen) <= 3, seen
    assert set(records) == {f"gpu-node-{i:02d}" for i in range(40)}
