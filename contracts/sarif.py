"""What maingrad's SARIF says, in one place: the analyzer writes it, the service reads it and writes it back.

- `FINGERPRINT_KEY`: the `partialFingerprints` key that carries the analyzer's fingerprint (which never
  depends on line numbers). The service matches a SARIF result carrying it exactly like the same finding
  uploaded as maingrad JSON, so the two formats give the same gate verdicts when code moves.
- `LEGACY_FINGERPRINT_KEYS`: keys earlier analyzers wrote (`maingradFingerprint/v1`, up to maingrad 0.1.x).
  The service still reads them for one release, so a SARIF report written before the keys were unified
  keeps matching; readers go through `maingrad_fingerprint()`, the one place that knows them.
- `LEVELS`: severity -> SARIF level (info -> note); `LEVEL_RANK` orders levels for gates.
- `result()`: one finding -> one SARIF result, used by the analyzer's SARIF reporter and by the service when
  it stores (and later serves back) a maingrad JSON upload as SARIF.

Locations are relative URIs under `uriBaseId` `SRCROOT`: a SARIF file never names the checkout it was
written in. Standard library only, like the rest of `contracts`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from maingrad.contracts.report import Finding, RuleInfo, Severity

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
SARIF_VERSION = "2.1.0"
SRCROOT = "%SRCROOT%"

FINGERPRINT_KEY = "maingrad/v1"
# Read (never written) for one release after the keys were unified; see the module docstring.
LEGACY_FINGERPRINT_KEYS: tuple[str, ...] = ("maingradFingerprint/v1",)

LEVELS: dict[Severity, str] = {Severity.INFO: "note", Severity.WARNING: "warning", Severity.ERROR: "error"}
LEVEL_RANK: dict[str, int] = {"none": 0, "note": 0, "warning": 1, "error": 2}


def level(severity: Severity) -> str:
    """The SARIF level of a maingrad severity."""
    return LEVELS[severity]


def uri(relpath: str) -> str:
    """A report path (POSIX, relative to the scan root) as a relative URI reference."""
    return quote(relpath, safe="/-_.~")


def maingrad_fingerprint(partial_fingerprints: Mapping[str, Any] | None) -> str | None:
    """The analyzer's fingerprint from a result's `partialFingerprints`: the current key, else a legacy one."""
    if not partial_fingerprints:
        return None
    for key in (FINGERPRINT_KEY, *LEGACY_FINGERPRINT_KEYS):
        value = partial_fingerprints.get(key)
        if isinstance(value, str) and value:
            return value
    return None


def region(finding: Finding) -> dict[str, Any]:
    """The finding's region: 1-based lines and columns (end column exclusive), with its source as snippet."""
    out: dict[str, Any] = {
        "startLine": finding.line,
        "startColumn": finding.column,
        "endLine": finding.end_line,
        "endColumn": finding.end_column,
    }
    if finding.snippet:
        out["snippet"] = {"text": finding.snippet}
    return out


def result(finding: Finding, *, path: str | None = None, rule_index: int | None = None) -> dict[str, Any]:
    """One finding as a SARIF result. `path` overrides the finding's path (the service stores normalized
    paths); `rule_index` points into `tool.driver.rules` when the caller lists them in a known order."""
    out: dict[str, Any] = {"ruleId": finding.rule}
    if rule_index is not None:
        out["ruleIndex"] = rule_index
    out["level"] = LEVELS[finding.severity]
    out["message"] = {"text": finding.message}
    out["locations"] = [
        {
            "physicalLocation": {
                "artifactLocation": {
                    "uri": uri(finding.path if path is None else path),
                    "uriBaseId": SRCROOT,
                },
                "region": region(finding),
            }
        }
    ]
    out["partialFingerprints"] = {FINGERPRINT_KEY: finding.fingerprint}
    properties: dict[str, Any] = {"fixAvailable": finding.fix_available}
    if finding.fix_applicability is not None:
        properties["fixApplicability"] = finding.fix_applicability
    out["properties"] = properties
    return out


def rule_descriptor(info: RuleInfo, help_text: str | None = None) -> dict[str, Any]:
    """A `tool.driver.rules` entry. `help` carries the rule's docs (the text `maingrad explain` prints, shipped
    in the package); no `helpUri`, since no published location of the docs is guaranteed to exist."""
    name = info.summary or info.name
    text = help_text or name
    return {
        "id": info.id,
        "name": info.name,
        "shortDescription": {"text": name},
        "fullDescription": {"text": name},
        "help": {"text": text, "markdown": text},
        "defaultConfiguration": {"level": LEVELS[info.severity]},
        "properties": {"tags": ["correctness", "main_grad"], "precision": "high"},
    }


def original_uri_base_ids() -> dict[str, Any]:
    """`originalUriBaseIds` without a location: the consumer (code scanning, the service) knows the checkout;
    the file must not carry the path of the machine it was written on."""
    return {SRCROOT: {"description": {"text": "The root of the scanned source tree."}}}
