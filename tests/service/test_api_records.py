"""Runtime records: NDJSON ingest, idempotency per record id, validation, timelines and aggregates."""

from __future__ import annotations

import gzip
import json

import pytest
from conftest import ProjectCtx
from svc_helpers import ndjson, record, sha


def post(project: ProjectCtx, run: str, body: bytes, **params: str):  # type: ignore[no-untyped-def]
    return project.client.post(
        project.url(f"/runs/{run}/records"),
        params=params,
        content=body,
        headers=project.headers("upload", **{"Content-Type": "application/x-ndjson"}),
    )


def test_batch_ingest_is_idempotent_per_record_id(project: ProjectCtx) -> None:
    recs = [record("r1", i) for i in range(100)]
    first = post(project, "r1", ndjson(recs), commit_sha=sha(1))
    assert first.status_code == 200, first.text
    assert first.json() == {
        "run": "r1",
        "commit_sha": sha(1),
        "received": 100,
        "inserted": 100,
        "duplicates": 0,
    }
    # Re-sent batch overlapping with new records: only the new ones count.
    again = post(project, "r1", ndjson(recs[50:] + [record("r1", i) for i in range(100, 120)]))
    assert again.json()["inserted"] == 20 and again.json()["duplicates"] == 50
    # Duplicates inside one batch are ignored too.
    dup = post(project, "r1", ndjson([record("r1", 500), record("r1", 500)]))
    assert dup.json()["inserted"] == 1
    run = project.client.get(project.url("/runs/r1"), headers=project.headers("read")).json()
    assert run["record_count"] == 121 and run["commit_sha"] == sha(1)


def test_gzip_ndjson_and_blank_lines(project: ProjectCtx) -> None:
    body = b"\n\n" + ndjson([record("rg", i) for i in range(10)]) + b"\n  \n"
    r = project.client.post(
        project.url("/runs/rg/records"),
        content=gzip.compress(body),
        headers=project.headers("upload", **{"Content-Encoding": "gzip"}),
    )
    assert r.status_code == 200 and r.json()["inserted"] == 10


def test_commit_comes_from_records_and_must_agree(project: ProjectCtx) -> None:
    r = post(project, "rc", ndjson([record("rc", 0, commit=sha(2).upper())]))
    assert r.json()["commit_sha"] == sha(2)
    r = post(project, "rc", ndjson([record("rc", 1)]), commit_sha=sha(3))
    assert r.status_code == 409 and r.json()["code"] == "run_commit_mismatch"
    r = post(project, "rd", ndjson([record("rd", 1, commit=sha(4))]), commit_sha=sha(5))
    assert r.status_code == 409 and r.json()["code"] == "commit_mismatch"
    r = post(project, "re", ndjson([record("re", 1, commit=sha(4)), record("re", 2, commit=sha(5))]))
    assert r.status_code == 422 and r.json()["line"] == 2


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda r: r.pop("id"), "'id'"),
        (lambda r: r.update(id=""), "'id'"),
        (lambda r: r.update(rank=-1), "'rank'"),
        (lambda r: r.update(rank=True), "'rank'"),
        (lambda r: r.update(step="3"), "'step'"),
        (lambda r: r.update(phase="sideways"), "'phase'"),
        (lambda r: r.update(action="explode"), "'action'"),
        (lambda r: r.update(anomaly=5), "'anomaly'"),
        (lambda r: r.update(has_main_grad="yes"), "has_main_grad"),
        (lambda r: r.update(schema=2), "schema"),
        (lambda r: r.update(run="other-run"), "belongs to run"),
        (lambda r: r.update(t_ns=2**70), "'t_ns'"),
    ],
)
def test_invalid_records_reject_the_whole_batch(project: ProjectCtx, mutate, needle: str) -> None:  # type: ignore[no-untyped-def]
    recs = [record("rv", i) for i in range(3)]
    mutate(recs[1])
    r = post(project, "rv", ndjson(recs))
    assert r.status_code == 422, r.text
    assert r.json()["code"] == "invalid_record" and r.json()["line"] == 2 and needle in r.json()["detail"]
    assert project.client.get(project.url("/runs/rv"), headers=project.headers("read")).status_code == 404


