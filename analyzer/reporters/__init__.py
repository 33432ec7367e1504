"""Output formats. Each reporter renders a finished `Report`; none of them sees rules or CSTs.
`render(format, report, options)` picks one by name and returns a string; `iter_render` yields the same text
in pieces (one per finding where the format allows: text, JSON, GitHub), so that a report with 10^5
findings is written without ever holding its whole text, or a copy of every finding as a dict, in memory."""

from __future__ import annotations

from collections.abc import Iterator

from maingrad.analyzer.reporters.base import OutputOptions
from maingrad.contracts.report import Report

FORMATS = ("text", "json", "sarif", "github")


def iter_render(fmt: str, report: Report, options: OutputOptions) -> Iterator[str]:
    if fmt == "text":
        from maingrad.analyzer.reporters.text import iter_text

        return iter_text(report, options)
    if fmt == "json":
        from maingrad.analyzer.reporters.json_report import iter_json

        return iter_json(report, options)
    if fmt == "github":
        from maingrad.analyzer.reporters.github import iter_github

        return iter_github(report, options)
    return iter((render(fmt, report, options),))


def render(fmt: str, report: Report, options: OutputOptions) -> str:
    if fmt == "text":
        from maingrad.analyzer.reporters.text import render_text

        return render_text(report, options)
    if fmt == "json":
        from maingrad.analyzer.reporters.json_report import render_json

        return render_json(report, options)
    if fmt == "sarif":
        from maingrad.analyzer.reporters.sarif import render_sarif

        return render_sarif(report, options)
    if fmt == "github":
        from maingrad.analyzer.reporters.github import render_github

        return render_github(report, options)
    raise ValueError(f"unknown format {fmt!r} (choose from {', '.join(FORMATS)})")


__all__ = ["FORMATS", "OutputOptions", "iter_render", "render"]
