"""Indexes for retention (log lines by time, finished incidents and plans by their last update) and the
producers' batch numbers.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_signals_ts", "signals", ["ts"])
    op.create_index("ix_incidents_state_updated", "incidents", ["state", "updated_at"])
    op.create_index("ix_plans_state_updated", "plans", ["state", "updated_at"])
    op.create_table(
        "producers",
        sa.Column("id", sa.String(300), primary_key=True),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("producers")
    op.drop_index("ix_plans_state_updated", "plans")
    op.drop_index("ix_incidents_state_updated", "incidents")
    op.drop_index("ix_signals_ts", "signals")
