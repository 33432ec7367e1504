"""GitHub Actions workflow commands: one `::error`/`::warning`/`::notice` annotation per finding."""

from __future__ import annotations

from maingrad.analyzer.reporters.base import OutputOptions
from maingrad.contracts.report import Report, Severity

_COMMAND = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "notice"}


def escape_data(value: str) -> str:
    return value.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(value: str) -> str:
    return escape_data(value).replace(":", "%3A").replace(",", "%2C")


def render_github(report: Report, options: OutputOptions) -> str:
    names = {r.id: r.name for r in report.rules}
    lines = []
    for f in report.findings:
        title = f"{f.rule} {names.get(f.rule, '')}".strip()
        props = (
            f"file={escape_property(options.display_path(f.path))},line={f.line},col={f.column},"
            f"endLine={f.end_line},endColumn={f.end_column},title={escape_property(title)}"
        )
        lines.append(f"::{_COMMAND[f.severity]} {props}::{escape_data(f'{f.rule} {f.message}')}")
    for e in report.parse_errors:
        where = f"file={escape_property(options.display_path(e.path))}"
        if e.line:
            where += f",line={e.line}"
            if e.column:
                where += f",col={e.column}"
        lines.append(f"::error {where},title=maingrad%3A parse error::{escape_data(e.message)}")
    return "".join(line + "\n" for line in lines)
