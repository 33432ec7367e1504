"""run_ends: each rank's end marker, so runtime evidence is complete only when the run says so

A run's records used to count as evidence from the first one: a clean batch, then an anomalous one 4 s later,
and `gate --wait --require runtime` had already passed. Each rank's sink now sends an end marker once its last
batch is acknowledged (contracts.records.end_marker); the gate waits until every rank of the run has ended
without losing a record.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "run_ends",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("records", sa.BigInteger(), nullable=False),
        sa.Column("lost", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_run_ends_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_run_ends")),
        sa.UniqueConstraint("run_id", "rank", name="uq_run_ends_rank"),
        sqlite_autoincrement=True,
    )
    with op.batch_alter_table("run_ends", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_run_ends_run_id"), ["run_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("run_ends", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_run_ends_run_id"))
    op.drop_table("run_ends")
