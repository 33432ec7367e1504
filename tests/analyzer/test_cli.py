"""Exit codes and the informational commands."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from maingrad.analyzer.rules import all_rules

pytestmark = pytest.mark.usefixtures("test_rules")


def test_exit_codes(project, run) -> None:
    project({"clean.py": "x = 1\n", "dirty.py": "y = p.main_grad\n"})
    assert run("check", "clean.py").code == 0
    assert run("check", "dirty.py").code == 1
    assert run("check", "dirty.py", "--exit-zero").code == 0
    missing = run("check", "nope.py")
    assert missing.code == 2 and "nope.py: no such file or directory" in missing.err
    assert run("check", "--jobs", "0").code == 2
    with pytest.raises(SystemExit) as usage:
        run("check", "--format", "xml")
    assert usage.value.code == 2


def test_no_command_prints_help_and_exits_2(run) -> None:
    result = run()
    assert result.code == 2 and "check" in result.err


def test_rules_lists_every_rule(run) -> None:
    out = run("rules").out
    assert out.splitlines()[0].split()[:4] == ["ID", "NAME", "SEVERITY", "FIX"]
    for rule in (*all_rules(),):
        assert rule.id in out and rule.name in out
    assert "MG901" in out and "MG000" in out
    listed = run("rules", "--format", "json")
    assert {"MG000", "MG901"} <= {r["id"] for r in listed.json()}


def test_explain(run, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    raw = run("explain", "mg901", "--format", "markdown")
    assert raw.code == 0
    assert raw.out.splitlines()[0] == "# MG901: test-main-grad-attribute"
    assert "## What it does" in raw.out and "<!--" not in raw.out
    rendered = run("explain", "MG901")  # rich renders the Markdown (plain text in a pipe)
    assert rendered.code == 0
    assert "MG901: test-main-grad-attribute" in rendered.out and "What it does" in rendered.out
    assert "## " not in rendered.out and "<!--" not in rendered.out and "\x1b[" not in rendered.out
    assert "# maingrad: ignore[MG901]" in rendered.out  # the table's code cell survives rendering
    mg999 = run("explain", "MG999", "--format", "markdown")
    assert mg999.code == 0 and mg999.out.startswith("# MG999: not-analyzed")
    unknown = run("explain", "MG998")
    assert unknown.code == 2 and "unknown rule 'MG998'" in unknown.err


def test_console_script_and_module_entry_point(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "a.py").write_text("x = 1\n")
    done = subprocess.run(
        [sys.executable, "-m", "maingrad.cli", "check", "--no-cache", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "All checks passed!" in done.stdout


def test_real_rules_on_the_shipped_example(monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's first command: `maingrad check examples/` reports the example's MG001 and exits 1,
    although the repository's own config excludes examples/ (a named directory is always scanned)."""
    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)
    done = subprocess.run(
        [sys.executable, "-m", "maingrad.cli", "check", "examples/", "--no-cache", "--format", "json"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1, done.stderr
    findings = json.loads(done.stdout)["findings"]
    assert ("examples/buggy_grouped_mlp.py", "MG001") in {(f["path"], f["rule"]) for f in findings}


@pytest.mark.usefixtures("test_rules")
def test_unwritable_output_and_internal_errors_exit_2(project, run, monkeypatch: pytest.MonkeyPatch) -> None:
    root = project({"a.py": "x = p.main_grad\n"})
    result = run("check", "--output", root / "missing" / "report.json")
    assert result.code == 2 and "No such file or directory" in result.err

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise ValueError("bug")

    monkeypatch.setattr("maingrad.analyzer.runner.scan", broken)
    result = run("check")
    assert result.code == 2 and "internal error" in result.err and "ValueError: bug" in result.err
