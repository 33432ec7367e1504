"""Human output in ruff's shape: `path:line:col: MG001 [*] message`, optional source context with a
caret, per-rule statistics, and a one-line summary. Colour only when asked (on a terminal)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from maingrad.analyzer.reporters.base import OutputOptions
from maingrad.contracts.report import Finding, Report

_RESET, _BOLD, _RED, _CYAN, _BLUE, _DIM = "\033[0m", "\033[1m", "\033[31m", "\033[36m", "\033[34m", "\033[2m"


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


def render_text(report: Report, options: OutputOptions) -> str:
    style = _Style(options.color)
    out: list[str] = []
    names = {r.id: r.name for r in report.rules}
    fixable = [f for f in report.findings if f.fingerprint in options.fixable]
    if options.statistics:
        counts = Counter(f.rule for f in report.findings)
        fixable_rules = {f.rule for f in fixable}
        width = max((len(str(n)) for n in counts.values()), default=1)
        for rule, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
            mark = "[*]" if rule in fixable_rules else "[ ]"
            out.append(
                f"{str(count).rjust(width)}\t{style(rule, _RED, _BOLD)}\t{mark} {names.get(rule, '')}".rstrip()
            )
    else:
        sources: dict[str, list[str] | None] = {}
        for f in report.findings:
            mark = "[*] " if f.fingerprint in options.fixable else ""
            where = f"{style(options.display_path(f.path), _BOLD)}{style(':', _CYAN)}{f.line}{style(':', _CYAN)}{f.column}"
            out.append(f"{where}{style(':', _CYAN)} {style(f.rule, _RED, _BOLD)} {mark}{f.message}")
            if options.show_source:
                lines = _source_lines(options, f.path, sources)
                if lines and f.line <= len(lines):
                    out.extend(_context(f, lines, style))
                    out.append("")
    if not options.quiet:
        count = len(report.findings)
        scanned = f"{report.files_scanned} file{'s' if report.files_scanned != 1 else ''}"
        if count:
            noun = "finding" if count == 1 else "findings"
            summary = f"Found {count} {noun} in {scanned}."
            if fixable:
                summary += f"\n[*] {len(fixable)} fixable with `maingrad fix`."
            out.append(summary)
        else:
            out.append(f"All checks passed! ({scanned} scanned)")
    return "".join(line + "\n" for line in out)


def render_errors(report: Report, options: OutputOptions) -> str:
    """Parse and internal errors, for stderr."""
    style = _Style(options.color)
    out = []
    for e in report.parse_errors:
        where = options.display_path(e.path)
        if e.line:
            where += f":{e.line}" + (f":{e.column}" if e.column else "")
        out.append(f"{style('error', _RED, _BOLD)}: {where}: {e.message}")
    return "".join(line + "\n" for line in out)
