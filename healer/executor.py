"""Plan execution: every step journaled before it runs and after, so a crash resumes and nothing runs twice.

A step found RUNNING or WAITING in the journal after a crash is run again: steps are idempotent through
the ports (and keyed by their step id where the API is not), so it cannot apply twice. (In a plan an operator had
rejected or cancelled, a step found RUNNING is closed as interrupted instead: ``kmend.interrupted``.) Before each step
the executor checks that this replica still leads and the safety brakes; before the first step of each
call, that nobody uncordoned the node by hand.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Protocol

from healer.cluster import NotFoundError, PermanentError, TemporaryError
from healer.deciding import ended
from healer.keys import QUARANTINE_PLAN
from healer.notify import Announcement
from healer.records import (
    DONE_STEP_STATES,
    FINAL_PLAN_STATES,
    LOCAL_STEPS,
    ActionStep,
    Mode,
    Plan,
    PlanState,
    StepKind,
    StepState,
)
from healer.safety import Guard, VerdictKind
from healer.steps import checkpoint, drain, evidence, node, repair, restart, spare
from healer.steps.base import StepContext, StepRunner
from healer.stopping import Closing, Stop, running, stop_asked

log = logging.getLogger("kmend.healer")

RUNNERS: dict[StepKind, StepRunner] = {
    **node.RUNNERS,
    StepKind.EVIDENCE: evidence.capture,
    StepKind.DRAIN: drain.drain,
    StepKind.SPARE_SWAP: spare.spare_swap,
    StepKind.CHECKPOINT: checkpoint.checkpoint,
    StepKind.RESTART_JOB: restart.restart_job,
    StepKind.REPAIR: repair.repair,
    StepKind.VALIDATE: repair.validate,
}
"""Every step kind's runner."""


class Journal(Protocol):
    """Durable record of plans and steps.

    Guarantees: ``save_step`` is durable when it returns (the service's store commits); ``save_plan``
    stores the plan with all its steps' current states.
    """

    def save_plan(self, plan: Plan) -> None:
        """Insert or update a plan and its steps."""
        ...

    def save_step(self, plan_id: str, step: ActionStep) -> None:
        """Update one step's state, result and outputs."""
        ...


class _Stopped(Exception):
    """An operator's decision came before the run's next journal write: the run ends there."""

    def __init__(self, plan: Plan) -> None:
        super().__init__(plan.id)
        self.plan = plan


StepObserver = Callable[[Plan, ActionStep], None]
PlanObserver = Callable[[Announcement, Plan], None]


