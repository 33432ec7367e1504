"""The gate at 100k findings on both databases (N3), long writes in short transactions (N2), admission
per project and on requests being processed (N4), complete runtime evidence (N5), the CLI's deadline and
Retry-After (N6, N7), and database errors told apart (N8)."""

from __future__ import annotations

import asyncio
import datetime as dt
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import PG_URL, ProjectCtx, new_project
from svc_helpers import (
    ADMIN,
    Server,
    asgi_get,
    finding,
    held_app,
    ndjson,
    record,
    report,
    sarif,
    sarif_result,
    sha,
    unique,
)

from maingrad.contracts.records import end_marker
from maingrad.service import reports as reports_module
from maingrad.service.client import MAX_RETRY_AFTER_S, MIN_RETRY_AFTER_S, Client, ClientError, retry_after_s
from maingrad.service.models import Alert, Finding
from maingrad.service.problems import classify_database_error
from maingrad.service.shedding import LoadShedMiddleware, admission_key

CLI = [sys.executable, "-m", "maingrad.cli.main"]


def _gate(project: ProjectCtx, commit: str, *require: str) -> dict[str, Any]:
    params: dict[str, Any] = {"commit_sha": commit}
    if require:
        params["require"] = list(require)
    r = project.client.get(project.url("/gate"), params=params, headers=project.headers("read"))
    assert r.status_code == 200, r.text
    return r.json()


def _records(project: ProjectCtx, run: str, commit: str, recs: list[dict[str, Any]]) -> None:
    r = project.client.post(
        project.url(f"/runs/{run}/records"),
        params={"commit_sha": commit},
        content=ndjson(recs),
        headers=project.headers("upload"),
    )
    assert r.status_code == 200, r.text


def _end(project: ProjectCtx, run: str, commit: str, rank: int = 0, world: int = 1, lost: int = 0) -> Any:
    r = project.client.post(
        project.url(f"/runs/{run}/end"),
        params={"commit_sha": commit},
        json=end_marker(run, rank, world, 10, lost),
        headers=project.headers("upload"),
    )
    assert r.status_code == 200, r.text
    return r.json()


# --- N3: the gate at 100k findings, on SQLite and PostgreSQL ---------------------------------------------------


def test_n3_gate_answers_at_100k_findings(project: ProjectCtx) -> None:
    """More than 65,535 new findings: the dismissed-alert query used one bind parameter per fingerprint, over
    PostgreSQL's limit, and the commit never got a gate (every poll 503 after seconds)."""
    commit = sha("n3-100k")
    r = project.upload(report(finding()), commit, branch="feature")
    assert r.status_code == 201, r.text
    analysis_id = r.json()["id"]
    db = project.client.app.state.db  # type: ignore[attr-defined]
    n = 100_000
    rows = [
        {
            "analysis_id": analysis_id,
            "run_index": 0,
            "fingerprint": f"{i:032x}",
            "context_hash": None,
            "rule": "MG001",
            "level": "error",
            "severity_rank": 2,
            "path": f"src/m{i % 997}.py",
            "start_line": i % 5000 + 1,
            "start_column": 1,
            "end_line": i % 5000 + 1,
            "end_column": 2,
            "message": f"finding {i}",
            "snippet": "",
            "suppressed": False,
            "sarif": {},
        }
        for i in range(n)
    ]
    now = dt.datetime.now(dt.timezone.utc)
    dismissed = [f"{i:032x}" for i in range(0, n, 9_999)]
    with db.writing() as session:
        conn = session.connection()
        for start in range(0, n, 20_000):
            conn.execute(Finding.__table__.insert(), rows[start : start + 20_000])  # type: ignore[attr-defined]
        pid = conn.exec_driver_sql(
            f"SELECT id FROM projects WHERE name = '{project.name}'"  # noqa: S608 - a test's own name
        ).scalar_one()
        conn.execute(
            Alert.__table__.insert(),  # type: ignore[attr-defined]
            [
                {
                    "project_id": pid,
                    "fingerprint": fp,
                    "category": "maingrad",
                    "rule": "MG001",
                    "level": "error",
                    "severity_rank": 2,
                    "path": "src/x.py",
                    "message": "m",
                    "state": "dismissed",
                    "first_seen_commit": commit,
                    "first_seen_at": now,
                    "last_seen_commit": commit,
                    "last_seen_at": now,
                }
                for fp in dismissed
            ],
        )
    started = time.perf_counter()
    gate = _gate(project, commit, "maingrad")
    elapsed = time.perf_counter() - started
    print(f"\ngate at {n + 1} findings ({db.dialect}): {elapsed:.2f} s")
    assert gate["summary"]["new"] == n + 1 and gate["summary"]["dismissed"] == len(dismissed)
    assert gate["summary"]["new_failing"] == n + 1 - len(dismissed)
    assert gate["status"] == "fail" and gate["truncated"] is True


