"""An index on when plans started: the hourly disruption budget counts the plans started in the last hour.

Without it the budget's count (``Ledger.plans_started_since``, asked before a plan's first disruptive step) read
every plan ever journaled.

Revision ID: 0008
Revises: 0007
"""

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_plans_started", "plans", ["started_at"])


def downgrade() -> None:
    op.drop_index("ix_plans_started", "plans")
