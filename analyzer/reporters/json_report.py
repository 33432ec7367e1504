"""The versioned maingrad JSON report (schema in docs/report-format.md; model in contracts/report.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from json.encoder import encode_basestring_ascii

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
            yield _flat_object(finding.to_dict()) + (",\n" if index < last else "\n")
        yield "  ]"
    yield after + "\n"


def _scalar(value: object) -> str:
    """A JSON scalar exactly as `json.dumps` writes it (ensure_ascii), without its per-call overhead."""
    if type(value) is str:
        return encode_basestring_ascii(value)
    if type(value) is int:
        return int.__repr__(value)  # what json.dumps writes for an int (a bool is not of type int)
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, str):
        return encode_basestring_ascii(value)
    if isinstance(value, (int, float)):
        return json.dumps(value)
    raise TypeError(f"not a JSON scalar: {value!r}")


_FIELD_SEPARATOR = f",\n{_INDENT}  "
_KEYS: dict[str, str] = {}  # key -> its JSON text and the `: ` after it (findings repeat the same keys)


def _flat_object(data: dict[str, object]) -> str:
    """`json.dumps(data, indent=2)` of a dict of scalars, indented as an element of the findings list.
    With `indent`, json.dumps runs its pure-Python encoder: at 10^5 findings that alone took longer than
    the analysis; this writes the same bytes with the C string encoder."""
    keys = _KEYS
    parts = []
    for key, value in data.items():
        head = keys.get(key)
        if head is None:
            head = keys[key] = encode_basestring_ascii(key) + ": "
        parts.append(head + _scalar(value))
    return f"{_INDENT}{{\n{_INDENT}  {_FIELD_SEPARATOR.join(parts)}\n{_INDENT}}}"


def _split(head: dict) -> tuple[str, str]:
    """The report's JSON text before and after the findings list (a placeholder marks where it goes)."""
    marker = "\u0000findings\u0000"
    text = json.dumps({**head, "findings": marker}, indent=2)
    before, after = text.split(json.dumps(marker), 1)
    return before, after
