"""The store's upserts, built once per store: the journal writes them on every step transition, and SQLAlchemy
caches them compiled."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Table, func

from healer.records import PlanState
from kmend.store import schema

DECIDED = (PlanState.REJECTED.value, PlanState.CANCELLED.value)
"""Plan states an operator's decision sets: a save that had not seen the decision never overwrites them."""


@dataclass(frozen=True, slots=True)
class Upserts:
    """Insert-or-update statements of the dialect in use."""

    plan: Any
    """A plan's row; returns its id, or no row when the plan was decided meanwhile."""
    incident: Any
    """An incident's row."""
    step: Any
    """A plan step's row (the journal)."""
    mark: Any
    """A producer's high-water mark (only ever raised)."""

    @classmethod
    def build(cls, insert: Callable[[Table], Any]) -> Upserts:
        """The statements, from the dialect's ``insert`` of a table."""
        plan_stmt = insert(schema.plans)
        plan = plan_stmt.on_conflict_do_update(
            index_elements=["id"], set_={**{k: plan_stmt.excluded[k] for k in ("state", "mode", "updated_at", "body")},
                                         # The first start counts for the brakes; a later save keeps it.
                                         "started_at": func.coalesce(schema.plans.c.started_at,
                                                                     plan_stmt.excluded.started_at)},
            # An operator's decision (any replica's) is never overwritten by a save that had not seen it.
            where=schema.plans.c.state.not_in(DECIDED) | plan_stmt.excluded.state.in_(DECIDED)).returning(
            schema.plans.c.id)
        inc_stmt = insert(schema.incidents)
        incident = inc_stmt.on_conflict_do_update(
            index_elements=["id"], set_={k: inc_stmt.excluded[k] for k in ("state", "fault_class", "hardware", "node",
                                                                            "opened_at", "updated_at", "body")})
        step_stmt = insert(schema.steps)
        step = step_stmt.on_conflict_do_update(
            index_elements=["id"], set_={k: step_stmt.excluded[k] for k in ("state", "result", "updated_at",
                                                                               "outputs")})
        mark_stmt = insert(schema.producers)
        mark = mark_stmt.on_conflict_do_update(
            index_elements=["id"], set_={"seq": mark_stmt.excluded.seq, "updated_at": mark_stmt.excluded.updated_at},
            where=schema.producers.c.seq < mark_stmt.excluded.seq)
        return cls(plan=plan, incident=incident, step=step, mark=mark)
