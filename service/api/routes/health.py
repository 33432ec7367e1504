"""Liveness, readiness and Prometheus metrics (unauthenticated, no project data)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from sqlalchemy import text

from maingrad.service import migrate
from maingrad.service.api.deps import DbDep, SettingsDep
from maingrad.service.problems import problem_response
from maingrad.service.schemas import Health, Problem, Ready

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="Liveness: the process answers")
def healthz() -> Health:
    return Health(status="ok")


@router.get(
    "/readyz",
    response_model=Ready,
    summary="Readiness: the database answers and its schema is current",
    responses={503: {"model": Problem, "description": "Not ready."}},
)
def readyz(db: DbDep, settings: SettingsDep) -> Ready | JSONResponse:
    retry = {"Retry-After": str(settings.retry_after_s)}
    try:
        with db.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        revision = migrate.current_revision(db.engine)
    except Exception as exc:
        return problem_response(
            503, "database_unavailable", f"database error: {type(exc).__name__}", headers=retry
        )
    if revision != migrate.head_revision():
        return problem_response(
            503, "schema_outdated", f"schema at {revision}, expected {migrate.head_revision()}", headers=retry
        )
    return Ready(status="ready", database=db.dialect, revision=revision)


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    summary="Prometheus metrics (text format 0.0.4)",
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
def metrics(request: Request) -> PlainTextResponse:
    return PlainTextResponse(
        request.app.state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
    )
