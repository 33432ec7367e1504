"""Human output in ruff's shape: `path:line:col: MG001 error [*] message` (the severity; `[*]`: `maingrad fix`
fixes it), then a code frame with a caret, the rest of a long message, and `= help: see `maingrad explain
MG001``; `--concise` keeps the first line only. Paths that could not be analyzed appear as
`path:line:col: MG999 reason` in the same stream; per-rule statistics; a summary that counts findings (by
severity), unanalyzed paths, safe fixes and hidden (unsafe) fixes apart. Colour only when asked (on a
terminal)."""

from __future__ import annotations

import re
import textwrap
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from maingrad.analyzer.reporters.base import OutputOptions
from maingrad.contracts.report import NOT_ANALYZED_CODE, Finding, NotAnalyzed, ParseError, Report

_RESET, _BOLD, _RED, _CYAN, _BLUE, _DIM = "\033[0m", "\033[1m", "\033[31m", "\033[36m", "\033[34m", "\033[2m"
_YELLOW = "\033[33m"
_SEVERITY_STYLE = {"error": (_RED, _BOLD), "warning": (_YELLOW, _BOLD), "info": (_BLUE,)}

# Where a long message splits into its headline and the rest: a sentence or clause end outside `code`.
_BOUNDARY = re.compile(r"`[^`]*`|(\. |; |: |, which |, so | \()")
SHORT_MESSAGE = 40  # no split before this many characters: the headline must say something


def split_message(message: str) -> tuple[str, str]:
    """(headline, detail): the message up to its first clause boundary outside backquotes (at or after
    SHORT_MESSAGE characters), and the rest. Nothing is lost: headline + detail is the whole message."""
    for match in _BOUNDARY.finditer(message):
        if match.group(1) is None or match.start() < SHORT_MESSAGE:
            continue
        head = message[: match.start()].rstrip()
        rest = message[match.start() :].lstrip(".;:, ").strip()
        if rest:
            return head, rest
    return message, ""


class _Style:
    def __init__(self, color: bool) -> None:
        self.color = color

    def __call__(self, text: str, *codes: str) -> str:
        return f"{''.join(codes)}{text}{_RESET}" if self.color and codes else text


def _source_lines(
    options: OutputOptions, relpath: str, cache: dict[str, list[str] | None]
) -> list[str] | None:
    if relpath not in cache:
        try:
            cache[relpath] = (
                (Path(options.root) / relpath).read_text(encoding="utf-8", errors="replace").splitlines()
            )
        except OSError:
            cache[relpath] = None
    return cache[relpath]


def _context(finding: Finding, lines: list[str], style: _Style, before: int = 1, after: int = 1) -> list[str]:
    first = max(1, finding.line - before)
    last = min(len(lines), finding.line + after)
    width = len(str(last))
    gutter = style(" " * width + " |", _BLUE)
    out = [gutter]
    for number in range(first, last + 1):
        text = lines[number - 1].expandtabs(1)
        out.append(f"{style(str(number).rjust(width) + ' |', _BLUE)} {text}")
        if number == finding.line:
            start = finding.column - 1
            end = finding.end_column - 1 if finding.end_line == finding.line else len(text)
            carets = "^" * max(1, end - start)
            out.append(f"{gutter} {' ' * start}{style(carets + ' ' + finding.rule, _RED, _BOLD)}")
    out.append(gutter)
    return out


def _plural(count: int, singular: str, plural: str | None = None) -> str:
    return f"{count} {singular if count == 1 else (plural or singular + 's')}"


def error_line(error: ParseError, options: OutputOptions, style: _Style | None = None) -> str:
    """One MG999 diagnostic in the findings' shape: `path:line:col: MG999 message` (`dir/: ...` for a
    directory, which has no lines)."""
    style = style or _Style(False)
    path = options.display_path(error.path)
    if error.kind is NotAnalyzed.DIRECTORY:
        where = style(path.rstrip("/") + "/", _BOLD)
    else:
        line, column = error.line or 1, error.column or 1
        where = f"{style(path, _BOLD)}{style(':', _CYAN)}{line}{style(':', _CYAN)}{column}"
    return f"{where}{style(':', _CYAN)} {style(error.code, _RED, _BOLD)} {error.message}"


def _by_severity(report: Report) -> str:
    """` (1 error, 2 warnings)`: the findings counted by severity, most severe first."""
    counts = Counter(f.severity for f in report.findings)
    if not counts:
        return ""
    parts = [_plural(counts[s], s.value) for s in sorted(counts, key=lambda s: -s.rank)]
    return f" ({', '.join(parts)})"


