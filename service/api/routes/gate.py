"""The CI gate and its SARIF (only the new results)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from maingrad.service.api.deps import ReadAccess, SessionDep, SettingsDep
from maingrad.service.api.params import CommitQuery, OptionalCommitQuery
from maingrad.service.gate import compute_gate
from maingrad.service.sarif_out import new_results_sarif
from maingrad.service.schemas import GateOut

router = APIRouter(tags=["gate"])


@router.get(
    "/projects/{project}/gate",
    response_model=GateOut,
    summary="The CI gate for a commit: pass | fail | neutral | pending | error",
    description="Always 200 for a visible project: the verdict is in `status`. The baseline is `base_sha` when "
    "given, else the latest analysis on the project's default branch uploaded before this commit's, else none "
    "(every finding is new). Recomputed on every read.",
)
def gate(
    access: ReadAccess,
    session: SessionDep,
    settings: SettingsDep,
    commit_sha: CommitQuery,
    base_sha: OptionalCommitQuery = None,
) -> dict[str, Any]:
    result = compute_gate(
        session, settings, access.project, commit_sha.lower(), base_sha.lower() if base_sha else None
    )
    return result.body


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
) -> JSONResponse:
    result = compute_gate(
        session, settings, access.project, commit_sha.lower(), base_sha.lower() if base_sha else None
    )
    return JSONResponse(
        new_results_sarif(session, result.head, result.new_rows), media_type="application/sarif+json"
    )
