"""The scan pipeline: cache equivalence, --jobs equivalence, errors that must not stop a scan."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from maingrad.analyzer import runner

pytestmark = pytest.mark.usefixtures("test_rules")


def _many_files(count: int = 24) -> dict[str, str]:
    files = {}
    for i in range(count):
        body = "\n".join(f"def f{j}(p):\n    return p.main_grad + {j}\n" for j in range(40))
        files[f"pkg/m{i:02d}.py"] = body + ("\nbad_call()\n" if i % 3 == 0 else "")
    files["pkg/broken.py"] = "def f(:\n    p.main_grad\n"
    files["pkg/clean.py"] = "x = 1\n"
    return files


def _stable(report: dict) -> dict:
    report = dict(report)
    report.pop("duration_s")
    return report


def test_output_identical_with_and_without_cache(project, run) -> None:
    root = project(_many_files())
    cold = run("check", "--format", "json", "--no-cache")
    assert not (root / ".maingrad_cache").exists()  # --no-cache writes nothing
    first = run("check", "--format", "json")
    assert (root / ".maingrad_cache").is_dir()
    warm = run("check", "--format", "json")
    assert cold.code == first.code == warm.code == 1
    assert _stable(cold.json()) == _stable(first.json()) == _stable(warm.json())
    text_cold, text_warm = run("check", "--no-cache"), run("check")
    assert text_cold.out == text_warm.out


def test_cache_hits_and_invalidation(project) -> None:
    from maingrad.analyzer.cache import ResultCache, cache_dir, settings_key
    from maingrad.analyzer.catalog import load_catalog
    from maingrad.analyzer.discovery import discover

    root = project(_many_files(3))
    rules = tuple(r for r in load_catalog(None) if r.id == "MG901")
    settings = runner.ScanSettings(rules=rules, known_ids=tuple(r.id for r in load_catalog(None)))

    def scan(s: runner.ScanSettings = settings) -> runner.ScanResult:
        cache = ResultCache(cache_dir(root), settings_key(s.cache_settings()))
        return runner.scan(discover([root], root), s, jobs=1, cache=cache)

    first = scan()
    assert first.cache_hits == 0
    second = scan()
    assert second.cache_hits == second.report.files_scanned == 5
    (root / "pkg" / "m00.py").write_text("y = q.main_grad\n")
    third = scan()
    assert third.cache_hits == 4
    assert [f.line for f in third.report.findings if f.path == "pkg/m00.py"] == [1]
    other = runner.ScanSettings(rules=rules, known_ids=settings.known_ids, warn_unused_ignores=True)
    assert scan(other).cache_hits == 0  # another configuration never reuses entries


def test_jobs_do_not_change_output(project, run, monkeypatch: pytest.MonkeyPatch) -> None:
    project(_many_files())
    monkeypatch.setattr(runner, "POOL_MIN_CHARS", 0)  # force the process pool even for this small tree
    serial = run("check", "--format", "json", "--no-cache", "--jobs", "1")
    parallel = run("check", "--format", "json", "--no-cache", "--jobs", "3")
    assert serial.code == parallel.code == 1
    assert _stable(serial.json()) == _stable(parallel.json())
    assert len(serial.json()["findings"]) > 24 * 40


def test_parse_errors_do_not_stop_the_scan(project, run) -> None:
    root = project(_many_files(2))
    (root / "pkg" / "latin1.py").write_bytes(b"x = '\xe9'  # p.main_grad\n")
    (root / "pkg" / "cookie.py").write_bytes(b"# -*- coding: latin-1 -*-\nx = '\xe9'; y = p.main_grad\n")
    unreadable = root / "pkg" / "secret.py"
    unreadable.write_text("p.main_grad\n")
    unreadable.chmod(0)
    try:
        result = run("check", "--format", "json", "--no-cache")
    finally:
        unreadable.chmod(0o644)
    data = result.json()
    errors = {e["path"]: e for e in data["parse_errors"]}
    assert errors["pkg/broken.py"]["message"].startswith("syntax error") and errors["pkg/broken.py"]["line"]
    assert "cannot decode" in errors["pkg/latin1.py"]["message"]
    if os.geteuid() != 0:  # root reads anything
        assert "cannot read" in errors["pkg/secret.py"]["message"]
    assert any(f["path"] == "pkg/cookie.py" for f in data["findings"])  # PEP 263 cookie honoured
    assert data["files_scanned"] == len(list(Path(root).rglob("*.py")))
    assert {e["kind"] for e in errors.values()} >= {"syntax", "decode"}
    assert result.code == 1


def test_rule_crash_is_reported_and_other_rules_still_run(project, run) -> None:
    project({"a.py": "explode = p.main_grad\n", "b.py": "q.main_grad\n"}, 'select = ["MG901", "MG903"]\n')
    result = run("check", "--format", "json")
    data = result.json()
    assert result.code == 2
    assert [(f["path"], f["rule"]) for f in data["findings"]] == [("a.py", "MG901"), ("b.py", "MG901")]
    assert data["parse_errors"] == [
        {
            "path": "a.py",
            "message": "internal error: rule MG903: RuntimeError: boom",
            "line": None,
            "column": None,
            "kind": "internal",
            "code": "MG999",
        }
    ]
    again = run("check", "--format", "json")  # results with internal errors are never cached
    assert again.code == 2 and again.json()["parse_errors"] == data["parse_errors"]


def test_prefilter_skips_parsing(project, run) -> None:
    project({"a.py": "def f(:\n", "b.py": "x = p.main_grad\n"}, 'select = ["MG901"]\n')
    data = run("check", "--format", "json").json()
    assert data["parse_errors"] == []  # a.py has no needle: never parsed, so its syntax error is unseen
    assert data["files_scanned"] == 2 and data["files_parsed"] == 1


def test_report_is_versioned_json(project, run) -> None:
    project({"a.py": "x = p.main_grad\n"})
    data = json.loads(run("check", "--format", "json").out)
    assert data["version"] == 1 and data["tool"]["name"] == "maingrad"
    assert set(data["findings"][0]) >= {
        "rule", "severity", "path", "line", "column", "end_line", "end_column", "message", "fingerprint", "fix_available",
    }  # fmt: skip
