"""Tables. The Alembic migrations in kmend/migrations create exactly these."""

from __future__ import annotations

import functools
import re
from importlib import resources

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Identity,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
)

metadata = MetaData()

signals = Table(
    "signals", metadata,
    Column("id", String(512), primary_key=True),
    Column("node", String(253), nullable=False),
    Column("source", String(16), nullable=False),
    Column("ts", Float, nullable=False),
    Column("body", JSON, nullable=False),
    Index("ix_signals_node_ts", "node", "ts"),
    Index("ix_signals_ts", "ts"),
)

incidents = Table(
    "incidents", metadata,
    Column("id", String(64), primary_key=True),
    Column("state", String(16), nullable=False),
    Column("fault_class", String(32), nullable=False),
    Column("hardware", Boolean, nullable=False),
    Column("node", String(253)),
    Column("opened_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("body", JSON, nullable=False),
    Index("ix_incidents_state", "state"),
    Index("ix_incidents_state_updated", "state", "updated_at"),
)

findings = Table(
    "findings", metadata,
    Column("id", String(600), primary_key=True),
    Column("seq", Integer, nullable=False),
    Column("incident_id", String(64), ForeignKey("incidents.id"), nullable=False),
    Column("ts", Float, nullable=False),
    Column("fault_class", String(32), nullable=False),
    Column("node", String(253)),
    Column("body", JSON, nullable=False),
    Index("ix_findings_seq", "seq"),
    Index("ix_findings_incident", "incident_id"),
    Index("ix_findings_ts", "ts"),
)

plans = Table(
    "plans", metadata,
    Column("id", String(64), primary_key=True),
    Column("incident_id", String(64), nullable=False),
    Column("state", String(24), nullable=False),
    Column("mode", String(16), nullable=False),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("body", JSON, nullable=False),
    Column("node", String(253)),
    Column("job", String(253)),
    Column("started_at", Float),
    Index("ix_plans_incident", "incident_id"),
    Index("ix_plans_node", "node"),
    Index("ix_plans_state_updated", "state", "updated_at"),
    Index("ix_plans_started", "started_at"),
)

steps = Table(
    "plan_steps", metadata,
    Column("id", String(80), primary_key=True),
    Column("plan_id", String(64), ForeignKey("plans.id"), nullable=False),
    Column("idx", Integer, nullable=False),
    Column("kind", String(16), nullable=False),
    Column("node", String(253)),
    Column("state", String(16), nullable=False),
    Column("result", Text, nullable=False, default=""),
    Column("params", JSON, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("outputs", JSON),
    Index("ix_plan_steps_kind_updated", "kind", "updated_at"),
    Index("ix_plan_steps_plan", "plan_id"),
)

audit_log = Table(
    "audit_log", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("ts", Float, nullable=False),
    Column("actor", String(128), nullable=False),
    Column("method", String(8), nullable=False),
    Column("path", String(512), nullable=False),
    Column("status", Integer, nullable=False),
    Column("detail", JSON, nullable=False),
    Index("ix_audit_ts", "ts"),
)

breaker = Table(
    "breaker", metadata,
    Column("name", String(64), primary_key=True),
    Column("tripped", Boolean, nullable=False),
    Column("tripped_at", Float),
    Column("reason", Text, nullable=False),
    Column("reset_at", Float),
    Column("reset_by", String(128), nullable=False),
)

node_requests = Table(
    "node_requests", metadata,
    Column("id", String(80), primary_key=True),
    Column("node", String(253), nullable=False),
    Column("kind", String(32), nullable=False),
    Column("params", JSON, nullable=False),
    Column("state", String(16), nullable=False),
    Column("result", Text, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Index("ix_node_requests_node", "node", "state"),
)

producers = Table(
    "producers", metadata,
    Column("id", String(300), primary_key=True),
    Column("seq", BigInteger, nullable=False),
    Column("updated_at", Float, nullable=False),
)
"""The last batch number taken from each producer (agent process): a replay is one lookup, not a row per signal."""

leases_seen = Table(
    "leases_seen", metadata,
    Column("name", String(253), primary_key=True),
    Column("holder", String(253), nullable=False),
    Column("resource_version", String(64), nullable=False),
    Column("transitions", Integer, nullable=False),
    Column("observed_at", Float, nullable=False),
)

metric_series = Table(
    "metric_series", metadata,
    Column("id", String(64), primary_key=True),
    Column("ts", Float, nullable=False),
    Column("body", JSON, nullable=False),
)
"""The last sample of each series a metric rule watches (id: sha256 of its key), written with the batch."""

replica_feed = Table(
    "replica_feed", metadata,
    Column("seq", BigInteger().with_variant(Integer, "sqlite"), Identity(), primary_key=True),
    Column("tx", BigInteger, nullable=False),
    Column("at", Float, nullable=False),
    Column("body", JSON, nullable=False),
    Index("ix_replica_feed_tx_seq", "tx", "seq"),
)
"""What each replica's ingested batch gave (findings, placements, progress): the Lease holder folds it in order.

``seq`` is an identity column; ``tx`` the writing transaction's id (``pg_current_xact_id()``), so the reader
takes only rows of transactions older than every one still running and no late commit is skipped.
"""

feed_cursor = Table(
    "feed_cursor", metadata,
    Column("name", String(64), primary_key=True),
    Column("tx", BigInteger, nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("holder", String(253), nullable=False),
    Column("updated_at", Float, nullable=False),
)
"""How far the Lease holder has folded the feed ((tx, seq) of the last row), written with the results."""


@functools.cache
def head_revision() -> str:
    """The newest migration's revision, read from the scripts' text (the revision no other script revises)."""
    revisions: set[str] = set()
    revised: set[str] = set()
    for script in (resources.files("kmend") / "migrations" / "versions").iterdir():
        if not script.name.endswith(".py"):
            continue
        text_ = script.read_text()
        if found := re.search(r"^revision\s*=\s*[\"']([^\"']+)", text_, re.M):
            revisions.add(found.group(1))
        revised.update(re.findall(r"^down_revision\s*=\s*[\"']([^\"']+)", text_, re.M))
    heads = revisions - revised
    # Several heads (or none) is for Alembic to sort out: no revision matches, so migrate runs it.
    return heads.pop() if len(heads) == 1 else ""
