"""SQLAlchemy 2 storage models (kept apart from the pydantic API schemas in schemas.py).

Alembic migrations in migrations/versions must match these; tests/service/test_migrations.py checks it.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

# Names every constraint so migrations are reproducible on SQLite and PostgreSQL alike.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite reuses the largest rowid after a delete unless AUTOINCREMENT; our ids order uploads and cursors.
AUTOINC: dict[str, Any] = {"sqlite_autoincrement": True}
BigId = BigInteger().with_variant(Integer, "sqlite")  # SQLite autoincrements only INTEGER PRIMARY KEY


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class UTCDateTime(TypeDecorator[dt.datetime]):
    """Timezone-aware UTC datetimes on both backends (SQLite stores naive text)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: Any) -> dt.datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=dt.timezone.utc)
        if value is not None and dialect.name == "sqlite":
            return value.astimezone(dt.timezone.utc).replace(tzinfo=None)
        return value

    def process_result_value(self, value: dt.datetime | None, dialect: Any) -> dt.datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=dt.timezone.utc)
        return value


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Project(Base):
    __tablename__ = "projects"
    __table_args__ = (AUTOINC,)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    default_branch: Mapped[str] = mapped_column(String(255), default="main")
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # Bumped by every change the gate depends on (uploads, triage, settings): gate answers are reused
    # only while it (and the commit's runs) stay the same.
    revision: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))
    # Evidence every commit needs before its gate decides ("runtime", or an analysis category); see gate.py.
    required_evidence: Mapped[list[str]] = mapped_column(JSON, default=list, server_default=text("'[]'"))


class Token(Base):
    """An API token; only its HMAC is stored. project_id NULL = an instance-wide admin token."""

    __tablename__ = "tokens"
    __table_args__ = (AUTOINC,)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    project_id: Mapped[int | None] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200), default="")
    prefix: Mapped[str] = mapped_column(String(16))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    scopes: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    revoked_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    last_used_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())

    @property
    def scope_set(self) -> frozenset[str]:
        return frozenset(s for s in self.scopes.split(",") if s)


class Commit(Base):
    """A commit seen through an upload or a run (ordered by first sight for listing)."""

    __tablename__ = "commits"
    __table_args__ = (UniqueConstraint("project_id", "sha", name="uq_commits_sha"), AUTOINC)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    sha: Mapped[str] = mapped_column(String(64))
    branch: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Analysis(Base):
    """One uploaded report for (project, commit, category); a new upload for the key replaces it."""

    __tablename__ = "analyses"
    __table_args__ = (
        UniqueConstraint("project_id", "commit_sha", "category", name="uq_analyses_key"),
        Index("ix_analyses_project_branch", "project_id", "branch", "id"),
        AUTOINC,
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    commit_sha: Mapped[str] = mapped_column(String(64))
    branch: Mapped[str | None] = mapped_column(String(255))
    category: Mapped[str] = mapped_column(String(200))
    format: Mapped[str] = mapped_column(String(16))  # "maingrad" | "sarif"
    tool_name: Mapped[str] = mapped_column(String(200))
    tool_version: Mapped[str] = mapped_column(String(100), default="")
    content_sha256: Mapped[str] = mapped_column(String(64))
    results_count: Mapped[int] = mapped_column(Integer, default=0)
    files_scanned: Mapped[int | None] = mapped_column(Integer)
    execution_successful: Mapped[bool] = mapped_column(Boolean, default=True)
    # Error-level tool execution notifications: paths the tool could not analyze (maingrad's MG999).
    not_analyzed: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # SARIF runs without their results (tool, rules, invocations...), to rebuild SARIF on the way out.
    runs_meta: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)

    findings: Mapped[list[Finding]] = relationship(
        back_populates="analysis", cascade="all, delete-orphan", passive_deletes=True
    )


class Finding(Base):
    __tablename__ = "findings"
    __table_args__ = (AUTOINC,)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    analysis_id: Mapped[int] = mapped_column(ForeignKey("analyses.id", ondelete="CASCADE"), index=True)
    run_index: Mapped[int] = mapped_column(Integer, default=0)
    fingerprint: Mapped[str] = mapped_column(String(64))
    context_hash: Mapped[str | None] = mapped_column(String(64))
    rule: Mapped[str] = mapped_column(String(255))
    level: Mapped[str] = mapped_column(String(16))
    severity_rank: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    start_line: Mapped[int | None] = mapped_column(Integer)
    start_column: Mapped[int | None] = mapped_column(Integer)
    end_line: Mapped[int | None] = mapped_column(Integer)
    end_column: Mapped[int | None] = mapped_column(Integer)
    message: Mapped[str] = mapped_column(Text)
    snippet: Mapped[str] = mapped_column(Text, default="")
    suppressed: Mapped[bool] = mapped_column(Boolean, default=False)
    # The SARIF result object as received (SARIF uploads) or as converted (maingrad JSON).
    sarif: Mapped[dict[str, Any]] = mapped_column(JSON)

    analysis: Mapped[Analysis] = relationship(back_populates="findings")


