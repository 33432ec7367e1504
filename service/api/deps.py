"""FastAPI dependencies: settings, database sessions, the caller and their access to a project."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Path, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from maingrad.service import auth
from maingrad.service.config import Settings
from maingrad.service.db import Database
from maingrad.service.models import Project

bearer = HTTPBearer(
    auto_error=False, description="A maingrad token: `mgp_...` (project) or `mga_...` (admin)."
)


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_db(request: Request) -> Database:
    return request.app.state.db


def get_session(request: Request) -> Iterator[Session]:
    """A read session for the request (writes go through Database.writing in the service modules)."""
    with request.app.state.db.read() as session:
        yield session


SettingsDep = Annotated[Settings, Depends(get_settings)]
DbDep = Annotated[Database, Depends(get_db)]
SessionDep = Annotated[Session, Depends(get_session)]


def get_principal(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)] = None,
) -> auth.Principal:
    """Authenticate in a short session of its own: no connection is held while the handler runs."""
    db: Database = request.app.state.db
    token = credentials.credentials if credentials is not None else None
    with db.read() as session:
        principal = auth.authenticate(session, request.app.state.settings, token)
    auth.touch(db, principal)
    return principal


PrincipalDep = Annotated[auth.Principal, Depends(get_principal)]


@dataclass(frozen=True)
class Access:
    principal: auth.Principal
    project: Project


ProjectName = Annotated[str, Path(description="Project name.", examples=["demo"], max_length=200)]


def _access(scope: str):
    def dependency(
        project: ProjectName,
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)] = None,
    ) -> Access:
        """Token and project in one query, in a short session released before the handler takes its own."""
        db: Database = request.app.state.db
        token = credentials.credentials if credentials is not None else None
        with db.read() as session:
            principal, row = auth.resolve(session, request.app.state.settings, token, project, scope)
        auth.touch(db, principal)
        return Access(principal, row)

    dependency.__name__ = f"require_{scope}"
    return dependency


ReadAccess = Annotated[Access, Depends(_access("read"))]
UploadAccess = Annotated[Access, Depends(_access("upload"))]
TriageAccess = Annotated[Access, Depends(_access("triage"))]
AdminAccess = Annotated[Access, Depends(_access("admin"))]