class PlanExecutor:
    """Runs plans step by step through the ports."""

    def __init__(
        self,
        ctx: StepContext,
        journal: Journal,
        *,
        guard: Guard | None = None,
        is_leader: Callable[[], bool] = lambda: True,
        max_attempts: int = 5,
        give_up_s: float = 600.0,
        sleep: Callable[[float], None] = time.sleep,
        on_step: StepObserver | None = None,
        on_plan: PlanObserver | None = None,
        decided: Callable[[str], Plan | None] | None = None,
        closing: Closing = ended,
    ) -> None:
        self.ctx = ctx
        self.decided = decided
        """The plan as the journal holds it once an operator rejected or cancelled it, else None: read before each
        step's journal write, so a decision taken by another replica's API stops this run as one taken here does."""
        self.closing = closing
        """How the step in flight ends in a plan decided in the journal (its open requests withdrawn too)."""
        self.journal = journal
        self.guard = guard
        self.is_leader = is_leader
        self.max_attempts = max_attempts
        self.give_up_s = give_up_s
        self.sleep = sleep
        self.on_step = on_step
        self.on_plan = on_plan
        self._admission = threading.Lock()

    def execute(self, plan: Plan, *, stop_before: Collection[StepKind] = (), journaled: bool = True,
                stop: Stop | None = None) -> Plan:
        """Run every unfinished step in order; stops at a waiting, failed or blocked step.

        Safe to call for different plans from several threads: the brakes are checked, and an allowed step
        journaled as running, one plan at a time.

        With ``stop_before``, it also stops (the plan still running) at the first unfinished step of one
        of those kinds: the healer quarantines every node of a batch before draining any of them.

        A plan that is not in the journal yet (``journaled=False``), the plan's start and the steps that change
        nothing outside the journal (``LOCAL_STEPS``) are written in one transaction with the intent of the first
        step that acts: a new plan's cordon follows one commit, not five. A crash before that commit leaves no
        trace to resume and nothing done; the incident is planned again.

        With ``stop``, an operator may decide about the plan while it runs (``Stop.decide``): the step in flight ends
        and its result is journaled, no other step starts, and the plan is returned as the decision left it.
        """
        stop = stop or Stop()
        with running(stop):
            try:
                done = self._execute(plan, stop_before, journaled, stop)
            except _Stopped as exc:
                done = exc.plan
            with stop.lock:  # with what was written into its steps from outside meanwhile (an agent's report)
                done = stop.merged_plan(done)
            # Decided while the last step ran (a drain stopped between evictions): the plan is as the decision left it.
            if stop.decided is None:
                return done
            return replace(stop.decided, steps=tuple(ended(s, stop.decided) for s in done.steps))

    def _execute(self, plan: Plan, stop_before: Collection[StepKind], journaled: bool, stop: Stop) -> Plan:
        if plan.state in FINAL_PLAN_STATES:
            if not journaled:
                self.journal.save_plan(plan)
            return plan
        if plan.mode is Mode.DRY_RUN:
            skipped = tuple(replace(s, state=StepState.SKIPPED, result="dry-run: would " + describe(s))
                            for s in plan.steps)
            done = replace(plan, steps=skipped, state=PlanState.DRY_RUN)
            self.journal.save_plan(done)
            return done
        unsaved = not journaled
        """The plan row or a step's state is not in the journal yet."""
        if plan.state is not PlanState.RUNNING:
            plan = replace(plan, state=PlanState.RUNNING, reason=plan.reason.split(" | blocked:")[0])
            unsaved = True
        seen = plan
        """The plan as the journal (and so the brakes of other plans) last saw it."""
        steps = list(plan.steps)
        asked = False

        def write(step: ActionStep | None = None) -> None:
            """Journal what ran in memory and, with ``step``, that step's intent: one transaction."""
            nonlocal unsaved, seen
            current = replace(plan, steps=tuple(steps))
            if step is not None:
                current = replace(current, steps=tuple(step if s.id == step.id else s for s in current.steps))
            with stop.lock:  # an operator's decision, journaled in between, is never overwritten
                if self._heard(plan.id, stop, ask=not unsaved or journaled):
                    raise _Stopped(current)
                if unsaved:
                    self.journal.save_plan(stop.merged_plan(current))
                elif step is not None:
                    self.journal.save_step(plan.id, stop.merged(step))
                if step is not None and step.state is StepState.RUNNING:
                    stop.in_flight(step.kind)
            unsaved = False
            seen = current

        for i, step in enumerate(steps):
            if step.state in DONE_STEP_STATES:
                continue
            if stop.decided is not None:
                raise _Stopped(replace(plan, steps=tuple(steps)))
            if step.kind in stop_before or not self.is_leader():
                write()
                return plan
            if step.kind in LOCAL_STEPS:
                finished = self._run(replace(step, state=StepState.RUNNING), plan)
                steps[i] = finished
                plan = replace(plan, steps=tuple(steps))
                unsaved = True
                if self.on_step:
                    self.on_step(plan, finished)
                if finished.state is StepState.SUCCEEDED:
                    continue
                if finished.state is StepState.FAILED:
                    return self._finish(plan, PlanState.FAILED, Announcement.PLAN_FAILED,
                                        f"step {finished.kind.value} failed: {finished.result}", stop)
                write()
                return plan
            # Asked once per call, before its first step: the steps of one call follow each other within
            # milliseconds, and a node read before each would double the API calls of a quarantine.
            if not asked and (why := self._taken_back(plan, step)) is not None:
                return self._finish(plan, PlanState.CANCELLED, Announcement.PLAN_FAILED, why, stop)
            asked = True
            admitted = False
            if self.guard is not None:
                with self._admission:
                    # The brakes judge the plan as the journal holds it: steps run in memory do not make it started.
                    verdict = self.guard.check(seen, step)
                    if verdict.kind is VerdictKind.ALLOW:
                        # Journaled as running before the next plan's check: plans run in parallel each count
                        # the others' cordons, so together they never pass the breaker.
                        write(replace(step, state=StepState.RUNNING))
                        admitted = True
                if verdict.kind is VerdictKind.BLOCK:
                    blocked = replace(plan, state=PlanState.BLOCKED,
                                      reason=f"{plan.reason} | blocked: {verdict.reason}")
                    with stop.lock:
                        if self._heard(plan.id, stop):
                            raise _Stopped(plan)
                        self.journal.save_plan(stop.merged_plan(blocked))
                    if self.on_plan:
                        if verdict.tripped:
                            self.on_plan(Announcement.BREAKER_TRIPPED, blocked)
                        self.on_plan(Announcement.PLAN_BLOCKED, blocked)
                    return blocked
                if verdict.kind is VerdictKind.WAIT:
                    if step.result != verdict.reason:
                        # Held by a brake, the step keeps its state: a pending one has not run, so the plan has
                        # not started (the hourly limit judges it again next time, and it counts toward no one's).
                        step = replace(step, result=verdict.reason)
                        steps[i] = step
                        unsaved = True
                    write()
                    return replace(plan, steps=tuple(steps))
            finished = step
            for attempt in range(50):  # a waiting step that made progress runs again at once
                before = finished
                if not (admitted and attempt == 0):
                    write(replace(finished, state=StepState.RUNNING))
                finished = self._run(replace(finished, state=StepState.RUNNING), plan)
                with stop.lock:  # what the step did is journaled, decided or not (then ended: it is not run again)
                    self._heard(plan.id, stop)
                    finished = stop.closed(finished)
                    self.journal.save_step(plan.id, stop.merged(finished))
                    stop.in_flight(None)
                steps[i] = finished
                plan = replace(plan, steps=tuple(steps))
                seen = plan
                if finished.state is not StepState.WAITING or finished.outputs == before.outputs:
                    break
                if not self.is_leader():
                    return plan
            if self.on_step:
                self.on_step(plan, finished)
            if finished.state is StepState.FAILED:
                return self._finish(plan, PlanState.FAILED, Announcement.PLAN_FAILED,
                                    f"step {finished.kind.value} failed: {finished.result}", stop)
            if finished.state is StepState.WAITING:
                return plan
        return self._finish(plan, PlanState.SUCCEEDED, Announcement.PLAN_DONE, "", stop)

    def _finish(self, plan: Plan, state: PlanState, what: Announcement, why: str, stop: Stop) -> Plan:
        plan = replace(plan, state=state, reason=f"{plan.reason} | {why}" if why else plan.reason)
        if state is not PlanState.SUCCEEDED:
            # A plan that ended early never runs again: its unfinished steps end with it, none is left pending, and a
            # waiting repair's request is withdrawn (the agent resets no GPU of a cancelled plan). A cancelled plan's
            # other open requests go too (the evidence's GPU report); a failed one keeps them for the investigation.
            close = {StepState.PENDING, StepState.WAITING, *(DONE_STEP_STATES if state is PlanState.CANCELLED else ())}
            plan = replace(plan, steps=tuple(self.closing(s, plan) if s.state in close else s for s in plan.steps))
        with stop.lock:
            if self._heard(plan.id, stop):
                raise _Stopped(plan)
            self.journal.save_plan(stop.merged_plan(plan))
        if self.on_plan:
            self.on_plan(what, plan)
        return plan

    def _heard(self, plan_id: str, stop: Stop, *, ask: bool = True) -> bool:
        """Whether an operator decided the plan: through ``stop`` (this process's API), or in the journal (``ask``: the
        plan is in it), where another replica's API journaled it. Called under ``stop.lock``."""
        if stop.decided is None and ask and self.decided is not None and (found := self.decided(plan_id)) is not None:
            stop.heard(found, self.closing)
        return stop.decided is not None

    def _taken_back(self, plan: Plan, step: ActionStep) -> str | None:
        """A person uncordoned the node kmend quarantined: the plan for that node stops there."""
        cordoned = any(s.kind is StepKind.CORDON and s.state is StepState.SUCCEEDED for s in plan.steps)
        if not cordoned or step.kind is StepKind.RETURN or not plan.node:
            return None
        try:
            info = self.ctx.cluster.get_node(plan.node)
        except NotFoundError:
            return f"node {plan.node} no longer exists"
        except TemporaryError:
            return None
        if not info.unschedulable and info.annotations.get(QUARANTINE_PLAN, plan.id) == plan.id:
            return f"node {plan.node} was uncordoned by hand: plan cancelled"
        return None

    def _run(self, step: ActionStep, plan: Plan) -> ActionStep:
        runner = RUNNERS.get(step.kind)
        if runner is None:
            return replace(step, state=StepState.FAILED, result=f"unknown step kind {step.kind}")
        delay = 0.2
        now = self.ctx.clock()
        for attempt in range(1, self.max_attempts + 1):
            try:
                out = runner(step, plan, self.ctx)
                outputs = {k: v for k, v in {**step.outputs, **out.outputs}.items() if k != "temporary_since"}
                return replace(step, state=out.state, result=out.result, outputs=outputs)
            except TemporaryError as exc:
                if attempt == self.max_attempts:
                    since = float(step.outputs.get("temporary_since", now))
                    if now - since > self.give_up_s:
                        return replace(step, state=StepState.FAILED,
                                       result=f"gave up after {now - since:.0f} s of temporary errors: {exc}")
                    return replace(step, state=StepState.WAITING, result=f"temporary error, retried later: {exc}",
                                   outputs={**step.outputs, "temporary_since": str(since)})
                if stop_asked():  # the operator's decision is not held up by a server's retries
                    return replace(step, state=StepState.WAITING, result=f"stopped by an operator: {exc}")
                log.info("step %s: temporary error (%s), retrying", step.id, exc)
                self.sleep(max(delay, min(exc.delay, 10.0)))
                delay = min(delay * 2, 10.0)
            except PermanentError as exc:
                return replace(step, state=StepState.FAILED, result=str(exc))
            except Exception as exc:  # a notifier or adapter bug must fail the step, not the service
                log.exception("step %s failed", step.id)
                return replace(step, state=StepState.FAILED, result=f"{type(exc).__name__}: {exc}")
        raise AssertionError("unreachable")


