"""The dashboard: server-rendered pages (Jinja2) for people; plots are inline SVG drawn here.

Sign-in stores a token in an HttpOnly, SameSite=Strict cookie; every page re-checks it the way the API
does, so the dashboard shows exactly what that token may read. `MAINGRAD_PUBLIC_DASHBOARD=true` skips it.
"""

from __future__ import annotations

import hmac
import secrets
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from maingrad.service import auth, records
from maingrad.service.api.deps import get_session
from maingrad.service.api.routes.reports import commits_page
from maingrad.service.dashboard.svg import timeline_svg
from maingrad.service.gate import compute_gate
from maingrad.service.models import Alert, Project, Record, Run
from maingrad.service.problems import ProblemError
from maingrad.service.tokens import expand_scopes

HERE = Path(__file__).parent
COOKIE = "maingrad_token"
LOGIN_CSRF_COOKIE = "maingrad_login_csrf"
CSP = "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'none'; frame-ancestors 'none'"
templates = Jinja2Templates(directory=str(HERE / "templates"))
router = APIRouter(include_in_schema=False)

SessionDep = Annotated[Session, Depends(get_session)]


class LoginRequired(Exception):
    pass


class PageError(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


def _viewer(request: Request, session: Session) -> auth.Principal:
    settings = request.app.state.settings
    if settings.public_dashboard:
        return auth.Principal(None, "public", None, expand_scopes({"read"}))
    token = request.cookies.get(COOKIE)
    if not token:
        raise LoginRequired
    try:
        principal = auth.authenticate(session, settings, token)
    except ProblemError:
        raise LoginRequired from None
    if "read" not in principal.scopes:
        # Every page shows project data (the home page shows each project's latest verdict): an upload-only
        # token set as the cookie by hand sees none of it, like the API.
        raise PageError(403, "this token cannot read: sign in with a token that has the read scope")
    return principal


def _render(request: Request, name: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    response = templates.TemplateResponse(request, name, context, status_code=status_code)
    response.headers["Content-Security-Policy"] = CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    # Pages show project data to a signed-in viewer: no browser or proxy cache may keep them.
    response.headers["Cache-Control"] = "no-store"
    return response


def _project(session: Session, viewer: auth.Principal, name: str) -> Project:
    try:
        return auth.authorize(session, viewer, name, "read")
    except ProblemError as exc:
        raise PageError(exc.status, exc.detail) from None


def _login_page(request: Request, error: str | None, status_code: int = 200) -> HTMLResponse:
    """The sign-in form with a fresh CSRF nonce, set as a SameSite=Strict cookie and echoed in the form.

    Without it another site could post its own token to /login and sign the visitor in as itself (login
    CSRF): what the visitor then uploads or reads goes to the attacker's project. A cross-site POST does not
    carry the Strict cookie, so its nonce cannot match."""
    nonce = secrets.token_urlsafe(24)
    response = _render(request, "login.html", status_code=status_code, error=error, csrf=nonce)
    response.set_cookie(
        LOGIN_CSRF_COOKIE,
        nonce,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        max_age=3600,
        path="/login",
    )
    return response


def _same_origin(request: Request) -> bool:
    """False only for an Origin naming another host. No Origin, or "null", tells nothing: browsers send "null"
    for the dashboard's own form because its pages set `Referrer-Policy: no-referrer` (Chromium does), and a
    sandboxed or cross-site context that also sends "null" carries no SameSite=Strict cookie, so the nonce
    check refuses it."""
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        return True
    # Host only: behind a TLS-terminating proxy the page is https and the request reaching us http.
    return origin.rstrip("/").split("://", 1)[-1] == request.headers.get("host", request.url.netloc)


@router.get("/login", response_class=HTMLResponse)
def login_form(request: Request) -> HTMLResponse:
    return _login_page(request, None)


@router.post("/login", response_class=HTMLResponse)
def login(
    request: Request,
    session: SessionDep,
    token: Annotated[str, Form(max_length=200)],
    csrf: Annotated[str, Form(max_length=100)] = "",
) -> Response:
    expected = request.cookies.get(LOGIN_CSRF_COOKIE, "")
    if not (csrf and expected and hmac.compare_digest(csrf, expected)) or not _same_origin(request):
        return _login_page(request, "the sign-in form expired or came from another site; sign in again", 403)
    try:
        principal = auth.authenticate(session, request.app.state.settings, token)
    except ProblemError as exc:
        return _login_page(request, exc.detail)  # the form again, with the reason
    if "read" not in principal.scopes:
        return _login_page(request, "this token cannot read")
    response = RedirectResponse("/", status_code=303, headers={"Cache-Control": "no-store"})
    response.delete_cookie(LOGIN_CSRF_COOKIE, path="/login")
    response.set_cookie(
        COOKIE,
        token.strip(),
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        max_age=86400 * 7,
    )
    return response


@router.post("/logout")
def logout() -> Response:
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(COOKIE)
    return response


@router.get("/", response_class=HTMLResponse)
def home(request: Request, session: SessionDep) -> HTMLResponse:
    viewer = _viewer(request, session)
    query = select(Project).order_by(Project.name)
    if viewer.project_id is not None:
        query = query.where(Project.id == viewer.project_id)
    rows = []
    for project in session.execute(query.limit(500)).scalars():
        page = commits_page(session, project.id, None, 1)
        latest = page["items"][0] if page["items"] else None
        gate = (
            compute_gate(session, request.app.state.settings, project, latest["sha"]).body if latest else None
        )
        rows.append({"project": project, "latest": latest, "gate": gate})
    return _render(request, "home.html", rows=rows, viewer=viewer)


@router.get("/projects/{name}", response_class=HTMLResponse)
def project_page(request: Request, name: str, session: SessionDep, cursor: str | None = None) -> HTMLResponse:
    viewer = _viewer(request, session)
    project = _project(session, viewer, name)
    settings = request.app.state.settings
    page = commits_page(session, project.id, cursor, 25)
    commits = [{**c, "gate": compute_gate(session, settings, project, c["sha"]).body} for c in page["items"]]
    runs = list(
        session.execute(
            select(Run).where(Run.project_id == project.id).order_by(Run.id.desc()).limit(25)
        ).scalars()
    )
    alert_counts = dict(
        session.execute(
            select(Alert.state, func.count()).where(Alert.project_id == project.id).group_by(Alert.state)
        ).all()
    )
    return _render(
        request,
        "project.html",
        project=project,
        commits=commits,
        next_cursor=page["next_cursor"],
        runs=runs,
        alert_counts=alert_counts,
        viewer=viewer,
    )


@router.get("/projects/{name}/commits/{sha}", response_class=HTMLResponse)
def commit_page(
    request: Request, name: str, sha: str, session: SessionDep, base: str | None = None
) -> HTMLResponse:
    viewer = _viewer(request, session)
    project = _project(session, viewer, name)
    sha = sha.lower()[:64]
    gate = compute_gate(
        session, request.app.state.settings, project, sha, base.lower()[:64] if base else None
    ).body
    runs = list(
        session.execute(
            select(Run).where(Run.project_id == project.id, Run.commit_sha == sha).order_by(Run.id)
        ).scalars()
    )
    return _render(request, "commit.html", project=project, sha=sha, gate=gate, runs=runs, viewer=viewer)


@router.get("/projects/{name}/runs/{run}", response_class=HTMLResponse)
def run_page(request: Request, name: str, run: str, session: SessionDep) -> HTMLResponse:
    viewer = _viewer(request, session)
    project = _project(session, viewer, name)
    row = session.execute(
        select(Run).where(Run.project_id == project.id, Run.name == run)
    ).scalar_one_or_none()
    if row is None:
        raise PageError(404, f"no run {run!r} in this project")
    points = records.timeline(session, row)
    return _render(
        request,
        "run.html",
        project=project,
        run=row,
        plot=timeline_svg(points, f"run {row.name}: main_grad per step"),
        points=len(points),
        modules=records.aggregates(session, row, Record.module),
        ranks=records.aggregates(session, row, Record.rank),
        anomalies=records.anomalies(session, row),
        anomaly_codes=records.anomaly_summary(session, row),
        viewer=viewer,
    )


@router.get("/projects/{name}/alerts", response_class=HTMLResponse)
def alerts_page(request: Request, name: str, session: SessionDep, state: str | None = None) -> HTMLResponse:
    viewer = _viewer(request, session)
    project = _project(session, viewer, name)
    query = select(Alert).where(Alert.project_id == project.id).order_by(Alert.id.desc()).limit(200)
    if state in ("open", "dismissed", "fixed"):
        query = query.where(Alert.state == state)
    alerts = list(session.execute(query).scalars())
    return _render(request, "alerts.html", project=project, alerts=alerts, state=state, viewer=viewer)


@router.get("/favicon.ico")
def favicon() -> Response:
    return Response((HERE / "static" / "favicon.svg").read_bytes(), media_type="image/svg+xml")


def mount(app: FastAPI) -> None:
    app.include_router(router)
    app.mount("/static", StaticFiles(directory=str(HERE / "static")), name="static")

    @app.exception_handler(LoginRequired)
    async def _login(request: Request, exc: LoginRequired) -> Response:
        return RedirectResponse("/login", status_code=303)

    @app.exception_handler(PageError)
    async def _page_error(request: Request, exc: PageError) -> Response:
        return _render(request, "error.html", status_code=exc.status, status=exc.status, detail=exc.detail)
