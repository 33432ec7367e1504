"""`# maingrad: ignore[...]` comments, `ignore-file`, and --warn-unused-ignores (MG000)."""

from __future__ import annotations

import pytest

from maingrad.analyzer.suppressions import parse_suppressions

pytestmark = pytest.mark.usefixtures("test_rules")


def _findings(run, *extra: str) -> list[tuple[str, int]]:  # type: ignore[no-untyped-def]
    result = run("check", "--format", "json", *extra)
    assert result.code in (0, 1), result.err
    return [(f["rule"], f["line"]) for f in result.json()["findings"]]


def test_reported_line_and_statement_first_line(project, run) -> None:
    project(
        {
            "a.py": """\
            a = p.main_grad  # maingrad: ignore[MG901]
            b = p.main_grad  # maingrad: ignore[MG902]
            c = f(  # maingrad: ignore[MG901]
                p.main_grad,
            )
            d = f(
                p.main_grad,  # maingrad: ignore
            )
            e = f(
                p.main_grad,
            )  # a comment on the last line does not count
            x = "# maingrad: ignore[MG901]"; y = p.main_grad
            """
        }
    )
    assert _findings(run) == [("MG901", 2), ("MG901", 10), ("MG901", 12)]


def test_several_codes_and_case(project, run) -> None:
    project(
        {
            "a.py": "bad_call(p.main_grad)  # Maingrad: ignore[mg901, MG902]\nbad_call(p.main_grad)  # maingrad: ignore[MG901,MG902]\n"
        }
    )
    assert _findings(run) == []


def test_ignore_file(project, run) -> None:
    project(
        {
            "a.py": "# maingrad: ignore-file\nx = p.main_grad\nbad_call()\n",
            "b.py": "# maingrad: ignore-file[MG902]\nx = p.main_grad\nbad_call()\n",
        }
    )
    assert _findings(run) == [("MG901", 2)]


def test_compound_statement_header(project, run) -> None:
    project({"a.py": "if p.main_grad:  # maingrad: ignore[MG901]\n    y = q.main_grad\n"})
    assert _findings(run) == [("MG901", 2)]


def test_warn_unused_ignores(project, run) -> None:
    project(
        {
            "a.py": """\
            a = p.main_grad  # maingrad: ignore[MG901]
            b = 1  # maingrad: ignore[MG901]
            c = 2  # maingrad: ignore[MG999]
            d = 3  # maingrad: ignore
            e = p.main_grad  # maingrad: ignore[MG901, MG902]
            """,
            "clean.py": "z = 1  # maingrad: ignore[MG901]\n",
        }
    )
    assert _findings(run) == []
    result = run("check", "--format", "json", "--warn-unused-ignores")
    data = result.json()
    got = [(f["path"], f["rule"], f["line"], f["message"]) for f in data["findings"]]
    assert got == [
        ("a.py", "MG000", 2, "unused suppression for MG901 in `# maingrad: ignore[MG901]`"),
        ("a.py", "MG000", 3, "unknown rule code(s) MG999 in `# maingrad: ignore[MG999]`"),
        ("a.py", "MG000", 4, "unused suppression `# maingrad: ignore`: it suppresses no finding"),
        ("a.py", "MG000", 5, "unused suppression for MG902 in `# maingrad: ignore[MG901, MG902]`"),
        ("clean.py", "MG000", 1, "unused suppression for MG901 in `# maingrad: ignore[MG901]`"),
    ]
    assert data["rules"][0]["id"] == "MG000"
    assert result.code == 0  # MG000 is a warning: below the default --fail-on error
    assert run("check", "--warn-unused-ignores", "--fail-on", "warning").code == 1
    # the config key does the same
    project({}, 'select = ["MG90"]\nwarn-unused-ignores = true\n')
    assert len(run("check", "--format", "json").json()["findings"]) == 5


def test_rules_not_run_are_neither_used_nor_unused(project, run) -> None:
    project({"a.py": "x = 1  # maingrad: ignore[MG902]\n"}, 'select = ["MG901"]\n')
    assert _findings(run, "--warn-unused-ignores") == []


def test_comments_only_not_strings() -> None:
    parsed = parse_suppressions('s = "# maingrad: ignore[MG001]"\nt = 1  # maingrad: ignore[MG001]\n')
    assert [(d.line, d.codes) for d in parsed.directives] == [(2, frozenset({"MG001"}))]
    broken = parse_suppressions('s = """\n# maingrad: ignore\n')  # untokenizable: line scan fallback
    assert [d.line for d in broken.directives] == [2]


def test_unused_ignores_in_a_fresh_process(tmp_path) -> None:
    """A file no rule parses gets its suppressions judged in the first pass, before any analysis ran in the
    process: a fresh `maingrad check` must not depend on an earlier scan's state (it raised KeyError once)."""
    import json
    import subprocess
    import sys

    (tmp_path / "clean.py").write_text("z = 1  # maingrad: ignore[MG901]\n")
    done = subprocess.run(
        [sys.executable, "-m", "maingrad.cli.main", "check", str(tmp_path), "--no-cache", "--format", "json",
         "--warn-unused-ignores"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert "internal error" not in done.stderr, done.stderr
    rules = [f["rule"] for f in json.loads(done.stdout)["findings"]]
    assert rules == ["MG000"]
