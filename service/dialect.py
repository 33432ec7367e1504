"""The few statements that differ between SQLite and PostgreSQL: upserts and retryable errors."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.orm import Session

R = TypeVar("R")


def insert_for(session: Session, table: Any) -> Any:
    """A dialect insert that supports ON CONFLICT (both backends speak it)."""
    name = session.get_bind().dialect.name
    table = getattr(table, "__table__", table)  # Core table: no ORM bulk machinery on hot paths
    return (postgresql.insert if name == "postgresql" else sqlite.insert)(table)


_RETRY_SQLSTATES = {"23505", "40001", "40P01"}  # unique violation, serialization failure, deadlock


def retryable(exc: BaseException) -> bool:
    """A lost race with a concurrent writer: running the whole transaction again will see its outcome."""
    if isinstance(exc, IntegrityError):
        return True
    orig = getattr(exc, "orig", exc)  # SQLAlchemy wraps driver errors; raw-cursor paths raise them bare
    if getattr(orig, "sqlstate", None) in _RETRY_SQLSTATES:
        return True
    return isinstance(exc, OperationalError | DBAPIError) and "database is locked" in str(exc)


def with_retries(fn: Callable[[], R], attempts: int = 6) -> R:
    """Run a whole write transaction again when a concurrent writer won a race (unique key, deadlock)."""
    for attempt in range(attempts):
        try:
            return fn()
        except Exception as exc:
            if attempt == attempts - 1 or not retryable(exc):
                raise
            time.sleep(0.005 * (2**attempt))
    raise AssertionError("unreachable")


def note_commit(session: Session, project_id: int, sha: str, branch: str | None) -> None:
    """Remember a commit (first sighting wins; a later branch fills in a missing one)."""
    from maingrad.service.models import Commit, utcnow

    stmt = insert_for(session, Commit).values(
        project_id=project_id, sha=sha, branch=branch, created_at=utcnow()
    )
    if branch is None:
        stmt = stmt.on_conflict_do_nothing(index_elements=["project_id", "sha"])
    else:
        from sqlalchemy import func

        stmt = stmt.on_conflict_do_update(
            index_elements=["project_id", "sha"],
            set_={"branch": func.coalesce(Commit.__table__.c.branch, branch)},
        )
    session.execute(stmt)


def bump_revision(session: Session, project_id: int) -> None:
    """Mark the project changed for the gate's answer cache (same transaction as the change)."""
    from sqlalchemy import update

    from maingrad.service.models import Project

    session.execute(update(Project).where(Project.id == project_id).values(revision=Project.revision + 1))
