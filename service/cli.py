"""`maingrad serve | upload | gate | token`: the service's commands.

Imports stay lazy: registering these commands costs nothing, so `maingrad check` never imports FastAPI,
SQLAlchemy or uvicorn. `upload` and `gate` talk to a server when given `--url` (or MAINGRAD_URL) and
otherwise run in-process on the database (default: the SQLite file maingrad.db in the current directory).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from maingrad.contracts.extras import install_hint
from maingrad.service.identifiers import COMMIT_RE

EXIT_OK, EXIT_FAIL, EXIT_ERROR = 0, 1, 2
_PROJECT_OK = re.compile(r"[^A-Za-z0-9._-]+")


def default_workers() -> int:
    """One worker process per CPU this process may run on, at most 8 (each worker is one event loop and one
    GIL: on the 2-core reference machine two workers ingest 62k records/s where one does 38k)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 8))


def register(subparsers: Any) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="run the maingrad service (API, dashboard, CI gate)",
        description="Run the maingrad service. Every MAINGRAD_* setting (docs/service.md) is read from the "
        "environment; errors in them, or a database that cannot be opened, are reported before the server starts.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="TCP port")
    serve.add_argument(
        "--database-url",
        default=os.environ.get("MAINGRAD_DATABASE_URL", "sqlite:///maingrad.db"),
        help="SQLite file or postgresql+psycopg:// URL; $MAINGRAD_DATABASE_URL sets the default",
    )
    serve.add_argument(
        "--workers",
        type=int,
        default=default_workers(),
        help="worker processes; the default is one per available CPU, at most 8",
    )
    serve.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="log level",
    )
    serve.add_argument("--no-access-log", action="store_true", help="skip per-request log lines (faster)")
    serve.set_defaults(handler=cmd_serve)

    upload = subparsers.add_parser("upload", help="upload a report (maingrad JSON or SARIF) for a commit")
    upload.add_argument("report", help="report file, or - for stdin")
    _remote_args(upload)
    upload.add_argument("--commit", help="commit SHA or revision id (default: from CI variables or git)")
    upload.add_argument("--branch", help="branch (default: from CI variables or git)")
    upload.add_argument("--category", help="analysis category (default: the tool's name)")
    upload.add_argument("--idempotency-key")
    upload.set_defaults(handler=cmd_upload)

    gate = subparsers.add_parser(
        "gate", help="the CI gate for a commit (exit 0 pass/neutral, 1 fail, 2 error or still pending)"
    )
    _remote_args(gate)
    gate.add_argument("--commit", help="commit SHA or revision id (default: from CI variables or git)")
    gate.add_argument("--base", help="baseline commit (default: latest analysis on the default branch)")
    gate.add_argument(
        "--require",
        action="append",
        metavar="EVIDENCE",
        help="evidence the commit needs before the gate decides, repeatable: an analysis category (e.g. "
        "maingrad) or 'runtime' (runtime records); default: $MAINGRAD_REQUIRE (comma-separated), else the "
        "project's required_evidence",
    )
    gate.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="poll while the gate is pending or the server unavailable; the deadline bounds every request",
    )
    gate.add_argument("--format", choices=("text", "json"), default="text")
    gate.set_defaults(handler=cmd_gate)

    token = subparsers.add_parser("token", help="create, revoke or list API tokens")
    token_sub = token.add_subparsers(dest="token_command", metavar="ACTION")
    create = token_sub.add_parser("create", help="mint a token (printed once)")
    _remote_args(create)
    create.add_argument("--admin", action="store_true", help="an instance-wide admin token (local mode only)")
    create.add_argument(
        "--scope",
        action="append",
        choices=("upload", "read", "triage", "admin"),
        help="repeatable (default: upload, read)",
    )
    create.add_argument("--name", default="")
    create.add_argument("--expires-in-days", type=int, metavar="DAYS", help="1 to 3650 (default: never)")
    create.set_defaults(handler=cmd_token_create)
    revoke = token_sub.add_parser("revoke", help="revoke a token by id")
    _remote_args(revoke)
    revoke.add_argument("token_id", type=int)
    revoke.set_defaults(handler=cmd_token_revoke)
    listing = token_sub.add_parser("list", help="list tokens (local mode)")
    listing.add_argument("--project")
    listing.add_argument("--database-url")
    listing.set_defaults(handler=cmd_token_list)
    token.set_defaults(handler=lambda args: (token.print_help(sys.stderr), EXIT_ERROR)[1])
    for parser in (serve, upload, gate, create, revoke, listing):
        parser.set_defaults(handler=_one_line_errors(parser.get_default("handler")))


