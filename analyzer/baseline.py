"""Baselines: accept today's findings, report only new ones.

`--write-baseline FILE` stores every current finding's fingerprint (plus rule, path, message and the
flagged code for people and for the second matching pass). `--baseline FILE` drops findings that match
an entry. Matching is by fingerprint first (rule + path + whitespace-normalised code context, never line
numbers, so code that moves inside its file stays matched); findings left over then match unused entries
with the same rule and the same normalised code (a file renamed or code moved to another file). Each
baseline entry matches at most one finding.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from maingrad.analyzer.fileio import atomic_write
from maingrad.contracts.report import Finding, normalize_context

BASELINE_VERSION = 1


class BaselineError(ValueError):
    pass


@dataclass(frozen=True)
class BaselineEntry:
    fingerprint: str
    rule: str
    path: str
    message: str
    code: str


def write_baseline(path: Path, findings: Sequence[Finding]) -> None:
    entries = sorted(
        (
            {
                "fingerprint": f.fingerprint,
                "rule": f.rule,
                "path": f.path,
                "message": f.message,
                "code": normalize_context(f.snippet),
            }
            for f in findings
        ),
        key=lambda e: (e["path"], e["rule"], e["fingerprint"]),
    )
    data = {"version": BASELINE_VERSION, "tool": "maingrad", "findings": entries}
    atomic_write(path, (json.dumps(data, indent=2) + "\n").encode("utf-8"))


def load_baseline(path: Path) -> list[BaselineEntry]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise BaselineError(f"cannot read baseline {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise BaselineError(f"baseline {path} is not valid JSON: {exc}") from exc
    if (
        not isinstance(data, dict)
        or data.get("version") != BASELINE_VERSION
        or not isinstance(data.get("findings"), list)
    ):
        raise BaselineError(f"baseline {path} is not a maingrad baseline (version {BASELINE_VERSION})")
    try:
        return [
            BaselineEntry(
                str(e["fingerprint"]),
                str(e["rule"]),
                str(e.get("path", "")),
                str(e.get("message", "")),
                str(e.get("code", "")),
            )
            for e in data["findings"]
        ]
    except (KeyError, TypeError) as exc:
        raise BaselineError(f"baseline {path} has a malformed entry: {exc}") from exc


def new_findings(findings: Sequence[Finding], baseline: Sequence[BaselineEntry]) -> list[Finding]:
    unused: dict[int, BaselineEntry] = dict(enumerate(baseline))
    by_fingerprint: dict[str, list[int]] = {}
    for index, entry in unused.items():
        by_fingerprint.setdefault(entry.fingerprint, []).append(index)
    leftover: list[Finding] = []
    for finding in findings:
        candidates = by_fingerprint.get(finding.fingerprint)
        if candidates:
            del unused[candidates.pop()]
        else:
            leftover.append(finding)
    result: list[Finding] = []
    for finding in leftover:
        code = normalize_context(finding.snippet)
        match = next(
            (i for i, e in unused.items() if e.rule == finding.rule and code and e.code == code), None
        )
        if match is None:
            result.append(finding)
        else:
            del unused[match]
    return result
