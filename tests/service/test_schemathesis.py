"""Contract fuzzing with schemathesis, all checks, every phase, against a real `maingrad serve` per backend.

Runs schemathesis's own command line (`st run --checks all`: examples, coverage, fuzzing and stateful phases,
deterministic generation, bounded examples per operation) rather than its pytest plugin, whose pytest
integration breaks across pytest majors. A project named `demo` (the documented example of the `project`
path parameter) is seeded so generated requests reach the handlers; 0 failures is the bar, on SQLite and on
PostgreSQL.

Three operations enforce a rule their schema cannot state, and are allowed a 422 for schema-valid input
(schemathesis's documented tuning for cross-field rules): a token's `expires_at` must be in the future (a token
is never born expired), a record's `run` must be the run in the URL, one batch naming one commit, and an end
marker's rank is below its world size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
from svc_helpers import ADMIN, Server, finding, ndjson, record, report, sha

HERE = Path(__file__).resolve().parent
MAX_EXAMPLES = 20  # per operation and phase
# Small count limits (they are in the published schemas): the coverage phase sends bodies one past every
# maxItems, and 25,001 SARIF results per case would make the run take minutes instead of about one.
LIMITS = {
    "MAINGRAD_MAX_RESULTS_PER_RUN": "50",
    "MAINGRAD_MAX_RUNS": "3",
    "MAINGRAD_MAX_RECORDS_PER_BATCH": "50",
}

CONFIG = """
# 413 is how the service refuses a body over a size or count limit (maxItems of results, runs, records).
[checks.negative_data_rejection]
expected-statuses = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429"]

[[operations]]
include-path = "/api/v1/projects/{project}/tokens"
include-method = "POST"
checks.positive_data_acceptance.expected-statuses = ["2xx", "401", "403", "404", "409", "422"]

[[operations]]
include-path = "/api/v1/projects/{project}/runs/{run}/records"
include-method = "POST"
checks.positive_data_acceptance.expected-statuses = ["2xx", "401", "403", "404", "409", "422"]

[[operations]]
include-path = "/api/v1/projects/{project}/runs/{run}/end"
include-method = "POST"
checks.positive_data_acceptance.expected-statuses = ["2xx", "401", "403", "404", "409", "422"]
"""


def seed(server: Server) -> None:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    r = httpx.post(f"{server.url}/api/v1/projects", json={"name": "demo"}, headers=admin)
    assert r.status_code == 201, r.text
    base = f"{server.url}/api/v1/projects/demo"
    for i, branch in enumerate(("main", "feature")):
        r = httpx.post(
            f"{base}/reports",
            params={"commit_sha": sha(i), "branch": branch},
            content=json.dumps(report(finding(line=3 + i))),
            headers=admin,
        )
        assert r.status_code == 201, r.text
    r = httpx.post(
        f"{base}/runs/run-1/records", content=ndjson([record("run-1", i) for i in range(5)]), headers=admin
    )
    assert r.status_code == 200, r.text


def test_api_conforms_to_its_schema_with_all_checks(fresh_database_url: str, tmp_path: Path) -> None:
    server = Server(fresh_database_url, tmp_path, env_extra=LIMITS).start()
    try:
        seed(server)
        config = tmp_path / "schemathesis.toml"
        config.write_text(CONFIG)
        env = {**os.environ, "SCHEMATHESIS_HOOKS": "st_hooks", "PYTHONPATH": str(HERE)}
        result = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run"]
            + [
                f"{server.url}/api/v1/openapi.json",
                "--checks",
                "all",
                "--phases",
                "examples,coverage,fuzzing,stateful",
            ]
            + ["--max-examples", str(MAX_EXAMPLES), "--generation-deterministic", "--workers", "1"]
            + ["-H", f"Authorization: Bearer {ADMIN}", "--no-color"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        output = result.stdout + result.stderr
        assert result.returncode == 0, output[-15000:]
        assert "Tested: 26" in output and "❌" not in output, output[-8000:]
        assert "Errors:" not in output, output[-8000:]
        assert not server.proc or server.proc.poll() is None, server.log()[-3000:]
        assert "Traceback" not in server.log(), server.log()[-5000:]
    finally:
        server.stop()
