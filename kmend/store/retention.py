"""Retention: how long each table keeps its rows, and the pruning that enforces it in small transactions.

A backlog (the first prune after a restart or an upgrade) is deleted in transactions sized to take about
`TARGET_S` each (an incident's chunk carries its findings, so rows alone say little about the time), with a
rest between them: the database's single writer is never held long, and a group commit waiting for it
goes before the next chunk. A `Pace` bounds a pass: its chunks take at most a share of the wall time (the rest
after each chunk grows with it), and the pass ends after a set time, the remainder left to the next pass.

Every table is bounded. Log lines, finished incidents with their findings, finished plans with their
steps, the audit log and answered node requests age out after their own time (0 keeps them for
ever); the breaker and the leases seen hold one row per name. Times written by senders (log lines,
incidents) are aged against the newest such time in the table, so a store replayed from an old
trace is not emptied by today's clock; times the service wrote are aged against its clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import partial

from sqlalchemy import Column, ColumnElement, Connection, Engine, Table, delete, func, select

from healer.records import FINAL_PLAN_STATES
from kmend.store import schema

DAY = 86400.0
TARGET_S = 0.02
"""About how long one pruning transaction should hold the database's writer."""
REST_S = 0.005
"""Rest between two pruning transactions (a writer waiting for the lock takes it meanwhile)."""


@dataclass(frozen=True, slots=True)
class Retention:
    """Seconds each kind of row is kept (0: for ever)."""

    signals_s: float = 7 * DAY
    """Stored log lines (evidence and redelivery ids), by their time; producers' batch numbers, by last use."""
    incidents_s: float = 90 * DAY
    """Resolved and suppressed incidents with their findings, by their last finding's time."""
    plans_s: float = 90 * DAY
    """Finished plans with their steps, by their last update (longer than the lemon-node window)."""
    audit_s: float = 365 * DAY
    """Audit log entries."""
    requests_s: float = 30 * DAY
    """Answered node requests (GPU resets, stack dumps)."""


@dataclass(slots=True)
class Pace:
    """How much of the time one pruning pass may take (the service prunes on a thread of its own with one)."""

    share: float = 0.25
    """The largest share of the wall time its transactions take: a chunk of t s is followed by t * (1 - share) / share
    s of rest."""
    pass_s: float = 5.0
    """The longest pass: what is still due after it waits for the next pass."""
    stop: Callable[[], bool] = lambda: False
    """Ends the pass between two chunks (the service is stopping)."""
    began: float = field(default_factory=time.monotonic)
    """When the pass began (monotonic clock)."""
    cut_short: bool = False
    """Set when the pass ended before everything due was deleted."""

    def over(self) -> bool:
        """Whether the pass must end now; notes that it was cut short."""
        if self.stop() or time.monotonic() - self.began >= self.pass_s:
            self.cut_short = True
        return self.cut_short

    def rest_s(self, took: float) -> float:
        """The rest after a chunk that took `took` seconds."""
        return max(REST_S, took * (1.0 - self.share) / self.share)


def _newest(engine: Engine, ts: Column[float]) -> float | None:
    with engine.connect() as conn:
        got = conn.execute(select(func.max(ts))).scalar_one()
    return None if got is None else float(got)


def _drop_before(engine: Engine, table: Table, ts: Column[float], cut: float, chunk: int,
                 where: ColumnElement[bool] | None = None, child: Column[str] | None = None,
                 rest: Callable[[float], None] = time.sleep,
                 begin: Callable[[], AbstractContextManager[Connection]] | None = None,
                 pace: Pace | None = None) -> tuple[int, int]:
    """Delete `table`'s rows with `ts` < `cut` (and `where`), `chunk` at a time, rows of `child` pointing at them
    first, resting between chunks (as `pace` says, and only until it says the pass is over); returns (rows,
    child rows) deleted."""
    rows = children = 0
    key = table.c.id
    size = chunk
    while pace is None or not pace.over():
        began = time.monotonic()
        q = select(key).where(ts < cut).limit(size)
        if where is not None:
            q = q.where(where)
        with (begin or engine.begin)() as conn:
            ids = [r[0] for r in conn.execute(q)]
            if not ids:
                break
            if child is not None:
                children += conn.execute(delete(child.table).where(child.in_(ids))).rowcount
            rows += conn.execute(delete(table).where(key.in_(ids))).rowcount
        if len(ids) < size:
            break
        took = time.monotonic() - began
        if took > TARGET_S:
            size = max(1, int(size * TARGET_S / took))
        elif took < TARGET_S / 2:
            size = min(chunk, size * 2)
        rest(REST_S if pace is None else pace.rest_s(took))  # the writers waiting for the lock go first
    return rows, children


def prune(engine: Engine, keep: Retention, now: float, *, chunk: int = 1000,
          begin: Callable[[], AbstractContextManager[Connection]] | None = None,
          pace: Pace | None = None) -> dict[str, int]:
    """Delete what is past its retention, `chunk` rows per transaction, at `pace` (`pace.cut_short` tells whether
    rows due are left for the next pass); returns rows deleted per table."""
    out: dict[str, int] = {}
    sig, inc, fnd, plans, steps = schema.signals, schema.incidents, schema.findings, schema.plans, schema.steps
    drop = partial(_drop_before, engine, chunk=chunk, begin=begin, pace=pace)
    if keep.signals_s > 0 and (newest := _newest(engine, sig.c.ts)) is not None:
        out["signals"], _ = drop(sig, sig.c.ts, newest - keep.signals_s)
    if keep.signals_s > 0:  # an agent process silent this long is gone (its spool replays long done)
        prod = schema.producers
        out["producers"], _ = drop(prod, prod.c.updated_at, now - keep.signals_s)
    if keep.incidents_s > 0 and (newest := _newest(engine, inc.c.updated_at)) is not None:
        out["incidents"], out["findings"] = drop(inc, inc.c.updated_at, newest - keep.incidents_s,
                                                 where=inc.c.state.in_(("resolved", "suppressed")),
                                                 child=fnd.c.incident_id)
    if keep.plans_s > 0:
        out["plans"], out["plan_steps"] = drop(plans, plans.c.updated_at, now - keep.plans_s,
                                               where=plans.c.state.in_([s.value for s in FINAL_PLAN_STATES]),
                                               child=steps.c.plan_id)
    if keep.audit_s > 0:
        out["audit_log"], _ = drop(schema.audit_log, schema.audit_log.c.ts, now - keep.audit_s)
    if keep.requests_s > 0:
        req = schema.node_requests
        out["node_requests"], _ = drop(req, req.c.updated_at, now - keep.requests_s, where=req.c.state != "pending")
    return {k: v for k, v in out.items() if v}