def describe(step: ActionStep) -> str:
    """What a step would do, in words (dry runs and previews)."""
    p = step.params
    node = step.node or "-"
    match step.kind:
        case StepKind.EVIDENCE:
            return f"keep the evidence of incident {p.get('incident')} with the plan"
        case StepKind.CORDON:
            return f"cordon {node}"
        case StepKind.TAINT:
            return f"taint {node} {p.get('key')}={p.get('value')}:{p.get('effect')}"
        case StepKind.LABEL:
            return f"label {node} kmend.io/quarantined=true (by {p.get('by')}, at {p.get('at')})"
        case StepKind.CONDITION:
            return f"set condition {p.get('type')}={p.get('status')} on {node}"
        case StepKind.EVENT:
            return f"record Event {p.get('reason')} on {node}"
        case StepKind.NOTIFY:
            return f"notify {p.get('to')}"
        case StepKind.DRAIN:
            return f"evict pods of {p.get('job') or 'every job'} from {node} (grace {p.get('grace_s')} s)"
        case StepKind.SPARE_SWAP:
            return f"hand the closest spare to {p.get('namespace')}/{p.get('job')} in place of {node}"
        case StepKind.CHECKPOINT:
            return f"publish the latest complete checkpoint of {p.get('job')} as its resume point"
        case StepKind.RESTART_JOB:
            return f"restart {p.get('namespace')}/{p.get('job')} as a gang through its owner"
        case StepKind.REPAIR:
            return f"request {p.get('kind')} of {node}"
        case StepKind.VALIDATE:
            return f"run the health-check Job on {node}"
        case StepKind.RETURN:
            return f"return {node} to the spare pool"
        case StepKind.ACCEPT:
            return f"remove kmend.io/unvalidated from {node}: it takes work"
        case StepKind.RELEASE:
            return f"release {node} ({p.get('write')}), as {p.get('by')} asked"
    return step.kind.value
