"""Healing: plan columns for the brakes, step outputs, audit log, breaker, node requests, leases seen.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("plans") as b:
        b.add_column(sa.Column("node", sa.String(253)))
        b.add_column(sa.Column("job", sa.String(253)))
        b.add_column(sa.Column("started_at", sa.Float))
    op.create_index("ix_plans_node", "plans", ["node"])
    with op.batch_alter_table("plan_steps") as b:
        b.add_column(sa.Column("outputs", sa.JSON))
    op.create_index("ix_plan_steps_kind_updated", "plan_steps", ["kind", "updated_at"])
    op.create_table(
        "audit_log",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("ts", sa.Float, nullable=False),
        sa.Column("actor", sa.String(128), nullable=False),
        sa.Column("method", sa.String(8), nullable=False),
        sa.Column("path", sa.String(512), nullable=False),
        sa.Column("status", sa.Integer, nullable=False),
        sa.Column("detail", sa.JSON, nullable=False),
    )
    op.create_index("ix_audit_ts", "audit_log", ["ts"])
    op.create_table(
        "breaker",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("tripped", sa.Boolean, nullable=False),
        sa.Column("tripped_at", sa.Float),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("reset_at", sa.Float),
        sa.Column("reset_by", sa.String(128), nullable=False),
    )
    op.create_table(
        "node_requests",
        sa.Column("id", sa.String(80), primary_key=True),
        sa.Column("node", sa.String(253), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("params", sa.JSON, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("result", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    op.create_index("ix_node_requests_node", "node_requests", ["node", "state"])
    op.create_table(
        "leases_seen",
        sa.Column("name", sa.String(253), primary_key=True),
        sa.Column("holder", sa.String(253), nullable=False),
        sa.Column("resource_version", sa.String(64), nullable=False),
        sa.Column("transitions", sa.Integer, nullable=False),
        sa.Column("observed_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    for t in ("leases_seen", "node_requests", "breaker", "audit_log"):
        op.drop_table(t)
    op.drop_index("ix_plan_steps_kind_updated", "plan_steps")
    with op.batch_alter_table("plan_steps") as b:
        b.drop_column("outputs")
    op.drop_index("ix_plans_node", "plans")
    with op.batch_alter_table("plans") as b:
        for c in ("started_at", "job", "node"):
            b.drop_column(c)
