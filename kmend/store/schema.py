"""Tables. The Alembic migrations in kmend/migrations create exactly these."""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    Boolean,
    Column,
    Float,
    ForeignKey,
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
    Index("ix_plans_incident", "incident_id"),
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
)
