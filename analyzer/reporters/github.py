"""GitHub Actions workflow commands: one `::error`/`::warning`/`::notice` annotation per finding, and one
`::error` per path that could not be analyzed (MG999)."""

from __future__ import annotations

from collections.abc import Iterator

from maingrad.analyzer.reporters.base import OutputOptions
from maingrad.contracts.report import NotAnalyzed, Report, Severity

_COMMAND = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "notice"}


def escape_data(value: str) -> str:
    return value.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(value: str) -> str:
    return escape_data(value).replace(":", "%3A").replace(",", "%2C")


def render_github(report: Report, options: OutputOptions) -> str:
    return "".join(iter_github(report, options))


def iter_github(report: Report, options: OutputOptions) -> Iterator[str]:
    names = {r.id: r.name for r in report.rules}
    for f in report.findings:
        title = f"{f.rule} {names.get(f.rule, '')}".strip()
        props = (
            f"file={escape_property(options.display_path(f.path))},line={f.line},col={f.column},"
            f"endLine={f.end_line},endColumn={f.end_column},title={escape_property(title)}"
        )
        yield f"::{_COMMAND[f.severity]} {props}::{escape_data(f'{f.rule} {f.message}')}\n"
    for e in report.parse_errors:  # MG999: not analyzed (a directory gets a file-less annotation)
        where = ""
        if e.kind is not NotAnalyzed.DIRECTORY:
            where = f"file={escape_property(options.display_path(e.path))},line={e.line or 1},col={e.column or 1},"
        title = escape_property(f"{e.code} not-analyzed")
        message = escape_data(f"{e.code} {options.display_path(e.path)}: {e.message}")
        yield f"::error {where}title={title}::{message}\n"
