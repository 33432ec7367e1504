"""Output formats. Each reporter renders a finished `Report`; none of them sees rules or CSTs.
`render(format, report, options)` picks one by name and returns a string; `iter_render` yields the same text
in pieces (one per finding where the format allows: text, JSON, GitHub), so that a report with 10^5
findings is written without ever holding its whole text, or a copy of every finding as a dict, in memory."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any

from maingrad.analyzer.reporters.base import OutputOptions
from maingrad.contracts.report import Report

FORMATS = ("text", "json", "sarif", "github")

# format -> (its module here, imported only when used; the function rendering a string; the one yielding
# pieces, where the format has one)
_REPORTERS: dict[str, tuple[str, str, str | None]] = {
    "text": ("text", "render_text", "iter_text"),
    "json": ("json_report", "render_json", "iter_json"),
    "sarif": ("sarif", "render_sarif", None),
    "github": ("github", "render_github", "iter_github"),
}


def _reporter(fmt: str, function: str) -> Callable[[Report, OutputOptions], Any]:
    return getattr(importlib.import_module(f"{__name__}.{_REPORTERS[fmt][0]}"), function)


def iter_render(fmt: str, report: Report, options: OutputOptions) -> Iterator[str]:
    pieces = _REPORTERS[fmt][2] if fmt in _REPORTERS else None
    if pieces is None:
        return iter((render(fmt, report, options),))
    iterate: Callable[[Report, OutputOptions], Iterator[str]] = _reporter(fmt, pieces)
    return iterate(report, options)


def render(fmt: str, report: Report, options: OutputOptions) -> str:
    if fmt not in _REPORTERS:
        raise ValueError(f"unknown format {fmt!r} (choose from {', '.join(FORMATS)})")
    text: str = _reporter(fmt, _REPORTERS[fmt][1])(report, options)
    return text


__all__ = ["FORMATS", "OutputOptions", "iter_render", "render"]
