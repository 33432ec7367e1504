"""End to end on the real test beds: `maingrad check` on megatron-core 0.18.2 -> `maingrad upload` ->
`maingrad gate` fails with the MG001 findings; 0.19.2 (the upstream fix, #5209) as the next commit on the
default branch -> the gate shows them fixed. 0.19.2 also adds `FusedSharedExpertMLP`, whose fused
GroupedLinear ops repeat the unexposed pattern (new MG001 findings, kept on purpose: see docs/rules/MG001.md);
they fail the gate until a person triages them, after which it passes. A real server process, the real CLI,
no fakes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from svc_helpers import Server, cli_env, run_cli

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from testbeds import testbed as unpacked_testbed  # noqa: E402 (not named test*: pytest would collect it)

pytestmark = pytest.mark.slow
ENV = cli_env(keep_test_database=False)


def mg(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, cwd=cwd, env=ENV, timeout=600)


def analyze(name: str, out: Path) -> dict:  # type: ignore[type-arg]
    root = unpacked_testbed(name)
    run = mg("check", "--format", "json", "--no-cache", "--output", str(out), ".", cwd=root)
    assert run.returncode in (0, 1), run.stderr  # 1: findings
    return json.loads(out.read_text())


def test_megatron_018_fails_and_019_fixes_it(tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'maingrad.db'}"
    server = Server(db_url, tmp_path).start()
    try:
        created = mg(
            "token", "create", "--project", "megatron-lm", "--database-url", db_url,
            "--scope", "upload", "--scope", "read", "--scope", "triage", cwd=tmp_path,
        )  # fmt: skip
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
        failing = [f for f in body["new"] if f["level"] == "error"]
        assert {(f["path"], f["rule"]) for f in failing} == {
            ("megatron/core/transformer/moe/shared_experts.py", "MG001")
        }, json.dumps(body["new"], indent=1)[:3000]
        assert gate.returncode == 1 and body["status"] == "fail"

        token = created.stdout.strip()
        for alert in _alerts(server.url, token, "megatron-lm"):
            if alert["fingerprint"] in {f["fingerprint"] for f in failing}:
                _dismiss(server.url, token, "megatron-lm", alert["id"])
        gate = mg("gate", *remote, "--commit", new, "--format", "json", cwd=tmp_path)
        body = json.loads(gate.stdout)
        assert gate.returncode == 0 and body["status"] == "pass", json.dumps(body["new"], indent=1)[:3000]
        text = mg("gate", *remote, "--commit", new, cwd=tmp_path)
        assert "PASS" in text.stdout and "fixed" in text.stdout
    finally:
        server.stop()


def _api(url: str, token: str, method: str = "GET", body: dict | None = None) -> dict:  # type: ignore[type-arg]
    request = urllib.request.Request(
        url,
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def _alerts(base: str, token: str, project: str) -> list[dict]:  # type: ignore[type-arg]
    items, cursor = [], None
    while True:
        page = _api(
            f"{base}/api/v1/projects/{project}/alerts" + (f"?cursor={cursor}" if cursor else ""), token
        )
        items += page["items"]
        cursor = page["next_cursor"]
        if not cursor:
            return items


def _dismiss(base: str, token: str, project: str, alert_id: int) -> None:
    reason = {"state": "dismissed", "reason": "wont_fix", "comment": "Blackwell-only CuTe path (MXFP8/NVFP4)"}
    done = _api(f"{base}/api/v1/projects/{project}/alerts/{alert_id}", token, "PATCH", reason)
    assert done["state"] == "dismissed"
