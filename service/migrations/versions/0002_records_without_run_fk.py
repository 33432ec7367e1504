"""records: no foreign key on run_id

The runtime-record table is the ingest hot path. PostgreSQL checks a foreign key with one row-level trigger
per inserted row (a `SELECT ... FOR KEY SHARE` on runs): 3-6 ms of every 1,000-record COPY, 20-30% of it,
measured on the development machine. Records are only written by the ingest path, in the same transaction
that looks up or creates their run, and the service never deletes runs, so the constraint guarded nothing
the application does not already guarantee.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("records", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("fk_records_run_id_runs"), type_="foreignkey")


def downgrade() -> None:
    with op.batch_alter_table("records", schema=None) as batch_op:
        batch_op.create_foreign_key(
            batch_op.f("fk_records_run_id_runs"), "runs", ["run_id"], ["id"], ondelete="CASCADE"
        )