def summary_lines(report: Report, options: OutputOptions) -> list[str]:
    """The closing lines: findings and not-analyzed paths counted apart, then safe and hidden fixes."""
    count = len(report.findings)
    scanned = _plural(report.files_scanned, "file")
    directories = sum(1 for e in report.parse_errors if e.kind is NotAnalyzed.DIRECTORY)
    files = len({e.path for e in report.parse_errors if e.kind is not NotAnalyzed.DIRECTORY})
    out: list[str] = []
    if report.parse_errors:
        what = " and ".join(
            part
            for part in (
                _plural(files, "file") if files else "",
                _plural(directories, "directory", "directories") if directories else "",
            )
            if part
        )
        verb = "was" if files + directories == 1 else "were"
        out.append(
            f"Found {_plural(count, 'finding')}{_by_severity(report)} in {scanned}; {what} {verb} not analyzed (MG999)."
        )
    elif count:
        out.append(f"Found {_plural(count, 'finding')}{_by_severity(report)} in {scanned}.")
    else:
        out.append(f"All checks passed! ({scanned} scanned)")
    if count and options.fail_on is not None and not report.parse_errors:
        failing = sum(1 for f in report.findings if f.severity.rank >= options.fail_on.rank)
        if not failing:
            out.append(f"None at or above --fail-on {options.fail_on.value}: exit status 0.")
    fixable = sum(1 for f in report.findings if f.fingerprint in options.fixable)
    hidden = options.hidden_fixes
    hint = f" ({_plural(hidden, 'hidden fix', 'hidden fixes')} can be enabled with `--unsafe-fixes`)"
    if fixable:
        out.append(f"[*] {fixable} fixable with `maingrad fix`{hint if hidden else ''}.")
    elif hidden:
        out.append(f"No fixes available{hint}.")
    return out


def render_text(report: Report, options: OutputOptions) -> str:
    return "".join(iter_text(report, options))


def iter_text(report: Report, options: OutputOptions) -> Iterator[str]:
    """The text report, line by line (findings and MG999 diagnostics merged in path and line order)."""
    style = _Style(options.color)
    names = {r.id: r.name for r in report.rules}
    if options.statistics:
        counts = Counter(f.rule for f in report.findings)
        fixable_rules = {f.rule for f in report.findings if f.fingerprint in options.fixable}
        rows = [
            (count, rule, "[*]" if rule in fixable_rules else "[ ]", names.get(rule, ""))
            for rule, count in counts.items()
        ]
        if report.parse_errors:
            rows.append((len(report.parse_errors), NOT_ANALYZED_CODE, "[ ]", "not-analyzed"))
        width = max((len(str(row[0])) for row in rows), default=1)
        for count, rule, mark, name in sorted(rows, key=lambda row: (-row[0], row[1])):
            yield f"{str(count).rjust(width)}\t{style(rule, _RED, _BOLD)}\t{mark} {name}".rstrip() + "\n"
    else:
        sources: dict[str, list[str] | None] = {}
        errors = sorted(report.parse_errors, key=lambda e: (e.path, e.line or 0, e.column or 0))
        next_error = 0
        for f in report.findings:
            while next_error < len(errors) and (errors[next_error].path, errors[next_error].line or 0) <= (
                f.path,
                f.line,
            ):
                yield error_line(errors[next_error], options, style) + "\n"
                next_error += 1
            mark = "[*] " if f.fingerprint in options.fixable else ""
            where = f"{style(options.display_path(f.path), _BOLD)}{style(':', _CYAN)}{f.line}{style(':', _CYAN)}{f.column}"
            severity = style(f.severity.value, *_SEVERITY_STYLE[f.severity.value])
            if not options.show_source:
                yield f"{where}{style(':', _CYAN)} {style(f.rule, _RED, _BOLD)} {severity} {mark}{f.message}\n"
                continue
            head, detail = split_message(f.message)
            yield f"{where}{style(':', _CYAN)} {style(f.rule, _RED, _BOLD)} {severity} {mark}{head}\n"
            if f.path not in sources:  # findings come in path order: hold one file's lines at a time
                sources.clear()
            lines = _source_lines(options, f.path, sources)
            frame = _context(f, lines, style) if lines and f.line <= len(lines) else []
            yield "".join(line + "\n" for line in frame)
            pad = " " * (len(str(min(len(lines or ()), f.line + 1))) + 1 if frame else 2)
            for i, text in enumerate(textwrap.wrap(detail, 100) if detail else []):
                yield f"{pad}{style('=', _BLUE) if i == 0 else ' '} {text}\n"
            yield f"{pad}{style('=', _BLUE)} {style('help', _BOLD)}: see `maingrad explain {f.rule}`\n\n"
        for error in errors[next_error:]:
            yield error_line(error, options, style) + "\n"
    if not options.quiet:
        yield "".join(line + "\n" for line in summary_lines(report, options))


def render_errors(report: Report, options: OutputOptions) -> str:
    """The MG999 diagnostics alone, for stderr (when the report itself goes to a file)."""
    style = _Style(options.color)
    return "".join(error_line(e, options, style) + "\n" for e in report.parse_errors)
