"""Reports in: format detection, gzip, replacement by key, idempotency, limits and malformed input."""

from __future__ import annotations

import gzip
import json

import pytest
from conftest import ProjectCtx, new_project, settings_for
from fastapi.testclient import TestClient
from svc_helpers import ADMIN, finding, report, sarif, sarif_result, sha

from maingrad.service.app import create_app


def test_maingrad_report_is_stored_with_fingerprints(project: ProjectCtx) -> None:
    r = project.upload(report(finding(), finding(rule="MG003", line=40, snippet="if p.main_grad:")), sha(1))
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["format"] == "maingrad" and body["category"] == "maingrad" and body["results_count"] == 2
    assert body["outcome"] == "created" and r.headers["location"].endswith(f"/analyses/{body['id']}")
    findings = project.client.get(
        project.url(f"/analyses/{body['id']}/findings"), headers=project.headers("read")
    ).json()
    assert {f["rule"] for f in findings["items"]} == {"MG001", "MG003"}
    assert all(len(f["fingerprint"]) == 32 for f in findings["items"])
    assert findings["items"][0]["snippet"]


def test_sarif_from_any_tool_is_detected_by_content(project: ProjectCtx) -> None:
    log = sarif(sarif_result(), sarif_result(rule="X2", level=None), tool="semgrep")
    r = project.upload(log, sha(2), headers={"Content-Type": "text/plain"})
    assert r.status_code == 201, r.text
    assert (
        r.json()["format"] == "sarif"
        and r.json()["tool"]["name"] == "semgrep"
        and r.json()["category"] == "semgrep"
    )


def test_gzip_body_is_accepted(project: ProjectCtx) -> None:
    data = gzip.compress(json.dumps(report(finding())).encode())
    r = project.upload(data, sha(3), headers={"Content-Encoding": "gzip"})
    assert r.status_code == 201, r.text
    assert r.json()["results_count"] == 1


def test_byte_identical_reupload_is_a_noop_with_the_same_id(project: ProjectCtx) -> None:
    data = json.dumps(report(finding())).encode()
    first = project.upload(data, sha(4))
    second = project.upload(data, sha(4))
    assert first.status_code == 201 and second.status_code == 200
    assert second.json()["id"] == first.json()["id"] and second.json()["outcome"] == "unchanged"
    listing = project.client.get(
        project.url("/analyses"), params={"commit_sha": sha(4)}, headers=project.headers("read")
    )
    assert [a["id"] for a in listing.json()["items"]] == [first.json()["id"]]


def test_second_upload_for_the_same_key_replaces_the_first(project: ProjectCtx) -> None:
    first = project.upload(report(finding()), sha(5)).json()
    second = project.upload(report(finding(), finding(line=99, snippet="other()")), sha(5))
    assert second.status_code == 201 and second.json()["outcome"] == "replaced"
    assert second.json()["replaced_id"] == first["id"] and second.json()["id"] != first["id"]
    gone = project.client.get(project.url(f"/analyses/{first['id']}"), headers=project.headers("read"))
    assert gone.status_code == 404
    # Another category is another key: both live side by side.
    other = project.upload(report(finding()), sha(5), params={"category": "maingrad-strict"})
    assert other.status_code == 201 and other.json()["outcome"] == "created"
    items = project.client.get(
        project.url("/analyses"), params={"commit_sha": sha(5)}, headers=project.headers("read")
    )
    assert sorted(a["category"] for a in items.json()["items"]) == ["maingrad", "maingrad-strict"]


def test_idempotency_key_replays_the_first_answer(project: ProjectCtx) -> None:
    key = {"Idempotency-Key": "ci-run-42"}
    first = project.upload(report(finding()), sha(6), headers=key)
    again = project.upload(report(finding()), sha(6), headers=key)
    assert first.status_code == 201 and again.status_code == 201
    assert again.json() == first.json()
    reused = project.upload(report(), sha(6), headers=key)
    assert reused.status_code == 422 and reused.json()["code"] == "idempotency_key_reused"


