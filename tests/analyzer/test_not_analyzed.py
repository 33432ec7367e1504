"""Files and directories `check` could not analyze are diagnostics (MG999), never a silent pass: each bad
input, in each output format, counted in the summary, with exit code 1; non-Python paths are refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("test_rules")

BAD_INPUTS = {
    "ok.py": b"x = p.main_grad\n",  # one real finding (MG901)
    "latin1.py": b"# p.main_grad\nname = 'Gr\xfcn'\n",  # latin-1 without a coding cookie
    "binary.py": b"x = 1\x00\x01\x02\n",  # a NUL byte
    "broken.py": b"def f(:\n    return p.main_grad\n",  # mentions main_grad, does not parse
    "unreadable.py": b"y = p.main_grad\n",  # made unreadable below
}


@pytest.fixture
def bad_tree(project, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = project({})
    for name, data in BAD_INPUTS.items():
        (root / name).write_bytes(data)
    (root / "locked").mkdir()
    (root / "locked" / "hidden.py").write_text("z = p.main_grad\n")
    # Root reads anything whatever its mode: make the reads fail the way they do for a normal user.
    real_read_bytes, real_scandir = Path.read_bytes, os.scandir

    def read_bytes(self: Path) -> bytes:
        if self.name == "unreadable.py":
            raise PermissionError(13, "Permission denied", str(self))
        return real_read_bytes(self)

    def scandir(path):  # type: ignore[no-untyped-def]
        if Path(path).name == "locked":
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    monkeypatch.setattr(os, "scandir", scandir)
    return root


EXPECTED = {  # path -> (kind, line, column, message start)
    "binary.py": ("decode", 1, 6, "cannot decode file: it contains a NUL byte"),
    "broken.py": ("syntax", 1, 7, "syntax error: "),
    "latin1.py": ("decode", 2, 11, "cannot decode file as utf-8: byte 0xfc"),
    "locked": ("directory", None, None, "cannot read directory: Permission denied"),
    "unreadable.py": ("read", 1, 1, "cannot read file: Permission denied"),
}


def test_json_lists_each_with_kind_line_and_code(bad_tree: Path, run) -> None:  # type: ignore[no-untyped-def]
    result = run("check", "--format", "json", "--no-cache")
    assert result.code == 1
    data = result.json()
    errors = {e["path"]: e for e in data["parse_errors"]}
    assert sorted(errors) == sorted(EXPECTED)
    for path, (kind, line, column, start) in EXPECTED.items():
        error = errors[path]
        assert (error["kind"], error["line"], error["column"], error["code"]) == (kind, line, column, "MG999")
        assert error["message"].startswith(start), error
    assert [f["path"] for f in data["findings"]] == ["ok.py"]


def test_text_counts_them_and_exits_1(bad_tree: Path, run) -> None:  # type: ignore[no-untyped-def]
    result = run("check", "--no-cache")
    assert result.code == 1 and result.err == ""
    lines = result.out.splitlines()
    assert lines[0].startswith("binary.py:1:6: MG999 cannot decode file")
    assert "locked/: MG999 cannot read directory: Permission denied; its files were not analyzed" in lines
    assert any(line.startswith("ok.py:1:5: MG901") for line in lines)
    assert "Found 1 finding (1 error) in 5 files; 4 files and 1 directory were not analyzed (MG999)." in lines
    assert "All checks passed" not in result.out
    assert run("check", "--no-cache", "--exit-zero").code == 0


def test_only_unanalyzable_files_still_fail(project, run, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    root = project({})
    (root / "latin1.py").write_bytes(BAD_INPUTS["latin1.py"])
    result = run("check", "--no-cache")
    assert result.code == 1
    assert result.out.splitlines()[-1] == "Found 0 findings in 1 file; 1 file was not analyzed (MG999)."


def test_sarif_results_and_notifications(bad_tree: Path, run) -> None:  # type: ignore[no-untyped-def]
    sarif = run("check", "--format", "sarif", "--no-cache").json()
    (run_,) = sarif["runs"]
    alerts = {
        r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]: r
        for r in run_["results"]
        if r["ruleId"] == "MG999"
    }
    assert sorted(alerts) == sorted(p for p in EXPECTED if p != "locked")  # a directory has no lines
    assert alerts["latin1.py"]["locations"][0]["physicalLocation"]["region"] == {
        "startLine": 2,
        "startColumn": 11,
    }
    rules = run_["tool"]["driver"]["rules"]
    assert rules[alerts["broken.py"]["ruleIndex"]]["id"] == "MG999"
    notes = run_["invocations"][0]["toolExecutionNotifications"]
    assert sorted(n["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] for n in notes) == sorted(
        EXPECTED
    )
    assert {n["descriptor"]["id"] for n in notes} == {"MG999"}


def test_github_annotations(bad_tree: Path, run) -> None:  # type: ignore[no-untyped-def]
    lines = run("check", "--format", "github", "--no-cache").out.splitlines()
    errors = [line for line in lines if "title=MG999 not-analyzed" in line]
    assert len(errors) == len(EXPECTED)
    assert (
        "::error file=latin1.py,line=2,col=11,title=MG999 not-analyzed::MG999 latin1.py: cannot decode"
        in "\n".join(errors)
    )
    assert any(
        line.startswith("::error title=MG999 not-analyzed::MG999 locked: cannot read directory")
        for line in errors
    )


def test_report_is_not_clean(bad_tree: Path, run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from maingrad.contracts.report import Report

    target = tmp_path / "r.json"
    result = run("check", "--format", "json", "-o", target, "--no-cache")
    assert result.code == 1 and "MG999" in result.err  # the report went to a file: say it on stderr too
    report = Report.from_json(target.read_text())
    assert not report.clean and len(report.parse_errors) == len(EXPECTED)
    assert Report(tool_version="0").clean


def test_non_python_paths_are_refused(project, run) -> None:  # type: ignore[no-untyped-def]
    root = project({"README.md": "# title\n", "a.py": "x = p.main_grad\n"})
    refused = run("check", "README.md", "a.py")
    assert refused.code == 2 and refused.out == ""
    assert refused.err.strip() == (
        "maingrad: error: README.md: not a Python file (expected *.py or *.pyi, a python script, or a pattern "
        "under [tool.maingrad] include); nothing was checked"
    )
    (root / "tool").write_text("#!/usr/bin/env python3\nx = p.main_grad\n")
    script = run("check", "tool", "--no-cache")
    assert script.code == 1 and "tool:2:5: MG901" in script.out  # a python script without a suffix
    (root / "stub.pyi").write_text("x: int\n")
    assert run("check", "stub.pyi", "--no-cache").code == 0


def test_fix_diff_names_the_hidden_unsafe_fixes(project, run) -> None:  # type: ignore[no-untyped-def]
    root = project({"a.py": "bad_call()\n"})  # MG902's fix is unsafe
    diff = run("fix", "--diff", "--no-cache")
    assert diff.code == 0 and diff.out == ""
    assert diff.err.strip() == "Would fix 0 files (1 hidden fix can be enabled with `--unsafe-fixes`)."
    checked = run("check", "--no-cache")
    assert (
        checked.out.splitlines()[-1]
        == "No fixes available (1 hidden fix can be enabled with `--unsafe-fixes`)."
    )
    unsafe = run("fix", "--diff", "--unsafe-fixes", "--no-cache")
    assert unsafe.code == 1 and "+good_call()" in unsafe.out and unsafe.err.strip() == "Would fix 1 file."
    assert run("fix", "--unsafe-fixes", "--no-cache").code == 0
    assert (root / "a.py").read_text() == "good_call()\n"
