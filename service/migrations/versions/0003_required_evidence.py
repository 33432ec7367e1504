"""projects.required_evidence: what a commit needs before the gate decides

A list of evidence names ("runtime" for runtime records, any other name an analysis category). While any is
missing for a commit, its gate is `pending`: CI waiting with `maingrad gate --wait` no longer passes a commit on
the first piece of evidence that arrives (clean runtime records before a failing analysis).

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("projects", schema=None) as batch_op:
        batch_op.add_column(sa.Column("required_evidence", sa.JSON(), nullable=False, server_default="[]"))


def downgrade() -> None:
    with op.batch_alter_table("projects", schema=None) as batch_op:
        batch_op.drop_column("required_evidence")