def test_oversize_body_is_413_before_parsing(project: ProjectCtx) -> None:
    huge = b"{" + b" " * (10 * 1024 * 1024 + 10) + b"}"
    r = project.upload(huge, sha(7))
    assert r.status_code == 413 and r.json()["code"] == "body_too_large"
    assert r.headers["content-type"].startswith("application/problem+json")


def test_zip_bomb_is_413_without_inflating_it(database_url: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    settings = settings_for(database_url, max_decompressed_bytes=5 * 1024 * 1024)
    with TestClient(create_app(settings)) as c:
        p = new_project(c)
        bomb = gzip.compress(b"[" + b"0," * (50 * 1024 * 1024) + b"0]", compresslevel=9)  # 100 MB of JSON
        assert len(bomb) < 1024 * 1024
        r = p.upload(bomb, sha(8), headers={"Content-Encoding": "gzip"})
        assert r.status_code == 413 and r.json()["code"] == "decompressed_too_large"
        assert r.json()["limit"] == 5 * 1024 * 1024


def test_too_many_runs_and_results_are_413_with_reason(database_url: str) -> None:
    settings = settings_for(database_url, max_runs=3, max_results_per_run=5)
    with TestClient(create_app(settings)) as c:
        p = new_project(c)
        r = p.upload(sarif(sarif_result(), runs=4), sha(9))
        assert r.status_code == 413 and r.json()["code"] == "too_many_runs" and r.json()["limit"] == 3
        r = p.upload(sarif(*[sarif_result(line=i) for i in range(6)]), sha(9))
        assert r.status_code == 413 and r.json()["code"] == "too_many_results"
        r = p.upload(report(*[finding(line=i, snippet=f"x{i}") for i in range(6)]), sha(9))
        assert r.status_code == 413 and r.json()["code"] == "too_many_results"
        assert p.upload(sarif(*[sarif_result(line=i) for i in range(5)], runs=3), sha(9)).status_code == 201


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"not json at all", "invalid_json"),
        (b"\xff\xfe garbage", "invalid_encoding"),
        (b"[1, 2, 3]", "unknown_format"),
        (b'{"hello": "world"}', "unknown_format"),
        (b'{"version": 2, "tool": {"name": "maingrad"}}', "invalid_report"),
        (b'{"version": 1, "tool": {"name": "maingrad"}, "findings": [{"rule": "MG001"}]}', "invalid_report"),
        (b'{"version": "2.0.0", "runs": []}', "invalid_sarif"),
        (b'{"version": "2.1.0", "runs": []}', "invalid_sarif"),
        (b'{"version": "2.1.0", "runs": [{"results": []}]}', "invalid_sarif"),
        (
            b'{"version": "2.1.0", "runs": [{"tool": {"driver": {"name": "t"}}, "results": [{"ruleId": "x"}]}]}',
            "invalid_sarif",
        ),
        (
            b'{"version": "2.1.0", "runs": [{"tool": {"driver": {"name": "t"}}, "results": "nope"}]}',
            "invalid_sarif",
        ),
        (b"[" * 100000, "invalid_json"),
    ],
)
def test_malformed_reports_are_422_with_a_reason(project: ProjectCtx, body: bytes, code: str) -> None:
    r = project.upload(body, sha(10))
    assert r.status_code == 422, r.text
    problem = r.json()
    assert problem["code"] == code and problem["detail"] and problem["status"] == 422
    assert r.headers["content-type"].startswith("application/problem+json")


def test_bad_gzip_and_unknown_encoding(project: ProjectCtx) -> None:
    r = project.upload(b"\x1f\x8b\x08\x00garbage", sha(11), headers={"Content-Encoding": "gzip"})
    assert r.status_code == 422 and r.json()["code"] == "invalid_gzip"
    r = project.upload(b"{}", sha(11), headers={"Content-Encoding": "br"})
    assert r.status_code == 415 and r.json()["code"] == "unsupported_encoding"


