"""End to end on the real test beds: `maingrad check` on megatron-core 0.18.2 -> `maingrad upload` ->
`maingrad gate` fails with the MG001 findings; 0.19.2 (the upstream fix, #5209) as the next commit on the
default branch -> the gate shows them fixed and passes. A real server process, the real CLI, no fakes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from svc_helpers import SECRET, Server

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from testbeds import testbed as unpacked_testbed  # noqa: E402 (not named test*: pytest would collect it)

pytestmark = pytest.mark.slow
ENV = {k: v for k, v in os.environ.items() if not k.startswith(("MAINGRAD_", "GITHUB_", "CI_"))}
ENV["MAINGRAD_SECRET"] = SECRET


def mg(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "maingrad.cli.main", *args],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )


def analyze(name: str, out: Path) -> dict:  # type: ignore[type-arg]
    root = unpacked_testbed(name)
    run = mg("check", "--format", "json", "--no-cache", "--output", str(out), ".", cwd=root)
    assert run.returncode in (0, 1), run.stderr  # 1: findings
    return json.loads(out.read_text())


def test_megatron_018_fails_and_019_fixes_it(tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'maingrad.db'}"
    server = Server(db_url, tmp_path).start()
    try:
        created = mg("token", "create", "--project", "megatron-lm", "--database-url", db_url, cwd=tmp_path)
        assert created.returncode == 0, created.stderr
        remote = ["--url", server.url, "--token", created.stdout.strip(), "--project", "megatron-lm"]
        old, new = "18" * 20, "19" * 20  # two consecutive commits of the default branch

        r18 = analyze("megatron-core-0.18.2", tmp_path / "r18.json")
        mg001 = {(f["path"], f["fingerprint"]) for f in r18["findings"] if f["rule"] == "MG001"}
        assert any(path.endswith("transformer/moe/experts.py") for path, _ in mg001), r18["findings"]
        up = mg(
            "upload", str(tmp_path / "r18.json"), *remote, "--commit", old, "--branch", "main", cwd=tmp_path
        )
        assert up.returncode == 0, up.stderr
        gate = mg("gate", *remote, "--commit", old, "--format", "json", cwd=tmp_path)
        body = json.loads(gate.stdout)
        assert gate.returncode == 1 and body["status"] == "fail"
        failing = {(f["path"], f["rule"]) for f in body["new"] if f["level"] == "error"}
        assert {("megatron/core/transformer/moe/experts.py", "MG001")} <= failing

        analyze("megatron-core-0.19.2", tmp_path / "r19.json")
        up = mg(
            "upload", str(tmp_path / "r19.json"), *remote, "--commit", new, "--branch", "main", cwd=tmp_path
        )
        assert up.returncode == 0, up.stderr
        gate = mg("gate", *remote, "--commit", new, "--format", "json", cwd=tmp_path)
        body = json.loads(gate.stdout)
        assert body["baseline"]["commit_sha"] == old and body["baseline"]["how"] == "default_branch"
        fixed = {(f["path"], f["rule"]) for f in body["fixed"]}
        assert ("megatron/core/transformer/moe/experts.py", "MG001") in fixed, body["fixed"]
        assert gate.returncode == 0 and body["status"] == "pass", json.dumps(body["new"], indent=1)[:3000]
        text = mg("gate", *remote, "--commit", new, cwd=tmp_path)
        assert "PASS" in text.stdout and "fixed" in text.stdout
    finally:
        server.stop()
