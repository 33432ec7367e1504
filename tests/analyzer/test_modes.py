"""--diff-only/--changed-since and --baseline/--write-baseline on a temporary git repository with moved,
edited, renamed and new code."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from maingrad.analyzer.changes import parse_diff

pytestmark = pytest.mark.usefixtures("test_rules")

BASE = {
    "a.py": """\
    def f(p):
        x = p.main_grad
        return x


    def g(q):
        y = q.main_grad
        return y
    """,
    "old_name.py": "def h(r):\n    return r.main_grad\n",
}


def _git(root: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


@pytest.fixture
def repo(project) -> Path:  # type: ignore[no-untyped-def]
    root = project(BASE, 'select = ["MG901"]\n')
    (root / ".gitignore").write_text(".maingrad_cache/\nbaseline.json\n")
    _git(root, "init", "-q", "-b", "main")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "base")
    return root


def _change(root: Path) -> None:
    """Move f and g down (new code above them), edit g's flagged line, rename old_name.py, add a file."""
    a = root / "a.py"
    text = a.read_text()
    text = "def new(p):\n    return p.main_grad * 2\n\n\n" + text.replace(
        "y = q.main_grad", "y = q.main_grad + 1"
    )
    a.write_text(text)
    _git(root, "mv", "old_name.py", "new_name.py")
    (root / "fresh.py").write_text("z = s.main_grad\n")


def _found(run, *args: str) -> list[tuple[str, int]]:  # type: ignore[no-untyped-def]
    result = run("check", "--format", "json", *args)
    assert result.code in (0, 1), result.err
    return [(f["path"], f["line"]) for f in result.json()["findings"]]


def test_diff_only_reports_changed_lines(repo: Path, run) -> None:  # type: ignore[no-untyped-def]
    assert _found(run, "--diff-only", "HEAD") == []
    _change(repo)
    expected = [("a.py", 2), ("a.py", 11), ("fresh.py", 1)]  # new code, the edited line, the untracked file
    assert _found(run, "--diff-only", "HEAD") == expected
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "change")
    assert _found(run, "--changed-since", "HEAD~1") == expected
    assert _found(run, "--diff-only", "HEAD") == []
    bad = run("check", "--diff-only", "no-such-rev")
    assert bad.code == 2 and "git" in bad.err


def test_baseline_matches_moved_code(repo: Path, run) -> None:  # type: ignore[no-untyped-def]
    baseline = repo / "baseline.json"
    written = run("check", "--write-baseline", baseline)
    assert written.code == 0 and baseline.exists()
    assert _found(run, "--baseline", baseline) == []
    _change(repo)
    # f moved down (matched by fingerprint), h moved to another file (matched by rule + code); the new
    # function, the edited line and the new file are reported.
    assert _found(run, "--baseline", baseline) == [("a.py", 2), ("a.py", 11), ("fresh.py", 1)]
    broken = repo / "broken.json"
    broken.write_text("{}")
    result = run("check", "--baseline", broken)
    assert result.code == 2 and "not a maingrad baseline" in result.err


def test_baseline_counts_duplicates(repo: Path, run) -> None:  # type: ignore[no-untyped-def]
    baseline = repo / "baseline.json"
    run("check", "--write-baseline", baseline)
    (repo / "old_name.py").write_text(
        "def h(r):\n    return r.main_grad\n\n\ndef h2(r):\n    return r.main_grad\n"
    )
    # the second identical `return r.main_grad` is new even though its code equals a baselined one
    assert _found(run, "--baseline", baseline) == [("old_name.py", 6)]


def test_parse_diff_hunks() -> None:
    diff = (
        "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1,0 +2,3 @@\n+a\n+b\n+c\n@@ -10 +12 @@\n-x\n+y\n"
        "@@ -20,2 +23,0 @@\n-gone\n-gone\n--- a/del.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-z\n"
    )
    assert parse_diff(diff) == {"x.py": {2, 3, 4, 12}}
