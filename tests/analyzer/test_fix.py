"""`maingrad fix`, `check --fix`, `--diff`, `--unsafe-fixes`: byte-preserving, idempotent, atomic."""

from __future__ import annotations

import codecs

import pytest

pytestmark = pytest.mark.usefixtures("test_rules")

SOURCE = """\
# a comment   with  odd   spacing
def f(p):   # keep me
    x = p.main_grad      # trailing
    bad_call( 1,2 )
    y = p.main_grad  # maingrad: ignore[MG901]
\treturn x
"""


def test_fix_is_byte_preserving_and_idempotent(project, run) -> None:
    root = project({"a.py": SOURCE.replace("\treturn", "    return")})
    path = root / "a.py"
    before = path.read_bytes()
    result = run("fix", ".", "--fail-on", "warning")
    assert result.code == 1  # the unsafe MG902 finding (a warning) and nothing else remains
    after = path.read_text()
    expected = before.decode().replace("    x = p.main_grad      #", "    x = p.main_grad_ok      #")
    assert after == expected  # only the edited node changed; the suppressed line was not fixed
    assert run("fix", ".", "--fail-on", "warning").code == 1 and path.read_text() == expected  # idempotent
    remaining = run("check", "--format", "json").json()["findings"]
    assert [f["rule"] for f in remaining] == ["MG902"]


def test_check_fix_and_unsafe(project, run) -> None:
    root = project({"a.py": "bad_call(p.main_grad)\n"})
    assert run("check", "--fix", "--fail-on", "warning").code == 1  # MG902 (a warning, unsafe fix) remains
    assert (root / "a.py").read_text() == "bad_call(p.main_grad_ok)\n"
    assert run("check", "--fix", "--unsafe-fixes").code == 0
    assert (root / "a.py").read_text() == "good_call(p.main_grad_ok)\n"


def test_diff_writes_nothing(project, run) -> None:
    root = project({"pkg/a.py": "x = p.main_grad\n", "pkg/b.py": "z = 1\n"})
    result = run("check", "--diff")
    assert result.code == 1
    assert (
        result.out == "--- a/pkg/a.py\n+++ b/pkg/a.py\n@@ -1 +1 @@\n-x = p.main_grad\n+x = p.main_grad_ok\n"
    )
    assert (root / "pkg" / "a.py").read_text() == "x = p.main_grad\n"
    assert run("fix", "--diff", "pkg/b.py").code == 0


def test_fix_keeps_encoding_bom_newlines_and_mode(project, run) -> None:
    root = project({})
    path = root / "a.py"
    path.write_bytes(codecs.BOM_UTF8 + b"x = p.main_grad\r\ny = '\xc3\xa9'\r\n")
    path.chmod(0o750)
    latin = root / "b.py"
    latin.write_bytes(b"# -*- coding: latin-1 -*-\nx = p.main_grad  # \xe9\n")
    assert run("fix").code == 0
    assert path.read_bytes() == codecs.BOM_UTF8 + b"x = p.main_grad_ok\r\ny = '\xc3\xa9'\r\n"
    assert path.stat().st_mode & 0o777 == 0o750
    assert latin.read_bytes() == b"# -*- coding: latin-1 -*-\nx = p.main_grad_ok  # \xe9\n"
    assert not [p for p in root.iterdir() if p.name.endswith(".tmp")]  # atomic writes leave no temp files


def test_unparsable_files_are_left_alone(project, run) -> None:
    root = project({"a.py": "x = p.main_grad(\n"})
    result = run("fix")
    assert (
        result.code == 1 and "a.py:1:16: MG999 syntax error: '(' was never closed" in result.out
    )  # nothing fixed, not clean
    assert (root / "a.py").read_text() == "x = p.main_grad(\n"


def test_diff_marks_a_missing_final_newline(project, run) -> None:
    project({"a.py": "x = p.main_grad"})
    assert run("check", "--diff").out.endswith("+x = p.main_grad_ok\n\\ No newline at end of file\n")


@pytest.mark.usefixtures("test_rules")
def test_a_crashing_rule_fails_fix_with_exit_2(project, run) -> None:
    root = project({"a.py": "explode = p.main_grad\n"}, 'select = ["MG901", "MG903"]\n')
    result = run("fix")
    assert result.code == 2 and "fixing a.py failed: RuntimeError: boom" in result.err
    assert (root / "a.py").read_text() == "explode = p.main_grad\n"  # nothing half-applied
