"""records: no foreign key on run_id

The runtime-record table is the ingest hot path. PostgreSQL checks a foreign key with one row-level trigger
per inserted row (a `SELECT ... FOR KEY SHARE` on the run's row): alone, 3-6 ms of every 1,000-record COPY;
with several writers of one run (the ranks of one training job), every inserted row share-locks that same
run row, and benchmarks/service.py ingest went from 34-38k to 54-56k records/s on PostgreSQL without it
(A/B on the development machine, 8 senders, 2 workers). Records are only written by the ingest path, in the
transaction that looks up or creates their run, and the service never deletes runs or projects, so the
constraint guarded nothing the application does not already guarantee.

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
