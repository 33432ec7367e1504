"""`maingrad upload | gate | token`: zero-server local mode on SQLite, and the HTTP client against a server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from svc_helpers import SECRET, Server, finding, report

ENV = {**os.environ, "MAINGRAD_SECRET": SECRET}
for var in (
    "MAINGRAD_URL",
    "MAINGRAD_TOKEN",
    "MAINGRAD_PROJECT",
    "MAINGRAD_DATABASE_URL",
    "GITHUB_SHA",
    "GITHUB_REF_NAME",
    "GITHUB_HEAD_REF",
    "CI_COMMIT_SHA",
    "CI_COMMIT_REF_NAME",
):
    ENV.pop(var, None)


def mg(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "maingrad.cli.main", *args],
        cwd=cwd,
        env=env or ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def git(cwd: Path, *args: str) -> str:
    out = subprocess.run(
        ["git", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
        env={
            **ENV,
            "GIT_AUTHOR_NAME": "t",
            "GIT_AUTHOR_EMAIL": "t@t",
            "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@t",
        },
    )
    return out.stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    path = tmp_path / "my-repo"
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    (path / "a.py").write_text("x = 1\n")
    git(path, "add", "a.py")
    git(path, "commit", "-qm", "one")
    return path


def test_local_mode_needs_no_server(repo: Path) -> None:
    (repo / "bad.json").write_text(json.dumps(report(finding())))
    up = mg("upload", "bad.json", cwd=repo)
    assert up.returncode == 0, up.stderr
    first = git(repo, "rev-parse", "HEAD")
    assert "created" in up.stdout and f"my-repo@{first[:12]}" in up.stdout
    assert (repo / "maingrad.db").exists()  # the embedded SQLite file, in the working directory
    gate = mg("gate", cwd=repo)
    assert gate.returncode == 1, gate.stdout + gate.stderr
    assert "FAIL" in gate.stdout and "MG001" in gate.stdout
    # The next commit fixes it: the gate compares with main's previous analysis and passes.
    (repo / "a.py").write_text("x = 2\n")
    git(repo, "commit", "-qam", "two")
    (repo / "good.json").write_text(json.dumps(report()))
    assert mg("upload", "good.json", cwd=repo).returncode == 0
    gate = mg("gate", "--format", "json", cwd=repo)
    body = json.loads(gate.stdout)
    assert gate.returncode == 0 and body["status"] == "pass"
    assert body["baseline"]["commit_sha"] == first and [f["rule"] for f in body["fixed"]] == ["MG001"]


def test_local_mode_errors(repo: Path) -> None:
    assert mg("upload", "missing.json", cwd=repo).returncode == 2
    (repo / "junk.json").write_text("{not json")
    bad = mg("upload", "junk.json", cwd=repo)
    assert bad.returncode == 2 and "invalid_json" in bad.stderr
    assert mg("gate", "--project", "nope", cwd=repo).returncode == 2
    (repo / "r.json").write_text(json.dumps(report()))
    assert mg("upload", "r.json", "--commit", "abcdef1", cwd=repo).returncode == 0
    pending = mg("gate", "--commit", "1234567", cwd=repo)
    assert pending.returncode == 2 and "PENDING" in pending.stdout


def test_http_mode_tokens_wait_and_revoke(fresh_database_url: str, tmp_path: Path, repo: Path) -> None:
    server = Server(fresh_database_url, tmp_path).start()
    try:
        db = ["--database-url", fresh_database_url]
        created = mg(
            "token", "create", "--project", "web", "--scope", "upload", "--scope", "read", *db, cwd=tmp_path
        )
        assert created.returncode == 0, created.stderr
        token = created.stdout.strip()
        assert token.startswith("mgp_")
        listing = mg("token", "list", *db, cwd=tmp_path)
        assert "web" in listing.stdout and token not in listing.stdout
        remote = ["--url", server.url, "--token", token, "--project", "web"]
        (repo / "bad.json").write_text(json.dumps(report(finding())))
        up = mg("upload", "bad.json", *remote, "--commit", "abc1234", "--branch", "main", cwd=repo)
        assert up.returncode == 0, up.stderr
        assert mg("gate", *remote, "--commit", "abc1234", cwd=repo).returncode == 1
        # --wait polls while pending: an upload that lands during the wait is picked up.
        later = threading.Timer(
            1.5, lambda: mg("upload", "bad.json", *remote, "--commit", "def5678", "--branch", "x", cwd=repo)
        )
        later.start()
        started = time.monotonic()
        waited = mg("gate", *remote, "--commit", "def5678", "--wait", "60", cwd=repo)
        later.join()
        assert waited.returncode == 0, waited.stdout + waited.stderr  # same finding as main: unchanged, pass
        assert "PASS" in waited.stdout and time.monotonic() - started < 60
        timeout = mg("gate", *remote, "--commit", "fff0000", "--wait", "1", cwd=repo)
        assert timeout.returncode == 2 and "pending" in timeout.stderr
        token_id = created.stderr.split()[1]
        assert mg("token", "revoke", token_id, *db, cwd=tmp_path).returncode == 0
        denied = mg("upload", "bad.json", *remote, "--commit", "abc1234", cwd=repo)
        assert denied.returncode == 2 and "401" in denied.stderr
    finally:
        server.stop()
    down = mg(
        "gate", "--url", server.url, "--token", "x", "--project", "web", "--commit", "abc1234", cwd=repo
    )
    assert down.returncode == 2 and "no answer" in down.stderr


def test_check_does_not_import_the_service() -> None:
    code = "import sys, maingrad.cli.main as m; m.build_parser(); print(sorted(k for k in sys.modules if k.split('.')[0] in ('fastapi', 'sqlalchemy', 'uvicorn', 'starlette')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
