"""The versioned maingrad JSON report (schema in docs/report-format.md; model in contracts/report.py)."""

from __future__ import annotations

from maingrad.analyzer.reporters.base import OutputOptions
from maingrad.contracts.report import Report


def render_json(report: Report, options: OutputOptions) -> str:
    return report.to_json(indent=2) + "\n"
