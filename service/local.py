"""In-process operations on the database, for the CLI's zero-server mode and for admin commands.

`maingrad upload` / `maingrad gate` without `--url` run the same service code as the server, against the
embedded SQLite file (or any MAINGRAD_DATABASE_URL), so a newcomer needs no server at all.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import select

from maingrad.service import auth
from maingrad.service.config import Settings
from maingrad.service.db import Database
from maingrad.service.gate import compute_gate
from maingrad.service.migrate import upgrade
from maingrad.service.models import Project, Token, utcnow
from maingrad.service.reports import store_report


@contextmanager
def open_database(settings: Settings) -> Iterator[Database]:
    db = Database.from_settings(settings)
    try:
        upgrade(db.engine)
        yield db
    finally:
        db.dispose()


def ensure_project(db: Database, name: str, default_branch: str = "main") -> Project:
    with db.writing() as session:
        project = session.execute(select(Project).where(Project.name == name)).scalar_one_or_none()
        if project is None:
            project = Project(name=name, default_branch=default_branch, created_at=utcnow())
            session.add(project)
            session.flush()
        return project


def get_project(db: Database, name: str) -> Project | None:
    with db.reading() as session:
        return session.execute(select(Project).where(Project.name == name)).scalar_one_or_none()


def upload(
    settings: Settings,
    project: str,
    report: bytes,
    *,
    commit_sha: str,
    branch: str | None,
    category: str | None,
    default_branch: str = "main",
    idempotency_key: str | None = None,
) -> tuple[int, dict[str, Any]]:
    with open_database(settings) as db:
        proj = ensure_project(db, project, default_branch)
        outcome = store_report(
            db,
            settings,
            proj,
            commit_sha=commit_sha,
            branch=branch,
            category=category,
            body=report,
            idempotency_key=idempotency_key,
        )
        return outcome.status_code, outcome.body


def gate(
    settings: Settings,
    project: str,
    commit_sha: str,
    base_sha: str | None = None,
    require: list[str] | None = None,
) -> dict[str, Any] | None:
    """The gate's body, or None when the project does not exist."""
    with open_database(settings) as db:
        proj = get_project(db, project)
        if proj is None:
            return None
        with db.reading() as session:
            return compute_gate(session, settings, proj, commit_sha, base_sha, require).body


def create_token(
    settings: Settings,
    project: str | None,
    scopes: list[str],
    name: str = "",
    expires_in_days: int | None = None,
    default_branch: str = "main",
) -> tuple[Token, str]:
    """Mint a token (project None: an instance admin token); creates the project when missing."""
    if expires_in_days is not None and not 1 <= expires_in_days <= 3650:
        raise ValueError(
            f"expires_in_days must be from 1 to 3650 (got {expires_in_days}): no token is born expired"
        )
    with open_database(settings) as db:
        proj = ensure_project(db, project, default_branch) if project else None
        expires = utcnow() + dt.timedelta(days=expires_in_days) if expires_in_days else None
        with db.writing() as session:
            return auth.create_token(session, settings, proj, scopes, name, expires)


def revoke_token(settings: Settings, token_id: int) -> Token | None:
    with open_database(settings) as db, db.writing() as session:
        row = session.get(Token, token_id)
        if row is not None and row.revoked_at is None:
            row.revoked_at = utcnow()
            session.flush()
        return row


def list_tokens(settings: Settings, project: str | None) -> list[tuple[Token, str | None]]:
    with open_database(settings) as db, db.reading() as session:
        query = (
            select(Token, Project.name).outerjoin(Project, Project.id == Token.project_id).order_by(Token.id)
        )
        if project:
            query = query.where(Project.name == project)
        return [(t, name) for t, name in session.execute(query).all()]
