"""analyses.not_analyzed: what the tool said it could not analyze

The number of error-level tool execution notifications in the uploaded runs (maingrad writes one per path it
could not read, decode or parse: MG999). Counted once at upload, so the gate, which CI polls, reads one integer
per analysis instead of the runs' metadata; the gate fails while it is above 0.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("analyses", schema=None) as batch_op:
        batch_op.add_column(sa.Column("not_analyzed", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("analyses", schema=None) as batch_op:
        batch_op.drop_column("not_analyzed")
