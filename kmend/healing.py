"""The healer loop and the runbook operations: plans for incidents, approvals, breaker, spares, node requests.

Only the replica holding the Lease plans and acts; every plan and step goes through the journal.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import Any

from analyzer.records import Incident, IncidentState
from healer import gpu_report
from healer.acceptance import acceptance_plan, candidates
from healer.executor import PlanExecutor, describe
from healer.history import node_records
from healer.keys import QUARANTINED_LABEL, UNVALIDATED_TAINT_KEY
from healer.lease import Leader as Leader  # re-exported: the wiring names it from here
from healer.notify import Announcement, Notifier, announce
from healer.policy import (
    RELEASE_POLICY,
    PolicyConfig,
    choose_plan,
    operator_quarantine_plan,
    plan_id_for,
    release_plan,
)
from healer.policy_explain import explain
from healer.policy_file import PolicyFile
from healer.records import Mode, Plan, PlanState, StepKind, StepState
from healer.safety import BreakerState, Guard
from healer.spares import Spare, pool
from healer.steps.base import RepairRequest, StepContext
from kmend.background import AFTER_CORDON, Background, next_kind
from kmend.deciding import closing, journal_decision
from kmend.held import RateHeld
from kmend.interrupted import close_interrupted
from kmend.metrics import Metrics
from kmend.planning import Restored, plan_context, settle
from kmend.releasing import finish_release
from kmend.store import Store

log = logging.getLogger("kmend.healer")

ACTIVE = (IncidentState.OPEN, IncidentState.REMEDIATING)

QUARANTINE = frozenset({StepKind.EVIDENCE, StepKind.CORDON, StepKind.TAINT, StepKind.LABEL, StepKind.CONDITION,
                        StepKind.EVENT})
"""The steps that take a node out of service (and keep the evidence first)."""
AFTER_QUARANTINE = frozenset(StepKind) - QUARANTINE
"""Everything a plan does once its node is out: drain, spare swap, restore, restart, repair, notify."""
SLOW_WAITS = frozenset({StepKind.REPAIR, StepKind.VALIDATE})
"""Steps that wait minutes to hours on work outside kmend (a repair, a health check): asked less often."""


class NotAllowed(Exception):
    """The operation does not apply to the object in its current state (HTTP 409)."""


class Healing:
    """Plans, executes and exposes the runbook operations. Thread-safe (one healing round at a time)."""

    def __init__(self, store: Store, ctx: StepContext, policy: PolicyFile, config: PolicyConfig, leader: Leader,
                 metrics: Metrics, *, symptom_settle_s: float, sleep: Callable[[float], None] | None = None,
                 resume_s: float = 1.0, resume_max_s: float = 30.0, parallel: int = 8, resync_s: float = 30.0,
                 new_per_round: int = 64, restored_per_round: int = 8) -> None:
        self.store = store
        self.ctx = ctx
        self.policy = policy
        self.config = config
        self.leader = leader
        self.metrics = metrics
        self.symptom_settle_s = symptom_settle_s
        self.resume_s = resume_s
        """How soon a plan whose step waits is asked again (an answered request asks at once)."""
        self.resume_max_s = resume_max_s
        """The longest wait between two asks of a plan that makes no progress."""
        self.parallel = parallel
        """New plans that quarantine their nodes at the same time (the breaker still decides one at a time)."""
        self.new_per_round = new_per_round
        """The most new incidents a round plans for (most severe, then oldest first); the rest go to the next rounds."""
        self.backlog = 0
        """New incidents the last round left to the next ones: the loop starts the next round at once."""
        self.restored = Restored(restored_per_round, new_per_round)
        """The incidents found open at start with no plan yet: a paced slice a round (the service sets them)."""
        self.guard = Guard(store.ledger, policy.safety, ctx.cluster.list_nodes, ctx.clock,
                           quarantined=lambda: ctx.cluster.list_nodes({QUARANTINED_LABEL: "true"}))
        kwargs: dict[str, Any] = {"sleep": sleep} if sleep else {}
        self.executor = PlanExecutor(ctx, store, guard=self.guard, is_leader=leader.is_leader,
                                     on_step=self._count_step, on_plan=self._announce, **kwargs,
                                     decided=store.decided_plan, closing=closing(store))  # any replica's decisions
        self.lock = threading.RLock()
        self._first_seen: dict[str, float] = {}
        self._known_nodes: set[str] | None = None
        self._due: dict[str, tuple[float, float]] = {}
        """Per running plan: when it is asked again, and the wait that gave that time."""
        self._accepted_at = float("-inf")
        self._plan_ids: set[str] | None = None
        """Ids of the journal's plans, read once per leadership: only the leader makes incidents' plans."""
        self._runnable: dict[str, None] | None = None
        """Ids of the plans the loop resumes (running or pending), oldest first: a round reads only the due ones."""
        self.resync_s = resync_s
        """How often the runnable ids are read again from the journal (a plan another replica's API saved)."""
        self._synced_at = float("-inf")
        self.held = RateHeld(store, self.guard)
        self.detached = False
        """The service's loop runs detached rounds: an operator's run leaves its later steps to the background."""
        self.background = Background(self.executor, self._announce, stop_before=AFTER_QUARANTINE, parallel=parallel)
        """Detached rounds' work past the cordons: new plans' quarantines and every later step; each plan is asked
        again by the loop once harvested from it."""

    @property
    def notifier(self) -> Notifier:
        """Where announcements go."""
        return self.ctx.notifier

    # -- the loop -------------------------------------------------------------------------------------

    def heal_once(self, incidents: Sequence[Incident], set_state: Callable[[str, IncidentState, str], None],
                  *, interrupted: Callable[[], bool] = lambda: False, detach: bool = False) -> list[Plan]:
        """Plan for new incidents, then resume unfinished plans that are due; acts only while leading.

        New incidents come first: quarantining a failing node is the hot path, and plans already under
        way are waiting on something outside (pods terminating, a repair) that a second's delay does not
        change. Every new plan of the round quarantines its node before any of them drains one. A plan
        whose step waits is asked again after ``resume_s`` (a repair or health check: twice as long each time
        nothing changed, up to ``resume_max_s``), and at once when a request is answered. Once ``interrupted()``
        says new work has come, the round stops resuming plans so that the caller can start the next one.
        A round plans for at most ``new_per_round`` new incidents, most severe and oldest first (``in_turn``): a new
        fault goes ahead of the lesser ones still waiting, and while some wait (``backlog``) a round resumes older plans
        as if interrupted; those found open at start come last, a slice a round (``Restored``), in the loop's pace.

        ``detach`` (the service's loop): the round makes only cordons; the rest of new plans' quarantines and every
        later step of new or resumed plans go on in the background (``kmend.background``), not before the next fault.
        """
        with self.lock:
            self.detached = self.detached or detach
            self.backlog = 0  # until this round's planning says otherwise
            touched = []
            for before, done, again in self.background.harvest():
                touched.append(self._settle(self._track(done), set_state))
                if again:  # paced as if this round had resumed it
                    self._pace(before, done, self.ctx.clock())
            if not self.leader.tick():
                self.metrics.leader.set(0)
                self._plan_ids = self._runnable = None
                return []
            self.metrics.leader.set(1)
            now = self.ctx.clock()
            if self._runnable is None or now - self._synced_at >= self.resync_s:
                # Once per leadership (first closing what a kill -9 left in flight in decided plans) and every resync_s.
                if self._runnable is None:
                    close_interrupted(self.store, self.background.running())
                self._runnable = dict.fromkeys(self.store.runnable_plan_ids())
                self._synced_at = now
                self.held.resync(list(self._runnable))
            touched += self._plan_new(incidents, set_state, now, interrupted, detach)
            busy: Callable[[], bool] = (lambda: True) if self.backlog else interrupted  # new incidents wait
            fresh = {p.id for p in touched} | self.background.running()
            self._due = {k: v for k, v in self._due.items() if k in self._runnable}
            # At least one plan per round goes on, however often new work interrupts: none waits forever.
            resumed = 0
            due = self.held.due([pid for pid in self._runnable if pid not in fresh
                                 and self._due.get(pid, (0.0, 0.0))[0] <= now], now)
            plans = {p.id: p for p in self.store.get_plans(due)} if due else {}  # one read for the round
            for pid in due:
                if resumed and busy():
                    return touched
                p = plans.get(pid)
                if p is None or p.state not in (PlanState.RUNNING, PlanState.PENDING) or pid not in self._runnable:
                    self._runnable.pop(pid, None)
                    continue
                resumed += 1
                if p.state is PlanState.PENDING and p.mode is Mode.APPROVAL:
                    # Saved but not yet announced when the process died.
                    p = replace(p, state=PlanState.AWAITING_APPROVAL)
                    self.store.save_plan(p)
                    self._announce(Announcement.NEEDS_APPROVAL, p)
                    self._track(p)
                    touched.append(p)
                elif p.policy == RELEASE_POLICY:  # a release cut short (a crash): finished before anything else
                    done, _ = self._release(p)
                    self._pace(p, done, now)
                    touched.append(done)
                elif not (detach and self.background.resume(p)):  # its steps go on in the background (its task)
                    touched.append(self._resume(p, set_state, now))
            if busy() and now - self._accepted_at < self.resume_max_s:
                return touched
            self._accepted_at = now
            return touched + self._accept_nodes(now, detach)

    def _plan_new(self, incidents: Sequence[Incident], set_state: Callable[[str, IncidentState, str], None],
                  now: float, interrupted: Callable[[], bool], detach: bool = False) -> list[Plan]:
        """Plans for incidents that have none yet; automatic ones quarantine their nodes first, all of them.

        The rest of each plan follows in the same round unless new work has come meanwhile: then it is left
        to the resumes of the next rounds, after that work's quarantines.
        """
        if self._plan_ids is None:
            self._plan_ids = self.store.plan_ids()
        known = self._plan_ids
        made: list[Plan] = []
        new = self.restored.order([inc for inc in incidents if inc.state in ACTIVE and plan_id_for(inc) not in known])
        self.backlog = 0
        for at, inc in enumerate(new):
            if len(made) >= self.new_per_round or self.restored.full(inc):
                self.backlog = self.restored.cut(new[at:])
                break
            first = self._first_seen.setdefault(f"{inc.id}/{inc.root_finding.id}", now)
            if inc.root_finding.is_symptom_class and now - first < self.symptom_settle_s:
                continue  # the cause may still arrive (kernel logs can lag container logs)
            # Soft evidence may wait for many rounds: decide that before asking the cluster anything.
            if (wait := explain(inc, self.policy, now).evidence_wait) is not None:
                log.debug("incident %s: no plan yet: %s", inc.id, wait)
                continue
            ctx = plan_context(self.ctx, self.store, self.policy, inc, now)
            if (wait := explain(inc, self.policy, now, ctx.node_labels, ctx.job).evidence_wait) is not None:
                continue
            plan = choose_plan(inc, self.policy, self.config, ctx)
            known.add(plan.id)
            if plan.mode is not Mode.AUTO:
                # An automatic plan is journaled with its cordon's intent, in one transaction (_quarantine).
                self.store.save_plan(plan)
            self.metrics.plans.labels(plan.policy, plan.mode.value).inc()
            if plan.mode is Mode.APPROVAL:
                self._announce(Announcement.PLAN_CREATED, plan)
                plan = replace(plan, state=PlanState.AWAITING_APPROVAL)
                self.store.save_plan(plan)
                self._announce(Announcement.NEEDS_APPROVAL, plan)
            elif plan.mode is not Mode.AUTO:
                self._announce(Announcement.PLAN_CREATED, plan)
            made.append(plan)
            self.restored.planned(inc)
        made = [self._track(p) for p in self._quarantine(made, detach)]
        for ask in filter(None, map(gpu_report.report_request, made)):  # after every cordon of the round
            self.store.ledger.open(ask)
        if interrupted() or self.backlog:  # every new incident's node is out before any plan drains one
            return [self._settle(p, set_state) for p in made]
        # A detached round makes only cordons: the rest of each plan goes on in the background.
        return [self._resume(p, set_state, now) if p.state in (PlanState.PENDING, PlanState.RUNNING)
                and p.id not in self.background.running() and not (detach and self.background.resume(p))
                else self._settle(p, set_state) for p in made]

    def _quarantine(self, plans: list[Plan], detach: bool = False) -> list[Plan]:
        """Cordon, taint, label, condition, Event for every automatic plan, up to ``parallel`` plans at a time.

        The executor checks the brakes one plan at a time, so the plans of a leaf go out together and still
        stop at the breaker. The announcement follows: a webhook that answers slowly must not hold a cordon back.
        ``detach``: only the cordons here, the rest in the background.
        """
        auto = [i for i, p in enumerate(plans) if p.mode is Mode.AUTO]

        def head(plan: Plan) -> Plan:
            done = self.executor.execute(plan, stop_before=AFTER_CORDON if detach else AFTER_QUARANTINE,
                                         journaled=False)
            if detach and done.state is PlanState.RUNNING and next_kind(done) in QUARANTINE:
                self.background.start(done)
                return done
            done = self._track(done)
            self._announce(Announcement.PLAN_CREATED, done)
            return done

        if len(auto) > 1 and self.parallel > 1:
            with ThreadPoolExecutor(max_workers=min(self.parallel, len(auto)), thread_name_prefix="kmend-quarantine") \
                    as pool:
                heads = list(pool.map(head, [plans[i] for i in auto]))
        else:
            heads = [head(plans[i]) for i in auto]
        out = list(plans)
        for i, done in zip(auto, heads, strict=True):
            out[i] = done
        return out

    def _resume(self, plan: Plan, set_state: Callable[[str, IncidentState, str], None], now: float) -> Plan:
        done = self._run(plan, set_state)
        self._pace(plan, done, now)
        return done

    def _pace(self, plan: Plan, done: Plan, now: float) -> None:
        """When the loop asks a plan again, after it was asked (in the round or in its background task)."""
        if done.state is PlanState.RUNNING:
            # Backing off while a repair or health check takes its time keeps a hundred plans waiting on repairs
            # from filling every round; a drain, spare swap or restart is the job's downtime and is asked every
            # resume_s.
            last = self._due.get(done.id)
            waiting = next((s.kind for s in done.steps if s.state is StepState.WAITING), None)
            same = last is not None and done.steps == plan.steps and waiting in SLOW_WAITS
            wait = min(last[1] * 2, self.resume_max_s) if last is not None and same else self.resume_s
            self._due[done.id] = (now + wait, wait)
        else:
            self._due.pop(done.id, None)
        self.held.note(plan, done)

    def _accept_nodes(self, now: float, detach: bool = False) -> list[Plan]:
        """Start the health check of nodes that are new or back from repair (``detach``: in the background)."""
        busy, nodes, known = self.background.busy_nodes(), self.ctx.cluster.list_nodes(), self._known_nodes
        self._known_nodes = {n.name for n in nodes if known is None or n.name in known or n.name not in busy}
        # A node whose steps go on in the background (its own check, a plan) is looked at once they are done.
        nodes = [n for n in nodes if n.name not in busy]
        maybe = [n.name for n in nodes if n.taint(UNVALIDATED_TAINT_KEY) or (known is not None and n.name not in known)]
        # The common round has nothing to check: only those nodes' plans are read from the journal.
        due = candidates(nodes, known, [p for n in maybe for p in self.store.list_plans(node=n)], self.policy)
        out = []
        for c in due:
            plan = acceptance_plan(c, self.policy, now)
            self.store.save_plan(plan)
            out.append(self._track(plan if detach and self.background.resume(plan) else self.executor.execute(plan)))
        return out

    def node_records(self) -> dict[str, dict[str, Any]]:
        """Per node: the last health check, hardware faults and MTBI within the lemon window, the lemon verdict."""
        return node_records(self.store.list_plans(), self.policy.safety, self.ctx.clock())

    def _run_now(self, plan: Plan, set_state: Callable[[str, IncidentState, str], None]) -> Plan:
        """An operator's run (approve, execute): under the service's loop, the node is out when it returns and the
        drain and every later step go on in the background, not in the lock that every healer round takes."""
        if not self.detached:
            return self._run(plan, set_state)
        done = self._settle(self._track(self.executor.execute(plan, stop_before=AFTER_QUARANTINE)), set_state)
        self.background.resume(done)  # the loop asks it again once its task is done (or its node's is)
        return done

    def _run(self, plan: Plan, set_state: Callable[[str, IncidentState, str], None]) -> Plan:
        return self._settle(self._track(self.executor.execute(plan)), set_state)

    def _track(self, plan: Plan) -> Plan:
        """Keep the runnable ids current: the loop asks a plan again only while it is running or pending."""
        self.held.forget(plan.id)  # it ran: _resume says again whether the rate limit holds it
        if self._runnable is not None and plan.state in (PlanState.RUNNING, PlanState.PENDING):
            self._runnable.setdefault(plan.id)
        elif self._runnable is not None:
            self._runnable.pop(plan.id, None)
        return plan

    _settle = staticmethod(settle)

    def _count_step(self, plan: Plan, step: Any) -> None:
        self.metrics.actions.labels(step.kind.value, step.state.value).inc()

    def _announce(self, what: Announcement, plan: Plan) -> None:
        if what is Announcement.BREAKER_TRIPPED:
            self.metrics.breaker.set(1)
        announce(self.notifier, what, {
            "plan": plan.id, "incident": plan.incident_id, "node": plan.node, "job": plan.job,
            "namespace": plan.namespace, "fault_class": plan.fault_class, "state": plan.state.value,
            "mode": plan.mode.value, "policy": plan.policy, "reason": plan.reason, "ts": self.ctx.clock(),
            "message": f"kmend {what.value.replace('_', ' ')}: {plan.policy} for "
                       f"{plan.node or plan.job or plan.incident_id} ({plan.state.value})",
        })

    # -- runbook operations (the API calls these) ---------------------------------------------------------

    def plan(self, plan_id: str) -> Plan:
        """One plan or KeyError."""
        found = self.store.get_plan(plan_id)
        if found is None:
            raise KeyError(plan_id)
        return found

    def _idle(self, plan_id: str) -> None:
        """A plan whose step runs in the background is not run a second time beside it: the caller asks again."""
        if self.background.active(plan_id):
            raise NotAllowed(f"plan {plan_id} has a step running in the background: ask again once it is done")

    def approve(self, plan_id: str, by: str, set_state: Callable[[str, IncidentState, str], None]) -> Plan:
        """Run a plan that waits for approval."""
        with self.lock:
            self._idle(plan_id)
            plan = self.plan(plan_id)
            if plan.state is not PlanState.AWAITING_APPROVAL:
                raise NotAllowed(f"plan {plan_id} is {plan.state.value}, not awaiting approval")
            plan = replace(plan, mode=Mode.AUTO, state=PlanState.RUNNING, reason=f"{plan.reason} | approved by {by}")
            self.store.save_plan(plan)
            return self._run_now(plan, set_state)

    def reject(self, plan_id: str, by: str) -> Plan:
        """Refuse a plan that waits for approval (or is blocked), or stop a running one: what it did stays done and
        journaled, its step in flight ends (a drain: the eviction in flight), no other step runs, its unfinished steps
        end and their requests are withdrawn (``kmend.deciding``). Answers at once, also while a task runs the plan: the
        decision is journaled between two of its journal writes, and the task sees it before its next step."""
        def decide(in_flight: bool) -> Plan:
            plan = self.plan(plan_id)
            if plan.state not in (PlanState.AWAITING_APPROVAL, PlanState.BLOCKED, PlanState.PENDING,
                                  PlanState.RUNNING):
                raise NotAllowed(f"plan {plan_id} is {plan.state.value}: only waiting or running plans can be "
                                 "rejected")
            plan = replace(plan, state=PlanState.REJECTED, reason=f"{plan.reason} | rejected by {by}")
            return journal_decision(self.store, plan, in_flight=in_flight,  # its waiting steps end, requests withdrawn
                                    leads=self.executor.is_leader())

        with self.lock:
            rejected = self.background.decide(plan_id, decide, closing(self.store))
            assert rejected is not None
            return self._track(rejected)

    def execute(self, plan_id: str, by: str, set_state: Callable[[str, IncidentState, str], None], *,
                dry_run: bool) -> tuple[Plan, list[dict[str, str]]]:
        """Preview (dry run) or run a plan now: an approval, a blocked plan after a breaker reset, a dry-run plan."""
        with self.lock:
            plan = self.plan(plan_id)
            preview = [{"step": s.id, "kind": s.kind.value, "state": s.state.value, "would": describe(s)}
                       for s in plan.steps if s.state not in (StepState.SUCCEEDED,)]
            if dry_run:
                return plan, preview
            self._idle(plan_id)
            if plan.state in (PlanState.SUCCEEDED, PlanState.REJECTED, PlanState.CANCELLED, PlanState.RUNNING):
                raise NotAllowed(f"plan {plan_id} is {plan.state.value}")
            if plan.state is PlanState.BLOCKED and self.store.ledger.breaker().tripped \
                    and any(s.kind is StepKind.CORDON and s.state is not StepState.SUCCEEDED for s in plan.steps):
                raise NotAllowed("the circuit breaker is tripped: reset it first (POST /v1/breaker/reset)")
            steps = tuple(replace(s, state=StepState.PENDING, result="") if s.state in (
                StepState.SKIPPED, StepState.FAILED) else s for s in plan.steps)
            plan = replace(plan, mode=Mode.AUTO, state=PlanState.RUNNING, steps=steps,
                           reason=f"{plan.reason.split(' | ')[0]} | executed by {by}")
            self.store.save_plan(plan)
            return self._run_now(plan, set_state), preview

    def quarantine(self, node: str, by: str, reason: str) -> Plan:
        """An operator's quarantine, journaled like any plan."""
        with self.lock:
            self.background.quiet(node)  # a drain or a restore of a plan for the node goes on beside it
            self.ctx.cluster.get_node(node)  # NotFoundError → 404
            plan = operator_quarantine_plan(node, by, reason, self.ctx.clock())
            return self._track(self.executor.execute(plan, journaled=False))

    def release(self, node: str, by: str) -> list[str]:
        """An operator puts the node back in service: kmend's plans for it are cancelled, its marks removed.

        The release is journaled as a plan before anything is written (``release_plan``: one step per write), so a
        crash part way leaves its intent, and the loop finishes it on restart with each write made once.

        A plan whose step runs in the background is cancelled through its task's hold: the task ends after its step in
        flight (a drain: the eviction in flight), which the release does not wait for unless it writes to the node."""
        with self.lock:
            self.ctx.cluster.get_node(node)
            plan = replace(release_plan(node, by, self.ctx.clock()), state=PlanState.RUNNING)
            self.store.save_plan(plan)  # the intent, before the first write
            self._track(plan)
            _, cancelled = self._release(plan)
            return cancelled

    def _release(self, plan: Plan) -> tuple[Plan, list[str]]:
        """Go on with a journaled release (``kmend.releasing``): the release and the plans it cancelled."""
        return finish_release(plan, self.store, self.executor, self.background, self.policy, self.ctx.clock,
                              self._track)

    def breaker(self) -> BreakerState:
        """The breaker (and its gauge)."""
        state = self.store.ledger.breaker()
        self.metrics.breaker.set(1 if state.tripped else 0)
        return state

    def reset_breaker(self, by: str) -> BreakerState:
        """Close the breaker; blocked plans wait for an operator to execute them."""
        state = self.store.ledger.reset_breaker(self.ctx.clock(), by)
        self.metrics.breaker.set(0)
        return state

    def spares(self) -> list[Spare]:
        """The spare pool (and its gauges)."""
        found = pool(self.ctx.cluster.list_nodes(), self.policy.topology_keys)
        for state in ("available", "in-use", "unhealthy"):
            self.metrics.spares.labels(state).set(sum(1 for s in found if s.state == state))
        return found

    def requests(self, node: str, *, pending_only: bool = True,
                 capabilities: frozenset[str] | None = None) -> list[RepairRequest]:
        """Repair requests for a node (the agent polls these, saying what it can carry out)."""
        if capabilities is not None:
            self.ctx.agents.seen(node, capabilities, self.ctx.clock())
        return self.store.ledger.requests_for(node, pending_only=pending_only)

    def answer(self, node: str, request_id: str, state: str, result: str) -> RepairRequest:
        """The agent or the platform reports a request done or failed."""
        req = self.store.ledger.get(request_id)
        if req is None or req.node != node:
            raise KeyError(request_id)
        if req.kind == gpu_report.GPU_REPORT and req.state == "pending":
            keep = partial(gpu_report.keep, self.store, request_id, state, result)
            with self.lock:  # rounds and runbook operations save whole plans under it: none overwrites this
                if (stop := self.background.stop_of(gpu_report.plan_of(request_id))) is None:
                    keep()
                else:  # the plan's task saves it too: between two of its writes, which then carry the answer
                    stop.amend(keep)
        answered = self.store.ledger.answer(request_id, state, result)
        assert answered is not None
        self._due.clear()  # the plan waiting on it goes on in the next round
        return answered

