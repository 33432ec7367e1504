"""The service-hardening reproducers D1-D4 (bounded work per request, 422 never 500), on every backend.

Each test sends the reproducer's body (sizes scaled down only where a setting scales the cap with them) and
checks the answer names the limit or the place at fault, and that nothing was stored.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator

import pytest
from conftest import ProjectCtx, new_project, settings_for
from fastapi.testclient import TestClient
from svc_helpers import finding, ndjson, record, report, sarif, sarif_result, sha

from maingrad.service.app import create_app
from maingrad.service.bodies import gunzip_capped
from maingrad.service.parsing import count_json_values
from maingrad.service.problems import ProblemError

GZ = {"Content-Encoding": "gzip"}


def gzip_stream(parts: Iterator[bytes]) -> bytes:
    """Gzip a body piece by piece (a 250 MiB reproducer never exists uncompressed in the test either)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    out = [packer.compress(p) for p in parts]
    out.append(packer.flush())
    return b"".join(out)


def empty_objects_bomb(mib: int) -> bytes:
    """D1: `{"version":"2.1.0","runs":[{... "results":[{},{},...]}]}` inflating to `mib` MiB."""
    head = b'{"version":"2.1.0","runs":[{"tool":{"driver":{"name":"x"}},"results":['
    block = b"{}," * (1 << 20)

    def parts() -> Iterator[bytes]:
        yield head
        for _ in range(mib // 3):
            yield block
        yield b"{}]}]}"

    return gzip_stream(parts())


def stored(project: ProjectCtx, commit: str) -> list[dict]:
    r = project.client.get(
        project.url("/analyses"), params={"commit_sha": commit}, headers=project.headers("read")
    )
    assert r.status_code == 200, r.text
    return r.json()["items"]


def problem(r, status: int, code: str) -> dict:  # type: ignore[no-untyped-def]
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    body = r.json()
    assert body["code"] == code, body
    return body


# --- D1 ------------------------------------------------------------------------------------------------


def test_d1_gzip_bomb_of_empty_objects_stops_at_the_inflate_cap(project: ProjectCtx) -> None:
    bomb = empty_objects_bomb(250)  # the reproducer: 0.24 MiB on the wire, 250 MiB inflated
    assert len(bomb) < 1024 * 1024
    r = project.upload(bomb, sha("d1"), headers=GZ)
    body = problem(r, 413, "decompressed_too_large")
    assert body["limit"] == 32 * 1024 * 1024 and str(body["limit"]) in body["detail"]
    assert stored(project, sha("d1")) == []


def test_d1_values_are_counted_before_anything_is_parsed(database_url: str) -> None:
    # Under the inflate cap, a body of millions of tiny values is refused by its value count.
    with TestClient(create_app(settings_for(database_url, max_json_values=100_000))) as c:
        p = new_project(c)
        r = p.upload(empty_objects_bomb(3), sha("d1b"), headers=GZ)
        body = problem(r, 413, "too_many_json_values")
        assert body["limit"] == 100_000
        # Commas and brackets inside strings do not count: a big message is not a big structure.
        text = ",[{" * 50_000
        ok = p.upload(
            sarif(sarif_result(message=text[:8000]), sarif_result(line=4, message=text[:8000])), sha("d1c")
        )
        assert ok.status_code == 201, ok.text


def test_count_json_values_is_exact_outside_strings() -> None:
    assert count_json_values(b'[1, 2, {"a": [3, 4]}]', 10**9) >= 6
    assert count_json_values(b'["a,b,c", "[[{"]', 2) == 3  # loose count passes the limit: strings blanked
    assert count_json_values(b'{"k\\",[": 1}', 1) == 2
    assert count_json_values(b"[{},{},[],{}]", 1) == 5  # empty containers are counted once


def test_d1_one_huge_ndjson_line_stops_while_inflating(project: ProjectCtx) -> None:
    line = b'{"id":"u1","rank":0,"step":1,"phase":"forward","module":"' + b"m" * (120 << 20) + b'"}\n'
    body = gzip_stream(iter([line[i : i + (8 << 20)] for i in range(0, len(line), 8 << 20)]))
    assert len(body) < 1024 * 1024
    r = project.client.post(
        project.url("/runs/d1/records"), content=body, headers=project.headers("upload", **GZ)
    )
    out = problem(r, 413, "line_too_long")
    assert out["limit"] == 64 * 1024 and out["line"] == 1
    assert project.client.get(project.url("/runs/d1"), headers=project.headers("read")).status_code == 404
    # Uncompressed, the same rule applies as the batch is split.
    r = project.client.post(
        project.url("/runs/d1/records"),
        content=b'{"id":"a","rank":0,"step":1,"phase":"forward"}\n'
        + b'{"id":"b","module":"'
        + b"x" * 70_000
        + b'"}',
        headers=project.headers("upload"),
    )
    assert problem(r, 413, "line_too_long")["line"] == 2


def test_gunzip_line_cap_names_the_line() -> None:
    data = gzip.compress(b"short\n" * 3 + b"y" * 5000 + b"\nok\n")
    with pytest.raises(ProblemError) as err:
        gunzip_capped(data, 10**6, max_line=4096)
    assert err.value.status == 413 and err.value.extra["line"] == 4
    assert gunzip_capped(data, 10**6, max_line=8192).count(b"\n") == 5


# --- D2 ------------------------------------------------------------------------------------------------


def _templated(template: str, results: int, argument: str = "i") -> dict:
    log = sarif(*[{"ruleId": "R", "message": {"id": "m", "arguments": [argument]}} for _ in range(results)])
    log["runs"][0]["tool"]["driver"]["rules"] = [{"id": "R", "messageStrings": {"m": {"text": template}}}]
    return log


def test_d2_message_templates_are_bounded(project: ProjectCtx) -> None:
    # The reproducer: a 100 KB template with {0}, 2,000 results; 13 KiB gzipped.
    body = gzip.compress(json.dumps(_templated("x" * 100_000 + "{0}", 2_000)).encode())
    assert len(body) < 64 * 1024
    out = problem(project.upload(body, sha("d2"), headers=GZ), 422, "invalid_sarif")
    assert out["pointer"] == "/runs/0/tool/driver/rules/0/messageStrings/m/text"
    # A short template whose expansion would pass the per-message cap is refused while expanding.
    out = problem(project.upload(_templated("{0}" * 100, 1, "a" * 1000), sha("d2")), 422, "message_too_long")
    assert out["limit"] == 8192 and out["pointer"] == "/runs/0/results/0/message"
    assert stored(project, sha("d2")) == []
    small = project.upload(_templated("hello {0}", 3, "world"), sha("d2"))
    assert small.status_code == 201, small.text


def test_d2_stored_text_has_a_budget(database_url: str) -> None:
    with TestClient(create_app(settings_for(database_url, max_analysis_text_chars=50_000))) as c:
        p = new_project(c)
        log = _templated("{0}", 10, "z" * 8_000)  # 80,000 characters of messages in all
        out = problem(p.upload(log, sha("d2b")), 413, "analysis_too_large")
        assert out["limit"] == 50_000
        assert stored(p, sha("d2b")) == []


# --- D3 ------------------------------------------------------------------------------------------------

_RUN = {"tool": {"driver": {"name": "t"}}}


def _sarif_result_with(**result: object) -> bytes:
    return json.dumps(
        {"version": "2.1.0", "runs": [{**_RUN, "results": [{"message": {"text": "m"}, **result}]}]}
    ).encode()


def _region(**region: object) -> dict:
    return {"locations": [{"physicalLocation": {"region": region}}]}


@pytest.mark.parametrize(
    ("body", "code", "pointer"),
    [
        (_sarif_result_with(level=[]), "invalid_sarif", "/runs/0/results/0/level"),
        (_sarif_result_with(level={}), "invalid_sarif", "/runs/0/results/0/level"),
        (
            _sarif_result_with(**_region(startLine=2**31)),
            "invalid_sarif",
            "/runs/0/results/0/locations/0/physicalLocation/region/startLine",
        ),
        (
            _sarif_result_with(**_region(startLine=2**63)),
            "invalid_sarif",
            "/runs/0/results/0/locations/0/physicalLocation/region/startLine",
        ),
        (_sarif_result_with(ruleIndex=2**40), "invalid_sarif", "/runs/0/results/0/ruleIndex"),
        (_sarif_result_with(ruleId="r" * 300), "invalid_sarif", "/runs/0/results/0/ruleId"),
        (json.dumps(report(finding(rule="R" * 300))).encode(), "invalid_report", "/findings/0/rule"),
        (json.dumps(report(finding(line=2**31))).encode(), "invalid_report", "/findings/0/line"),
        (json.dumps(report(files_scanned=2**31)).encode(), "invalid_report", "/files_scanned"),
        (json.dumps(report(finding(severity=["error"]))).encode(), "invalid_report", "/findings/0/severity"),  # type: ignore[arg-type]
    ],
)
def test_d3_wrong_shapes_and_wide_integers_are_422_with_a_pointer(
    project: ProjectCtx, body: bytes, code: str, pointer: str
) -> None:
    out = problem(project.upload(body, sha("d3")), 422, code)
    assert out["pointer"] == pointer and pointer in out["detail"]
    assert stored(project, sha("d3")) == []


def test_d3_integers_of_thousands_of_digits(project: ProjectCtx) -> None:
    body = b'{"version":"2.1.0","runs":[],"x":' + b"1" * 5000 + b"}"
    problem(project.upload(body, sha("d3b")), 422, "invalid_json")
    body = json.dumps(report(finding())).replace('"line": 10', '"line": ' + "9" * 5000).encode()
    problem(project.upload(body, sha("d3b")), 422, "invalid_json")


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('{"id":"u1","rank":0,"step":1,"phase":[]}', "phase"),
        ('{"id":"u1","rank":0,"step":1,"phase":"forward","action":{}}', "action"),
        ('{"id":"x","rank":2147483648,"step":1,"phase":"forward"}', "rank"),
        ('{"id":"x","rank":9223372036854775808,"step":1,"phase":"forward"}', "rank"),
        ('{"id":"x","rank":0,"step":1e400,"phase":"forward"}', None),
        ('{"id":"x","rank":0,"step":1,"phase":"forward","microbatch":2147483648}', "microbatch"),
        ('{"id":"x","rank":0,"step":1,"phase":"forward","module":{"a":1}}', "module"),
        ('{"id":"x","rank":0,"step":1,"phase":"forward","schema":true}', "schema"),
        ('{"id":"x","rank":0,"step":NaN,"phase":"forward"}', None),
    ],
)
def test_d3_bad_records_name_their_line_and_field(project: ProjectCtx, line: str, field: str | None) -> None:
    good = json.dumps(record("d3", 0))
    r = project.client.post(
        project.url("/runs/d3/records"), content=f"{good}\n\n{line}\n", headers=project.headers("upload")
    )
    out = problem(r, 422, "invalid_record")
    assert out["line"] == 3 and "line 3" in out["detail"]
    if field:
        assert out["pointer"] == f"/1/{field}" and f"'{field}'" in out["detail"]
    assert project.client.get(project.url("/runs/d3"), headers=project.headers("read")).status_code == 404


