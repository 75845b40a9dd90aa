"""The last sample of each watched metric series, so counters are judged across a service restart.

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
    op.create_table(
        "metric_series",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("ts", sa.Float, nullable=False),
        sa.Column("body", sa.JSON, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("metric_series")
