"""The contract between maingrad.hooks and the service: records valid for the hooks' own schema check are
accepted, and the hooks' HttpSink delivers them to a real server (batched, re-sends harmless)."""

from __future__ import annotations

from pathlib import Path

import httpx
from svc_helpers import ADMIN, Server, record, sha, unique

from maingrad.contracts.records import validate
from maingrad.hooks.records import RunMeta
from maingrad.hooks.sinks import HttpSink


def test_http_sink_delivers_to_the_records_endpoint(tmp_path: Path) -> None:
    server = Server(f"sqlite:///{tmp_path / 'maingrad.db'}", tmp_path).start()
    try:
        h = {"Authorization": f"Bearer {ADMIN}"}
        name = unique()
        httpx.post(f"{server.url}/api/v1/projects", json={"name": name}, headers=h).raise_for_status()
        token = httpx.post(
            f"{server.url}/api/v1/projects/{name}/tokens", json={"scopes": ["upload"]}, headers=h
        ).json()
        commit = sha("hooks")
        records = [record("run-7", i, commit=commit, mode="observe") for i in range(2_500)]
        records[42]["anomaly"] = "main_grad_none"
        assert all(validate(r) == [] for r in records)  # the hooks' own schema check
        sink = HttpSink(server.url, name, token=token["token"], batch_size=1_000)
        sink.open(RunMeta(run="run-7", rank=0, mode="observe", commit=commit))
        sink.emit(records)
        sink.emit(records[:1_000])  # a re-sent batch changes nothing
        sink.close()
        assert sink.failed == 0 and sink.dropped == 0, sink.stats()
        run = httpx.get(f"{server.url}/api/v1/projects/{name}/runs/run-7", headers=h).json()
        assert run["record_count"] == 2_500 and run["commit_sha"] == commit
        gate = httpx.get(
            f"{server.url}/api/v1/projects/{name}/gate", params={"commit_sha": commit}, headers=h
        ).json()
        assert gate["status"] == "fail" and gate["runtime"]["samples"][0]["anomaly"] == "main_grad_none"
    finally:
        server.stop()
