"""Quarantines that go on in the background after their cordons, so that the next fault's round does not wait.

On a real API server each write takes milliseconds: a fault that arrives while the previous plan still writes its
taint, label, condition and Event used to wait for all of them (p50 ~40 ms where a lone fault is cordoned in
14-21 ms). The healer loop now makes each new plan's cordon in its round and hands the rest of the quarantine to
this pool: one task per plan, so a node's steps still follow each other; the executor still journals each step
before it acts and asks the brakes one step at a time. A plan is resumed by the loop only once its task is done, in
the loop's next round (not at once: the drain it resumes must not sit in front of the next fault's cordon).

Every step after the quarantine goes on here too (``resume``): a drain's evictions (a PodDisruptionBudget or a slow
server can hold each for long), the spare swap, a checkpoint's discovery and restore, the restart, a repair or health
check asked again, and a node's acceptance check, whether the plan was made in this round or resumed: each runs as one
task, to the plan's next wait, while the loop's rounds keep cordoning new faults. One task per node at a time keeps a
node's steps in order; the executor journals each step before it acts, as in a round, so a kill -9 mid-step resumes
the plan from the journal and nothing is done twice.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from healer.executor import PlanExecutor
from healer.notify import Announcement
from healer.records import DONE_STEP_STATES, Mode, Plan, PlanState, StepKind

log = logging.getLogger("kmend.healer")

AFTER_CORDON = frozenset(StepKind) - {StepKind.EVIDENCE, StepKind.CORDON}
"""Where a detached round stops a new plan: its taint, label, condition and Event go on in the background."""


def next_kind(plan: Plan) -> StepKind | None:
    """The kind of the plan's first unfinished step."""
    return next((s.kind for s in plan.steps if s.state not in DONE_STEP_STATES), None)


class Background:
    """The rest of new plans' quarantines and every later step, one task per plan, up to ``parallel`` at a time."""

    def __init__(self, executor: PlanExecutor, announce: Callable[[Announcement, Plan], None], *,
                 stop_before: frozenset[StepKind], parallel: int) -> None:
        self.executor = executor
        self.announce = announce
        self.stop_before = stop_before
        """Where each task stops (the steps after the quarantine are the loop's)."""
        self.parallel = parallel
        self._tasks: dict[str, tuple[str, Plan, bool, Future[Plan]]] = {}
        """Per plan: its node, the plan as the task got it, whether the loop resumed it (not a new quarantine), its
        task."""
        self._pool: ThreadPoolExecutor | None = None
        self.on_done: Callable[[], None] = lambda: None
        """Called when a task ends (the service wakes its loop, which settles the plan's incident and node)."""

    def _submit(self, plan: Plan, resumed: bool) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.parallel, thread_name_prefix="kmend-quarantine")
        task = self._pool.submit(self._resume if resumed else self._run, plan)
        self._tasks[plan.id] = (plan.node or "", plan, resumed, task)
        task.add_done_callback(lambda _: self.on_done())

    def start(self, plan: Plan) -> None:
        """Run the plan on up to ``stop_before`` in the background."""
        self._submit(plan, resumed=False)

    def resume(self, plan: Plan) -> bool:
        """Take a plan the loop would run in its round: it runs here to its next wait, failure or end. False (the loop
        runs it) for a plan that is not running or pending, or a dry run (it only writes the journal); one whose node
        has a task still running waits for a later round."""
        if plan.state not in (PlanState.RUNNING, PlanState.PENDING) or plan.mode is Mode.DRY_RUN \
                or next_kind(plan) is None:
            return False
        if plan.id not in self._tasks and (plan.node or "") not in self.busy_nodes():
            self._submit(plan, resumed=True)
        return True

    def running(self) -> set[str]:
        """Ids of the plans with a task not yet harvested (no round resumes them)."""
        return set(self._tasks)

    def busy_nodes(self) -> set[str]:
        """Nodes with a task not yet harvested: a second task for one of them waits (a node's steps stay in order)."""
        return {node for node, *_ in self._tasks.values() if node}

    def harvest(self) -> list[tuple[Plan, Plan, bool]]:
        """The plans whose task has finished: each as the task got it, as the task left it, and whether the loop had
        resumed it (a failed task's plan is resumed from the journal)."""
        out = []
        for pid, (_, before, resumed, task) in list(self._tasks.items()):
            if not task.done():
                continue
            del self._tasks[pid]
            try:
                out.append((before, task.result(), resumed))
            except Exception:
                log.exception("plan %s failed in the background", pid)
        return out

    def wait(self, *, plan_id: str | None = None, node: str | None = None, timeout: float = 60.0) -> None:
        """Wait for the tasks of this plan or node: a runbook operation on them must come after their writes."""
        for pid, (on, _, _, task) in list(self._tasks.items()):
            if pid == plan_id or (node is not None and on == node):
                with contextlib.suppress(Exception):
                    task.result(timeout=timeout)

    def _run(self, plan: Plan) -> Plan:
        done = self.executor.execute(plan, stop_before=self.stop_before)
        self.announce(Announcement.PLAN_CREATED, done)
        return done

    def _resume(self, plan: Plan) -> Plan:
        return self.executor.execute(plan)