class Alert(Base):
    """One per (project, fingerprint): the life of a finding across commits, and its triage."""

    __tablename__ = "alerts"
    __table_args__ = (UniqueConstraint("project_id", "fingerprint", name="uq_alerts_fingerprint"), AUTOINC)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    fingerprint: Mapped[str] = mapped_column(String(64))
    category: Mapped[str] = mapped_column(String(200))
    rule: Mapped[str] = mapped_column(String(255))
    level: Mapped[str] = mapped_column(String(16))
    severity_rank: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    message: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16), default="open")  # open | dismissed | fixed
    dismissed_reason: Mapped[str | None] = mapped_column(String(32))
    dismissed_comment: Mapped[str | None] = mapped_column(Text)
    dismissed_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    dismissed_by: Mapped[str | None] = mapped_column(String(200))
    first_seen_commit: Mapped[str] = mapped_column(String(64))
    first_seen_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    last_seen_commit: Mapped[str] = mapped_column(String(64))
    last_seen_branch: Mapped[str | None] = mapped_column(String(255))
    last_seen_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    last_seen_analysis_id: Mapped[int | None] = mapped_column(Integer)
    fixed_commit: Mapped[str | None] = mapped_column(String(64))


class AlertEvent(Base):
    """The audit trail of triage: who changed an alert's state, when and why."""

    __tablename__ = "alert_events"
    __table_args__ = (AUTOINC,)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    alert_id: Mapped[int] = mapped_column(ForeignKey("alerts.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    actor: Mapped[str] = mapped_column(String(200))
    from_state: Mapped[str] = mapped_column(String(16))
    to_state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(String(32))
    comment: Mapped[str | None] = mapped_column(Text)


class IdempotencyKey(Base):
    __tablename__ = "idempotency_keys"
    __table_args__ = (UniqueConstraint("project_id", "key", name="uq_idempotency_keys_key"), AUTOINC)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(255))
    request_sha256: Mapped[str] = mapped_column(String(64))
    analysis_id: Mapped[int] = mapped_column(Integer)
    status_code: Mapped[int] = mapped_column(Integer)
    response: Mapped[dict[str, Any]] = mapped_column(JSON)  # replayed verbatim
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Run(Base):
    """A training run that sent runtime records; it belongs to one commit."""

    __tablename__ = "runs"
    __table_args__ = (
        UniqueConstraint("project_id", "name", name="uq_runs_name"),
        Index("ix_runs_project_commit", "project_id", "commit_sha"),
        AUTOINC,
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(255))
    commit_sha: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    last_record_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    record_count: Mapped[int] = mapped_column(BigInteger, default=0)


class RunEnd(Base):
    """One rank's end marker (contracts.records.end_marker): the rank handed over `records` records and lost
    `lost` of them. A run is complete once `world_size` ranks have ended and none lost a record."""

    __tablename__ = "run_ends"
    __table_args__ = (UniqueConstraint("run_id", "rank", name="uq_run_ends_rank"), AUTOINC)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    world_size: Mapped[int] = mapped_column(Integer)
    records: Mapped[int] = mapped_column(BigInteger)
    lost: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Record(Base):
    """One runtime record: indexed columns for aggregation plus the raw JSON line as received.

    The key is (run, record id): it makes re-sent records no-ops, and leaving out a surrogate id saves an
    index on the hottest insert path (a third of PostgreSQL's COPY cost)."""

    __tablename__ = "records"
    __table_args__ = (
        # Tiny: only anomalous records are indexed, so the gate counts them without scanning a run.
        Index(
            "ix_records_anomalies",
            "run_id",
            sqlite_where=text("anomaly IS NOT NULL"),
            postgresql_where=text("anomaly IS NOT NULL"),
        ),
    )

    # runs.id, without a database foreign key: PostgreSQL would check it with one trigger per inserted row,
    # share-locking the run's row each time (a third of ingest throughput, migration 0002). Only the ingest
    # path writes records, in the transaction that looks up or creates their run, and runs are never deleted.
    run_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    record_key: Mapped[str] = mapped_column(String(255), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(BigInteger)
    microbatch: Mapped[int | None] = mapped_column(Integer)
    phase: Mapped[str] = mapped_column(String(16))
    module: Mapped[str] = mapped_column(Text)
    param: Mapped[str] = mapped_column(Text)
    has_main_grad: Mapped[bool | None] = mapped_column(Boolean)
    main_grad_is_none: Mapped[bool | None] = mapped_column(Boolean)
    action: Mapped[str] = mapped_column(String(16))
    anomaly: Mapped[str | None] = mapped_column(Text)
    t_ns: Mapped[int | None] = mapped_column(BigInteger)
    raw: Mapped[str] = mapped_column(Text)