def test_empty_record_batch_is_refused(project: ProjectCtx) -> None:
    for body in (b"", b"\n\n  \n"):
        r = project.client.post(
            project.url("/runs/e/records"), content=body, headers=project.headers("upload")
        )
        problem(r, 422, "empty_batch")


# --- D4 ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("number", ["1e400", "-1e400", "NaN", "Infinity", "-Infinity"])
def test_d4_non_finite_numbers_are_refused_and_exports_stay_healthy(project: ProjectCtx, number: str) -> None:
    commit = sha(f"d4-{number}")
    body = _sarif_result_with(**_region(startLine=1)).replace(
        b'"startLine": 1', b'"startLine": ' + number.encode()
    )
    assert number.encode() in body
    problem(project.upload(body, commit, params={"category": "c"}), 422, "invalid_json")
    assert stored(project, commit) == []
    gate = project.client.get(
        project.url("/gate/sarif"), params={"commit_sha": commit}, headers=project.headers("read")
    )
    assert gate.status_code == 200
    ok = project.upload(sarif(sarif_result()), commit, params={"category": "c"})
    assert ok.status_code == 201
    export = project.client.get(
        project.url(f"/analyses/{ok.json()['id']}"),
        headers=project.headers("read", Accept="application/sarif+json"),
    )
    assert export.status_code == 200 and export.json()["version"] == "2.1.0"


def test_records_refuse_what_the_schema_refuses_and_keep_the_rest(project: ProjectCtx) -> None:
    rec = record("keep", 1, extra_field={"nested": [1, 2]})
    r = project.client.post(
        project.url("/runs/keep/records"), content=ndjson([rec]), headers=project.headers("upload")
    )
    assert r.status_code == 200 and r.json()["inserted"] == 1
    raw = project.client.get(project.url("/runs/keep/records"), headers=project.headers("read")).json()
    assert raw["items"][0]["record"]["extra_field"] == {"nested": [1, 2]}


def test_uris_that_urlsplit_refuses_are_paths_not_500(project: ProjectCtx) -> None:
    result = sarif_result(path="file://[abc/src/x.py")
    r = project.upload(sarif(result), sha("uri"))
    assert r.status_code == 201, r.text
    findings = project.client.get(
        project.url(f"/analyses/{r.json()['id']}/findings"), headers=project.headers("read")
    ).json()["items"]
    assert findings[0]["path"].endswith("src/x.py")
