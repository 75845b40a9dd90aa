"""An operator's decision about a plan (reject, or cancel by a release of its node), journaled with its consequences.

The plan's unfinished steps end (``healer.deciding.ended``), a step still running without a task of this process to
end it (a kill -9 left it) is closed as interrupted, and the requests its steps opened for the node agent are
withdrawn: the agent's poll no longer lists them, so no GPU is reset for a plan the operator rejected. The step a
task of this process has in flight ends when the task journals it (``closing``), its requests withdrawn then.
"""

from __future__ import annotations

from dataclasses import replace

from healer.deciding import decision, ended, request_ids
from healer.records import ActionStep, Plan, StepState
from healer.stopping import Closing
from kmend.interrupted import interrupted
from kmend.store import Store


def _withdraw(store: Store, plan: Plan, steps: list[ActionStep]) -> None:
    store.ledger.withdraw(request_ids(steps), f"withdrawn: the plan was {plan.state.value} ({decision(plan)})")


def journal_decision(store: Store, plan: Plan, *, in_flight: bool, leads: bool = True) -> Plan:
    """Save ``plan`` (in its decided state) with every unfinished step ended and withdraw its steps' open requests.
    ``in_flight``: a task of this process runs the plan, and ends its running step itself; ``leads``: this replica
    leads (else the leader may be running the step)."""
    def end(step: ActionStep) -> ActionStep:
        if step.state is StepState.RUNNING:
            return step if in_flight else interrupted(step, plan, leads=leads)
        return ended(step, plan)

    plan = replace(plan, steps=tuple(map(end, plan.steps)))
    store.save_plan(plan)
    _withdraw(store, plan, [s for s in plan.steps if s.state is not StepState.RUNNING])
    return plan


def closing(store: Store) -> Closing:
    """How a task ends its step in flight in a plan decided meanwhile: ended, and the step's open requests withdrawn
    (it may have opened one while the decision was journaled)."""
    def close(step: ActionStep, plan: Plan) -> ActionStep:
        _withdraw(store, plan, [step])
        return ended(step, plan)
    return close
