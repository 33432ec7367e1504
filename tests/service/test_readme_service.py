"""README's Service block runs as pasted, and every service command fails with one line, never a traceback."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from svc_helpers import SECRET, Server, finding, free_port, report

REPO = Path(__file__).resolve().parents[2]
BIN = str(Path(sys.executable).parent)
CLEAN_ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith(("MAINGRAD_", "GITHUB_", "CI_", "GIT_"))},
    "PATH": BIN + os.pathsep + os.environ.get("PATH", ""),
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@t",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@t",
}


def service_block() -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text[text.index("### Service") :]
    match = re.search(r"```bash\n(.*?)```", section, re.S)
    assert match, "README's Service section has no bash block"
    return match.group(1)


@pytest.mark.parametrize("where", ["fresh clone", "outside git"])
def test_readme_service_block_runs_as_pasted(tmp_path: Path, where: str) -> None:
    block = service_block()
    port = free_port()
    script = block.replace("8000", str(port))  # the only change: a free port instead of 8000
    work = tmp_path / "maingrad-clone"  # a repository name that is not the token's project
    work.mkdir()
    shutil.copytree(REPO / "examples", work / "examples")
    if where == "fresh clone":
        for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-qm", "clone"]):
            subprocess.run(["git", *args], cwd=work, env=CLEAN_ENV, check=True, capture_output=True)
    proc = subprocess.Popen(
        ["bash", "-c", script],
        cwd=work,
        env=CLEAN_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "Traceback" not in err, err
    assert re.search(r"^mgp_\w+$", out, re.M) is None  # the token went into $TOKEN, not to the screen
    assert re.search(r"maingrad upload: analysis \d+ created for myproj@demo-2", out), out + err
    assert "maingrad gate: FAIL  myproj@demo-2" in out, out + err
    assert "MG001" in out
    # `kill %1` stopped the server: the port is free again.
    with pytest.raises(OSError):
        import socket

        socket.create_connection(("127.0.0.1", port), timeout=1).close()


# --- one line and an exit code, never a traceback -------------------------------------------------------


def mg(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "maingrad.cli.main", *args],
        cwd=cwd,
        env={**CLEAN_ENV, "MAINGRAD_SECRET": SECRET, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_line(result: subprocess.CompletedProcess[str], needle: str, code: int = 2) -> None:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("maingrad: ") and needle in result.stderr, result.stderr


def test_every_service_command_fails_in_one_line(tmp_path: Path) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    remote = ["--token", "mgp_x", "--project", "p", "--commit", "abc1234", "--timeout", "1"]
    one_line(mg("upload", "missing.json", "--commit", "abc1234", cwd=tmp_path), "cannot read missing.json")
    one_line(mg("upload", ".", "--commit", "abc1234", cwd=tmp_path), "directory")
    (tmp_path / "r.json").write_text(json.dumps(report()))
    for command in (["upload", "r.json"], ["gate"]):
        one_line(mg(*command, "--url", closed, *remote, cwd=tmp_path), "no answer from")
        one_line(mg(*command, "--url", "localhost:8000", *remote, cwd=tmp_path), "bad URL")
        one_line(mg(*command, "--url", "http://127.0.0.1:99999", *remote, cwd=tmp_path), "bad URL")
    for url in ("postgresql+psycopg://nobody@127.0.0.1:1/none", "nosuchdb://x", "not a url"):
        db = ["--database-url", url]
        one_line(mg("upload", "r.json", "--commit", "abc1234", *db, cwd=tmp_path), "database")
        one_line(mg("gate", "--commit", "abc1234", "--project", "p", *db, cwd=tmp_path), "database")
        one_line(mg("token", "create", "--project", "p", *db, cwd=tmp_path), "database")
        one_line(mg("token", "list", *db, cwd=tmp_path), "database")
        one_line(mg("serve", "--port", str(free_port()), *db, cwd=tmp_path, timeout=60), "database")
    one_line(
        mg("serve", "--port", str(free_port()), cwd=tmp_path, env={"MAINGRAD_MAX_BODY_BYTES": "lots"}),
        "MAINGRAD_MAX_BODY_BYTES",
    )
    one_line(
        mg("token", "create", "--project", "p", "--expires-in-days", "0", cwd=tmp_path), "expires-in-days"
    )
    one_line(mg("upload", "r.json", cwd=tmp_path), "no commit")  # outside git, no CI variable


def test_4xx_reason_is_printed_once_and_never_retried(fresh_database_url: str, tmp_path: Path) -> None:
    server = Server(fresh_database_url, tmp_path).start()
    try:
        created = mg(
            "token", "create", "--project", "alpha", "--database-url", fresh_database_url, cwd=tmp_path
        )
        token = created.stdout.strip()
        bad = report(finding(rule="R" * 300))
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        r = mg(
            "upload", "bad.json", "--url", server.url, "--token", token, "--commit", "abc1234", cwd=tmp_path
        )
        one_line(r, "HTTP 422 invalid_report: /findings/0/rule: longer than 255 characters")
        assert r.stderr.count("longer than 255") == 1
        # The project came from the token: no --project, and the folder's name is not "alpha".
        (tmp_path / "ok.json").write_text(json.dumps(report()))
        ok = mg(
            "upload", "ok.json", "--url", server.url, "--token", token, "--commit", "abc1234", cwd=tmp_path
        )
        assert ok.returncode == 0 and "alpha@abc1234" in ok.stdout, ok.stderr
        metrics = __import__("httpx").get(server.url + "/metrics").text
        posts = [
            line
            for line in metrics.splitlines()
            if line.startswith("maingrad_http_requests_total")
            and 'method="POST"' in line
            and "reports" in line
        ]
        assert any('status="422"' in p and p.endswith(" 1") for p in posts), posts  # sent once, not retried
    finally:
        server.stop()


def test_serve_help_shows_the_defaults(tmp_path: Path) -> None:
    r = mg("serve", "--help", cwd=tmp_path)
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    for default in (
        "(default: 127.0.0.1)",
        "(default: 8000)",
        "(default: sqlite:///maingrad.db)",
        "(default: info)",
    ):
        assert default in text, text
    assert re.search(r"one per available CPU, at most 8 \(default: \d+\)", text), text
    upload = " ".join(mg("upload", "--help", cwd=tmp_path).stdout.split())
    assert "the token's project" in upload and "current folder outside git" in upload
