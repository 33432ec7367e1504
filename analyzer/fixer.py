"""`maingrad fix` / `check --fix` / `--diff`: apply rule fixes to files.

Fixes run through `engine.fix_source` (libcst round trip: bytes outside the replaced nodes are kept;
repeated until nothing changes, so a second run is a no-op), honour suppression comments, keep the file's
encoding and BOM, and are written atomically. Files no selected rule needs are never parsed.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from maingrad.analyzer.discovery import SourceFile
from maingrad.analyzer.fileio import SourceText, atomic_write, decode_source, encode_source
from maingrad.analyzer.progress import Progress
from maingrad.analyzer.runner import (
    _STATE,
    ScanSettings,
    _FileRules,
    _init_worker,
    _rule_instances,
    run_tasks,
)


@dataclass
class FixOutcome:
    source: SourceFile
    original: str
    fixed: str
    encoding: SourceText | None = None
    error: str | None = None

    @property
    def changed(self) -> bool:
        return self.error is None and self.fixed != self.original

    def diff(self) -> str:
        """A unified diff as git prints it (including its marker for a missing final newline)."""
        lines = difflib.unified_diff(
            self.original.splitlines(keepends=True),
            self.fixed.splitlines(keepends=True),
            fromfile=f"a/{self.source.relpath}",
            tofile=f"b/{self.source.relpath}",
        )
        return "".join(
            line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines
        )


def _fix_task(task: tuple[str, str, tuple[str, ...], bool]) -> str:
    from maingrad.analyzer.context import RuleSettings
    from maingrad.analyzer.engine import fix_source

    relpath, text, ids, unsafe = task
    settings: ScanSettings = _STATE["settings"]
    rule_settings = RuleSettings(exposure_helpers=frozenset(settings.exposure_helpers))
    return fix_source(
        text, relpath, _rule_instances(ids), rule_settings, unsafe=unsafe, honor_suppressions=True
    )


def fix_files(
    files: Sequence[SourceFile],
    settings: ScanSettings,
    unsafe: bool = False,
    jobs: int | None = None,
    show_progress: bool = False,
) -> list[FixOutcome]:
    """Fixed text for every file some fixable rule needs to look at (nothing is written here)."""
    # Every selected rule, not only those declaring `fixable`: a violation carries its fix either way.
    fix_settings = replace(settings, warn_unused_ignores=False)
    file_rules = _FileRules(fix_settings)
    outcomes: dict[str, FixOutcome] = {}
    tasks: list[tuple[str, int, Any]] = []
    for source in files:
        try:
            decoded = decode_source(source.path.read_bytes())
        except (OSError, UnicodeDecodeError, SyntaxError, LookupError):
            continue  # `check` reports unreadable files; there is nothing to fix in them
        ids = file_rules.for_path(source.relpath)
        if not file_rules.needed(ids, decoded.text):
            continue
        outcomes[source.relpath] = FixOutcome(source, decoded.text, decoded.text, decoded)
        tasks.append((source.relpath, len(decoded.text), (source.relpath, decoded.text, ids, unsafe)))
    _STATE["settings"] = fix_settings
    with Progress(len(tasks), "maingrad fix", show_progress) as progress:
        results = run_tasks(
            _fix_task, tasks, jobs or os.cpu_count() or 1, _init_worker, (fix_settings,), progress
        )
    for relpath, value in results.items():
        outcome = outcomes[relpath]
        if isinstance(value, BaseException):
            outcome.error = f"{type(value).__name__}: {value}"
        else:
            outcome.fixed = value
    return [outcomes[key] for key in sorted(outcomes)]


def write_fixes(outcomes: Sequence[FixOutcome]) -> int:
    """Write every changed file atomically; returns how many were written."""
    written = 0
    for outcome in outcomes:
        if outcome.changed and outcome.encoding is not None:
            atomic_write(outcome.source.path, encode_source(outcome.encoding, outcome.fixed))
            written += 1
    return written
