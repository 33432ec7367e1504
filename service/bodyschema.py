"""JSON Schemas of the request bodies: the maingrad report, the SARIF 2.1.0 subset the service reads, and a
runtime record. The OpenAPI document publishes them and `jsonvalidate` enforces them, so what the document
promises and what the server accepts are the same thing.

The field lists, enumerations and versions come from `maingrad.contracts`; the numeric bounds are the database
columns' (INTEGER: below 2^31, BIGINT: below 2^63) and the configured limits.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from maingrad.contracts import records as record_contract
from maingrad.contracts.report import REPORT_VERSION, TOOL_NAME, Severity
from maingrad.service.identifiers import COMMIT_PATTERN

INT32_MAX = 2**31 - 1  # INTEGER columns (lines, columns, ranks, counts)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # BIGINT columns (t_ns)
STEP_BOUND = 2**62 - 1  # steps: BIGINT with room for arithmetic on them
SARIF_LEVELS = ["none", "note", "warning", "error"]
SARIF_KINDS = ["pass", "open", "informational", "notApplicable", "review", "fail"]


@dataclass(frozen=True)
class BodyLimits:
    """Bounds a body must respect; from Settings (see config.py), which has a setting of each field's name."""

    max_runs: int = 20
    max_results_per_run: int = 25_000
    max_message_chars: int = 8_192
    max_snippet_chars: int = 8_192
    max_path_chars: int = 4_096
    max_records_per_batch: int = 10_000
    max_record_string_chars: int = 4_096

    @classmethod
    def from_settings(cls, settings: Any) -> BodyLimits:
        return cls(**{limit.name: getattr(settings, limit.name) for limit in fields(cls)})


def _int(minimum: int, maximum: int = INT32_MAX) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


def _str(max_length: int, min_length: int = 0) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string", "maxLength": max_length}
    if min_length:
        schema["minLength"] = min_length
    return schema


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "type": [schema["type"], "null"]}


# --- maingrad JSON report (contracts/report.py) ---------------------------------------------------------


def maingrad_report_schema(limits: BodyLimits) -> dict[str, Any]:
    severities = [s.value for s in Severity]
    finding = {
        "type": "object",
        "required": ["rule", "severity", "path", "line", "column", "message", "fingerprint"],
        "properties": {
            "rule": _str(255, 1),
            "severity": {"type": "string", "enum": severities},
            "path": _str(limits.max_path_chars),
            "line": _int(0),
            "column": _int(0),
            "end_line": _int(0),
            "end_column": _int(0),
            "message": _str(limits.max_message_chars),
            "fingerprint": _str(64),
            "fix_available": {"type": "boolean"},
            "snippet": _str(limits.max_snippet_chars),
        },
    }
    return {
        "title": "maingrad report",
        "description": "The analyzer's JSON report, version 1 (`maingrad check --format json`; docs/report-format.md).",
        "type": "object",
        "required": ["version", "tool"],
        "properties": {
            "version": {"type": "integer", "const": REPORT_VERSION},
            "tool": {
                "type": "object",
                "required": ["name"],
                "properties": {"name": {"type": "string", "const": TOOL_NAME}, "version": _str(100)},
            },
            "root": _str(limits.max_path_chars),
            "files_scanned": _int(0),
            "files_parsed": _int(0),
            "parse_errors": {
                "type": "array",
                "maxItems": limits.max_results_per_run,
                "items": {
                    "type": "object",
                    "required": ["path", "message"],
                    "properties": {
                        "path": _str(limits.max_path_chars),
                        "message": _str(limits.max_message_chars),
                        "line": _nullable(_int(0)),
                        "column": _nullable(_int(0)),
                    },
                },
            },
            "findings": {"type": "array", "maxItems": limits.max_results_per_run, "items": finding},
            "rules": {
                "type": "array",
                "maxItems": 10_000,
                "items": {
                    "type": "object",
                    "required": ["id"],
                    "properties": {
                        "id": _str(255, 1),
                        "name": _str(255),
                        "severity": {"type": "string", "enum": severities},
                        "summary": _str(limits.max_message_chars),
                        "help_uri": _str(2_048),
                    },
                },
            },
            "duration_s": {"type": "number", "minimum": 0},
        },
    }


# --- SARIF 2.1.0, the subset the service reads ----------------------------------------------------------


