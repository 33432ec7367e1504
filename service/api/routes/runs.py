"""Runtime records from maingrad.hooks in; runs, timelines and aggregates out."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from fastapi.concurrency import run_in_threadpool
from sqlalchemy import select

from maingrad.service import fastjson, records
from maingrad.service.api.deps import DbDep, ReadAccess, SessionDep, SettingsDep, UploadAccess
from maingrad.service.api.params import CursorQuery, KeyCursorQuery, LimitQuery, OptionalCommitQuery
from maingrad.service.bodies import SMALL_BODY, decode_content, read_body
from maingrad.service.models import Record, Run
from maingrad.service.pagination import decode_key_cursor, encode_key_cursor, keyset_page
from maingrad.service.problems import ProblemError
from maingrad.service.schemas import Page, RecordOut, RecordsIngested, RunDetail, RunEnded, RunOut, Timeline

router = APIRouter(tags=["runtime"])

RunName = Annotated[str, Path(min_length=1, max_length=255, description="Run id (the hooks' `run`).")]

_NDJSON_BODY = {
    "required": True,
    "description": "One runtime record (`maingrad.hooks`, schema 1) per line; re-sent records are ignored by "
    "`id`. The schema describes the body as the array of its lines. `Content-Encoding: gzip` is accepted.",
    # The schema itself is filled in from the running configuration's limits (app._openapi).
    "content": {"application/x-ndjson": {"schema": {"$ref": "#/components/schemas/RecordsBody"}}},
}


def run_out(run: Run) -> dict[str, Any]:
    return {
        "name": run.name,
        "commit_sha": run.commit_sha,
        "created_at": run.created_at,
        "last_record_at": run.last_record_at,
        "record_count": int(run.record_count),
    }


@router.post(
    "/projects/{project}/runs/{run}/records",
    response_model=RecordsIngested,
    summary="Append a batch of runtime records (NDJSON)",
    openapi_extra={"requestBody": _NDJSON_BODY},
    responses={
        409: {"description": "The run belongs to another commit, or the records name another commit."},
        413: {"description": "Too large: body, inflated body, one line, or the number of records."},
        422: {
            "description": "A line is not JSON or breaks the record schema (`line` and `pointer` say where)."
        },
    },
)
async def post_records(
    run: RunName,
    request: Request,
    access: UploadAccess,
    db: DbDep,
    settings: SettingsDep,
    commit_sha: OptionalCommitQuery = None,
) -> dict[str, Any]:
    raw = await read_body(request, settings.max_records_body_bytes)
    body = decode_content(
        raw,
        request.headers.get("content-encoding"),
        settings.max_records_decompressed_bytes,
        settings.max_record_line_bytes,
    )
    result = await run_in_threadpool(
        records.ingest,
        db,
        access.project,
        run,
        commit_sha.lower() if commit_sha else None,
        body,
        settings.max_records_per_batch,
        settings.max_record_line_bytes,
        settings.max_record_string_chars,
    )
    request.app.state.metrics.inc("maingrad_records_ingested_total", result["inserted"])
    if result["duplicates"]:
        request.app.state.metrics.inc("maingrad_records_duplicate_total", result["duplicates"])
    return result


_COUNT = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
# contracts.records.end_marker, as validate_end_marker checks it (plus two rules a schema cannot state: the
# rank is below world_size, and `run`, when given, is the run in the URL).
_END_MARKER_SCHEMA = {
    "type": "object",
    "required": ["rank", "world_size", "records", "lost"],
    "additionalProperties": False,
    "properties": {
        "schema": {"type": "integer", "enum": [1]},
        "run": {"type": "string", "minLength": 1, "maxLength": 255},
        "rank": _COUNT,
        "world_size": {**_COUNT, "minimum": 1},
        "records": _COUNT,
        "lost": _COUNT,
    },
}


@router.post(
    "/projects/{project}/runs/{run}/end",
    response_model=RunEnded,
    summary="One rank's end of records (its sink sends it when closed)",
    openapi_extra={
        "requestBody": {
            "required": True,
            "description": "`contracts.records.end_marker`: rank, world_size, records handed over, lost.",
            "content": {"application/json": {"schema": _END_MARKER_SCHEMA}},
        }
    },
    responses={
        409: {"description": "The run belongs to another commit."},
        422: {"description": "Not an end marker (the detail names what is wrong)."},
    },
)
async def post_run_end(
    run: RunName,
    request: Request,
    access: UploadAccess,
    db: DbDep,
    commit_sha: OptionalCommitQuery = None,
) -> dict[str, Any]:
    """The run's runtime evidence counts only once every rank has ended and none lost a record."""
    raw = await read_body(request, SMALL_BODY)
    try:
        marker = fastjson.loads_strict(raw)
    except (fastjson.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ProblemError(422, "invalid_json", f"body is not JSON: {exc}") from None
    return await run_in_threadpool(
        records.end_run, db, access.project, run, commit_sha.lower() if commit_sha else None, marker
    )


def _run(session: Any, access: Any, name: str) -> Run:
    run = session.execute(
        select(Run).where(Run.project_id == access.project.id, Run.name == name)
    ).scalar_one_or_none()
    if run is None:
        raise ProblemError(404, "run_not_found", f"no run {name!r} in this project")
    return run


@router.get("/projects/{project}/runs", response_model=Page[RunOut], summary="Runs, newest first")
def list_runs(
    access: ReadAccess,
    session: SessionDep,
    commit_sha: OptionalCommitQuery = None,
    cursor: CursorQuery = None,
    limit: LimitQuery = 50,
) -> dict[str, Any]:
    query = select(Run).where(Run.project_id == access.project.id).order_by(Run.id.desc())
    if commit_sha:
        query = query.where(Run.commit_sha == commit_sha.lower())
    rows, nxt = keyset_page(session, query, Run.id, cursor, limit, newest_first=True)
    return {"items": [run_out(r) for r in rows], "next_cursor": nxt}


@router.get(
    "/projects/{project}/runs/{run}",
    response_model=RunDetail,
    summary="A run with per-module and per-rank aggregates",
)
def get_run(run: RunName, access: ReadAccess, session: SessionDep) -> dict[str, Any]:
    row = _run(session, access, run)
    return {
        **run_out(row),
        "steps": records.step_count(session, row),
        "modules": records.aggregates(session, row, Record.module),
        "ranks": records.aggregates(session, row, Record.rank),
        "anomalies": records.anomalies(session, row),
    }


@router.get(
    "/projects/{project}/runs/{run}/timeline", response_model=Timeline, summary="Per-step counts of a run"
)
def get_timeline(run: RunName, access: ReadAccess, session: SessionDep) -> dict[str, Any]:
    row = _run(session, access, run)
    return {"run": row.name, "commit_sha": row.commit_sha, "points": records.timeline(session, row)}


@router.get(
    "/projects/{project}/runs/{run}/records",
    response_model=Page[RecordOut],
    summary="A run's raw records, by record id",
)
def list_records(
    run: RunName,
    access: ReadAccess,
    session: SessionDep,
    cursor: KeyCursorQuery = None,
    limit: LimitQuery = 100,
) -> dict[str, Any]:
    row = _run(session, access, run)
    query = select(Record.record_key, Record.raw).where(Record.run_id == row.id).order_by(Record.record_key)
    after = decode_key_cursor(cursor)
    if after is not None:
        query = query.where(Record.record_key > after)
    rows = list(session.execute(query.limit(limit + 1)).all())
    nxt = encode_key_cursor(rows[limit - 1].record_key) if len(rows) > limit else None
    return {
        "items": [{"id": r.record_key, "record": json.loads(r.raw)} for r in rows[:limit]],
        "next_cursor": nxt,
    }
