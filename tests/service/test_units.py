"""Pure units (no database): tokens, matching passes, parsing edge cases, gzip caps, SVG, metrics."""

from __future__ import annotations

import gzip
import re

import pytest

from maingrad.service import tokens
from maingrad.service.bodies import gunzip_capped
from maingrad.service.dashboard.svg import _ticks, downsample, timeline_svg
from maingrad.service.matching import Item, match
from maingrad.service.metrics import Registry, route_template
from maingrad.service.pagination import decode_cursor, decode_key_cursor, encode_cursor, encode_key_cursor
from maingrad.service.parsing import Limits, assign_fingerprints, normalize_path, parse_report
from maingrad.service.problems import ProblemError

LIMITS = Limits(20, 25_000)


def test_tokens_are_prefixed_checksummed_and_distinct() -> None:
    seen = {tokens.generate() for _ in range(200)}
    assert len(seen) == 200
    for t in list(seen)[:20]:
        assert re.fullmatch(r"mgp_[0-9A-Za-z]{36}", t) and tokens.well_formed(t)
        for i in range(4, len(t)):  # any single-character typo is caught by the checksum
            alt = "0" if t[i] != "0" else "1"
            assert not tokens.well_formed(t[:i] + alt + t[i + 1 :])
    assert tokens.generate(admin=True).startswith("mga_")
    assert tokens.hash_token("x", b"k1") != tokens.hash_token("x", b"k2")
    assert tokens.expand_scopes({"admin"}) == {"admin", "upload", "read", "triage"}
    assert tokens.expand_scopes({"triage"}) == {"triage", "read"}
    with pytest.raises(ValueError):
        tokens.normalize_scopes(["read", "root"])


def item(
    fp: str, line: int | None = 1, path: str = "a.py", msg: str = "m", ctx: str | None = "c", rule: str = "R"
) -> Item:
    return Item(fp, "cat", rule, path, msg, line, ctx)


def test_matching_passes_in_order() -> None:
    base = [
        item("f1", 10),
        item("f2", 20, ctx="c2"),
        item("f3", 30, path="old.py", ctx="c3"),
        item("f4", 40, ctx="c4"),
    ]
    head = [
        item("f1", 99),  # pass 1: same fingerprint anywhere
        item("g2", 22, ctx="edited"),  # pass 2: same rule/path/message, 2 lines away
        item("g3", 5, path="new.py", ctx="c3"),  # pass 3: same context, renamed file
        item("g5", 500, ctx="zzz"),  # new
    ]
    m = match(head, base, line_window=3)
    assert [(h.fingerprint, b.fingerprint, how) for h, b, how in m.unchanged] == [
        ("f1", "f1", "fingerprint"),
        ("g2", "f2", "nearby"),
        ("g3", "f3", "renamed"),
    ]
    assert [i.fingerprint for i in m.new] == ["g5"] and [i.fingerprint for i in m.fixed] == ["f4"]


def test_matching_is_a_multiset_and_respects_the_window() -> None:
    m = match([item("x"), item("x")], [item("x")])
    assert len(m.unchanged) == 1 and len(m.new) == 1
    m = match([item("y", 14, ctx="other")], [item("x", 10)], line_window=3)
    assert m.new and m.fixed
    m = match([item("y", 13, ctx="other")], [item("x", 10)], line_window=3)
    assert m.unchanged[0][2] == "nearby"
    m = match([item("y", 13, rule="S", ctx="other")], [item("x", 10)], line_window=3)
    assert m.new  # another rule is another finding


def test_nearby_prefers_the_closest() -> None:
    m = match([item("h", 12, ctx="z")], [item("a", 10, ctx="q"), item("b", 13, ctx="r")], line_window=3)
    assert m.unchanged[0][1].fingerprint == "b"


def test_fingerprints_ignore_lines_and_count_duplicates() -> None:
    import json

    from svc_helpers import finding, report

    a = parse_report(json.dumps(report(finding(line=1))).encode(), LIMITS).findings
    b = parse_report(json.dumps(report(finding(line=500))).encode(), LIMITS).findings
    assign_fingerprints(a, "maingrad")
    assign_fingerprints(b, "maingrad")
    assert a[0].fingerprint == b[0].fingerprint
    c = parse_report(json.dumps(report(finding(line=500))).encode(), LIMITS).findings
    assign_fingerprints(c, "other-category")
    assert c[0].fingerprint != a[0].fingerprint
    from svc_helpers import sarif, sarif_result

    dup = parse_report(json.dumps(sarif(sarif_result(), sarif_result(line=9))).encode(), LIMITS).findings
    assign_fingerprints(dup, "t")
    assert dup[0].fingerprint != dup[1].fingerprint  # same code twice in a file: two identities