def sarif_schema(limits: BodyLimits) -> dict[str, Any]:
    """Only the properties the service reads are constrained; everything else is kept as received."""
    region = {
        "type": "object",
        "properties": {
            # SARIF says >= 1; 0 is accepted because some tools write it (the upper bound is the column's).
            "startLine": _int(0),
            "startColumn": _int(0),
            "endLine": _int(0),
            "endColumn": _int(0),
            "snippet": {"type": "object", "properties": {"text": _str(limits.max_snippet_chars)}},
        },
    }
    location = {
        "type": "object",
        "properties": {
            "physicalLocation": {
                "type": "object",
                "properties": {
                    "artifactLocation": {
                        "type": "object",
                        "properties": {"uri": _str(limits.max_path_chars), "uriBaseId": _str(255)},
                    },
                    "region": region,
                    "contextRegion": region,
                },
            }
        },
    }
    fingerprints = {"type": "object", "additionalProperties": _str(255)}
    result = {
        "type": "object",
        "required": ["message"],
        "properties": {
            "ruleId": _str(255, 1),
            "ruleIndex": _int(-1),
            "rule": {"type": "object", "properties": {"id": _str(255, 1), "index": _int(-1)}},
            "kind": {"type": "string", "enum": SARIF_KINDS},
            "level": {"type": "string", "enum": SARIF_LEVELS},
            "message": {
                "type": "object",
                "properties": {
                    "text": _str(limits.max_message_chars),
                    "id": _str(255),
                    "arguments": {"type": "array", "maxItems": 100, "items": _str(limits.max_message_chars)},
                },
            },
            "locations": {"type": "array", "maxItems": 1_000, "items": location},
            "suppressions": {
                "type": "array",
                "maxItems": 100,
                "items": {
                    "type": "object",
                    "properties": {
                        "status": {"type": "string", "enum": ["accepted", "underReview", "rejected"]}
                    },
                },
            },
            "fingerprints": fingerprints,
            "partialFingerprints": fingerprints,
        },
    }
    rule = {
        "type": "object",
        "properties": {
            "id": _str(255, 1),
            "messageStrings": {
                "type": "object",
                "additionalProperties": {
                    "type": "object",
                    "properties": {"text": _str(limits.max_message_chars)},
                },
            },
            "defaultConfiguration": {
                "type": "object",
                "properties": {"level": {"type": "string", "enum": SARIF_LEVELS}},
            },
        },
    }
    run = {
        "type": "object",
        "required": ["tool"],
        "properties": {
            "tool": {
                "type": "object",
                "required": ["driver"],
                "properties": {
                    "driver": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {
                            "name": _str(200, 1),
                            "version": _str(100),
                            "semanticVersion": _str(100),
                            "rules": {"type": "array", "maxItems": 10_000, "items": rule},
                        },
                    }
                },
            },
            "results": {"type": "array", "maxItems": limits.max_results_per_run, "items": result},
            "invocations": {
                "type": "array",
                "maxItems": 100,
                "items": {"type": "object", "properties": {"executionSuccessful": {"type": "boolean"}}},
            },
            "originalUriBaseIds": {
                "type": "object",
                "additionalProperties": {
                    "type": "object",
                    "properties": {"uri": _str(limits.max_path_chars)},
                },
            },
        },
    }
    return {
        "title": "SARIF 2.1.0 log",
        "description": "A SARIF 2.1.0 log from any tool. Only the properties listed are constrained (those the "
        "service reads); every other property is kept as received.",
        "type": "object",
        "required": ["version", "runs"],
        "properties": {
            "version": {"type": "string", "const": "2.1.0"},
            "$schema": _str(2_048),
            "runs": {"type": "array", "minItems": 1, "maxItems": limits.max_runs, "items": run},
        },
    }


# --- runtime records (contracts/records.py) -------------------------------------------------------------


def record_schema(limits: BodyLimits) -> dict[str, Any]:
    """One NDJSON line: the record contract's schema (`contracts.records.json_schema`) bounded by what the
    database columns and the configured limits hold. Fields beyond these are kept verbatim in the raw line."""
    return record_contract.json_schema(
        record_contract.RecordBounds(
            max_string_chars=limits.max_record_string_chars,
            int32_max=INT32_MAX,
            step_bound=STEP_BOUND,
            int64_min=INT64_MIN,
            int64_max=INT64_MAX,
            commit_pattern=COMMIT_PATTERN,
        )
    )


def records_body_schema(limits: BodyLimits) -> dict[str, Any]:
    """The NDJSON body as the array of its lines (one record per line; blank lines are skipped)."""
    return {
        "type": "array",
        "minItems": 1,
        "maxItems": limits.max_records_per_batch,
        "items": record_schema(limits),
        "description": "NDJSON: each item is one line. A batch is validated whole; a bad line is a 422 naming it.",
    }
