"""RFC 9457 problem details for every error we answer, with a machine-readable `code`."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

PROBLEM_JSON = "application/problem+json"
log = logging.getLogger("maingrad.service")


class ProblemError(Exception):
    """Raise anywhere in a request to answer with a problem document."""

    def __init__(
        self,
        status: int,
        code: str,
        detail: str = "",
        *,
        title: str | None = None,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(detail or code)
        self.status = status
        self.code = code
        self.detail = detail
        self.title = title or HTTPStatus(status).phrase
        self.headers = headers or {}
        self.extra = extra


def problem_body(
    status: int, code: str, detail: str, title: str | None = None, **extra: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "type": f"urn:maingrad:problem:{code.replace('_', '-')}",
        "title": title or HTTPStatus(status).phrase,
        "status": status,
        "detail": detail,
        "code": code,
    }
    body.update(extra)
    return body


def problem_response(
    status: int,
    code: str,
    detail: str,
    *,
    instance: str | None = None,
    headers: dict[str, str] | None = None,
    title: str | None = None,
    **extra: Any,
) -> JSONResponse:
    body = problem_body(status, code, detail, title, **extra)
    if instance:
        body["instance"] = instance
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON, headers=headers)


_STATUS_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "validation_failed",
    500: "internal_error",
    503: "unavailable",
}


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def allowed_methods(request: Request) -> list[str]:
    """Every method some route of the application fully matches at this path (included routers too)."""
    from starlette.routing import Match

    allowed = []
    for method in _METHODS:
        scope = {**request.scope, "type": "http", "method": method}
        if any(route.matches(scope)[0] == Match.FULL for route in request.app.router.routes):
            allowed.append(method)
    return allowed


def install(app: FastAPI) -> None:
    @app.exception_handler(ProblemError)
    async def _problem(request: Request, exc: ProblemError) -> JSONResponse:
        return problem_response(
            exc.status,
            exc.code,
            exc.detail,
            instance=request.url.path,
            headers=exc.headers,
            title=exc.title,
            **exc.extra,
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {
                "loc": [str(p) for p in err.get("loc", ())],
                "msg": str(err.get("msg", "")),
                "type": str(err.get("type", "")),
            }
            for err in exc.errors()
        ]
        detail = "; ".join(f"{'.'.join(e['loc'])}: {e['msg']}" for e in errors[:5])
        return problem_response(422, "validation_failed", detail, instance=request.url.path, errors=errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            # FastAPI's answer to an undecodable JSON body; a malformed body is a 422 everywhere else.
            return problem_response(
                422, "invalid_body", "the request body is not valid UTF-8 JSON", instance=request.url.path
            )
        code = _STATUS_CODES.get(exc.status_code, "http_error")
        if exc.status_code == 405:
            # Starlette's Allow names the methods of the first route whose path matched; RFC 9110 wants
            # every method the resource supports (routes of one path are often split by method).
            allow = ", ".join(allowed_methods(request))
            return problem_response(
                405,
                code,
                f"{request.method} is not allowed here (allowed: {allow})",
                instance=request.url.path,
                headers={"Allow": allow},
            )
        if exc.status_code == 413:
            code = "body_too_large"
            limit = getattr(exc, "limit", None)
            extra = {"limit": limit} if limit is not None else {}
            return problem_response(413, code, str(exc.detail), instance=request.url.path, **extra)
        detail = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        headers = dict(exc.headers) if exc.headers else None
        return problem_response(exc.status_code, code, detail, instance=request.url.path, headers=headers)

    from sqlalchemy import exc as sa_exc

    retry_after = str(getattr(getattr(app.state, "settings", None), "retry_after_s", 2))

    async def _database(request: Request, exc: Exception) -> JSONResponse:
        status, code, detail = classify_database_error(exc)
        if status == 503:
            log.warning("database unavailable on %s %s: %s", request.method, request.url.path, exc)
            headers = {"Retry-After": retry_after}
        else:
            log.error("database error on %s %s", request.method, request.url.path, exc_info=exc)
            headers = None
        return problem_response(status, code, detail, instance=request.url.path, headers=headers)

    # Only a database that cannot be reached (or has no free connection for seconds) is an outage: 503 with
    # Retry-After, so clients (and `maingrad gate --wait`) come back. Any other database error is a refused
    # value (422) or a server bug (500), each with the database's reason: answering every one 503 made a
    # query over the bind-parameter limit look like an outage that clients retried forever.
    for kind in (sa_exc.DBAPIError, sa_exc.DisconnectionError, sa_exc.TimeoutError):
        app.add_exception_handler(kind, _database)
    try:  # raw-cursor paths (COPY) raise the driver's own errors
        import psycopg

        app.add_exception_handler(psycopg.Error, _database)
    except ImportError:  # pragma: no cover - the service extra has psycopg
        pass

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return problem_response(500, "internal_error", "unexpected server error", instance=request.url.path)


# PostgreSQL SQLSTATE classes and codes that mean "not reachable now": connection exceptions, too many
# connections, the server shutting down or starting, no disk (class 53 but "out of memory" is left to 500).
_UNREACHABLE_SQLSTATES = ("08", "57P01", "57P02", "57P03", "53300", "53100", "40001", "40P01")
_SQLITE_UNREACHABLE = ("database is locked", "unable to open database", "disk i/o error", "database is full")


def classify_database_error(exc: BaseException) -> tuple[int, str, str]:
    """(status, code, detail) of a database error: 503 only when the database is unreachable or busy."""
    from sqlalchemy import exc as sa_exc

    if isinstance(exc, sa_exc.TimeoutError | sa_exc.DisconnectionError | sa_exc.InterfaceError):
        return 503, "database_unavailable", "the database is unavailable; retry later"
    if getattr(exc, "connection_invalidated", False):
        return 503, "database_unavailable", "the database is unavailable; retry later"
    orig = getattr(exc, "orig", None) or exc
    sqlstate = getattr(orig, "sqlstate", None)
    reason = (str(orig).strip().splitlines() or [type(orig).__name__])[0][:300]
    if sqlstate is not None:
        if sqlstate.startswith(_UNREACHABLE_SQLSTATES):
            return 503, "database_unavailable", "the database is unavailable; retry later"
        if sqlstate.startswith("22"):  # data exception: a value the column cannot hold
            return 422, "invalid_value", f"the database refused a value: {reason}"
        return 500, "database_error", f"the database refused the request: {reason}"
    module = type(orig).__module__
    if (
        module.startswith("psycopg")
        and type(orig).__name__ in ("OperationalError", "InterfaceError")
        and "number of parameters" not in reason  # psycopg's own check of the bind-parameter limit
    ):
        return (
            503,
            "database_unavailable",
            "the database is unavailable; retry later",
        )  # no SQLSTATE: no answer
    if ("sqlite" in module or isinstance(exc, sa_exc.OperationalError)) and any(
        text in reason.lower() for text in _SQLITE_UNREACHABLE
    ):
        return 503, "database_unavailable", "the database is unavailable; retry later"
    if isinstance(exc, sa_exc.DataError):
        return 422, "invalid_value", f"the database refused a value: {reason}"
    return 500, "database_error", f"the database refused the request: {reason}"
