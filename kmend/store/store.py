"""The store: signals (deduplicated by id), findings, incidents, plans and the step journal."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from importlib import resources
from typing import Any

from sqlalchemy import Connection, Engine, Table, create_engine, event, func, or_, select, text
from sqlalchemy.dialects import postgresql, sqlite

from analyzer.metric_eval import SeriesState
from analyzer.records import Finding, Incident
from collector.signal import Signal
from collector.wire import to_wire
from healer.records import FINAL_PLAN_STATES, ActionStep, Plan, PlanState, StepState, has_acted
from kmend.serialize import (
    finding_from_dict,
    finding_to_dict,
    incident_from_dict,
    incident_to_dict,
    plan_from_dict,
    plan_to_dict,
)
from kmend.store import schema
from kmend.store.group import IngestOutcome as IngestOutcome
from kmend.store.group import WriteSet
from kmend.store.ledger import Ledger
from kmend.store.retention import Pace, Retention, prune
from kmend.store.rows import body_json, kept
from kmend.store.rows import json_text as _json_text
from kmend.store.series import series_row, series_state
from kmend.store.upserts import DECIDED, Upserts
from kmend.store.writing import Writes

RELEASE_ID = "plan-rel-"
"""Id prefix of an operator's release plans (``healer.policy.release_plan``): the loop resumes them first."""
MIGRATION_LOCK = 0x6B6D656E64
"""PostgreSQL advisory lock key held while the schema is migrated ("kmend")."""

Analyze = Callable[[Sequence[Signal]], tuple[list[Finding], list[Incident], list[tuple[str, str]]]]
"""Signals → (new findings, changed incidents, merges as (merged incident id, surviving id))."""


_LINE_COLUMNS = ("id", "node", "source", "ts", "body")
_kept = kept  # the replica feed's name for it


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=5000")
    cur.close()


