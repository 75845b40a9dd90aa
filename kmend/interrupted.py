"""Steps a kill -9 left ``running`` in plans an operator had decided, closed by the next leader before its first round.

A reject or a release journals the operator's decision while the plan's step is still in flight (``healer.stopping``)
and answers; the plan's task journals that step's result once the step ends. A kill -9 in between left the step
``running`` in a rejected or cancelled plan: never run again (the plan is decided), but never ended either, so the
plan showed a step running for ever. The leader closes each such step once, as ``interrupted``, its result naming the
restart and the decision; nothing is run again.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import replace

from healer.records import ActionStep, Plan, PlanState, StepState
from kmend.store import Store

log = logging.getLogger("kmend.healer")

DECIDED = (PlanState.REJECTED, PlanState.CANCELLED)
"""Plans an operator ended while a step of theirs could be in flight (a reject, a release of the node)."""


def interrupted(step: ActionStep, plan: Plan, *, leads: bool = True) -> ActionStep:
    """The step as it is closed: what it did is unknown (its request may or may not have been applied). ``leads``:
    the replica closing it leads, so no task runs the step any more (a kill -9 left it); else the leader may still run
    it, and journals its result when it ends."""
    why = plan.reason.rsplit(" | ", 1)[-1]
    if not leads:
        return replace(step, state=StepState.INTERRUPTED,
                       result=f"interrupted: the plan was {plan.state.value} ({why}) through a replica that does not "
                              "lead while this step ran on the leader, which journals its result when it ends; no "
                              "later step runs")
    return replace(step, state=StepState.INTERRUPTED,
                   result=f"interrupted: kmend restarted while this step ran, after the plan was {plan.state.value} "
                          f"({why}); not run again")


def close_interrupted(store: Store, busy: Collection[str]) -> list[Plan]:
    """Close the running steps of decided plans, except those of ``busy`` plans (a task of this process still runs
    them and journals their results); each closing journaled once. The plans as they were closed."""
    ids = [pid for pid in store.ledger.decided_in_flight(DECIDED) if pid not in busy]
    closed = []
    for plan in store.get_plans(ids) if ids else []:
        steps = tuple(interrupted(s, plan) if s.state is StepState.RUNNING else s for s in plan.steps)
        for before, after in zip(plan.steps, steps, strict=True):
            if after is not before:
                store.save_step(plan.id, after)
                log.warning("plan %s (%s): step %s (%s) was in flight at a restart: closed as interrupted", plan.id,
                            plan.state.value, after.id, after.kind.value)
        closed.append(replace(plan, steps=steps))
    return closed
