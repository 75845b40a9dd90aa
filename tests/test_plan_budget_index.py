"""The hourly disruption budget's count of plans started in the last hour reads them through an index on when they
started, on SQLite and a real PostgreSQL holding 100,000 journaled plans: the query the ledger sends is explained as
an index scan of ``ix_plans_started``, not a scan of every plan."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import event, text

from kmend.store import Store

pytestmark = pytest.mark.postgres

PLANS = 100_000
"""Journaled plans: one started every 30 s for five weeks."""
NOW = 1_700_000_000.0


def _journal(store: Store) -> None:
    """PLANS plans (every tenth a health check), each with a succeeded cordon and a pending drain, written by the
    database itself (one statement each)."""
    pg = store.engine.dialect.name == "postgresql"
    series = ("SELECT i FROM generate_series(1, :n) AS i" if pg else
              "WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s WHERE i < :n) SELECT i FROM s")
    pid = "(CASE WHEN i % 10 = 0 THEN 'plan-accept-' ELSE 'plan-' END || i)"
    with store.engine.begin() as conn:
        conn.execute(text(f"""INSERT INTO plans (id, incident_id, state, mode, created_at, updated_at, body, node, job,
                              started_at)
                              SELECT {pid}, 'inc-' || i, 'succeeded', 'auto', :now - i * 30, :now - i * 30, '{{}}',
                                     'gpu-' || (i % 512), NULL, :now - i * 30 FROM ({series}) AS s"""),
                     {"n": PLANS, "now": NOW})
        for idx, kind, state in ((0, "cordon", "succeeded"), (1, "drain", "pending")):
            conn.execute(text(f"""INSERT INTO plan_steps (id, plan_id, idx, kind, node, state, result, params,
                                  updated_at)
                                  SELECT {pid} || '-{idx}', {pid}, {idx}, '{kind}', 'gpu-' || (i % 512), '{state}',
                                         '', '{{}}', :now - i * 30 FROM ({series}) AS s"""),
                         {"n": PLANS, "now": NOW})
        conn.execute(text("ANALYZE"))


def _sent(store: Store) -> tuple[str, Any]:
    """The statement and parameters the ledger sends for the budget's count (with the count it answers)."""
    sent: list[tuple[str, Any]] = []

    def keep(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        sent.append((statement, parameters))

    event.listen(store.engine, "before_cursor_execute", keep)
    try:
        count = store.ledger.plans_started_since(NOW - 3600, exclude_plan="plan-none")
    finally:
        event.remove(store.engine, "before_cursor_execute", keep)
    assert count == 3600 // 30 - 3600 // 300, count  # the last hour's plans but its health checks
    [(statement, parameters)] = [s for s in sent if "plans" in s[0]]
    return statement, parameters


def test_the_budgets_count_of_started_plans_uses_the_started_index(database_url: str) -> None:
    store = Store(database_url)
    store.migrate()
    _journal(store)
    statement, parameters = _sent(store)
    with store.engine.connect() as conn:
        raw = conn.connection.dbapi_connection
        assert raw is not None
        cur = raw.cursor()
        if store.engine.dialect.name == "postgresql":
            cur.execute("EXPLAIN " + statement, parameters)
        else:
            cur.execute("EXPLAIN QUERY PLAN " + statement, parameters)
        explained = "\n".join(" ".join(map(str, row)) for row in cur.fetchall())
    assert "ix_plans_started" in explained, explained