class Store:
    """SQLAlchemy Core store; SQLite file by default, PostgreSQL by URL."""

    def __init__(self, url: str, *, clock: Callable[[], float] = time.time, lines: str = "all") -> None:
        self.url = url
        self.clock = clock
        self.lines = lines
        """Lines of numbered batches kept as rows: ``all``, or ``evidence`` (only those a finding names)."""
        self.engine: Engine = create_engine(url, future=True, pool_pre_ping=True, json_serializer=_json_text,
                                            **self._engine_args(url))
        if self.engine.dialect.name == "sqlite":
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self.writes = Writes(self.engine)
        """Opens the write transactions (on SQLite, this process's writers queue here, not in the busy handler)."""
        self._lines_sql: tuple[str, tuple[str, ...]] | None = None
        self._seq_lock = threading.Lock()
        self._seq = 0
        self._upserts = Upserts.build(self._insert)
        self.ledger = Ledger(self.engine, self._insert, clock, begin=self.writes.begin)
        """Breaker, brakes' counts, repair requests, audit log, leases seen."""

    @staticmethod
    def _engine_args(url: str) -> dict[str, Any]:
        if url.startswith("sqlite"):
            return {"connect_args": {"check_same_thread": False}}
        return {"pool_size": 5, "max_overflow": 5}

    # -- schema -------------------------------------------------------------------

    def migrate(self) -> None:
        """Bring the schema to the latest Alembic revision (Alembic is loaded only when there is one to apply)."""
        if self.revision() == schema.head_revision():
            # The common start: one query, and none of Alembic's import and script loading (a third of a second).
            with self.engine.connect() as conn:
                self._seq = conn.execute(select(func.coalesce(func.max(schema.findings.c.seq), 0))).scalar_one()
            return
        from alembic import command
        from alembic.config import Config

        cfg = Config()
        cfg.set_main_option("script_location", str(resources.files("kmend") / "migrations"))
        cfg.set_main_option("sqlalchemy.url", self.url.replace("%", "%%"))
        with self.writes.begin() as conn:
            if self.engine.dialect.name == "postgresql":
                # Replicas starting together: one migrates, the others wait here and find the schema at head.
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
        with self.engine.connect() as conn:
            self._seq = conn.execute(select(func.coalesce(func.max(schema.findings.c.seq), 0))).scalar_one()

    def reload_seq(self) -> None:
        """Continue finding numbers after the newest stored one (a replica taking over from another writer)."""
        with self._seq_lock, self.engine.connect() as conn:
            self._seq = conn.execute(select(func.coalesce(func.max(schema.findings.c.seq), 0))).scalar_one()

    def revision(self) -> str | None:
        """Current Alembic revision (None on an empty database, or one with several heads)."""
        with self.engine.connect() as conn:
            try:
                found = conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
            except Exception:
                return None
            return found[0] if len(found) == 1 else None

    def ping(self) -> bool:
        """Whether the database answers."""
        try:
            with self.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            return True
        except Exception:
            return False

    def close(self) -> None:
        """Release connections."""
        self.engine.dispose()

    # -- ingest ---------------------------------------------------------------------

    def ingest(self, signals: Sequence[Signal], analyze: Analyze,
               series: Callable[[], Sequence[SeriesState]] | None = None,
               origin: tuple[str, int] | None = None) -> IngestOutcome:
        """Store new log lines, analyze the batch and store the results — all in one transaction.

        Lines and the findings they produced commit together, so a crash can neither lose
        a line's analysis nor analyze a line twice. ``series`` gives the metric series states
        the analysis changed (the last value of each watched series); they commit with it.

        A numbered batch (`origin`: producer, seq) is a replay when its number is at or below the
        producer's last one: recognised by one lookup.
        """
        unique: dict[str, Signal] = {}
        for s in signals:
            unique.setdefault(s.id, s)
        if origin is not None:
            return self._ingest_numbered(list(unique.values()), len(signals), analyze, series, origin)
        # Log lines and alerts are rows: they are the evidence behind findings (an alert is rare and is
        # resent by Alertmanager), and their ids make a redelivery harmless. Metric and progress samples are
        # not: the analyzer keeps the latest values and the windows its detectors need in memory, and the
        # agents' next samples rebuild them after a restart.
        with self.writes.begin() as conn:
            new_ids = self._insert_new(conn, [s for s in unique.values() if _kept(s)])
            fresh = [s for s in unique.values() if s.id in new_ids or not _kept(s)]
            found, changed, merges = analyze(fresh) if fresh else ([], [], [])
            self._write_results(conn, found, changed, merges)
            if fresh and series is not None:
                self._upsert_series(conn, series())
        return IngestOutcome(len(fresh), len(signals) - len(fresh), tuple(found), tuple(changed), tuple(fresh))

    def _ingest_numbered(self, fresh: list[Signal], sent: int, analyze: Analyze,
                         series: Callable[[], Sequence[SeriesState]] | None, origin: tuple[str, int]
                         ) -> IngestOutcome:
        producer, seq = origin
        prod = schema.producers
        with self.writes.begin() as conn:
            last = conn.execute(select(prod.c.seq).where(prod.c.id == producer)).scalar()
            if last is not None and seq <= last:
                return IngestOutcome(0, sent, (), ())
            found, changed, merges = analyze(fresh) if fresh else ([], [], [])
            evidence = {e for f in found for e in f.evidence} if self.lines == "evidence" else None
            lines = [s for s in fresh if _kept(s) and (evidence is None or s.id in evidence)]
            self._write(conn, [WriteSet(lines, origin, found, changed, merges, series() if fresh and series else ())])
        return IngestOutcome(len(fresh), sent - len(fresh), tuple(found), tuple(changed), tuple(fresh))

    def write(self, sets: Sequence[WriteSet]) -> None:
        """Write a group of analysed batches in one transaction, in the order they were analysed (group commit).

        Each batch's lines, its producer's mark and its results commit together, so a batch is stored whole
        or not at all; one commit serves the whole group.
        """
        with self.writes.begin() as conn:
            self._write(conn, sets)

    def _write(self, conn: Connection, sets: Sequence[WriteSet]) -> None:
        self._insert_lines(conn, [s for ws in sets for s in ws.lines])
        marks: dict[str, int] = {}
        for ws in sets:
            if ws.origin is not None:
                marks[ws.origin[0]] = max(ws.origin[1], marks.get(ws.origin[0], 0))
        if marks:
            now = self.clock()
            conn.execute(self._upserts.mark, [{"id": p, "seq": n, "updated_at": now} for p, n in marks.items()])
        for ws in sets:
            if ws.found or ws.changed or ws.merges:
                self._write_results(conn, ws.found, ws.changed, ws.merges)
        series = {st.key: st for ws in sets for st in ws.series}  # one row per series: its newest state
        if series:
            self._upsert_series(conn, list(series.values()))

    def producer_seq(self, producer: str) -> int | None:
        """The last batch number taken from a producer (None: none yet)."""
        prod = schema.producers
        with self.engine.connect() as conn:
            last = conn.execute(select(prod.c.seq).where(prod.c.id == producer)).scalar()
        return None if last is None else int(last)

    def record(self, analyze: Callable[[], tuple[list[Finding], list[Incident], list[tuple[str, str]]]],
               then: Callable[[Connection], None] | None = None) -> IngestOutcome:
        """Run a detector evaluation and store its findings and incidents in one transaction.

        Like ``ingest`` without signals: detector findings carry stable ids, so a
        finding emitted again after a restart is ignored, never stored twice. ``then`` writes
        more in the same transaction (the replica feed's cursor).
        """
        with self.writes.begin() as conn:
            found, changed, merges = analyze()
            if found or changed or merges:
                self._write_results(conn, found, changed, merges)
            if then is not None:
                then(conn)
        return IngestOutcome(0, 0, tuple(found), tuple(changed))

    def _insert(self, table: Table) -> Any:
        return (postgresql if self.engine.dialect.name == "postgresql" else sqlite).insert(table)

    def _insert_new(self, conn: Connection, sigs: list[Signal]) -> set[str]:
        if not sigs:
            return set()
        rows = [{"id": s.id, "node": s.node, "source": s.source.value, "ts": s.ts,
                 "body": to_wire(s) if s.sent_ts is None else to_wire(s) | {"sent_ts": s.sent_ts}}
                for s in sigs]
        new: set[str] = set()
        for i in range(0, len(rows), 2000):
            stmt = self._insert(schema.signals).on_conflict_do_nothing(index_elements=["id"])
            res = conn.execute(stmt.returning(schema.signals.c.id), rows[i:i + 2000])
            new.update(r[0] for r in res)
        return new

    def _insert_lines(self, conn: Connection, sigs: list[Signal]) -> None:
        """Insert signal rows whose ids need not come back (a numbered batch's lines; a repeated id is skipped).

        Through the driver's executemany with the body already encoded: SQLAlchemy's per-row parameter
        processing cost more than the database's own work for a batch of a thousand lines.
        """
        if not sigs:
            return
        if self._lines_sql is None:
            compiled = self._insert(schema.signals).on_conflict_do_nothing(index_elements=["id"]).compile(
                dialect=self.engine.dialect, column_keys=list(_LINE_COLUMNS))
            self._lines_sql = (str(compiled), tuple(compiled.positiontup or ()))
        sql, positions = self._lines_sql
        params: list[Any]
        if positions == _LINE_COLUMNS:  # positional (SQLite): the tuples straight away
            params = [(s.id, s.node, s.source.value, s.ts, body_json(s)) for s in sigs]
        else:
            rows = [{"id": s.id, "node": s.node, "source": s.source.value, "ts": s.ts, "body": body_json(s)}
                    for s in sigs]
            params = [tuple(r[k] for k in positions) for r in rows] if positions else rows
        conn.exec_driver_sql(sql, params)

    def _upsert_series(self, conn: Connection, states: Sequence[SeriesState]) -> None:
        if not states:
            return
        rows = [series_row(st) for st in states]
        stmt = self._insert(schema.metric_series)
        stmt = stmt.on_conflict_do_update(index_elements=["id"], set_={"ts": stmt.excluded.ts,
                                                                       "body": stmt.excluded.body})
        for i in range(0, len(rows), 2000):
            conn.execute(stmt, rows[i:i + 2000])

    def metric_series(self) -> list[SeriesState]:
        """The stored last sample of every watched metric series."""
        with self.engine.connect() as conn:
            return [series_state(b) for (b,) in conn.execute(select(schema.metric_series.c.body))]

    def _write_results(self, conn: Connection, found: Sequence[Finding], changed: Iterable[Incident],
                       merges: Iterable[tuple[str, str]]) -> None:
        new_ids = {f.id for f in found}
        inc_by_finding: dict[str, str] = {}
        latest: dict[str, Incident] = {}
        for inc in changed:
            latest[inc.id] = inc  # one row per incident, its last version: one statement for all of them
            for f in inc.findings:
                if f.id in new_ids:
                    inc_by_finding[f.id] = inc.id
        if latest:
            conn.execute(self._upserts.incident, [self._incident_row(i) for i in latest.values()])
        rows = []
        with self._seq_lock:
            for f in found:
                self._seq += 1
                rows.append({"id": f.id, "seq": self._seq, "incident_id": inc_by_finding[f.id], "ts": f.ts,
                             "fault_class": f.fault_class.value, "node": f.where.node,
                             "body": finding_to_dict(f)})
        if rows:
            stmt = self._insert(schema.findings).on_conflict_do_nothing(index_elements=["id"])
            conn.execute(stmt, rows)
        # A cause that adopted several symptom incidents: their findings move to the survivor.
        for old, new in merges:
            conn.execute(schema.findings.update().where(schema.findings.c.incident_id == old)
                         .values(incident_id=new))

    @staticmethod
    def _incident_row(inc: Incident) -> dict[str, Any]:
        return {"id": inc.id, "state": inc.state.value, "fault_class": inc.fault_class.value,
                "hardware": inc.hardware, "node": inc.root_cause.node, "opened_at": inc.opened_at,
                "updated_at": inc.updated_at, "body": incident_to_dict(inc, findings=False)}

    def _upsert_incident(self, conn: Connection, inc: Incident) -> None:
        conn.execute(self._upserts.incident, [self._incident_row(inc)])

    def save_incident(self, inc: Incident) -> None:
        """Insert or update one incident (state changes from the healer)."""
        with self.writes.begin() as conn:
            self._upsert_incident(conn, inc)

    # -- reads ------------------------------------------------------------------------

    def findings_in_order(self, since_ts: float | None = None) -> list[Finding]:
        """Findings in the order they were first stored (to rebuild the correlator)."""
        q = select(schema.findings.c.body).order_by(schema.findings.c.seq)
        if since_ts is not None:
            q = q.where(schema.findings.c.ts >= since_ts)
        with self.engine.connect() as conn:
            return [finding_from_dict(r[0]) for r in conn.execute(q)]

    def live_incidents(self, keep_s: float) -> list[Incident]:
        """Incidents still open or being healed, or updated within `keep_s` of the newest, with their findings.

        Findings come in the order they were stored; incidents merged into another have none of their own.
        """
        inc, fnd = schema.incidents, schema.findings
        with self.engine.connect() as conn:
            newest = conn.execute(select(func.max(inc.c.updated_at))).scalar_one()
            if newest is None:
                return []
            live = select(inc.c.id, inc.c.body).where(or_(inc.c.state.in_(("open", "remediating")),
                                                          inc.c.updated_at >= newest - keep_s))
            bodies = {r[0]: dict(r[1]) for r in conn.execute(live)}
            members: dict[str, list[dict[str, Any]]] = {i: [] for i in bodies}
            q = (select(fnd.c.incident_id, fnd.c.body).where(fnd.c.incident_id.in_(live.with_only_columns(inc.c.id)))
                 .order_by(fnd.c.seq))
            for iid, body in conn.execute(q):
                members[iid].append(body)
        return [incident_from_dict(bodies[i] | {"findings": fs}) for i, fs in members.items() if fs]

    def incident_states(self) -> dict[str, str]:
        """State of every stored incident."""
        with self.engine.connect() as conn:
            return {r[0]: r[1] for r in conn.execute(select(schema.incidents.c.id, schema.incidents.c.state))}

    def list_incidents(self, *, state: str | None = None, node: str | None = None,
                       limit: int = 500) -> list[dict[str, Any]]:
        """Incident summaries, newest first."""
        q = select(schema.incidents.c.body).order_by(schema.incidents.c.updated_at.desc()).limit(limit)
        if state:
            q = q.where(schema.incidents.c.state == state)
        if node:
            q = q.where(schema.incidents.c.node == node)
        with self.engine.connect() as conn:
            return [dict(r[0]) for r in conn.execute(q)]

    def get_incident(self, incident_id: str) -> dict[str, Any] | None:
        """One incident with its findings."""
        with self.engine.connect() as conn:
            row = conn.execute(select(schema.incidents.c.body).where(schema.incidents.c.id == incident_id)).first()
            if row is None:
                return None
            body = dict(row[0])
            fs = conn.execute(select(schema.findings.c.body).where(schema.findings.c.incident_id == incident_id)
                              .order_by(schema.findings.c.seq))
            body["findings"] = [r[0] for r in fs]
            body["plans"] = [plan_to_dict(p) for p in self._plans(conn, incident_id)]
            return body

    def count_signals(self) -> int:
        """Number of distinct signals stored."""
        with self.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(schema.signals)).scalar_one())

    # -- plans: the healer's journal ----------------------------------------------------

    def save_plan(self, plan: Plan) -> None:
        """Insert or update a plan and all its steps in one transaction (Journal); started once it acted."""
        now = self.clock()
        started = now if has_acted(plan.steps) else None
        with self.writes.begin() as conn:
            row = {"id": plan.id, "incident_id": plan.incident_id, "state": plan.state.value,
                   "mode": plan.mode.value, "created_at": now, "updated_at": now, "body": plan_to_dict(plan),
                   "node": plan.node, "job": plan.job, "started_at": started}
            if conn.execute(self._upserts.plan, row).first() is None:
                return  # decided meanwhile (journal_decision): its steps stay as the decision left them
            self._upsert_steps(conn, plan.id, list(enumerate(plan.steps)), now)

    def decided_plan(self, plan_id: str) -> Plan | None:
        """The plan once an operator rejected or cancelled it (through any replica's API), else None: a task of the
        leader reads it before each journal write."""
        p = schema.plans
        with self.engine.connect() as conn:
            state = conn.execute(select(p.c.state).where(p.c.id == plan_id)).scalar()
        if state not in DECIDED:
            return None
        return self.get_plan(plan_id)

    def save_step(self, plan_id: str, step: ActionStep) -> None:
        """Durably record one step's state (Journal)."""
        now = self.clock()
        with self.writes.begin() as conn:
            idx = int(step.id.rsplit("-", 1)[1])
            self._upsert_steps(conn, plan_id, [(idx, step)], now)
            if step.state is StepState.RUNNING:
                conn.execute(schema.plans.update().where(schema.plans.c.id == plan_id)
                             .where(schema.plans.c.started_at.is_(None)).values(started_at=now))

    def _upsert_steps(self, conn: Connection, plan_id: str, steps: list[tuple[int, ActionStep]], now: float) -> None:
        if steps:  # one statement for a plan's dozen steps (the driver's executemany), not one each
            conn.execute(self._upserts.step, [{"id": s.id, "plan_id": plan_id, "idx": idx, "kind": s.kind.value,
                                              "node": s.node, "state": s.state.value, "result": s.result,
                                              "params": dict(s.params), "updated_at": now, "outputs": dict(s.outputs)}
                                             for idx, s in steps])

    def _plans(self, conn: Connection, incident_id: str | None = None, plan_id: str | None = None,
               state: str | None = None, node: str | None = None, plan_ids: Sequence[str] | None = None) -> list[Plan]:
        p = schema.plans
        where = [col == v for col, v in ((p.c.incident_id, incident_id), (p.c.id, plan_id), (p.c.state, state),
                                         (p.c.node, node)) if v]
        if plan_ids is not None:
            where.append(p.c.id.in_(plan_ids))
        plans = [plan_from_dict(r[0]) for r in conn.execute(select(p.c.body).where(*where)
                                                            .order_by(p.c.created_at, p.c.id))]
        # The step table is the journal: it is newer than the plan body. One query for all the plans' steps.
        st = schema.steps
        rows = conn.execute(select(st.c.id, st.c.state, st.c.result, st.c.outputs)
                            .where(st.c.plan_id.in_(select(p.c.id).where(*where)))).all() if plans else []
        by_id = {r[0]: (r[1], r[2], r[3]) for r in rows}
        return [replace(x, steps=tuple(
            replace(s, state=StepState(by_id[s.id][0]), result=by_id[s.id][1],
                    outputs=dict(by_id[s.id][2] or {})) if s.id in by_id else s for s in x.steps)) for x in plans]

    def get_plan(self, plan_id: str) -> Plan | None:
        """One plan with its journaled step states."""
        with self.engine.connect() as conn:
            found = self._plans(conn, plan_id=plan_id)
            return found[0] if found else None

    def get_plans(self, plan_ids: Sequence[str]) -> list[Plan]:
        """These plans (those stored) with their journaled step states, oldest first: two queries."""
        with self.engine.connect() as conn:
            return self._plans(conn, plan_ids=plan_ids)

    def list_plans(self, *, state: str | None = None, node: str | None = None) -> list[Plan]:
        """All plans (in one state, about one node), oldest first."""
        with self.engine.connect() as conn:
            plans = self._plans(conn, state=state, node=node)
        return plans

    def plan_counts(self) -> dict[str, int]:
        """Number of plans in each state (one GROUP BY; for the metrics)."""
        q = select(schema.plans.c.state, func.count()).group_by(schema.plans.c.state)
        with self.engine.connect() as conn:
            return {str(state): int(n) for state, n in conn.execute(q)}

    def incidents_with_unfinished_plans(self) -> set[str]:
        """Ids of incidents with a plan not yet finished (running, pending, waiting for approval, blocked)."""
        final = [s.value for s in FINAL_PLAN_STATES]
        q = select(schema.plans.c.incident_id).where(schema.plans.c.state.not_in(final)).distinct()
        with self.engine.connect() as conn:
            return {r[0] for r in conn.execute(q) if r[0]}

    def prune(self, keep: Retention, pace: Pace | None = None) -> dict[str, int]:
        """Delete rows past their retention (small transactions, at `pace`); returns rows deleted per table."""
        return prune(self.engine, keep, self.clock(), begin=self.writes.begin, pace=pace)

    def runnable_plan_ids(self) -> list[str]:
        """Ids of the plans the healer loop resumes (running or pending), oldest first; no bodies are read.

        Releases come first: one cut short by a crash may not have cancelled its node's other plans yet, and a drain
        resumed before it could make one more eviction on a node the operator put back in service."""
        p = schema.plans
        q = (select(p.c.id).where(p.c.state.in_([PlanState.RUNNING.value, PlanState.PENDING.value]))
             .order_by(~p.c.id.startswith(RELEASE_ID), p.c.created_at, p.c.id))
        with self.engine.connect() as conn:
            return [r[0] for r in conn.execute(q)]

    def plan_ids(self) -> set[str]:
        """Ids of all stored plans."""
        with self.engine.connect() as conn:
            return {r[0] for r in conn.execute(select(schema.plans.c.id))}
