"""Indexes for retention: log lines by time, finished incidents and plans by their last update.

Revision ID: 0005
Revises: 0004
"""

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_signals_ts", "signals", ["ts"])
    op.create_index("ix_incidents_state_updated", "incidents", ["state", "updated_at"])
    op.create_index("ix_plans_state_updated", "plans", ["state", "updated_at"])


def downgrade() -> None:
    op.drop_index("ix_plans_state_updated", "plans")
    op.drop_index("ix_incidents_state_updated", "incidents")
    op.drop_index("ix_signals_ts", "signals")
