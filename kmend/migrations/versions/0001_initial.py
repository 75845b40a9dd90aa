"""Initial schema: signals, incidents, findings, plans, plan steps.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "signals",
        sa.Column("id", sa.String(512), primary_key=True),
        sa.Column("node", sa.String(253), nullable=False),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("ts", sa.Float, nullable=False),
        sa.Column("body", sa.JSON, nullable=False),
    )
    op.create_index("ix_signals_node_ts", "signals", ["node", "ts"])
    op.create_table(
        "incidents",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("fault_class", sa.String(32), nullable=False),
        sa.Column("hardware", sa.Boolean, nullable=False),
        sa.Column("node", sa.String(253)),
        sa.Column("opened_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.Column("body", sa.JSON, nullable=False),
    )
    op.create_index("ix_incidents_state", "incidents", ["state"])
    op.create_table(
        "findings",
        sa.Column("id", sa.String(600), primary_key=True),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("incident_id", sa.String(64), sa.ForeignKey("incidents.id"), nullable=False),
        sa.Column("ts", sa.Float, nullable=False),
        sa.Column("fault_class", sa.String(32), nullable=False),
        sa.Column("node", sa.String(253)),
        sa.Column("body", sa.JSON, nullable=False),
    )
    op.create_index("ix_findings_seq", "findings", ["seq"])
    op.create_table(
        "plans",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("incident_id", sa.String(64), nullable=False),
        sa.Column("state", sa.String(24), nullable=False),
        sa.Column("mode", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.Column("body", sa.JSON, nullable=False),
    )
    op.create_index("ix_plans_incident", "plans", ["incident_id"])
    op.create_table(
        "plan_steps",
        sa.Column("id", sa.String(80), primary_key=True),
        sa.Column("plan_id", sa.String(64), sa.ForeignKey("plans.id"), nullable=False),
        sa.Column("idx", sa.Integer, nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("node", sa.String(253)),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("result", sa.Text, nullable=False),
        sa.Column("params", sa.JSON, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    for t in ("plan_steps", "plans", "findings", "incidents", "signals"):
        op.drop_table(t)