def _remote_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", help="server URL (default: $MAINGRAD_URL; none: work on the database directly)"
    )
    parser.add_argument("--token", help="API token (default: $MAINGRAD_TOKEN)")
    parser.add_argument(
        "--project",
        help="project (default: $MAINGRAD_PROJECT; with --url and a project token, the token's project; "
        "else the name of the git repository's top folder, or of the current folder outside git)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="with --url: deadline of each command's requests, retries included (gate --wait sets its own)",
    )
    parser.add_argument(
        "--database-url", help="local mode: default $MAINGRAD_DATABASE_URL or sqlite:///maingrad.db"
    )


def _one_line_errors(handler: Any) -> Any:
    """Every failure of a service command is one line on stderr and exit 2, never a traceback (set
    MAINGRAD_DEBUG=1 to see it): a bad setting, a database URL that cannot be opened, an unreadable file."""

    def run(args: argparse.Namespace) -> int:
        try:
            return int(handler(args) or 0)
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            if os.environ.get("MAINGRAD_DEBUG"):
                raise
            return _err(describe_error(exc))

    run.__name__ = getattr(handler, "__name__", "run")
    return run


def describe_error(exc: BaseException) -> str:
    """One line for the errors users cause (settings, database URLs, files), and a terse one otherwise."""
    hint = install_hint(exc)
    if hint is not None:  # a light install without the service extra
        return hint
    name = type(exc).__name__
    module = type(exc).__module__
    if name == "ValidationError" and module.startswith("pydantic"):
        errors = exc.errors()  # type: ignore[attr-defined]
        parts = [f"MAINGRAD_{'_'.join(str(p) for p in e['loc']).upper()}: {e['msg']}" for e in errors[:3]]
        return "bad setting: " + "; ".join(parts)
    if module.startswith("sqlalchemy"):
        orig = getattr(exc, "orig", None)
        text = str(orig if orig is not None else exc).strip().splitlines()
        first = text[0] if text else name
        if name in ("ArgumentError", "NoSuchModuleError"):
            return f"bad database URL: {first}"
        return f"database error ({name}): {first}"
    if isinstance(exc, OSError):
        return f"{exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}"
    message = str(exc).strip().splitlines()
    return f"{name}: {message[0] if message else ''} (MAINGRAD_DEBUG=1 shows the traceback)"


# --- helpers -------------------------------------------------------------------------------------------


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    value = out.stdout.strip()
    return value if out.returncode == 0 and value else None


def detect_commit() -> str | None:
    for var in ("MAINGRAD_COMMIT", "GITHUB_SHA", "CI_COMMIT_SHA", "BUILDKITE_COMMIT", "GIT_COMMIT"):
        if os.environ.get(var):
            return os.environ[var]
    return _git("rev-parse", "HEAD")


def detect_branch() -> str | None:
    for var in (
        "MAINGRAD_BRANCH",
        "GITHUB_HEAD_REF",
        "GITHUB_REF_NAME",
        "CI_COMMIT_REF_NAME",
        "BUILDKITE_BRANCH",
    ):
        if os.environ.get(var):
            return os.environ[var]
    branch = _git("rev-parse", "--abbrev-ref", "HEAD")
    return None if branch in (None, "HEAD") else branch


