"""Suppression comments.

- `# maingrad: ignore[MG001]` / `# maingrad: ignore[MG001, MG003]` / bare `# maingrad: ignore` on the
  reported line, or on the first line of the innermost statement enclosing the reported node.
- `# maingrad: ignore-file` (optionally `ignore-file[MG001]`) anywhere in the file.

With `--warn-unused-ignores`, suppressions that suppressed nothing, and rule ids maingrad does not know,
are reported as findings of the pseudo rule MG000 (so they flow through every output format, baselines
and exit codes like any other finding). Codes of known rules that were not run on the file are neither
used nor unused and are never reported.

Only real comments count (found with `tokenize`), never text inside strings; this module does not need
libcst, so files that hit the cache or fail the pre-filter never import it.
"""

from __future__ import annotations

import io
import re
import tokenize
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from maingrad.analyzer.catalog import UNUSED_SUPPRESSION, UNUSED_SUPPRESSION_ID
from maingrad.contracts.report import Finding, Severity, fingerprint

MARKER = "maingrad"
_DIRECTIVE = re.compile(r"#\s*maingrad\s*:\s*(ignore-file|ignore)\b(?:\[([^\]]*)\])?", re.IGNORECASE)


@dataclass
class Directive:
    line: int
    column: int  # 1-based column of the comment
    text: str  # the directive as written
    codes: frozenset[str] | None  # None: every rule
    file_level: bool
    used: set[str] = field(default_factory=set)

    def covers(self, rule: str) -> bool:
        return self.codes is None or rule in self.codes


@dataclass
class Suppressions:
    directives: list[Directive] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.directives

    def suppresses(self, rule: str, lines: Iterable[int]) -> bool:
        """Whether a directive on one of `lines` (or a file-level one) covers `rule` (marks nothing used)."""
        wanted = set(lines)
        return any(d.covers(rule) and (d.file_level or d.line in wanted) for d in self.directives)

    def by_line(self) -> dict[int, list[Directive]]:
        lines: dict[int, list[Directive]] = {}
        for directive in self.directives:
            if not directive.file_level:
                lines.setdefault(directive.line, []).append(directive)
        return lines


def _comments(source: str) -> Iterable[tuple[int, int, str]]:
    """(line, 0-based column, text) of each comment; falls back to a line scan when tokenize fails."""
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT:
                yield token.start[0], token.start[1], token.string
        return
    except (tokenize.TokenError, SyntaxError, IndentationError):
        pass
    for number, line in enumerate(source.splitlines(), start=1):
        index = line.find("#")
        if index >= 0:
            yield number, index, line[index:]


def parse_suppressions(source: str) -> Suppressions:
    result = Suppressions()
    if MARKER not in source:
        return result
    for line, column, comment in _comments(source):
        for match in _DIRECTIVE.finditer(comment):
            kind, raw_codes = match.group(1).lower(), match.group(2)
            codes = None
            if raw_codes is not None:
                codes = frozenset(c.strip().upper() for c in raw_codes.split(",") if c.strip())
            result.directives.append(
                Directive(line, column + 1 + match.start(), match.group(0), codes, kind == "ignore-file")
            )
    return result


def apply_suppressions(
    findings: Sequence[Finding], anchors: Mapping[str, Sequence[int]], suppressions: Suppressions
) -> tuple[list[Finding], int]:
    """Findings that survive, and how many were suppressed. `anchors[fingerprint]` lists the extra lines
    (the enclosing statement's first line) where a comment suppresses that finding."""
    if suppressions.empty:
        return list(findings), 0
    file_level = [d for d in suppressions.directives if d.file_level]
    by_line = suppressions.by_line()
    kept: list[Finding] = []
    for finding in findings:
        directive = next((d for d in file_level if d.covers(finding.rule)), None)
        if directive is None:
            for line in (finding.line, *anchors.get(finding.fingerprint, ())):
                directive = next((d for d in by_line.get(line, ()) if d.covers(finding.rule)), None)
                if directive is not None:
                    break
        if directive is None:
            kept.append(finding)
        else:
            directive.used.add(finding.rule)
    return kept, len(findings) - len(kept)


def unused_findings(
    suppressions: Suppressions,
    path: str,
    source: str,
    active_rules: Iterable[str],
    known_rules: Iterable[str],
    severity: Severity | None = None,
) -> list[Finding]:
    """MG000 findings for directives that suppressed nothing among `active_rules` (the rules that ran on
    this file) or that name unknown rules."""
    active, known = set(active_rules), set(known_rules) | {UNUSED_SUPPRESSION_ID}
    lines = source.splitlines()
    findings: list[Finding] = []
    seen: dict[str, int] = {}
    for directive in suppressions.directives:
        problems: list[str] = []
        if directive.codes is None:
            if not directive.used:
                problems.append(f"unused suppression `{directive.text}`: it suppresses no finding")
        else:
            unknown = sorted(c for c in directive.codes if c not in known)
            unused = sorted(c for c in directive.codes if c in active and c not in directive.used)
            if unknown:
                problems.append(f"unknown rule code(s) {', '.join(unknown)} in `{directive.text}`")
            if unused:
                problems.append(f"unused suppression for {', '.join(unused)} in `{directive.text}`")
        if not problems:
            continue
        code_line = lines[directive.line - 1] if directive.line <= len(lines) else ""
        context = f"{directive.text}\0{code_line}"
        occurrence = seen.get(context, 0)
        seen[context] = occurrence + 1
        for message in problems:
            findings.append(
                Finding(
                    rule=UNUSED_SUPPRESSION_ID,
                    severity=severity or UNUSED_SUPPRESSION.severity,
                    path=path,
                    line=directive.line,
                    column=directive.column,
                    end_line=directive.line,
                    end_column=directive.column + len(directive.text),
                    message=message,
                    fingerprint=fingerprint(
                        UNUSED_SUPPRESSION_ID, path, f"{message}\0{code_line}", occurrence
                    ),
                    snippet=code_line,
                )
            )
    return findings