def test_non_json_lines_are_422(project: ProjectCtx) -> None:
    r = post(project, "rj", b'{"schema": 1}\nnot json\n')
    assert r.status_code == 422 and r.json()["code"] == "invalid_record"
    r = post(project, "rj", b"[1, 2]\n")
    assert r.status_code == 422 and "object" in r.json()["detail"]
    r = post(project, "rj", b"\xff\xfe\n")
    assert r.status_code == 422 and r.json()["code"] == "invalid_encoding"


def test_timeline_and_aggregates(project: ProjectCtx) -> None:
    recs = []
    for step in range(3):
        for i in range(4):
            recs.append(
                record(
                    "rt",
                    step * 10 + i,
                    step=step,
                    rank=i % 2,
                    module=f"m{i % 2}",
                    param=f"w{i}",
                    phase="forward" if i < 2 else "backward",
                    action="exposed" if i == 0 else "none",
                    has_main_grad=i != 3,
                    main_grad_is_none=i == 1,
                    anomaly="boom" if (step == 2 and i == 2) else None,
                )
            )
    assert post(project, "rt", ndjson(recs)).status_code == 200
    tl = project.client.get(project.url("/runs/rt/timeline"), headers=project.headers("read")).json()
    assert [p["step"] for p in tl["points"]] == [0, 1, 2]
    p0 = tl["points"][0]
    assert p0 == {
        "step": 0,
        "records": 4,
        "forward": 2,
        "backward": 2,
        "exposed": 1,
        "none": 1,
        "missing": 1,
        "anomalies": 0,
    }
    assert tl["points"][2]["anomalies"] == 1
    run = project.client.get(project.url("/runs/rt"), headers=project.headers("read")).json()
    assert run["steps"] == 3 and run["record_count"] == 12
    modules = {m["key"]: m for m in run["modules"]}
    assert modules["m0"]["records"] == 6 and modules["m0"]["params"] == 2 and modules["m0"]["exposed"] == 3
    assert {r["key"] for r in run["ranks"]} == {"0", "1"}
    assert run["anomalies"][0]["anomaly"] == "boom" and run["anomalies"][0]["step"] == 2


def test_raw_records_are_kept_and_paginated(project: ProjectCtx) -> None:
    recs = [record("rp", i, extra_field={"future": i}) for i in range(7)]
    post(project, "rp", ndjson(recs))
    seen = project.every_item("/runs/rp/records", limit=3)
    assert [s["id"] for s in seen] == sorted(r["id"] for r in recs)  # keyset pages in record-id order
    by_id = {s["id"]: s["record"] for s in seen}
    assert by_id[recs[3]["id"]]["extra_field"] == {"future": 3}
    runs = project.client.get(project.url("/runs"), headers=project.headers("read")).json()["items"]
    assert [r["name"] for r in runs] == ["rp"]


def test_too_many_records_in_one_batch(database_url: str) -> None:
    from conftest import new_project, settings_for
    from fastapi.testclient import TestClient

    from maingrad.service.app import create_app

    with TestClient(create_app(settings_for(database_url, max_records_per_batch=5))) as c:
        p = new_project(c)
        r = c.post(
            p.url("/runs/big/records"),
            content=ndjson([record("big", i) for i in range(6)]),
            headers=p.headers("upload"),
        )
        assert r.status_code == 413 and r.json()["code"] == "too_many_records"


def test_unknown_run_is_404(project: ProjectCtx) -> None:
    for suffix in ("", "/timeline", "/records"):
        r = project.client.get(project.url(f"/runs/missing{suffix}"), headers=project.headers("read"))
        assert r.status_code == 404 and r.json()["code"] == "run_not_found"


def test_record_json_is_stored_verbatim(project: ProjectCtx) -> None:
    rec = record("rx", 0, module='décodeur.layers.0 "q"')
    post(project, "rx", (json.dumps(rec, ensure_ascii=False) + "\n").encode())
    page = project.client.get(project.url("/runs/rx/records"), headers=project.headers("read")).json()
    assert page["items"][0]["record"] == rec