def test_sarif_suppressions_and_fingerprints_are_honoured(project: ProjectCtx) -> None:
    log = sarif(
        sarif_result(rule="A", line=1, snippet="a()", suppressions=[{"kind": "inSource"}]),
        sarif_result(
            rule="B", line=2, snippet="b()", suppressions=[{"kind": "external", "status": "rejected"}]
        ),
        sarif_result(
            rule="C", line=3, snippet=None, partialFingerprints={"primaryLocationLineHash": "abc:1"}
        ),
    )
    body = project.upload(log, sha(12)).json()
    items = project.client.get(
        project.url(f"/analyses/{body['id']}/findings"), headers=project.headers("read")
    ).json()["items"]
    by_rule = {f["rule"]: f for f in items}
    assert by_rule["A"]["suppressed"] is True and by_rule["B"]["suppressed"] is False
    # Same tool fingerprint, other line: same identity.
    moved = sarif(
        sarif_result(
            rule="C", line=30, snippet=None, partialFingerprints={"primaryLocationLineHash": "abc:1"}
        )
    )
    body2 = project.upload(moved, sha(13)).json()
    items2 = project.client.get(
        project.url(f"/analyses/{body2['id']}/findings"), headers=project.headers("read")
    ).json()
    assert items2["items"][0]["fingerprint"] == by_rule["C"]["fingerprint"]
    alerts = project.client.get(project.url("/alerts"), headers=project.headers("read")).json()["items"]
    assert {a["rule"] for a in alerts} == {"B", "C"}  # suppressed results raise no alert


def test_analysis_as_sarif_round_trips_every_result(project: ProjectCtx) -> None:
    body = project.upload(
        report(finding(), finding(rule="MG003", line=7, snippet="not p.main_grad")), sha(14)
    ).json()
    r = project.client.get(
        project.url(f"/analyses/{body['id']}"),
        headers=project.headers("read", Accept="application/sarif+json"),
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/sarif+json")
    log = r.json()
    assert log["version"] == "2.1.0" and len(log["runs"]) == 1
    run = log["runs"][0]
    assert run["tool"]["driver"]["name"] == "maingrad" and run["automationDetails"]["id"] == "maingrad/"
    assert sorted(res["ruleId"] for res in run["results"]) == ["MG001", "MG003"]
    assert all("maingrad/v1" in res["partialFingerprints"] for res in run["results"])
    # The stored SARIF re-uploads as SARIF and keeps identities (fingerprints come from partialFingerprints).
    again = project.upload(json.dumps(log).encode(), sha(15)).json()
    a = project.client.get(
        project.url(f"/analyses/{body['id']}/findings"), headers=project.headers("read")
    ).json()
    b = project.client.get(
        project.url(f"/analyses/{again['id']}/findings"), headers=project.headers("read")
    ).json()
    assert again["format"] == "sarif"
    assert {f["fingerprint"] for f in a["items"]} == {f["fingerprint"] for f in b["items"]}
    plain = project.client.get(project.url(f"/analyses/{body['id']}"), headers=project.headers("read"))
    assert plain.json()["id"] == body["id"] and plain.headers["content-type"].startswith("application/json")


def test_commits_listing_and_pagination(project: ProjectCtx) -> None:
    for i in range(5):
        assert project.upload(report(), sha(100 + i)).status_code == 201
    seen = [c["sha"] for c in project.every_item("/commits", limit=2)]
    assert seen == [sha(100 + i) for i in reversed(range(5))]
    bad = project.client.get(
        project.url("/commits"), params={"cursor": "!!!"}, headers=project.headers("read")
    )
    # The cursor's shape is part of the published schema: a malformed one fails query validation.
    assert bad.status_code == 422 and "cursor" in bad.json()["detail"]


def test_admin_token_from_env_works_everywhere(project: ProjectCtx) -> None:
    r = project.client.post(
        project.url("/reports"),
        params={"commit_sha": sha(16)},
        content=json.dumps(report()).encode(),
        headers={"Authorization": f"Bearer {ADMIN}"},
    )
    assert r.status_code == 201


def test_commit_ids_other_than_shas(project: ProjectCtx) -> None:
    r = project.upload(report(finding()), "Release-1.2_rc3")
    assert r.status_code == 201 and r.json()["commit_sha"] == "release-1.2_rc3"
    assert project.gate("release-1.2_rc3")["status"] == "fail"
    for bad in ("has space", "-leading", "x" * 65, "a/b", "é"):
        assert project.upload(report(), bad).status_code == 422, bad