def detect_default_branch() -> str:
    ref = _git("symbolic-ref", "--short", "refs/remotes/origin/HEAD")
    return ref.split("/", 1)[1] if ref and "/" in ref else "main"


def detect_project() -> str:
    if os.environ.get("MAINGRAD_PROJECT"):
        return os.environ["MAINGRAD_PROJECT"]
    top = _git("rev-parse", "--show-toplevel")
    name = Path(top).name if top else Path.cwd().name
    return _PROJECT_OK.sub("-", name).strip("-._")[:100] or "default"


def _settings(args: argparse.Namespace) -> Any:
    from maingrad.service.config import Settings

    overrides = {"database_url": args.database_url} if getattr(args, "database_url", None) else {}
    return Settings(**overrides)


def _remote(args: argparse.Namespace) -> Any:
    url = getattr(args, "url", None) or os.environ.get("MAINGRAD_URL")
    if not url:
        return None
    from maingrad.service.client import Client

    return Client(
        url,
        getattr(args, "token", None) or os.environ.get("MAINGRAD_TOKEN"),
        timeout=max(getattr(args, "timeout", 30.0), 0.1),
    )


def _project(args: argparse.Namespace, client: Any = None, deadline: float | None = None) -> str:
    """--project, else $MAINGRAD_PROJECT, else (with a server) the one project a project token sees, else the
    git repository's (or the current folder's) name. A project token belongs to one project: asking the
    server which is what makes `token create --project myproj` then `upload --token ...` work anywhere."""
    if getattr(args, "project", None):
        return args.project
    if os.environ.get("MAINGRAD_PROJECT"):
        return os.environ["MAINGRAD_PROJECT"]
    token = getattr(args, "token", None) or os.environ.get("MAINGRAD_TOKEN") or ""
    if client is not None and token.startswith("mgp_"):
        names = client.projects(deadline=deadline)
        if len(names) == 1:
            return names[0]
    return detect_project()


def _validate_database(settings: Any) -> None:
    """Open the configured database once (a bad URL or an unreachable server becomes one line here)."""
    from sqlalchemy import text

    from maingrad.service.db import make_engine

    engine = make_engine(settings)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    finally:
        engine.dispose()


def _err(message: str) -> int:
    print(f"maingrad: {message}", file=sys.stderr)
    return EXIT_ERROR


# --- commands ------------------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    os.environ["MAINGRAD_DATABASE_URL"] = args.database_url
    if args.workers < 1:
        return _err(f"--workers must be at least 1 (got {args.workers})")
    if not 0 < args.port < 65536:
        return _err(f"--port must be from 1 to 65535 (got {args.port})")
    settings = _settings(args)  # every MAINGRAD_* setting, checked before the server starts
    _validate_database(settings)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    uvicorn.run(
        "maingrad.service.app:create_app",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
        log_level=args.log_level,
        access_log=not args.no_access_log,
    )
    return EXIT_OK


def _read_report(name: str) -> bytes:
    if name == "-":
        return sys.stdin.buffer.read()
    path = Path(name)
    if path.is_dir():
        raise IsADirectoryError(21, "is a directory, not a report file", name)
    return path.read_bytes()


