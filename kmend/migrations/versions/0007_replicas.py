"""The replica feed and the leader's cursor in it: replicas write, the Lease holder correlates.

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "replica_feed",
        sa.Column("seq", sa.BigInteger().with_variant(sa.Integer, "sqlite"), sa.Identity(), primary_key=True),
        sa.Column("tx", sa.BigInteger, nullable=False),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("body", sa.JSON, nullable=False),
    )
    op.create_index("ix_replica_feed_tx_seq", "replica_feed", ["tx", "seq"])
    op.create_table(
        "feed_cursor",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("tx", sa.BigInteger, nullable=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("holder", sa.String(253), nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("feed_cursor")
    op.drop_index("ix_replica_feed_tx_seq", "replica_feed")
    op.drop_table("replica_feed")
