"""Plan execution: every step journaled before it runs and after, so a crash resumes.

Steps are idempotent through the Cluster port, so a step found RUNNING in the
journal after a crash is simply run again: it cannot apply twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from healer.cluster import Cluster, ClusterEvent, Condition, PermanentError, Taint, TemporaryError
from healer.notify import Notifier
from healer.records import ActionStep, Mode, Plan, PlanState, StepKind, StepState

log = logging.getLogger("kmend.healer")


class Journal(Protocol):
    """Durable record of plans and steps.

    Guarantees: ``save_step`` is durable when it returns (the service's store
    commits); ``save_plan`` stores the plan with all its steps' current states.
    """

    def save_plan(self, plan: Plan) -> None:
        """Insert or update a plan and its steps."""
        ...

    def save_step(self, plan_id: str, step: ActionStep) -> None:
        """Update one step's state and result."""
        ...


StepObserver = Callable[[Plan, ActionStep], None]


class PlanExecutor:
    """Runs plans step by step through the Cluster port."""

    def __init__(
        self,
        cluster: Cluster,
        journal: Journal,
        notifier: Notifier,
        *,
        max_attempts: int = 5,
        sleep: Callable[[float], None] = time.sleep,
        on_step: StepObserver | None = None,
    ) -> None:
        self.cluster = cluster
        self.journal = journal
        self.notifier = notifier
        self.max_attempts = max_attempts
        self.sleep = sleep
        self.on_step = on_step

    def execute(self, plan: Plan) -> Plan:
        """Run every unfinished step in order; stops at the first failed step."""
        if plan.mode is Mode.DRY_RUN:
            skipped = tuple(replace(s, state=StepState.SKIPPED, result="dry-run") for s in plan.steps)
            done = replace(plan, steps=skipped, state=PlanState.DRY_RUN)
            self.journal.save_plan(done)
            return done
        plan = replace(plan, state=PlanState.RUNNING)
        self.journal.save_plan(plan)
        steps: list[ActionStep] = list(plan.steps)
        for i, step in enumerate(steps):
            if step.state in (StepState.SUCCEEDED, StepState.SKIPPED):
                continue
            running = replace(step, state=StepState.RUNNING)
            self.journal.save_step(plan.id, running)
            finished = self._run(running)
            steps[i] = finished
            self.journal.save_step(plan.id, finished)
            plan = replace(plan, steps=tuple(steps))
            if self.on_step:
                self.on_step(plan, finished)
            if finished.state is StepState.FAILED:
                plan = replace(plan, state=PlanState.FAILED)
                self.journal.save_plan(plan)
                return plan
        plan = replace(plan, state=PlanState.SUCCEEDED)
        self.journal.save_plan(plan)
        return plan

    def _run(self, step: ActionStep) -> ActionStep:
        delay = 0.2
        for attempt in range(1, self.max_attempts + 1):
            try:
                result = self._apply(step)
                return replace(step, state=StepState.SUCCEEDED, result=result)
            except TemporaryError as exc:
                if attempt == self.max_attempts:
                    return replace(step, state=StepState.FAILED, result=f"gave up after {attempt} tries: {exc}")
                log.info("step %s: temporary error (%s), retrying", step.id, exc)
                self.sleep(max(delay, min(exc.delay, 10.0)))
                delay = min(delay * 2, 10.0)
            except PermanentError as exc:
                return replace(step, state=StepState.FAILED, result=str(exc))
            except Exception as exc:  # a notifier or adapter bug must fail the step, not the service
                log.exception("step %s failed", step.id)
                return replace(step, state=StepState.FAILED, result=f"{type(exc).__name__}: {exc}")
        raise AssertionError("unreachable")

    def _apply(self, step: ActionStep) -> str:
        p = step.params
        node = step.node
        if step.kind is StepKind.NOTIFY:
            self.notifier.notify({"step": step.id, "node": node, **p})
            return f"notified {p.get('to', '')}".strip()
        if node is None:
            raise PermanentError(f"step {step.kind.value} needs a node")
        if step.kind is StepKind.CORDON:
            self.cluster.cordon(node)
            return f"cordoned {node}"
        if step.kind is StepKind.TAINT:
            self.cluster.add_taint(node, Taint(p["key"], p["value"], p["effect"]))
            return f"tainted {node} {p['key']}={p['value']}:{p['effect']}"
        if step.kind is StepKind.CONDITION:
            self.cluster.set_condition(node, Condition(p["type"], p["status"], p["reason"], p["message"]))
            return f"condition {p['type']}={p['status']} on {node}"
        if step.kind is StepKind.EVENT:
            self.cluster.emit_event(ClusterEvent(node, p["reason"], p["message"], p.get("type", "Warning")))
            return f"event {p['reason']} on {node}"
        raise PermanentError(f"unknown step kind {step.kind}")
