"""The FastAPI application: API v1, dashboard, health and metrics.

`create_app()` reads settings from the environment; the lifespan migrates the database (an empty one gets
the whole schema) and, when no admin credential exists at all, mints a bootstrap admin token and writes it
to a file only its owner can read (the log says where, never the token), so `maingrad serve` works with zero setup.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.openapi.utils import get_openapi
from sqlalchemy import select

from maingrad.service import auth, migrate, problems
from maingrad.service.api.routes import alerts, gate, health, projects, reports, runs
from maingrad.service.bodies import BodyLimitMiddleware, body_limits
from maingrad.service.bodyschema import (
    BodyLimits,
    maingrad_report_schema,
    record_schema,
    records_body_schema,
    sarif_schema,
)
from maingrad.service.config import Settings
from maingrad.service.db import Database
from maingrad.service.gate_cache import GateCache
from maingrad.service.metrics import MetricsMiddleware, new_registry
from maingrad.service.models import Token
from maingrad.service.reports import lock_key
from maingrad.service.schemas import Problem
from maingrad.service.shedding import LoadShedMiddleware

log = logging.getLogger("maingrad.service")
API_PREFIX = "/api/v1"


def api_router() -> APIRouter:
    router = APIRouter(prefix=API_PREFIX)
    for module in (projects, reports, gate, runs, alerts):
        router.include_router(module.router)
    return router


def bootstrap_admin(db: Database, settings: Settings) -> str | None:
    """Mint an admin token when there is no way at all to authenticate as admin; returns it (once)."""
    if settings.admin_token is not None and settings.admin_token.get_secret_value():
        return None
    with db.writing() as session:
        lock_key(session, "bootstrap-admin")  # several workers start at once: one mints, the others see it
        exists = session.execute(
            select(Token.id).where(Token.project_id.is_(None), Token.revoked_at.is_(None)).limit(1)
        ).first()
        if exists is not None:
            return None
        _row, secret = auth.create_token(session, settings, None, ["admin"], "bootstrap-admin")
        return secret


def write_bootstrap_token(path: Path, secret: str) -> Path:
    """Write the minted admin token to a file only its owner can read (replacing an older one)."""
    path = path.resolve()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(secret + "\n")
    os.replace(tmp, path)
    return path


def prepare_database(settings: Settings) -> Database:
    db = Database.from_settings(settings, server=True)
    migrate.upgrade(db.engine)
    return db


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()  # pyright: ignore[reportCallIssue] - takes Field(x)'s x as no default

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The event loop and the thread pool share the GIL: with the default 5 ms switch interval, a
        # thread returning from SQLite or a socket waits up to 5 ms to run again (a convoy that cost a
        # third of the ingest rate and most of the gate's latency under load).
        sys.setswitchinterval(settings.gil_switch_interval_ms / 1000)
        db = prepare_database(settings)
        app.state.db = db
        secret = bootstrap_admin(db, settings)
        if secret:
            path = write_bootstrap_token(Path(settings.bootstrap_token_file), secret)
            # The token itself never goes to the log: logs are shipped, kept and read by many.
            log.warning(
                "bootstrap admin token written to %s (mode 0600; read it, create projects, then delete the file)",
                path,
            )
        try:
            yield
        finally:
            db.dispose()

    app = FastAPI(
        title="maingrad service",
        version="1",
        summary="Stores maingrad reports (and any tool's SARIF) and runtime records; answers CI.",
        openapi_url=f"{API_PREFIX}/openapi.json",
        docs_url=None,  # Swagger UI and ReDoc load from a CDN; the machines have no internet
        redoc_url=None,
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.gate_cache = GateCache(settings.gate_cache_size)
    problems.install(app)
    app.add_middleware(BodyLimitMiddleware, limit_for=body_limits(settings))
    app.state.metrics = new_registry()
    # Added last, so it runs first: a shed request costs no body read, no metrics middleware, no handler.
    app.add_middleware(MetricsMiddleware, registry=app.state.metrics)
    app.add_middleware(
        LoadShedMiddleware,
        limit=settings.max_concurrent_requests,
        retry_after_s=settings.retry_after_s,
        on_shed=lambda: app.state.metrics.inc("maingrad_requests_shed_total"),
        per_key_limit=min(settings.max_concurrent_requests_per_project, settings.max_concurrent_requests),
        body_timeout_s=settings.body_read_timeout_s,
        limit_for=body_limits(settings),
    )
    app.include_router(health.router)
    app.include_router(api_router())
    from maingrad.service.dashboard.routes import mount as mount_dashboard

    mount_dashboard(app)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


_PROBLEM_REF = {"$ref": "#/components/schemas/Problem"}
_ERRORS = {
    "401": "Missing, malformed, unknown, revoked or expired token.",
    "403": "The token lacks the scope.",
    "404": "No such project visible to this token (or no such resource in it).",
    "422": "Invalid request (see `errors` / `code`).",
}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, with every error documented as application/problem+json (RFC 9457)."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(
        title=app.title,
        version=app.version,
        summary=app.summary,
        routes=app.routes,
        description=app.description,
    )
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["Problem"] = Problem.model_json_schema(ref_template="#/components/schemas/{model}")
    limits = BodyLimits.from_settings(app.state.settings)
    components["MaingradReport"] = maingrad_report_schema(limits)
    components["SarifLog"] = sarif_schema(limits)
    components["ReportBody"] = {
        "oneOf": [
            {"$ref": "#/components/schemas/MaingradReport"},
            {"$ref": "#/components/schemas/SarifLog"},
        ]
    }
    components["RuntimeRecord"] = record_schema(limits)
    components["RecordsBody"] = {
        **records_body_schema(limits),
        "items": {"$ref": "#/components/schemas/RuntimeRecord"},
    }
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for path, item in schema.get("paths", {}).items():
        for method, op in item.items():
            responses = op.setdefault("responses", {})
            if path.startswith(API_PREFIX):
                for code, text in _ERRORS.items():
                    responses.setdefault(code, {"description": text})
            for code, resp in responses.items():
                if code.isdigit() and int(code) >= 400:
                    resp["content"] = {problems.PROBLEM_JSON: {"schema": _PROBLEM_REF}}
                    if resp.get("description") in (None, "", "Validation Error"):
                        resp["description"] = _ERRORS.get(code, "Error.")
            if method in ("post", "patch", "put") and path.startswith(API_PREFIX):
                responses.setdefault(
                    "413",
                    {
                        "description": "Request body too large.",
                        "content": {problems.PROBLEM_JSON: {"schema": _PROBLEM_REF}},
                    },
                )
                responses.setdefault(
                    "415",
                    {
                        "description": "Unsupported Content-Encoding.",
                        "content": {problems.PROBLEM_JSON: {"schema": _PROBLEM_REF}},
                    },
                )
    app.openapi_schema = schema
    return schema