def cmd_upload(args: argparse.Namespace) -> int:
    try:
        data = _read_report(args.report)
    except OSError as exc:
        return _err(f"cannot read {args.report}: {exc.strerror or exc}")
    commit = args.commit or detect_commit()
    if not commit:
        return _err("no commit: pass --commit (not in a git repository, no CI variable)")
    if not COMMIT_RE.match(commit):
        return _err(f"bad commit {commit!r}: a SHA or a revision id of letters, digits, . _ - (at most 64)")
    branch = args.branch or detect_branch()
    client = _remote(args)
    if client is not None:
        from maingrad.service.client import ClientError

        deadline = time.monotonic() + client.timeout
        try:
            project = _project(args, client, deadline)
            status, body = client.upload(
                project,
                data,
                commit_sha=commit,
                branch=branch,
                category=args.category,
                idempotency_key=args.idempotency_key,
                deadline=deadline,
            )
        except ClientError as exc:
            return _err(f"upload failed: {exc}")
    else:
        from maingrad.service import local
        from maingrad.service.problems import ProblemError

        project = _project(args)
        try:
            status, body = local.upload(
                _settings(args),
                project,
                data,
                commit_sha=commit.lower(),
                branch=branch,
                category=args.category,
                default_branch=detect_default_branch(),
                idempotency_key=args.idempotency_key,
            )
        except ProblemError as exc:
            pointer = exc.extra.get("pointer")
            where = f" (at {pointer})" if pointer and pointer not in exc.detail else ""
            return _err(f"upload rejected ({exc.status} {exc.code}): {exc.detail}{where}")
    print(
        f"maingrad upload: analysis {body['id']} {body['outcome']} for {project}@{body['commit_sha'][:12]} "
        f"[{body['category']}] with {body['results_count']} results"
    )
    return EXIT_OK


def _print_gate(body: dict[str, Any]) -> None:
    base = body["baseline"]
    base_text = (
        f"{base['commit_sha'][:12]} ({base['how']})" if base["commit_sha"] else "none (every finding is new)"
    )
    print(
        f"maingrad gate: {body['status'].upper()}  {body['project']}@{body['commit_sha'][:12]}  baseline {base_text}"
    )
    if body.get("reason"):
        print(f"  {body['reason']}")
    for cond in body["conditions"]:
        mark = "ok  " if cond["passed"] else "FAIL"
        print(f"  [{mark}] {cond['description']}: {cond['actual']} ({cond['operator']} {cond['threshold']})")
    s = body["summary"]
    print(f"  new {s['new']} (failing {s['new_failing']}), unchanged {s['unchanged']}, fixed {s['fixed']}")
    for f in body["new"]:
        loc = f"{f['path']}:{f['start_line']}" if f.get("start_line") else f["path"]
        flag = " (dismissed)" if f.get("dismissed") else ""
        print(f"  new   {f['level']:<7} {f['rule']:<8} {loc}: {f['message']}{flag}")
    for f in body["fixed"]:
        loc = f"{f['path']}:{f['start_line']}" if f.get("start_line") else f["path"]
        print(f"  fixed {f['level']:<7} {f['rule']:<8} {loc}: {f['message']}")
    rt = body.get("runtime") or {}
    if rt.get("runs"):
        print(f"  runtime: {len(rt['runs'])} run(s), {rt['records']} records, {rt['anomalies']} anomalies")


def _required(args: argparse.Namespace) -> list[str] | None:
    if args.require:
        return sorted({r.strip() for item in args.require for r in item.split(",") if r.strip()})
    env = os.environ.get("MAINGRAD_REQUIRE", "")
    return sorted({r.strip() for r in env.split(",") if r.strip()}) or None