def test_sarif_details() -> None:
    import json

    log = {
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "t",
                        "rules": [
                            {
                                "id": "R1",
                                "defaultConfiguration": {"level": "error"},
                                "messageStrings": {"m": {"text": "bad {0}"}},
                            }
                        ],
                    }
                },
                "originalUriBaseIds": {"SRC": {"uri": "file:///home/ci/repo/"}},
                "results": [
                    {
                        "ruleIndex": 0,
                        "message": {"id": "m", "arguments": ["thing"]},
                        "locations": [
                            {
                                "physicalLocation": {
                                    "artifactLocation": {"uri": "file:///home/ci/repo/pkg/x.py"}
                                }
                            }
                        ],
                    },
                    {"ruleId": "R2", "kind": "pass", "message": {"text": "ok"}},
                    {"ruleId": "R3", "level": "note", "message": {"text": "n"}},
                ],
            }
        ],
    }
    norm = parse_report(json.dumps(log).encode(), LIMITS)
    assert [f.rule for f in norm.findings] == ["R1", "R3"]  # kind=pass is not a finding
    first = norm.findings[0]
    assert first.level == "error" and first.message == "bad thing" and first.path == "pkg/x.py"
    assert norm.findings[1].severity_rank == 0


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("./a/b.py", "a/b.py"),
        ("a\\b.py", "a/b.py"),
        ("a/./c/../b.py", "a/b.py"),
        ("src/%20x.py", "src/ x.py"),
    ],
)
def test_normalize_path(uri: str, expected: str) -> None:
    assert normalize_path(uri) == expected


def test_gunzip_cap_and_concatenated_members() -> None:
    assert gunzip_capped(gzip.compress(b"ab") + gzip.compress(b"cd"), 10) == b"abcd"
    with pytest.raises(ProblemError) as err:
        gunzip_capped(gzip.compress(b"\0" * 1_000_000), 999_999)
    assert err.value.status == 413


def test_cursor_round_trip_and_tampering() -> None:
    assert decode_cursor(encode_cursor(42)) == 42
    assert decode_cursor(None) is None
    for bad in ("x", "-1", "1" * 19, "４２"):  # outside the published pattern (the query refuses them first)
        with pytest.raises(ProblemError):
            decode_cursor(bad)
    for key in ("run:0:17", "é/ü", "x" * 255):
        assert decode_key_cursor(encode_key_cursor(key)) == key
    assert decode_key_cursor("ff00") == "\ufffd\ufffd"  # any hex is a position; NUL never reaches SQL


def test_svg_plot() -> None:
    points = [
        {"step": s, "exposed": s % 4, "none": 1, "missing": 0, "anomalies": 1 if s == 7 else 0}
        for s in range(20)
    ]
    svg = timeline_svg(points, "t <script>")
    assert svg.startswith("<svg") and svg.count("<polyline") == 3 and 'class="anomaly"' in svg
    assert "<script>" not in svg  # titles are escaped
    assert "no records yet" in timeline_svg([])
    assert len(downsample([{"step": i, "exposed": i} for i in range(10_000)], 100)) == 100
    assert max(p["exposed"] for p in downsample([{"step": i, "exposed": i} for i in range(1000)], 10)) == 999
    assert _ticks(0, 10) == [0, 2, 4, 6, 8, 10]


def test_metrics_text_format() -> None:
    reg = Registry()
    reg.describe("x_total", "counter", "X.")
    reg.inc("x_total", route='/a"b', status="200")
    reg.observe("lat_seconds", 0.003, route="/a")
    reg.observe("lat_seconds", 20.0, route="/a")
    text = reg.render()
    assert '# TYPE x_total counter\nx_total{route="/a\\"b",status="200"} 1' in text
    assert 'lat_seconds_bucket{route="/a",le="0.005"} 1' in text
    assert 'lat_seconds_bucket{route="/a",le="+Inf"} 2' in text and 'lat_seconds_count{route="/a"} 2' in text
    scope = {
        "route": object(),
        "path": "/api/v1/projects/demo/runs/demo/records",
        "path_params": {"project": "demo", "run": "demo"},
    }
    assert route_template(scope) == "/api/v1/projects/{project}/runs/{run}/records"
    assert route_template({"path": "/nope"}) == "unmatched"


def test_secret_file_is_created_once_and_private(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import concurrent.futures
    import os

    from maingrad.service.config import load_or_create_secret

    path = tmp_path / "maingrad.secret"
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        values = set(pool.map(load_or_create_secret, [path] * 32))
    assert len(values) == 1 and len(values.pop()) >= 48
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["maingrad.secret"]  # no temporary file left behind
