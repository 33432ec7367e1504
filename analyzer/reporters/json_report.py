"""The versioned maingrad JSON report (schema in docs/report-format.md; model in analyzer/report.py)."""

from __future__ import annotations

from maingrad.analyzer.report import Report
from maingrad.analyzer.reporters.base import OutputOptions


def render_json(report: Report, options: OutputOptions) -> str:
    return report.to_json(indent=2) + "\n"