def cmd_gate(args: argparse.Namespace) -> int:
    commit = args.commit or detect_commit()
    if not commit:
        return _err("no commit: pass --commit (not in a git repository, no CI variable)")
    if not COMMIT_RE.match(commit) or (args.base and not COMMIT_RE.match(args.base)):
        return _err("bad commit: a SHA or a revision id of letters, digits, . _ - (at most 64)")
    require = _required(args)
    client = _remote(args)
    # The deadline bounds everything, every request included: --wait's, else the request timeout.
    budget = args.wait if args.wait > 0 else (client.timeout if client is not None else 0.0)
    deadline = time.monotonic() + budget
    if client is not None and args.wait > 0:
        client.connect_grace = args.wait
    if client is not None:
        from maingrad.service.client import ClientError

        try:
            project = _project(args, client, deadline)
        except ClientError as exc:
            return _err(f"gate failed: {exc}")
    else:
        project = _project(args)
    body: dict[str, Any] | None = None
    while True:
        if client is not None:
            try:
                body = client.gate(project, commit, args.base, require, deadline=deadline)
            except ClientError as exc:
                # No answer or 503 (database down, load shed): the outage may end before the deadline.
                if exc.retryable and args.wait > 0 and time.monotonic() < deadline - 0.1:
                    time.sleep(min(2.0, max(0.1, deadline - time.monotonic() - 0.1)))
                    continue
                if body is None or not exc.retryable:
                    return _err(f"gate failed: {exc}")
                break  # the deadline came during an outage: report the last answer (pending)
        else:
            from maingrad.service import local

            body = local.gate(
                _settings(args), project, commit.lower(), args.base.lower() if args.base else None, require
            )
            if body is None:
                return _err(f"no project {project!r} in the database")
        remaining = deadline - time.monotonic()
        if body["status"] != "pending" or remaining <= 0.25:
            break
        time.sleep(min(2.0, remaining - 0.25))  # the last poll still has time to be answered
    if args.format == "json":
        print(json.dumps(body, indent=2))
    else:
        _print_gate(body)
    if body["status"] in ("pass", "neutral"):
        return EXIT_OK
    if body["status"] == "fail":
        return EXIT_FAIL
    if body["status"] == "pending":
        print(f"maingrad gate: still pending after {args.wait:g}s", file=sys.stderr)
    return EXIT_ERROR


def cmd_token_create(args: argparse.Namespace) -> int:
    scopes = sorted(set(args.scope or ["upload", "read"]))
    if args.expires_in_days is not None and not 1 <= args.expires_in_days <= 3650:
        return _err(f"--expires-in-days must be from 1 to 3650 (got {args.expires_in_days})")
    client = _remote(args)
    if client is not None:
        if args.admin:
            return _err("admin tokens are created in local mode only (on the server's database)")
        from maingrad.service.client import ClientError

        try:
            body = client.create_token(_project(args, client), scopes, args.name, args.expires_in_days)
        except ClientError as exc:
            return _err(f"token create failed: {exc}")
        print(body["token"])
        print(
            f"token {body['id']} for {body['project']} scopes {','.join(body['scopes'])} (shown once)",
            file=sys.stderr,
        )
        return EXIT_OK
    from maingrad.service import local

    project = None if args.admin else _project(args)
    row, secret = local.create_token(
        _settings(args), project, ["admin"] if args.admin else scopes, args.name, args.expires_in_days
    )
    print(secret)
    what = "instance admin" if project is None else f"project {project}, scopes {row.scopes}"
    print(f"token {row.id} ({what}) created; it is shown once", file=sys.stderr)
    return EXIT_OK


def cmd_token_revoke(args: argparse.Namespace) -> int:
    client = _remote(args)
    if client is not None:
        from maingrad.service.client import ClientError

        try:
            client.revoke_token(_project(args, client), args.token_id)
        except ClientError as exc:
            return _err(f"token revoke failed: {exc}")
        print(f"token {args.token_id} revoked")
        return EXIT_OK
    from maingrad.service import local

    row = local.revoke_token(_settings(args), args.token_id)
    if row is None:
        return _err(f"no token {args.token_id}")
    print(f"token {args.token_id} revoked")
    return EXIT_OK


def cmd_token_list(args: argparse.Namespace) -> int:
    from maingrad.service import local

    for row, project in local.list_tokens(_settings(args), args.project):
        state = (
            "revoked"
            if row.revoked_at
            else ("expired" if row.expires_at and row.expires_at.timestamp() < time.time() else "active")
        )
        print(
            f"{row.id:>5}  {row.prefix}…  {project or '(instance)':<20} {row.scopes:<28} {state:<8} {row.name}"
        )
    return EXIT_OK
