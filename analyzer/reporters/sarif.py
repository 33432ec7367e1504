"""SARIF 2.1.0 for GitHub code scanning and other SARIF consumers.

- `tool.driver.rules`: every reported rule with short/full description, help (the rule's docs as text and
  markdown) and `helpUri`; results point at them by `ruleId` and `ruleIndex`.
- Locations are relative URIs with `uriBaseId` `%SRCROOT%` (the scan root, given in
  `originalUriBaseIds`), 1-based lines and columns in Unicode code points (`columnKind`), with the
  flagged source as the region's snippet.
- `partialFingerprints` carry the analyzer's fingerprint, which never depends on line numbers, so a
  result keeps its identity when code moves.
- Paths that could not be analyzed (MG999) are both: a result of rule `MG999` at the file's line (so code
  scanning shows an alert on it, and the upload is not "clean"), and a `toolExecutionNotifications` entry of
  the invocation (the tool-status view). A directory that could not be listed has no lines: notification
  only. `executionSuccessful` is false when a rule itself failed (exit code 2).
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

from maingrad.analyzer.not_analyzed import NOT_ANALYZED
from maingrad.analyzer.reporters.base import OutputOptions
from maingrad.contracts.report import NotAnalyzed, ParseError, Report, RuleInfo, fingerprint

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
SARIF_VERSION = "2.1.0"
FINGERPRINT_KEY = "maingradFingerprint/v1"
SRCROOT = "%SRCROOT%"
INFORMATION_URI = "https://github.com/maingrad/maingrad"


def _uri(relpath: str) -> str:
    return quote(relpath, safe="/-_.~")


def build_sarif(report: Report, options: OutputOptions) -> dict[str, Any]:
    rules: list[dict[str, Any]] = []
    index: dict[str, int] = {}
    infos = {r.id: r for r in report.rules}
    for finding in report.findings:  # rules that are reported but not listed still get a descriptor
        if finding.rule not in infos:
            infos[finding.rule] = RuleInfo(finding.rule, finding.rule, finding.severity, "", "")
    file_errors = [e for e in report.parse_errors if e.kind is not NotAnalyzed.DIRECTORY]
    if report.parse_errors:
        infos[NOT_ANALYZED.id] = NOT_ANALYZED.info()
    metas = {NOT_ANALYZED.id: NOT_ANALYZED}
    for rule_id in sorted(infos):
        info = infos[rule_id]
        meta = options.rule_meta(rule_id) or metas.get(rule_id)
        help_text = meta.docs if meta is not None and meta.docs else info.summary
        descriptor: dict[str, Any] = {
            "id": info.id,
            "name": info.name,
            "shortDescription": {"text": info.summary or info.name},
            "fullDescription": {"text": info.summary or info.name},
            "help": {"text": help_text or info.name, "markdown": help_text or info.name},
            "defaultConfiguration": {"level": info.severity.sarif_level},
            "properties": {"tags": ["correctness", "main_grad"], "precision": "high"},
        }
        if info.help_uri:
            descriptor["helpUri"] = info.help_uri
        index[rule_id] = len(rules)
        rules.append(descriptor)
    results = []
    for f in report.findings:
        region: dict[str, Any] = {
            "startLine": f.line,
            "startColumn": f.column,
            "endLine": f.end_line,
            "endColumn": f.end_column,
        }
        if f.snippet:
            region["snippet"] = {"text": f.snippet}
        results.append(
            {
                "ruleId": f.rule,
                "ruleIndex": index[f.rule],
                "level": f.severity.sarif_level,
                "message": {"text": f.message},
                "locations": [
                    {
                        "physicalLocation": {
                            "artifactLocation": {"uri": _uri(f.path), "uriBaseId": SRCROOT},
                            "region": region,
                        }
                    }
                ],
                "partialFingerprints": {FINGERPRINT_KEY: f.fingerprint},
                "properties": {"fixAvailable": f.fix_available},
            }
        )
    for e in file_errors:
        results.append(
            {
                "ruleId": e.code,
                "ruleIndex": index[e.code],
                "level": "error",
                "message": {"text": e.message},
                "locations": [{"physicalLocation": _error_location(e, region_default=True)}],
                "partialFingerprints": {FINGERPRINT_KEY: fingerprint(e.code, e.path, e.kind.value)},
                "properties": {"kind": e.kind.value},
            }
        )
    notifications = []
    for e in report.parse_errors:
        notifications.append(
            {
                "level": "error",
                "message": {"text": f"{e.path}: {e.message}"},
                "locations": [{"physicalLocation": _error_location(e, region_default=False)}],
                "descriptor": {"id": e.code},
                "properties": {"kind": e.kind.value},
            }
        )
    root_uri = options.root.resolve().as_uri().rstrip("/") + "/"
    return {
        "$schema": SARIF_SCHEMA,
        "version": SARIF_VERSION,
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "maingrad",
                        "version": report.tool_version,
                        "semanticVersion": report.tool_version,
                        "informationUri": INFORMATION_URI,
                        "rules": rules,
                    }
                },
                "originalUriBaseIds": {SRCROOT: {"uri": root_uri}},
                "columnKind": "unicodeCodePoints",
                "results": results,
                "invocations": [
                    {
                        "executionSuccessful": not any(e.internal for e in report.parse_errors),
                        "toolExecutionNotifications": notifications,
                    }
                ],
                "properties": {"filesScanned": report.files_scanned, "filesParsed": report.files_parsed},
            }
        ],
    }


def _error_location(error: ParseError, region_default: bool) -> dict[str, Any]:
    location: dict[str, Any] = {"artifactLocation": {"uri": _uri(error.path), "uriBaseId": SRCROOT}}
    if error.line or region_default:
        region = {"startLine": error.line or 1}
        if error.column or region_default:
            region["startColumn"] = error.column or 1
        location["region"] = region
    return location


def render_sarif(report: Report, options: OutputOptions) -> str:
    return json.dumps(build_sarif(report, options), indent=2) + "\n"
