"""Indexes for the lookups that scan otherwise: an incident's findings, findings by time, a plan's steps.

Revision ID: 0003
Revises: 0002
"""

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_findings_incident", "findings", ["incident_id"])
    op.create_index("ix_findings_ts", "findings", ["ts"])
    op.create_index("ix_plan_steps_plan", "plan_steps", ["plan_id"])


def downgrade() -> None:
    op.drop_index("ix_plan_steps_plan", "plan_steps")
    op.drop_index("ix_findings_ts", "findings")
    op.drop_index("ix_findings_incident", "findings")
