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

An operator's call never waits for a task: a reject or a release journals its decision through the task's ``Stop``
(``healer.stopping``) and answers; the task ends after the step (or the eviction) it has in flight. A call that writes
to the node itself (a release, a quarantine) waits only while a task writes to that node (a single request).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

from healer.executor import PlanExecutor
from healer.notify import Announcement
from healer.records import DONE_STEP_STATES, Mode, Plan, PlanState, StepKind
from healer.stopping import Closing, Stop

log = logging.getLogger("kmend.healer")

AFTER_CORDON = frozenset(StepKind) - {StepKind.EVIDENCE, StepKind.CORDON}
"""Where a detached round stops a new plan: its taint, label, condition and Event go on in the background."""


NODE_WRITES = frozenset({StepKind.CORDON, StepKind.TAINT, StepKind.LABEL, StepKind.CONDITION, StepKind.EVENT,
                         StepKind.RETURN, StepKind.ACCEPT})
"""Steps that write the node's own marks: an operator's release or quarantine of the node comes after the one in
flight, not beside it (a release's removed label must not be added back by a label write still on its way)."""
NODE_WRITE_WAIT_S = 30.0
"""The longest an operator's call waits for a task's write to the node (one request; its retries when refused)."""


@dataclass(frozen=True, slots=True)
class _Task:
    """One plan's task."""

    node: str
    """The plan's node ('' for none)."""
    plan: Plan
    """The plan as the task got it."""
    resumed: bool
    """Whether the loop resumed it (not a new quarantine)."""
    stop: Stop
    """The operator's hold on it."""
    future: Future[Plan]
    """Its result."""


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
        self._tasks: dict[str, _Task] = {}
        """Per plan: its task, not yet harvested."""
        self._pool: ThreadPoolExecutor | None = None
        self.on_done: Callable[[], None] = lambda: None
        """Called when a task ends (the service wakes its loop, which settles the plan's incident and node)."""

    def _submit(self, plan: Plan, resumed: bool) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.parallel, thread_name_prefix="kmend-quarantine")
        stop = Stop()
        task = self._pool.submit(self._resume if resumed else self._run, plan, stop)
        self._tasks[plan.id] = _Task(plan.node or "", plan, resumed, stop, task)
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
        return {t.node for t in self._tasks.values() if t.node}

    def harvest(self) -> list[tuple[Plan, Plan, bool]]:
        """The plans whose task has finished: each as the task got it, as the task left it, and whether the loop had
        resumed it (a failed task's plan is resumed from the journal)."""
        out = []
        for pid, t in list(self._tasks.items()):
            if not t.future.done():
                continue
            del self._tasks[pid]
            try:
                out.append((t.plan, t.future.result(), t.resumed))
            except Exception:
                log.exception("plan %s failed in the background", pid)
        return out

    def stop_of(self, plan_id: str) -> Stop | None:
        """The hold on the plan's task, while it runs (an operator's decision about the plan goes through it)."""
        task = self._tasks.get(plan_id)
        return task.stop if task is not None and not task.future.done() else None

    def decide(self, plan_id: str, decision: Callable[[bool], Plan | None],
               closing: Closing | None = None) -> Plan | None:
        """An operator's decision about a plan (read it, check its state, journal the change; told whether a task runs
        the plan): between two journal writes of its task, which then ends after its step in flight (that step ended
        by ``closing``), or at once when no task runs it."""
        stop = self.stop_of(plan_id)
        return stop.decide(partial(decision, True), closing) if stop is not None else decision(False)

    def active(self, plan_id: str) -> bool:
        """Whether a task of the plan still runs."""
        return self.stop_of(plan_id) is not None

    def quiet(self, node: str, timeout: float = NODE_WRITE_WAIT_S) -> None:
        """Wait while a task writes to the node's marks (``NODE_WRITES``): an operator's write to the node comes after
        it. A task evicting, restoring a checkpoint or waiting on a health check is not waited for."""
        for t in list(self._tasks.values()):
            if t.node == node and not t.future.done() and not t.stop.wait_out(NODE_WRITES, timeout):
                log.warning("a step of plan %s still writes to node %s after %.0f s", t.plan.id, node, timeout)

    def _run(self, plan: Plan, stop: Stop) -> Plan:
        done = self.executor.execute(plan, stop_before=self.stop_before, stop=stop)
        if stop.decided is None:
            self.announce(Announcement.PLAN_CREATED, done)
        return done

    def _resume(self, plan: Plan, stop: Stop) -> Plan:
        return self.executor.execute(plan, stop=stop)
