"""Reports in (maingrad JSON or SARIF), analyses and commits out."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlalchemy import func, select

from maingrad.service.api.deps import DbDep, ReadAccess, SessionDep, SettingsDep, UploadAccess
from maingrad.service.api.params import CommitQuery, CursorQuery, IdPath, LimitQuery, OptionalCommitQuery
from maingrad.service.bodies import decode_content, read_body
from maingrad.service.gate import finding_out
from maingrad.service.models import Analysis, Commit, Finding, Run
from maingrad.service.pagination import after_id, decode_cursor, encode_cursor, keyset_page
from maingrad.service.problems import ProblemError
from maingrad.service.reports import HIDDEN_PREFIX, analysis_dict, store_report
from maingrad.service.sarif_out import analysis_sarif
from maingrad.service.schemas import AnalysisOut, CommitOut, FindingOut, Page, UploadResult

router = APIRouter(tags=["reports"])

SARIF_MEDIA = "application/sarif+json"
_REPORT_BODY = {
    "required": True,
    "description": "A maingrad JSON report (`version` 1) or a SARIF 2.1.0 log from any tool (`version` "
    '"2.1.0"). `Content-Encoding: gzip` is accepted. The limits are in the schemas and in 413 answers.',
    # Filled in from the running configuration's limits (app._openapi).
    "content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/ReportBody"}},
        SARIF_MEDIA: {"schema": {"$ref": "#/components/schemas/ReportBody"}},
    },
}


@router.post(
    "/projects/{project}/reports",
    response_model=UploadResult,
    status_code=201,
    summary="Upload a report for (commit, category)",
    openapi_extra={"requestBody": _REPORT_BODY},
    responses={
        200: {
            "model": UploadResult,
            "description": "Unchanged: byte-identical re-upload, or an Idempotency-Key replay.",
        },
        409: {"description": "Conflict."},
        413: {
            "description": "Too large: body, inflated body, JSON values, runs, results or stored text "
            "(`limit` says which bound)."
        },
        422: {"description": "Not JSON, or breaks the report schema (`pointer` says where)."},
        415: {"description": "Unsupported Content-Encoding."},
    },
)
async def upload_report(
    request: Request,
    access: UploadAccess,
    db: DbDep,
    settings: SettingsDep,
    commit_sha: CommitQuery,
    branch: Annotated[str | None, Query(min_length=1, max_length=255)] = None,
    category: Annotated[
        str | None, Query(min_length=1, max_length=200, description="Defaults to the tool's name.")
    ] = None,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=255)] = None,
) -> JSONResponse:
    raw = await read_body(request, settings.max_body_bytes)
    body = decode_content(raw, request.headers.get("content-encoding"), settings.max_decompressed_bytes)
    outcome = await run_in_threadpool(
        store_report,
        db,
        settings,
        access.project,
        commit_sha=commit_sha.lower(),
        branch=branch,
        category=category,
        body=body,
        idempotency_key=idempotency_key,
    )
    request.app.state.metrics.inc("maingrad_reports_total", outcome=outcome.body["outcome"])
    location = f"/api/v1/projects/{access.project.name}/analyses/{outcome.body['id']}"
    return JSONResponse(outcome.body, status_code=outcome.status_code, headers={"Location": location})


@router.get(
    "/projects/{project}/analyses", response_model=Page[AnalysisOut], summary="Analyses, newest first"
)
def list_analyses(
    access: ReadAccess,
    session: SessionDep,
    commit_sha: OptionalCommitQuery = None,
    cursor: CursorQuery = None,
    limit: LimitQuery = 50,
) -> dict[str, Any]:
    query = (
        select(Analysis)
        .where(Analysis.project_id == access.project.id, Analysis.commit_sha.not_like(f"{HIDDEN_PREFIX}%"))
        .order_by(Analysis.id.desc())
    )
    if commit_sha:
        query = query.where(Analysis.commit_sha == commit_sha.lower())
    rows, nxt = keyset_page(session, query, Analysis.id, cursor, limit, newest_first=True)
    return {"items": [analysis_dict(a, access.project.name) for a in rows], "next_cursor": nxt}


def _analysis(session: Any, access: Any, analysis_id: int) -> Analysis:
    analysis = session.get(Analysis, analysis_id)
    if (
        analysis is None
        or analysis.project_id != access.project.id
        or analysis.commit_sha.startswith(HIDDEN_PREFIX)
    ):
        raise ProblemError(404, "analysis_not_found", f"no analysis {analysis_id} in this project")
    return analysis


@router.get(
    "/projects/{project}/analyses/{analysis_id}",
    response_model=AnalysisOut,
    summary="One analysis; `Accept: application/sarif+json` gives it whole as SARIF 2.1.0",
    responses={200: {"content": {SARIF_MEDIA: {"schema": {"type": "object"}}}}},
)
def get_analysis(analysis_id: IdPath, request: Request, access: ReadAccess, session: SessionDep) -> Any:
    analysis = _analysis(session, access, analysis_id)
    if SARIF_MEDIA in request.headers.get("accept", ""):
        return JSONResponse(analysis_sarif(session, analysis), media_type=SARIF_MEDIA)
    return analysis_dict(analysis, access.project.name)


@router.get(
    "/projects/{project}/analyses/{analysis_id}/findings",
    response_model=Page[FindingOut],
    summary="An analysis's findings, in upload order",
)
def list_findings(
    analysis_id: IdPath,
    access: ReadAccess,
    session: SessionDep,
    cursor: CursorQuery = None,
    limit: LimitQuery = 100,
) -> dict[str, Any]:
    analysis = _analysis(session, access, analysis_id)
    query = select(Finding).where(Finding.analysis_id == analysis.id).order_by(Finding.id)
    rows, nxt = keyset_page(session, query, Finding.id, cursor, limit, newest_first=False)
    return {"items": [finding_out(f, analysis.category) for f in rows], "next_cursor": nxt}


@router.get(
    "/projects/{project}/commits",
    response_model=Page[CommitOut],
    summary="Commits seen (uploads or runs), newest first",
)
def list_commits(
    access: ReadAccess, session: SessionDep, cursor: CursorQuery = None, limit: LimitQuery = 50
) -> Any:
    return commits_page(session, access.project.id, cursor, limit)


def commits_page(session: Any, project_id: int, cursor: str | None, limit: int) -> dict[str, Any]:
    query = select(Commit).where(Commit.project_id == project_id).order_by(Commit.id.desc())
    before = decode_cursor(cursor)
    if before is not None:
        query = after_id(query, Commit.id, before, newest_first=True)
    rows = list(session.execute(query.limit(limit + 1)).scalars())
    page = rows[:limit]
    shas = [c.sha for c in page]
    analyses: dict[str, tuple[int, Any]] = {}
    runs: dict[str, tuple[int, Any]] = {}
    if shas:
        for sha, count, last in session.execute(
            select(Analysis.commit_sha, func.count(), func.max(Analysis.created_at))
            .where(Analysis.project_id == project_id, Analysis.commit_sha.in_(shas))
            .group_by(Analysis.commit_sha)
        ).all():
            analyses[sha] = (int(count), last)
        for sha, count, last in session.execute(
            select(Run.commit_sha, func.count(), func.max(func.coalesce(Run.last_record_at, Run.created_at)))
            .where(Run.project_id == project_id, Run.commit_sha.in_(shas))
            .group_by(Run.commit_sha)
        ).all():
            runs[sha] = (int(count), last)
    items = []
    for c in page:
        times = [
            t for t in (analyses.get(c.sha, (0, None))[1], runs.get(c.sha, (0, None))[1], c.created_at) if t
        ]
        items.append(
            {
                "sha": c.sha,
                "branch": c.branch,
                "analyses": analyses.get(c.sha, (0, None))[0],
                "runs": runs.get(c.sha, (0, None))[0],
                "last_activity": max(_aware(t) for t in times),
            }
        )
    nxt = encode_cursor(page[-1].id) if len(rows) > limit else None
    return {"items": items, "next_cursor": nxt}


def _aware(value: Any) -> Any:
    import datetime as dt

    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value)
    return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)
