"""Who is calling and what they may do: token verification, project access and scopes.

A project token only ever sees its own project: any other project answers 404, whether it exists or not,
so tokens cannot probe for project names. Missing or bad credentials are 401; a known project with too
small a scope is 403.
"""

from __future__ import annotations

import datetime as dt
import hmac
import logging
import secrets
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, select, update
from sqlalchemy.orm import Session

from maingrad.service import tokens
from maingrad.service.config import Settings
from maingrad.service.db import Database
from maingrad.service.models import Project, Token, utcnow
from maingrad.service.problems import ProblemError

log = logging.getLogger("maingrad.service")
_TOUCH_EVERY = dt.timedelta(seconds=60)
_BEARER = {"WWW-Authenticate": 'Bearer realm="maingrad"'}


@dataclass(frozen=True)
class Principal:
    token_id: int | None  # None: the bootstrap admin token from the environment
    name: str
    project_id: int | None  # None: instance-wide
    scopes: frozenset[str]
    needs_touch: bool = False  # last_used_at is older than a minute

    @property
    def instance_admin(self) -> bool:
        return self.project_id is None and "admin" in self.scopes

    @property
    def actor(self) -> str:
        return f"token:{self.token_id}:{self.name}" if self.token_id is not None else "admin:env"


# Built once: these run on every request (statement construction costs more than the query on SQLite).
_TOKEN_COLUMNS = (
    Token.id,
    Token.name,
    Token.project_id,
    Token.scopes,
    Token.expires_at,
    Token.revoked_at,
    Token.last_used_at,
)
_TOKEN_BY_HASH = select(*_TOKEN_COLUMNS).where(Token.token_hash == bindparam("h"))
_PROJECT_BY_NAME = select(Project).where(Project.name == bindparam("n"))


def unauthorized(code: str, detail: str) -> ProblemError:
    return ProblemError(401, code, detail, headers=_BEARER)


def authenticate(session: Session, settings: Settings, token: str | None) -> Principal:
    if not token:
        raise unauthorized("missing_token", "an API token is required (Authorization: Bearer <token>)")
    token = token.strip()
    key = settings.hmac_key
    if settings.admin_token is not None:
        expected = settings.admin_token.get_secret_value()
        if expected and hmac.compare_digest(tokens.hash_token(token, key), tokens.hash_token(expected, key)):
            return Principal(None, "bootstrap-admin", None, tokens.expand_scopes({"admin"}))
    if not tokens.well_formed(token):
        raise unauthorized("invalid_token", "the token is malformed (bad prefix, length or checksum)")
    row = session.connection().execute(_TOKEN_BY_HASH, {"h": tokens.hash_token(token, key)}).first()
    if row is None:
        raise unauthorized("invalid_token", "unknown token")
    return _principal(row)


def _principal(row: Any) -> Principal:
    now = utcnow()
    if row.revoked_at is not None:
        raise unauthorized("token_revoked", "the token was revoked")
    if row.expires_at is not None and row.expires_at <= now:
        raise unauthorized("token_expired", "the token has expired")
    stale = row.last_used_at is None or now - row.last_used_at > _TOUCH_EVERY
    scopes = frozenset(x for x in row.scopes.split(",") if x)
    return Principal(row.id, row.name, row.project_id, tokens.expand_scopes(scopes), stale)


def touch(db: Database, principal: Principal) -> None:
    """Best-effort last_used_at, at most once a minute per token (a write per request would cost).

    Call it with no session open: it takes a write connection of its own."""
    if not principal.needs_touch or principal.token_id is None:
        return
    try:
        with db.writing() as session:
            session.execute(update(Token).where(Token.id == principal.token_id).values(last_used_at=utcnow()))
    except Exception as exc:  # never fail a request over bookkeeping
        log.warning("could not record token use: %s", exc)


def _check_access(principal: Principal, project_id: int | None, project_name: str, scope: str) -> None:
    """404 for a project that does not exist or that the token's project is not; 403 for a missing scope."""
    if project_id is None or (principal.project_id is not None and principal.project_id != project_id):
        raise ProblemError(404, "project_not_found", f"no project {project_name!r} visible to this token")
    if scope not in principal.scopes:
        raise ProblemError(
            403, "insufficient_scope", f"this token lacks the {scope!r} scope", required_scope=scope
        )


def authorize(session: Session, principal: Principal, project_name: str, scope: str) -> Project:
    project = session.execute(_PROJECT_BY_NAME, {"n": project_name}).scalar_one_or_none()
    _check_access(principal, None if project is None else project.id, project_name, scope)
    assert project is not None  # _check_access answers 404 for a missing project
    return project


# The project's columns ride beside the token's in one row, each labelled "p_" + its attribute.
_PROJECT_FIELDS = ("id", "name", "default_branch", "created_at", "revision", "required_evidence")
_TOKEN_AND_PROJECT = (
    select(*_TOKEN_COLUMNS, *(getattr(Project, name).label(f"p_{name}") for name in _PROJECT_FIELDS))
    .select_from(Token)
    .outerjoin(Project, Project.name == bindparam("n"))
    .where(Token.token_hash == bindparam("h"))
)


def resolve(
    session: Session, settings: Settings, token: str | None, project_name: str, scope: str
) -> tuple[Principal, Project]:
    """authenticate() + authorize() in one query: the token and the project side by side (hot paths)."""
    if not token or not tokens.well_formed(token.strip()):
        principal = authenticate(session, settings, token)  # the admin token, or the right 401
        return principal, authorize(session, principal, project_name, scope)
    key = settings.hmac_key
    row = (
        session.connection()
        .execute(_TOKEN_AND_PROJECT, {"h": tokens.hash_token(token.strip(), key), "n": project_name})
        .first()
    )
    if row is None:
        principal = authenticate(session, settings, token)  # the env admin token, or "unknown token"
        return principal, authorize(session, principal, project_name, scope)
    principal = _principal(row)
    _check_access(principal, row.p_id, project_name, scope)
    project = Project(**{name: getattr(row, f"p_{name}") for name in _PROJECT_FIELDS})
    return principal, project


def require_instance_admin(principal: Principal) -> None:
    if not principal.instance_admin:
        raise ProblemError(
            403, "insufficient_scope", "only an instance admin token may do this", required_scope="admin"
        )


def create_token(
    session: Session,
    settings: Settings,
    project: Project | None,
    scopes: list[str] | str,
    name: str = "",
    expires_at: dt.datetime | None = None,
) -> tuple[Token, str]:
    """Mint a token; returns the row and the secret (the only time it exists in clear)."""
    secret = tokens.generate(admin=project is None)
    row = Token(
        project_id=project.id if project is not None else None,
        name=name or ("admin" if project is None else f"{project.name}-{secrets.token_hex(3)}"),
        prefix=tokens.display_prefix(secret),
        token_hash=tokens.hash_token(secret, settings.hmac_key),
        scopes=tokens.normalize_scopes(scopes),
        expires_at=expires_at,
        created_at=utcnow(),
    )
    session.add(row)
    session.flush()
    return row, secret
