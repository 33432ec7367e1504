"""What reporters need besides the report: where files are, how to show them, rule docs."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from maingrad.analyzer.catalog import RuleMeta
from maingrad.contracts.report import Severity


@dataclass(frozen=True)
class OutputOptions:
    root: Path  # the scan root (report paths are relative to it)
    cwd: Path = field(default_factory=Path.cwd)
    color: bool = False
    show_source: bool = False  # the code frame, the rest of a long message and the `explain` pointer
    statistics: bool = False
    quiet: bool = False
    rules: tuple[RuleMeta, ...] = ()  # metadata (docs) of the reported rules, for SARIF help text
    fixable: frozenset[str] = (
        frozenset()
    )  # fingerprints whose fix `maingrad fix` applies (with the given flags)
    hidden_fixes: int = 0  # findings with an unsafe fix that only `--unsafe-fixes` applies
    fail_on: Severity | None = None  # check's --fail-on (None: not a check run, or --exit-zero)

    _display: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def display_path(self, relpath: str) -> str:
        """A report path as the user's shell sees it: relative to the working directory when under it.
        Cached per path: a file with many findings asks for the same path each time."""
        shown = self._display.get(relpath)
        if shown is None:
            absolute = Path(os.path.normpath(self.root / relpath))
            cwd = self.cwd.resolve()
            if absolute == cwd or cwd in absolute.parents:
                shown = absolute.relative_to(cwd).as_posix()
            else:
                shown = str(absolute)
            self._display[relpath] = shown
        return shown

    def rule_meta(self, rule_id: str) -> RuleMeta | None:
        return next((r for r in self.rules if r.id == rule_id), None)