# --- N2: caps across runs, and long writes in short transactions ---------------------------------------------


def test_n2_results_are_capped_over_all_runs(project: ProjectCtx) -> None:
    run = {"tool": {"driver": {"name": "t"}}, "results": [sarif_result()] * 13_000}
    r = project.upload({"version": "2.1.0", "runs": [run, run]}, sha("n2-cap"))
    assert r.status_code == 413 and r.json()["code"] == "too_many_results", r.text
    assert r.json()["limit"] == 25_000 and "over all its runs" in r.json()["detail"]


def test_n2_large_report_is_written_in_short_transactions(
    project: ProjectCtx, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each write transaction holds at most WRITE_CHUNK_ROWS findings, and between them readers see either the
    previous analysis whole or the new one whole (never a part)."""
    monkeypatch.setattr(reports_module, "WRITE_CHUNK_ROWS", 40)
    db = project.client.app.state.db  # type: ignore[attr-defined]
    commit = sha("n2-chunks")
    first = [sarif_result(rule=f"R{i}", path=f"src/a{i}.py", line=i + 1) for i in range(150)]
    assert project.upload(sarif(*first), commit).status_code == 201
    seen: list[tuple[int, ...]] = []
    real_writing = db.writing

    class Watch:
        def __init__(self) -> None:
            self.cm = real_writing()

        def __enter__(self) -> Any:
            return self.cm.__enter__()

        def __exit__(self, *exc: Any) -> Any:
            out = self.cm.__exit__(*exc)
            listing = project.client.get(
                project.url("/analyses"), params={"commit_sha": commit}, headers=project.headers("read")
            ).json()["items"]
            seen.append(tuple(a["results_count"] for a in listing))
            return out

    monkeypatch.setattr(db, "writing", Watch)
    second = [sarif_result(rule=f"S{i}", path=f"src/b{i}.py", line=i + 1) for i in range(230)]
    r = project.upload(sarif(*second), commit)
    monkeypatch.setattr(db, "writing", real_writing)
    assert r.status_code == 201 and r.json()["outcome"] == "replaced", r.text
    assert len(seen) >= 230 // 40 + 2  # staging, the chunks, the swap, alerts, cleanup
    assert set(seen) == {(150,), (230,)}, seen  # whole old, then whole new
    assert seen.index((230,)) > 230 // 40  # the swap came after every chunk
    gate = _gate(project, commit, "othertool")
    assert gate["summary"]["new"] == 230 and gate["analyses"][0]["results_count"] == 230
    alerts = project.client.get(
        project.url("/alerts"), params={"limit": 500}, headers=project.headers("read")
    ).json()["items"]
    assert sum(1 for a in alerts if a["rule"].startswith("S")) >= 100  # the alerts followed, in chunks
    # Nothing of the retired analysis or the staging is left visible.
    listing = project.client.get(project.url("/analyses"), headers=project.headers("read")).json()["items"]
    assert [a["results_count"] for a in listing if a["commit_sha"] == commit] == [230]


# --- N4: admission per project, on requests being processed ----------------------------------------------------


def test_n4_admission_keys() -> None:
    def scope(path: str, headers: list[tuple[bytes, bytes]] | None = None) -> dict[str, Any]:
        return {"path": path, "headers": headers or []}

    assert admission_key(scope("/api/v1/projects/alpha/gate")) == "p:alpha"
    assert admission_key(scope("/projects/alpha")) == "p:alpha"
    assert admission_key(scope("/api/v1/projects")) == "anon"
    a = admission_key(scope("/api/v1/projects", [(b"authorization", b"Bearer x")]))
    b = admission_key(scope("/api/v1/projects", [(b"authorization", b"Bearer y")]))
    assert a.startswith("t:") and a != b


def test_n4_one_project_cannot_take_every_slot() -> None:
    release = asyncio.Event()
    shed = LoadShedMiddleware(held_app(release), limit=8, retry_after_s=1, per_key_limit=6)

    async def call(path: str) -> int:
        return (await asgi_get(shed, path))[0]

    async def scenario() -> tuple[list[int], list[int]]:
        beta = [asyncio.create_task(call("/api/v1/projects/beta/gate")) for _ in range(20)]
        await asyncio.sleep(0.01)
        alpha = [asyncio.create_task(call("/api/v1/projects/alpha/gate")) for _ in range(2)]
        await asyncio.sleep(0.01)
        release.set()
        return [await t for t in beta], [await t for t in alpha]

    beta, alpha = asyncio.run(scenario())
    assert Counter(beta) == {200: 6, 503: 14}  # beta holds at most its share
    assert alpha == [200, 200]  # alpha still finds room
    assert shed.in_flight == 0 and not shed.per_key


def _slow_sender(url: str, path: str, token: str, stop: threading.Event, out: list[int]) -> None:
    host, port = url.removeprefix("http://").split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            head = (
                f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
            )
            sock.sendall(head.encode())
            sock.settimeout(0.5)
            while not stop.is_set():
                try:
                    answer = sock.recv(200)
                    if answer:
                        out.append(int(answer.split()[1]))
                        return
                except TimeoutError:
                    pass
                sock.sendall(b" ")  # one byte at a time
    except OSError:
        out.append(0)


def test_n4_slow_bodies_of_one_project_do_not_starve_another(tmp_path: Path) -> None:
    """The audit's N4: 130 bodies at 1 byte/s from beta made every gate poll of alpha answer 503."""
    server = Server(
        f"sqlite:///{tmp_path / 'n4.db'}", tmp_path, env_extra={"MAINGRAD_BODY_READ_TIMEOUT_S": "6"}
    ).start()
    stop = threading.Event()
    try:
        h = {"Authorization": f"Bearer {ADMIN}"}
        for name in ("alpha", "beta"):
            httpx.post(f"{server.url}/api/v1/projects", json={"name": name}, headers=h).raise_for_status()
        commit = sha("n4")
        httpx.post(
            f"{server.url}/api/v1/projects/alpha/reports",
            params={"commit_sha": commit, "branch": "main"},
            json=report(),
            headers=h,
        ).raise_for_status()
        answers: list[int] = []
        senders = [
            threading.Thread(
                target=_slow_sender,
                args=(server.url, f"/api/v1/projects/beta/reports?commit_sha={commit}", ADMIN, stop, answers),
                daemon=True,
            )
            for _ in range(130)
        ]
        for t in senders:
            t.start()
        time.sleep(1.5)
        polls = []
        with httpx.Client(timeout=10) as c:
            for _ in range(40):
                polls.append(
                    c.get(
                        f"{server.url}/api/v1/projects/alpha/gate", params={"commit_sha": commit}, headers=h
                    ).status_code
                )
                time.sleep(0.05)
        for t in senders:
            t.join(timeout=20)
        counts = Counter(answers)
        print(f"\nalpha's polls during beta's 130 slow bodies: {Counter(polls)}; beta's answers: {counts}")
        assert polls == [200] * 40
        assert counts[408] >= 1  # admitted slow bodies are cut by the read deadline
        assert counts[503] >= 1  # the rest were refused at once, not queued
        assert counts[408] <= 24  # at most one project's share of receiving slots
    finally:
        stop.set()
        server.stop()


# --- N5: runtime evidence is complete only when the run says so ----------------------------------------------


def test_n5_clean_batch_then_anomalous_batch_never_passes(project: ProjectCtx) -> None:
    commit = sha("n5-repro")
    assert project.upload(report(), commit, branch="feature").status_code == 201
    _records(project, "n5", commit, [record("n5", i, commit=commit) for i in range(8)])
    gate = _gate(project, commit, "maingrad", "runtime")
    assert gate["status"] == "pending" and gate["evidence"]["missing"] == ["runtime"]
    _records(project, "n5", commit, [record("n5", 100, commit=commit, anomaly="main_grad_none")])
    gate = _gate(project, commit, "maingrad", "runtime")  # the anomalous batch (4 s later in the audit)
    assert gate["status"] == "fail" and gate["runtime"]["anomalies"] == 1  # final: records stay
    _end(project, "n5", commit)
    assert _gate(project, commit, "maingrad", "runtime")["status"] == "fail"


def test_n5_every_rank_must_end_and_none_lose_records(project: ProjectCtx) -> None:
    commit = sha("n5-ranks")
    for rank in (0, 1):
        _records(project, "r2", commit, [record("r2", i, rank=rank, commit=commit) for i in range(4)])
    assert _end(project, "r2", commit, rank=0, world=2)["complete"] is False
    gate = _gate(project, commit)
    assert gate["status"] == "pending" and "1 of 2 ranks ended" in gate["reason"]
    assert _end(project, "r2", commit, rank=1, world=2)["complete"] is True
    assert _gate(project, commit)["status"] == "neutral"
    lossy = sha("n5-lost")
    _records(project, "r3", lossy, [record("r3", 0, commit=lossy)])
    assert _end(project, "r3", lossy, lost=7)["complete"] is False
    gate = _gate(project, lossy)
    assert gate["status"] == "pending" and "7 records lost" in gate["reason"]
    bad = project.client.post(
        project.url("/runs/r3/end"),
        json={"rank": 2, "world_size": 2, "records": 0, "lost": 0},
        headers=project.headers("upload"),
    )
    assert bad.status_code == 422 and bad.json()["code"] == "invalid_end_marker"


def test_n5_nothing_required_waits_for_what_main_received_last(client: Any) -> None:
    p = new_project(client)
    main = sha("n5-main")
    assert p.upload(report(), main, branch="main").status_code == 201
    _records(p, "m", main, [record("m", 0, commit=main)])
    _end(p, "m", main)
    head = sha("n5-head")
    assert p.upload(report(), head, branch="feature").status_code == 201
    gate = _gate(p, head)
    assert gate["status"] == "pending" and gate["evidence"]["missing"] == ["runtime"]
    assert gate["evidence"]["source"] == "default_branch"
    explicit = p.client.get(
        p.url("/gate"), params={"commit_sha": head, "base_sha": main}, headers=p.headers("read")
    ).json()
    assert explicit["status"] == "pending" and explicit["evidence"]["source"] == "explicit_base"
    _records(p, "h", head, [record("h", 0, commit=head)])
    _end(p, "h", head)
    assert _gate(p, head)["status"] == "pass"


def test_n5_hooks_sink_sends_the_end_marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from maingrad.hooks.records import RunMeta
    from maingrad.hooks.sinks import HttpSink

    monkeypatch.setenv("WORLD_SIZE", "2")
    server = Server(f"sqlite:///{tmp_path / 'hooks.db'}", tmp_path).start()
    try:
        h = {"Authorization": f"Bearer {ADMIN}"}
        name = unique()
        httpx.post(f"{server.url}/api/v1/projects", json={"name": name}, headers=h).raise_for_status()
        commit = sha("sink-end")
        gate_url = f"{server.url}/api/v1/projects/{name}/gate"
        for rank in (0, 1):
            sink = HttpSink(server.url, name, token=ADMIN, batch_size=10)
            sink.open(RunMeta(run="ranked", rank=rank, mode="observe", commit=commit))
            sink.emit([record("ranked", i, rank=rank, commit=commit, mode="observe") for i in range(25)])
            time.sleep(0.3)
            gate = httpx.get(gate_url, params={"commit_sha": commit}, headers=h).json()
            assert gate["status"] == "pending", gate  # records arrived, this rank has not ended
            sink.close()
            assert sink.ended and sink.stats()["ended"], sink.stats()
            gate = httpx.get(gate_url, params={"commit_sha": commit}, headers=h).json()
            assert gate["status"] == ("pending" if rank == 0 else "neutral"), gate
    finally:
        server.stop()


# --- N6, N7: the CLI's one deadline and a clamped Retry-After ---------------------------------------------------


class _Trickle:
    """A server that answers every request with a 503, a `Retry-After`, and (optionally) one byte a second."""

    def __init__(self, retry_after: str, trickle: bool) -> None:
        self.retry_after = retry_after
        self.trickle = trickle
        self.requests = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:  # the socket was closed while waiting: the test is over
                return
            self.requests += 1
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(65536)
                body = b'{"code":"overloaded"}'
                head = (
                    f"HTTP/1.1 503 Service Unavailable\r\nRetry-After: {self.retry_after}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                ).encode()
                if not self.trickle:
                    conn.sendall(head + body)
                    return
                for byte in head + body:
                    if self.stop.is_set():
                        return
                    conn.sendall(bytes([byte]))
                    time.sleep(1.0)
            except OSError:
                pass

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def test_n6_gate_wait_is_bounded_against_a_one_byte_per_second_server(tmp_path: Path) -> None:
    server = _Trickle("1", trickle=True)
    try:
        started = time.monotonic()
        out = subprocess.run(
            [*CLI, "gate", "--url", server.url, "--token", "mgp_x", "--project", "p", "--commit", sha(1)]
            + ["--wait", "5"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        elapsed = time.monotonic() - started
        print(f"\ngate --wait 5 against a 1 byte/s server: exit {out.returncode} after {elapsed:.1f} s")
        assert out.returncode != 0, out.stdout
        assert elapsed < 20, f"gate --wait 5 ran {elapsed:.1f} s"  # was 60 s and more
        started = time.monotonic()
        with pytest.raises(ClientError):
            Client(server.url, token="mgp_x", timeout=3).gate("p", sha(1))
        assert time.monotonic() - started < 10
    finally:
        server.close()


def test_n7_retry_after_zero_is_clamped() -> None:
    assert retry_after_s("0", 1.0) == MIN_RETRY_AFTER_S
    assert retry_after_s("-5", 1.0) == MIN_RETRY_AFTER_S
    assert retry_after_s("1e308", 1.0) == MAX_RETRY_AFTER_S
    assert retry_after_s("nan", 2.0) == 2.0 and retry_after_s(None, 2.0) == 2.0
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT", 2.0) == 2.0
    server = _Trickle("0", trickle=False)
    try:
        with pytest.raises(ClientError) as caught:
            Client(server.url, token="mgp_x", timeout=3, connect_grace=3).gate("p", sha(1))
        assert caught.value.status == 503
        print(f"\nRetry-After: 0 for 3 s: {server.requests} requests")
        # 646 requests in 1.5 s before: now at most one per MIN_RETRY_AFTER_S within the 3 s deadline.
        assert server.requests <= 3 / MIN_RETRY_AFTER_S + 1, server.requests
    finally:
        server.close()


# --- N8: database errors told apart -----------------------------------------------------------------------------


def test_n8_database_errors_are_told_apart(tmp_path: Path) -> None:
    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import DBAPIError

    def error_of(url: str, sql: str, **params: Any) -> DBAPIError:
        engine = create_engine(url, connect_args={"connect_timeout": 2} if "postgresql" in url else {})
        try:
            with engine.connect() as conn:
                conn.execute(text(sql), params)
        except DBAPIError as exc:
            return exc
        finally:
            engine.dispose()
        raise AssertionError(f"{sql} did not fail")

    sqlite = f"sqlite:///{tmp_path / 'n8.db'}"
    assert classify_database_error(error_of(sqlite, "SELECT * FROM no_such_table"))[0] == 500
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    down = error_of(f"postgresql+psycopg://postgres@127.0.0.1:{closed_port}/x", "SELECT 1")
    assert classify_database_error(down)[:2] == (503, "database_unavailable")
    if PG_URL:
        status, code, detail = classify_database_error(
            error_of(PG_URL, "SELECT CAST(:v AS integer)", v="2147483648")
        )
        assert (status, code) == (422, "invalid_value") and "out of range" in detail
        status, _code, detail = classify_database_error(error_of(PG_URL, "SELEC 1"))
        assert status == 500 and "syntax" in detail
