"""An operator's release, journaled before it acts and finished after a crash.

A release used to write the node directly (labels and annotations off, the unvalidated taint on, the fault taint off,
its condition, the uncordon, an Event): a crash between two writes left some of kmend's marks on the node and nothing
finished them. It is now a plan (``healer.policy.release_plan``, one step per write) saved before the first write;
the executor journals each write's intent and result, and the healer loop resumes a release it finds unfinished, so
each write is made once and the node ends fully released.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial

from healer.acceptance import Candidate, acceptance_plan, is_acceptance
from healer.executor import PlanExecutor
from healer.policy_file import PolicyFile
from healer.records import FINAL_PLAN_STATES, Plan, PlanState
from kmend.background import Background
from kmend.deciding import closing, journal_decision
from kmend.store import Store


def finish_release(plan: Plan, store: Store, executor: PlanExecutor, background: Background, policy: PolicyFile,
                   clock: Callable[[], float], track: Callable[[Plan], Plan]) -> tuple[Plan, list[str]]:
    """Go on with a journaled release: the node's other unfinished plans cancelled, then its writes, each journaled;
    once all are made, the node's health check is journaled (the healer loop runs it, and resumes it after a crash).
    The release as it ended and the ids of the plans it cancelled. Called under the healing lock."""
    node, by = plan.node or "", plan.steps[0].params.get("by", "")

    def cancel(plan_id: str, in_flight: bool) -> Plan | None:
        p = store.get_plan(plan_id)  # read again: the task may have finished it meanwhile
        if p is None or p.state in FINAL_PLAN_STATES:
            return None
        p = replace(p, state=PlanState.CANCELLED, reason=f"{p.reason} | node released by {by}")
        # its waiting steps end, its requests withdrawn
        return journal_decision(store, p, in_flight=in_flight, leads=executor.is_leader())

    cancelled = []
    for p in store.list_plans(node=node):
        # A plan whose step runs in the background is cancelled through its task's hold: the task ends after its step
        # in flight (a drain: the eviction in flight).
        if p.id != plan.id and p.state not in FINAL_PLAN_STATES \
                and background.decide(p.id, partial(cancel, p.id), closing(store)):
            track(replace(p, state=PlanState.CANCELLED))
            cancelled.append(p.id)
    background.quiet(node)  # a quarantine write still on its way comes before the marks come off
    done = track(executor.execute(plan))
    if done.state is PlanState.SUCCEEDED and not any(
            is_acceptance(p) and p.state not in FINAL_PLAN_STATES for p in store.list_plans(node=node)):
        check = acceptance_plan(Candidate(node, "repaired"), policy, clock())
        store.save_plan(check)  # the healer loop runs it (and resumes it after a crash)
        track(check)
    return done, cancelled
