"""Durability and concurrency against one real server process (uvicorn subprocess on loopback).

50 concurrent clients (uploaders racing on shared and private keys, record writers re-sending batches)
must leave exactly one copy of everything; a server killed with SIGKILL mid-ingest must keep every record
it acknowledged. Counts are read straight from the database afterwards.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import settings_for
from sqlalchemy import func, select
from svc_helpers import ADMIN, Server, finding, ndjson, record, report, sha, unique

from maingrad.service.db import Database
from maingrad.service.models import Analysis, Record, Run

pytestmark = pytest.mark.slow
H = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture
def live(fresh_database_url: str, tmp_path: Path) -> Iterator[Server]:
    server = Server(fresh_database_url, tmp_path).start()
    try:
        yield server
    finally:
        server.stop()


def _project(server: Server) -> str:
    name = unique()
    assert httpx.post(f"{server.url}/api/v1/projects", json={"name": name}, headers=H).status_code == 201
    return name


def _db(url: str) -> Database:
    return Database.from_settings(settings_for(url))


def post_honouring_503(c: httpx.Client, url: str, **kw: Any) -> httpx.Response:
    """POST as a well-behaved client: a 503 (the server shed the request before running it) is sent again
    after its Retry-After, as the CLI and the hooks' sink are told to."""
    for _ in range(60):
        r = c.post(url, **kw)
        if r.status_code != 503:
            return r
        time.sleep(float(r.headers.get("Retry-After", "1")))
    return r


def test_fifty_concurrent_clients_lose_and_duplicate_nothing(live: Server) -> None:
    name = _project(live)
    base = f"{live.url}/api/v1/projects/{name}"
    shared_body = json.dumps(
        report(finding(), finding(rule="MG003", line=3, snippet="not p.main_grad"))
    ).encode()
    barrier = threading.Barrier(50)
    errors: list[str] = []
    upload_ids: dict[int, tuple[int, int]] = {}
    shared_ids: list[int] = []
    sent: Counter[str] = Counter()
    lock = threading.Lock()

    def uploader(k: int) -> None:
        with httpx.Client(timeout=120) as c:
            body = json.dumps(report(finding(line=k, snippet=f"call_{k}()"))).encode()
            barrier.wait()
            r1 = post_honouring_503(
                c, f"{base}/reports", params={"commit_sha": sha(k), "branch": "main"}, content=body, headers=H
            )
            r2 = post_honouring_503(
                c, f"{base}/reports", params={"commit_sha": sha("shared")}, content=shared_body, headers=H
            )
            r3 = post_honouring_503(
                c, f"{base}/reports", params={"commit_sha": sha(k), "branch": "main"}, content=body, headers=H
            )
            for r in (r1, r2, r3):
                if r.status_code not in (200, 201):
                    errors.append(f"upload {k}: {r.status_code} {r.text[:200]}")
                    return
            with lock:
                upload_ids[k] = (r1.json()["id"], r3.json()["id"])
                shared_ids.append(r2.json()["id"])

    def writer(k: int) -> None:
        # Writers k and k+1 (k even, below 20) deliver the same records at the same moment (a sink racing
        # its own retry); writers 20-24 are alone. Five runs, interleaving disjoint ranges.
        owner = k - (k % 2) if k < 20 else k
        run = f"run-{owner % 5}"
        batches = [
            [record(run, owner * 10_000 + b * 200 + i, commit=sha("rt")) for i in range(200)]
            for b in range(6)
        ]
        with httpx.Client(timeout=120) as c:
            barrier.wait()
            for b, batch in enumerate(batches + [batches[2]]):  # the last one re-sends a batch
                r = post_honouring_503(c, f"{base}/runs/{run}/records", content=ndjson(batch), headers=H)
                if r.status_code != 200:
                    errors.append(f"writer {k} batch {b}: {r.status_code} {r.text[:200]}")
                    return
            with lock:
                for batch in batches:
                    sent.update(rec["id"] for rec in batch)

    threads = [threading.Thread(target=uploader, args=(k,)) for k in range(25)]
    threads += [threading.Thread(target=writer, args=(k,)) for k in range(25)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors[:5]
    assert len(upload_ids) == 25 and all(a == b for a, b in upload_ids.values())
    assert len(set(shared_ids)) == 1  # 25 racers on one key: one analysis, everyone got its id

    db = _db(live.database_url)
    try:
        with db.reading() as s:
            per_commit = dict(
                s.execute(select(Analysis.commit_sha, func.count()).group_by(Analysis.commit_sha)).all()
            )
            assert per_commit == {**{sha(k): 1 for k in range(25)}, sha("shared"): 1}
            keys = s.execute(select(Record.record_key)).scalars().all()
            assert len(keys) == len(set(keys)) == len(sent) == 15 * 6 * 200  # 15 distinct writers' records
            assert (
                set(keys) == set(sent) and max(sent.values()) == 2
            )  # the racing pairs sent everything twice
            runs = dict(s.execute(select(Run.name, Run.record_count)).all())
            assert runs == {f"run-{i}": 3 * 6 * 200 for i in range(5)}
    finally:
        db.dispose()
    gate = httpx.get(f"{base}/gate", params={"commit_sha": sha("shared")}, headers=H).json()
    assert gate["status"] == "fail" and gate["analyses"][0]["id"] == shared_ids[0]


def test_sigkill_mid_ingest_loses_no_acknowledged_record(fresh_database_url: str, tmp_path: Path) -> None:
    server = Server(fresh_database_url, tmp_path).start()
    name = _project(server)
    acked: list[list[str]] = []
    lock = threading.Lock()
    stop = threading.Event()

    def writer(k: int) -> None:
        with httpx.Client(timeout=30) as c:
            for b in range(10_000):
                if stop.is_set():
                    return
                batch = [record("crash", k * 1_000_000 + b * 500 + i) for i in range(500)]
                try:
                    r = c.post(
                        f"{server.url}/api/v1/projects/{name}/runs/crash/records",
                        content=ndjson(batch),
                        headers=H,
                    )
                except httpx.HTTPError:
                    return  # the server died under us: this batch was never acknowledged
                if r.status_code == 200:
                    with lock:
                        acked.append([rec["id"] for rec in batch])

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while len(acked) < 40 and time.monotonic() < deadline:
        time.sleep(0.02)
    server.kill()  # SIGKILL while the writers are still sending
    stop.set()
    for t in threads:
        t.join(timeout=60)
    assert len(acked) >= 40
    acknowledged = {rid for batch in acked for rid in batch}

    restarted = Server(fresh_database_url, tmp_path).start()
    try:
        assert httpx.get(f"{restarted.url}/readyz").status_code == 200
        db = _db(fresh_database_url)
        try:
            with db.reading() as s:
                stored = set(s.execute(select(Record.record_key)).scalars().all())
                count = s.execute(select(Run.record_count).where(Run.name == "crash")).scalar_one()
        finally:
            db.dispose()
        assert acknowledged <= stored, f"lost {len(acknowledged - stored)} acknowledged records"
        assert count == len(stored)  # the run's counter moved with its records, atomically
        # The restarted server keeps ingesting; re-sent acknowledged batches are no-ops.
        again = [record("crash", int(acked[0][0].rsplit(":", 1)[1]) + i) for i in range(500)]
        r = httpx.post(
            f"{restarted.url}/api/v1/projects/{name}/runs/crash/records", content=ndjson(again), headers=H
        )
        assert r.status_code == 200 and r.json()["inserted"] == 0
    finally:
        restarted.stop()
