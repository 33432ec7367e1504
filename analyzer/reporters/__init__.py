"""Output formats. Each reporter renders a finished `Report` to a string; none of them sees rules or
CSTs. `render(format, report, options)` picks one by name."""

from __future__ import annotations

from maingrad.analyzer.reporters.base import OutputOptions

FORMATS = ("text", "json", "sarif", "github")


def render(fmt: str, report, options: OutputOptions) -> str:  # type: ignore[no-untyped-def]
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


__all__ = ["FORMATS", "OutputOptions", "render"]
