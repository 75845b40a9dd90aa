"""The last batch number taken from each producer (agent process), so a replayed batch is one lookup.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "producers",
        sa.Column("id", sa.String(300), primary_key=True),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("producers")
