"""Lines changed since a git revision (`--diff-only REV` / `--changed-since REV`), from `git diff -U0`.

Committed, staged and unstaged changes against REV all count; untracked files (not ignored) count as
changed everywhere.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from maingrad.contracts.report import Finding

_HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@")


class ChangesError(RuntimeError):
    pass


@dataclass
class ChangedLines:
    lines: dict[str, set[int]] = field(default_factory=dict)  # root-relative path -> changed new-side lines
    whole_files: set[str] = field(default_factory=set)  # untracked files

    def touches_path(self, path: str) -> bool:
        """Whether the file (or, for a directory, anything under it) changed at all."""
        if path in self.whole_files or self.lines.get(path):
            return True
        prefix = path.rstrip("/") + "/"
        return any(p.startswith(prefix) for p in (*self.lines, *self.whole_files))

    def touches(self, finding: Finding) -> bool:
        if finding.path in self.whole_files:
            return True
        changed = self.lines.get(finding.path)
        return changed is not None and any(
            n in changed for n in range(finding.line, max(finding.line, finding.end_line) + 1)
        )


def _git(args: Sequence[str], cwd: Path) -> str:
    try:
        done = subprocess.run(
            ["git", "-c", "core.quotepath=off", *args], cwd=cwd, capture_output=True, text=True, check=False
        )
    except FileNotFoundError as exc:
        raise ChangesError("git is not installed") from exc
    if done.returncode != 0:
        reason = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        raise ChangesError(f"git {' '.join(args)} failed: {reason}")
    return done.stdout


def _unquote(path: str) -> str:
    if len(path) >= 2 and path[0] == path[-1] == '"':
        return (
            path[1:-1]
            .encode("latin-1", "backslashreplace")
            .decode("unicode_escape")
            .encode("latin-1")
            .decode("utf-8")
        )
    return path


def parse_diff(text: str) -> dict[str, set[int]]:
    """New-side line numbers per file (git-root-relative) from `git diff -U0` output."""
    result: dict[str, set[int]] = {}
    current: set[int] | None = None
    for line in text.splitlines():
        if line.startswith("+++ "):
            target = line[4:]
            if target == "/dev/null":
                current = None
                continue
            target = _unquote(target)
            current = result.setdefault(target[2:] if target.startswith("b/") else target, set())
        elif line.startswith("@@") and current is not None:
            match = _HUNK.match(line)
            if match:
                start, count = int(match.group(1)), int(match.group(2) or "1")
                current.update(range(start, start + count))
    return result


def changed_lines(rev: str, root: Path) -> ChangedLines:
    """Raises ChangesError with a one-line reason: git missing, not a work tree, REV not a commit."""
    try:
        top = Path(_git(["rev-parse", "--show-toplevel"], root).strip())
    except ChangesError as exc:
        raise ChangesError(f"--diff-only {rev}: {root} is not inside a git work tree ({exc})") from None
    try:
        _git(["rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], top)
    except ChangesError:
        raise ChangesError(
            f"--diff-only {rev}: no such commit in {top} (a branch, tag or commit id, e.g. origin/main; "
            "a shallow CI clone may need `git fetch` of that revision)"
        ) from None
    diff = _git(["diff", "-U0", "--no-color", "--no-ext-diff", rev, "--"], top)
    untracked = _git(["ls-files", "--others", "--exclude-standard", "-z"], top)

    def rel(path: str) -> str:
        return Path(os.path.relpath(top / path, root)).as_posix()

    result = ChangedLines()
    for path, lines in parse_diff(diff).items():
        result.lines[rel(path)] = lines
    result.whole_files = {rel(p) for p in untracked.split("\0") if p}
    return result
