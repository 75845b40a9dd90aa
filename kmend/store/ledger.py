"""The healer's durable state beside the plan journal: breaker, brakes' counts, repair requests, audit, leases.

The brakes count from the step journal itself (``plan_steps``), so a step that ran before a crash is
counted after it, and several replicas sharing a PostgreSQL database see the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from sqlalchemy import Connection, Engine, and_, func, select

from healer.lease import LeaseRecord
from healer.records import DISRUPTIVE_STEPS, PlanState, StepKind, StepState
from healer.safety import BreakerState
from healer.steps.base import RepairRequest
from kmend.store import schema

ACCEPTANCE_ID = "plan-accept-"
"""Id prefix of acceptance plans (healer.acceptance)."""
BREAKER = "quarantine"
"""Name of the one breaker row."""
WITHDRAWN = "withdrawn"
"""A request's state once the plan that opened it was rejected or cancelled before an answer came."""
LATE_ANSWER = "; answered after it was withdrawn: "
"""Joins a withdrawn request's reason and the answer that came later."""


class Ledger:
    """SafetyLedger, RepairRequests and History on the store's database."""

    def __init__(self, engine: Engine, insert: Callable[[Any], Any], clock: Callable[[], float],
                 begin: Callable[[], AbstractContextManager[Connection]] | None = None) -> None:
        self.engine = engine
        self._begin = begin or engine.begin
        self._insert = insert
        self.clock = clock

    # -- breaker ------------------------------------------------------------------------

    def breaker(self) -> BreakerState:
        with self.engine.connect() as conn:
            r = conn.execute(select(schema.breaker).where(schema.breaker.c.name == BREAKER)).mappings().first()
        if r is None:
            return BreakerState(False)
        return BreakerState(bool(r["tripped"]), r["tripped_at"], r["reason"], r["reset_at"], r["reset_by"])

    def trip_breaker(self, at: float, reason: str) -> BreakerState:
        with self._begin() as conn:
            current = conn.execute(select(schema.breaker.c.tripped).where(schema.breaker.c.name == BREAKER)).first()
            if current is None:
                conn.execute(schema.breaker.insert().values(name=BREAKER, tripped=True, tripped_at=at, reason=reason,
                                                            reset_at=None, reset_by=""))
            elif not current[0]:
                conn.execute(schema.breaker.update().where(schema.breaker.c.name == BREAKER)
                             .values(tripped=True, tripped_at=at, reason=reason))
        return self.breaker()

    def reset_breaker(self, at: float, by: str) -> BreakerState:
        with self._begin() as conn:
            done = conn.execute(schema.breaker.update().where(schema.breaker.c.name == BREAKER)
                                .values(tripped=False, reset_at=at, reset_by=by))
            if done.rowcount == 0:
                conn.execute(schema.breaker.insert().values(name=BREAKER, tripped=False, tripped_at=None, reason="",
                                                            reset_at=at, reset_by=by))
        return self.breaker()

    # -- counts from the journal -----------------------------------------------------------

    def quarantined_nodes_since(self, since: float, *, exclude_plan: str) -> set[str]:
        s = schema.steps
        q = (select(s.c.node).distinct()
             .where(s.c.kind == StepKind.CORDON.value, s.c.updated_at >= since, s.c.plan_id != exclude_plan,
                    # A cordon cut short by a kill -9 (interrupted) may have reached the server: it counts.
                    s.c.state.in_([StepState.RUNNING.value, StepState.SUCCEEDED.value, StepState.INTERRUPTED.value])))
        with self.engine.connect() as conn:
            return {r[0] for r in conn.execute(q) if r[0]}

    def plans_started_since(self, since: float, *, exclude_plan: str) -> int:
        p, s = schema.plans, schema.steps
        # Health checks of new nodes do not use up the incidents' budget (a fleet grows by racks), nor do plans
        # that only told people (notify, Events, conditions): the budget is for taking capacity or work away.
        disrupted = (select(s.c.plan_id).where(s.c.plan_id == p.c.id,
                                              s.c.kind.in_([k.value for k in DISRUPTIVE_STEPS]),
                                              s.c.state.not_in([StepState.PENDING.value, StepState.SKIPPED.value]))
                     .exists())
        q = select(func.count()).select_from(p).where(p.c.started_at >= since, p.c.id != exclude_plan,
                                                      p.c.node.is_not(None), ~p.c.id.startswith(ACCEPTANCE_ID),
                                                      disrupted)
        with self.engine.connect() as conn:
            return int(conn.execute(q).scalar_one())

    def decided_in_flight(self, states: Sequence[PlanState]) -> list[str]:
        """Ids of the plans in ``states`` (decided by an operator) with a step journaled running, oldest first: a
        kill -9 landed while that step ran, after the decision was journaled."""
        p, s = schema.plans, schema.steps
        q = (select(p.c.id, p.c.created_at).distinct().select_from(s.join(p, s.c.plan_id == p.c.id))
             .where(s.c.state == StepState.RUNNING.value, p.c.state.in_([x.value for x in states]))
             .order_by(p.c.created_at, p.c.id))
        with self.engine.connect() as conn:
            return [r[0] for r in conn.execute(q)]

    def restarts_of(self, job: str, *, exclude_plan: str) -> list[float]:
        s, p = schema.steps, schema.plans
        q = (select(s.c.updated_at).select_from(s.join(p, s.c.plan_id == p.c.id))
             .where(and_(s.c.kind == StepKind.RESTART_JOB.value, s.c.state == StepState.SUCCEEDED.value,
                         p.c.job == job, p.c.id != exclude_plan))
             .order_by(s.c.updated_at))
        with self.engine.connect() as conn:
            return [float(r[0]) for r in conn.execute(q)]

    # -- repair requests ------------------------------------------------------------------------

    def open(self, request: RepairRequest) -> RepairRequest:
        now = self.clock()
        row = {"id": request.id, "node": request.node, "kind": request.kind, "params": dict(request.params),
               "state": request.state, "result": request.result, "created_at": now, "updated_at": now}
        with self._begin() as conn:
            conn.execute(self._insert(schema.node_requests).values(row).on_conflict_do_nothing(index_elements=["id"]))
        found = self.get(request.id)
        assert found is not None
        return found

    def open_all(self, requests: Sequence[RepairRequest]) -> None:
        """Open many requests in one transaction (one turn of the write queue); those already there stay as they are."""
        if not requests:
            return
        now = self.clock()
        rows = [{"id": r.id, "node": r.node, "kind": r.kind, "params": dict(r.params), "state": r.state,
                 "result": r.result, "created_at": now, "updated_at": now} for r in requests]
        with self._begin() as conn:
            conn.execute(self._insert(schema.node_requests).on_conflict_do_nothing(index_elements=["id"]), rows)

    def get(self, request_id: str) -> RepairRequest | None:
        with self.engine.connect() as conn:
            r = conn.execute(select(schema.node_requests).where(schema.node_requests.c.id == request_id)) \
                .mappings().first()
        return _request(r) if r is not None else None

    def requests_for(self, node: str, *, pending_only: bool = True) -> list[RepairRequest]:
        """Requests about a node (what its agent polls)."""
        q = select(schema.node_requests).where(schema.node_requests.c.node == node) \
            .order_by(schema.node_requests.c.created_at)
        if pending_only:
            q = q.where(schema.node_requests.c.state == "pending")
        with self.engine.connect() as conn:
            return [_request(r) for r in conn.execute(q).mappings()]

    def answer(self, request_id: str, state: str, result: str) -> RepairRequest | None:
        """Record the agent's or the platform's answer; an answered request keeps its first answer. A request
        withdrawn before its answer came stays withdrawn and keeps that first answer in its result (evidence)."""
        r = schema.node_requests
        with self._begin() as conn:
            done = conn.execute(r.update().where(r.c.id == request_id, r.c.state == "pending")
                                .values(state=state, result=result[:2000], updated_at=self.clock()))
            if done.rowcount == 0:
                row = conn.execute(select(r.c.result).where(r.c.id == request_id, r.c.state == WITHDRAWN)).first()
                if row is not None and LATE_ANSWER not in row[0]:
                    conn.execute(r.update().where(r.c.id == request_id, r.c.state == WITHDRAWN).values(
                        result=f"{row[0]}{LATE_ANSWER}{state}: {result}"[:2000], updated_at=self.clock()))
        return self.get(request_id)

    def withdraw(self, request_ids: Sequence[str], why: str) -> int:
        """Withdraw the pending ones of these requests (their plan was decided): the agent's poll no longer lists them.
        How many were withdrawn."""
        if not request_ids:
            return 0
        r = schema.node_requests
        with self._begin() as conn:
            done = conn.execute(r.update().where(r.c.id.in_(list(request_ids)), r.c.state == "pending")
                                .values(state=WITHDRAWN, result=why[:2000], updated_at=self.clock()))
        return int(done.rowcount or 0)

    # -- audit ------------------------------------------------------------------------------------

    def audit(self, actor: str, method: str, path: str, status: int, detail: dict[str, Any]) -> None:
        """Record one runbook API call."""
        with self._begin() as conn:
            conn.execute(schema.audit_log.insert().values(ts=self.clock(), actor=actor[:128], method=method,
                                                          path=path[:512], status=status, detail=detail))

    def audit_entries(self, limit: int = 200) -> list[dict[str, Any]]:
        """Latest audit entries, newest first."""
        a = schema.audit_log
        q = select(a.c.ts, a.c.actor, a.c.method, a.c.path, a.c.status, a.c.detail).order_by(a.c.id.desc()).limit(limit)
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(q).mappings()]

    # -- leases as seen -------------------------------------------------------------------------------

    def lease_seen(self, lease: LeaseRecord | None, name: str) -> None:
        """Record who holds the lease, as this replica last saw it."""
        row = {"name": name, "holder": lease.holder if lease else "", "transitions": lease.transitions if lease else 0,
               "resource_version": lease.resource_version if lease else "", "observed_at": self.clock()}
        stmt = self._insert(schema.leases_seen).values(row)
        with self._begin() as conn:
            conn.execute(stmt.on_conflict_do_update(index_elements=["name"],
                                                    set_={k: stmt.excluded[k] for k in row if k != "name"}))


def _request(r: Any) -> RepairRequest:
    return RepairRequest(r["id"], r["node"], r["kind"], dict(r["params"]), r["state"], r["result"])
