"""Projects and their tokens."""

from __future__ import annotations

import datetime as dt
from typing import Any

from fastapi import APIRouter, status
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from maingrad.service import auth
from maingrad.service.api.deps import AdminAccess, DbDep, PrincipalDep, ReadAccess, SessionDep, SettingsDep
from maingrad.service.api.params import CursorQuery, IdPath, LimitQuery
from maingrad.service.models import Project, Token, utcnow
from maingrad.service.pagination import keyset_page
from maingrad.service.problems import ProblemError
from maingrad.service.schemas import (
    Page,
    ProjectCreate,
    ProjectOut,
    ProjectUpdate,
    TokenCreate,
    TokenCreated,
    TokenOut,
)

router = APIRouter(tags=["projects"])


def project_out(p: Project) -> ProjectOut:
    return ProjectOut(
        name=p.name,
        default_branch=p.default_branch,
        required_evidence=list(p.required_evidence or []),
        created_at=p.created_at,
    )


def token_out(t: Token, project_name: str | None) -> dict[str, Any]:
    return {
        "id": t.id,
        "project": project_name,
        "name": t.name,
        "prefix": t.prefix,
        "scopes": sorted(t.scope_set),
        "created_at": t.created_at,
        "expires_at": t.expires_at,
        "revoked_at": t.revoked_at,
        "last_used_at": t.last_used_at,
    }


@router.get("/projects", response_model=Page[ProjectOut], summary="Projects visible to this token")
def list_projects(
    principal: PrincipalDep, session: SessionDep, cursor: CursorQuery = None, limit: LimitQuery = 100
) -> Page[ProjectOut]:
    query = select(Project).order_by(Project.id)
    if principal.project_id is not None:
        query = query.where(Project.id == principal.project_id)
    rows, nxt = keyset_page(session, query, Project.id, cursor, limit, newest_first=False)
    return Page[ProjectOut](items=[project_out(p) for p in rows], next_cursor=nxt)


@router.post(
    "/projects",
    response_model=ProjectOut,
    status_code=status.HTTP_201_CREATED,
    summary="Create a project (instance admin)",
    responses={409: {"description": "A project with this name exists."}},
)
def create_project(body: ProjectCreate, principal: PrincipalDep, db: DbDep) -> ProjectOut:
    auth.require_instance_admin(principal)
    try:
        with db.writing() as session:
            project = Project(
                name=body.name,
                default_branch=body.default_branch,
                required_evidence=sorted(set(body.required_evidence)),
                created_at=utcnow(),
            )
            session.add(project)
            session.flush()
            return project_out(project)
    except IntegrityError:
        raise ProblemError(409, "project_exists", f"project {body.name!r} already exists") from None


@router.get("/projects/{project}", response_model=ProjectOut, summary="One project")
def get_project(access: ReadAccess) -> ProjectOut:
    return project_out(access.project)


@router.patch(
    "/projects/{project}",
    response_model=ProjectOut,
    summary="Change a project's default branch or the evidence its commits need",
)
def update_project(body: ProjectUpdate, access: AdminAccess, db: DbDep) -> ProjectOut:
    with db.writing() as session:
        project = session.get(Project, access.project.id)
        if project is None:
            raise ProblemError(404, "project_not_found", "the project was deleted")
        if body.default_branch is not None:
            project.default_branch = body.default_branch
        if body.required_evidence is not None:
            project.required_evidence = sorted(set(body.required_evidence))
        project.revision = (project.revision or 0) + 1  # the gate's baseline may change
        session.flush()
        return project_out(project)


@router.post(
    "/projects/{project}/tokens",
    response_model=TokenCreated,
    status_code=status.HTTP_201_CREATED,
    summary="Mint a project token (shown once)",
)
def create_project_token(
    body: TokenCreate, access: AdminAccess, db: DbDep, settings: SettingsDep
) -> dict[str, Any]:
    expires_at = body.expires_at
    if body.expires_in_days is not None:
        expires_at = utcnow() + dt.timedelta(days=body.expires_in_days)
    with db.writing() as session:
        row, secret = auth.create_token(
            session, settings, access.project, list(body.scopes), body.name, expires_at
        )
        return {**token_out(row, access.project.name), "token": secret}


@router.get(
    "/projects/{project}/tokens", response_model=Page[TokenOut], summary="The project's tokens (no secrets)"
)
def list_project_tokens(
    access: AdminAccess, session: SessionDep, cursor: CursorQuery = None, limit: LimitQuery = 100
) -> dict[str, Any]:
    query = select(Token).where(Token.project_id == access.project.id).order_by(Token.id)
    rows, nxt = keyset_page(session, query, Token.id, cursor, limit, newest_first=False)
    return {"items": [token_out(t, access.project.name) for t in rows], "next_cursor": nxt}


@router.delete("/projects/{project}/tokens/{token_id}", response_model=TokenOut, summary="Revoke a token")
def revoke_project_token(token_id: IdPath, access: AdminAccess, db: DbDep) -> dict[str, Any]:
    with db.writing() as session:
        row = session.execute(
            select(Token).where(Token.id == token_id, Token.project_id == access.project.id)
        ).scalar_one_or_none()
        if row is None:
            raise ProblemError(404, "token_not_found", f"no token {token_id} in this project")
        if row.revoked_at is None:
            row.revoked_at = utcnow()
        session.flush()
        return token_out(row, access.project.name)
