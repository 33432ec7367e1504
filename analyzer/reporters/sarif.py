"""SARIF 2.1.0 for GitHub code scanning and other SARIF consumers.

- `tool.driver.rules`: every reported rule with short/full description and help (the rule's docs, the text
  `maingrad explain` prints, as text and markdown); no `helpUri`. Results point at them by `ruleId` and
  `ruleIndex`.
- Locations are relative URIs with `uriBaseId` `%SRCROOT%`; `originalUriBaseIds` names that base without a
  location, so the file never carries the path of the checkout it was written in. Lines and columns are
  1-based, in Unicode code points (`columnKind`), with the flagged source as the region's snippet.
- `partialFingerprints` carry the analyzer's fingerprint under `contracts.sarif.FINGERPRINT_KEY` (never
  dependent on line numbers), the key the service matches on, so a result keeps its identity when code moves
  and a SARIF upload matches the same findings uploaded as JSON.
- Paths that could not be analyzed (MG999) are both: a result of rule `MG999` at the file's line (so code
  scanning shows an alert on it, and the upload is not "clean"), and a `toolExecutionNotifications` entry of
  the invocation (the tool-status view). A directory that could not be listed has no lines: notification
  only. `executionSuccessful` is false when a rule itself failed (exit code 2).

The finding -> result mapping and the rule descriptor are `maingrad.contracts.sarif`'s, shared with the service.
"""

from __future__ import annotations

import json
from typing import Any

from maingrad.analyzer.not_analyzed import NOT_ANALYZED
from maingrad.analyzer.reporters.base import OutputOptions
from maingrad.contracts import sarif as contract
from maingrad.contracts.report import NotAnalyzed, ParseError, Report, RuleInfo, fingerprint

SRCROOT = contract.SRCROOT


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
        index[rule_id] = len(rules)
        rules.append(contract.rule_descriptor(info, help_text))
    results = [contract.result(f, rule_index=index[f.rule]) for f in report.findings]
    for e in file_errors:
        results.append(
            {
                "ruleId": e.code,
                "ruleIndex": index[e.code],
                "level": "error",
                "message": {"text": e.message},
                "locations": [{"physicalLocation": _error_location(e, region_default=True)}],
                "partialFingerprints": {contract.FINGERPRINT_KEY: fingerprint(e.code, e.path, e.kind.value)},
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
    return {
        "$schema": contract.SARIF_SCHEMA,
        "version": contract.SARIF_VERSION,
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "maingrad",
                        "version": report.tool_version,
                        "semanticVersion": report.tool_version,
                        "rules": rules,
                    }
                },
                "originalUriBaseIds": contract.original_uri_base_ids(),
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
    location: dict[str, Any] = {"artifactLocation": {"uri": contract.uri(error.path), "uriBaseId": SRCROOT}}
    if error.line or region_default:
        region = {"startLine": error.line or 1}
        if error.column or region_default:
            region["startColumn"] = error.column or 1
        location["region"] = region
    return location


def render_sarif(report: Report, options: OutputOptions) -> str:
    return json.dumps(build_sarif(report, options), indent=2) + "\n"
