"""The versioned maingrad JSON report (schema in docs/report-format.md; model in contracts/report.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace

from maingrad.analyzer.reporters.base import OutputOptions
from maingrad.contracts.report import Report

_INDENT = "    "  # a finding's lines inside `"findings": [...]` at indent=2


def render_json(report: Report, options: OutputOptions) -> str:
    return "".join(iter_json(report, options))


def iter_json(report: Report, options: OutputOptions) -> Iterator[str]:
    """Exactly `report.to_json(indent=2)` plus a newline, one finding at a time (a report's findings are
    never all turned into dicts and text at once)."""
    before, after = _split(replace(report, findings=[]).to_dict())
    yield before
    if not report.findings:
        yield "[]"
    else:
        yield "[\n"
        last = len(report.findings) - 1
        for index, finding in enumerate(report.findings):
            text = json.dumps(finding.to_dict(), indent=2)
            yield _INDENT + text.replace("\n", "\n" + _INDENT) + (",\n" if index < last else "\n")
        yield "  ]"
    yield after + "\n"


def _split(head: dict) -> tuple[str, str]:
    """The report's JSON text before and after the findings list (a placeholder marks where it goes)."""
    marker = "\u0000findings\u0000"
    text = json.dumps({**head, "findings": marker}, indent=2)
    before, after = text.split(json.dumps(marker), 1)
    return before, after
