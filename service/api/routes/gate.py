"""The CI gate and its SARIF (only the new results).

The gate is the hottest read (every CI job polls it), so its handler does authentication, authorization,
the computation and JSON encoding in one trip to the thread pool and one database session, and returns
the encoded body directly (the schema is still published; schemathesis checks responses against it).
An answer is reused only while everything it depends on is unchanged (gate_cache.py).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Request, Security
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials
from sqlalchemy import select

from maingrad.service import auth, fastjson, gate_cache
from maingrad.service.api.deps import ProjectName, ReadAccess, SessionDep, SettingsDep, bearer
from maingrad.service.api.params import CommitQuery, OptionalCommitQuery, RequireQuery
from maingrad.service.gate import compute_gate
from maingrad.service.models import Analysis
from maingrad.service.sarif_out import new_results_sarif
from maingrad.service.schemas import GateOut

router = APIRouter(tags=["gate"])


def _gate_body(
    state: Any,
    project_name: str,
    token: str | None,
    commit_sha: str,
    base_sha: str | None,
    require: tuple[str, ...] | None,
) -> bytes:
    db, settings, cache = state.db, state.settings, state.gate_cache
    with db.read() as session:  # one snapshot: the version checked is the state computed from
        principal, project = auth.resolve(session, settings, token, project_name, "read")
        key = (project.id, commit_sha, base_sha, require)
        current = gate_cache.version(session, project, commit_sha)
        body = cache.get(key, current)
        if body is None:
            result = compute_gate(session, settings, project, commit_sha, base_sha, require)
            body = fastjson.dumps(result.body)
            cache.put(key, current, body)
    auth.touch(db, principal)
    return body


@router.get(
    "/projects/{project}/gate",
    response_model=GateOut,
    summary="The CI gate for a commit: pass | fail | neutral | pending | error",
    description="Always 200 for a visible project: the verdict is in `status`. `require` (repeatable; default: "
    "the project's `required_evidence`) names the evidence the commit needs before the gate decides: "
    "`runtime` and/or analysis categories; while some is missing the status is `pending`. "
    "The baseline is `base_sha` when "
    "given, else the latest analysis on the project's default branch uploaded before this commit's, else none "
    "(every finding is new). Recomputed on every read.",
)
async def gate(
    request: Request,
    project: ProjectName,
    commit_sha: CommitQuery,
    base_sha: OptionalCommitQuery = None,
    require: RequireQuery = None,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)] = None,
) -> Response:
    token = credentials.credentials if credentials is not None else None
    body = await run_in_threadpool(
        _gate_body,
        request.app.state,
        project,
        token,
        commit_sha.lower(),
        base_sha.lower() if base_sha else None,
        tuple(sorted(set(require))) if require is not None else None,
    )
    return Response(body, media_type="application/json")


@router.get(
    "/projects/{project}/gate/sarif",
    summary="SARIF 2.1.0 holding only the gate's new results (for code-scanning upload)",
    response_class=JSONResponse,
    responses={200: {"content": {"application/sarif+json": {"schema": {"type": "object"}}}}},
)
def gate_sarif(
    access: ReadAccess,
    session: SessionDep,
    settings: SettingsDep,
    commit_sha: CommitQuery,
    base_sha: OptionalCommitQuery = None,
    require: RequireQuery = None,
) -> JSONResponse:
    result = compute_gate(
        session,
        settings,
        access.project,
        commit_sha.lower(),
        base_sha.lower() if base_sha else None,
        require,
    )
    head = list(
        session.execute(
            select(Analysis).where(Analysis.id.in_(result.head_ids)).order_by(Analysis.id)
        ).scalars()
    )
    return JSONResponse(
        new_results_sarif(session, head, result.new_rows), media_type="application/sarif+json"
    )
