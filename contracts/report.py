"""The report model: the one data model the analyzer writes and the service reads (both import it from here).

JSON schema version 1 (documented in docs/report-format.md):

    {"version": 1, "tool": {"name": "maingrad", "version": "..."}, "root": ".",
     "files_scanned": int, "files_parsed": int,
     "parse_errors": [{"path", "message", "line", "column", "kind", "code"}],
     "findings": [{"rule", "severity", "path", "line", "column", "end_line", "end_column", "message",
                   "fingerprint", "fix_available", "fix_applicability", "snippet"}],
     "rules": [{"id", "name", "severity", "summary", "help_uri"}],
     "duration_s": float}

Lines and columns are 1-based; `end_column` is exclusive. Paths are relative to the scan root, POSIX style.
`fingerprint` never depends on line numbers: see `fingerprint()`.

`parse_errors` lists what the analyzer could NOT analyze (code MG999: a file it could not read, decode or
parse, a directory it could not list, a rule that failed on a file). A report with any of them is not clean
(`Report.clean`): a file nobody analyzed may hold any finding, so a CI gate must not pass it as clean.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, cast

REPORT_VERSION = 1
TOOL_NAME = "maingrad"

# The diagnostic code of everything in `parse_errors`: a path that was not (fully) analyzed.
NOT_ANALYZED_CODE = "MG999"


class NotAnalyzed(str, Enum):
    """Why a path was not analyzed (`ParseError.kind`)."""

    READ = "read"  # the file could not be read (permission, I/O error, dangling link)
    DECODE = (
        "decode"  # not text in its declared encoding (binary, latin-1 without a coding cookie, NUL bytes)
    )
    SYNTAX = "syntax"  # not valid Python (only files some rule had to parse, i.e. that mention its needles)
    DIRECTORY = "directory"  # a directory that could not be listed: its files were never seen
    INTERNAL = "internal"  # maingrad itself failed on the file (a rule raised): exit code 2


class Severity(str, Enum):
    """Ordered from least to most severe; the SARIF level of each is `maingrad.contracts.sarif.LEVELS`'s."""

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"

    @property
    def rank(self) -> int:
        return _SEVERITY_RANK[self]


_SEVERITY_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.ERROR: 2}

# The lowest severity that fails: the default of `maingrad check --fail-on` and of the service gate
# (MAINGRAD_GATE_FAIL_SEVERITY), so a report the gate passes does not fail `check`, and the reverse.
DEFAULT_FAIL_ON = Severity.ERROR


@dataclass(frozen=True)
class Finding:
    rule: str
    severity: Severity
    path: str
    line: int
    column: int
    end_line: int
    end_column: int
    message: str
    fingerprint: str
    fix_available: bool = False
    snippet: str = ""
    # "safe" (applied by `maingrad fix`), "unsafe" (only with --unsafe-fixes) or None (no fix).
    fix_applicability: str | None = None

    def to_dict(self) -> dict[str, Any]:
        # Spelled out (not dataclasses.asdict, which deep-copies every value): reports hold 10^5 findings.
        return {
            "rule": self.rule,
            "severity": self.severity.value,
            "path": self.path,
            "line": self.line,
            "column": self.column,
            "end_line": self.end_line,
            "end_column": self.end_column,
            "message": self.message,
            "fingerprint": self.fingerprint,
            "fix_available": self.fix_available,
            "snippet": self.snippet,
            "fix_applicability": self.fix_applicability,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Finding:
        return cls(
            rule=str(data["rule"]),
            severity=Severity(data["severity"]),
            path=str(data["path"]),
            line=int(data["line"]),
            column=int(data["column"]),
            end_line=int(data.get("end_line", data["line"])),
            end_column=int(data.get("end_column", data["column"])),
            message=str(data["message"]),
            fingerprint=str(data["fingerprint"]),
            fix_available=bool(data.get("fix_available", False)),
            snippet=str(data.get("snippet", "")),
            fix_applicability=_applicability(data),
        )

    @property
    def sort_key(self) -> tuple[str, int, int, str]:
        return (self.path, self.line, self.column, self.rule)


def _applicability(data: dict[str, Any]) -> str | None:
    value = data.get("fix_applicability")
    if value in ("safe", "unsafe"):
        return str(value)
    if value is None and data.get("fix_available"):
        return "safe"  # written before the field existed: the fix was counted as fixable
    return None


def _json_fields(record: Any) -> dict[str, Any]:
    """A small dataclass's fields (`dataclasses.asdict`), its Enum members as their values."""
    return {k: v.value if isinstance(v, Enum) else v for k, v in asdict(record).items()}


@dataclass(frozen=True)
class ParseError:
    """A path that was not (fully) analyzed: diagnostic MG999 in every output format."""

    path: str
    message: str
    line: int | None = None
    column: int | None = None
    kind: NotAnalyzed = NotAnalyzed.SYNTAX
    code: str = NOT_ANALYZED_CODE

    @property
    def internal(self) -> bool:
        return self.kind is NotAnalyzed.INTERNAL

    def to_dict(self) -> dict[str, Any]:
        return _json_fields(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParseError:
        message = str(data["message"])
        kind = data.get("kind")
        return cls(
            path=str(data["path"]),
            message=message,
            line=data.get("line"),
            column=data.get("column"),
            kind=NotAnalyzed(kind) if kind else _kind_of(message),
            code=str(data.get("code") or NOT_ANALYZED_CODE),
        )


def _kind_of(message: str) -> NotAnalyzed:
    """The kind of an entry written before `kind` existed, from its message."""
    for prefix, kind in (
        ("internal error", NotAnalyzed.INTERNAL),
        ("cannot read directory", NotAnalyzed.DIRECTORY),
        ("cannot read", NotAnalyzed.READ),
        ("cannot decode", NotAnalyzed.DECODE),
    ):
        if message.startswith(prefix):
            return kind
    return NotAnalyzed.SYNTAX


@dataclass(frozen=True)
class RuleInfo:
    id: str
    name: str
    severity: Severity
    summary: str
    help_uri: str

    def to_dict(self) -> dict[str, Any]:
        return _json_fields(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RuleInfo:
        return cls(
            id=str(data["id"]),
            name=str(data.get("name", data["id"])),
            severity=Severity(data.get("severity", "warning")),
            summary=str(data.get("summary", "")),
            help_uri=str(data.get("help_uri", "")),
        )


@dataclass
class Report:
    tool_version: str
    root: str = "."
    files_scanned: int = 0
    files_parsed: int = 0
    parse_errors: list[ParseError] = field(default_factory=list[ParseError])
    findings: list[Finding] = field(default_factory=list[Finding])
    rules: list[RuleInfo] = field(default_factory=list[RuleInfo])
    duration_s: float = 0.0

    @property
    def clean(self) -> bool:
        """No finding and nothing left unanalyzed: the only report a gate may pass as clean."""
        return not self.findings and not self.parse_errors

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": REPORT_VERSION,
            "tool": {"name": TOOL_NAME, "version": self.tool_version},
            "root": self.root,
            "files_scanned": self.files_scanned,
            "files_parsed": self.files_parsed,
            "parse_errors": [e.to_dict() for e in self.parse_errors],
            "findings": [f.to_dict() for f in self.findings],
            "rules": [r.to_dict() for r in self.rules],
            "duration_s": round(self.duration_s, 6),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        """Parse a version-1 report; raises ValueError/KeyError/TypeError on malformed input."""
        if not isinstance(cast(object, data), dict):
            raise ValueError("report must be a JSON object")
        version = data.get("version")
        if version != REPORT_VERSION:
            raise ValueError(f"unsupported report version {version!r} (expected {REPORT_VERSION})")
        found: Any = data.get("tool") or {}
        tool: dict[str, Any] = cast("dict[str, Any]", found) if isinstance(found, dict) else {}
        if tool.get("name") != TOOL_NAME:
            raise ValueError("report.tool.name must be 'maingrad'")
        return cls(
            tool_version=str(tool.get("version", "")),
            root=str(data.get("root", ".")),
            files_scanned=int(data.get("files_scanned", 0)),
            files_parsed=int(data.get("files_parsed", 0)),
            parse_errors=[ParseError.from_dict(e) for e in data.get("parse_errors", [])],
            findings=[Finding.from_dict(f) for f in data.get("findings", [])],
            rules=[RuleInfo.from_dict(r) for r in data.get("rules", [])],
            duration_s=float(data.get("duration_s", 0.0)),
        )

    @classmethod
    def from_json(cls, text: str) -> Report:
        return cls.from_dict(json.loads(text))


_WS = re.compile(r"\s+")


def normalize_context(code: str) -> str:
    """Whitespace-insensitive form of a code context: moving or re-indenting code keeps its fingerprint."""
    return _WS.sub(" ", code).strip()


def fingerprint(rule: str, path: str, context: str, occurrence: int = 0) -> str:
    """Stable identity of a finding: rule + repo-relative path + normalized code context (+ the index of
    identical contexts in the same file). Never line numbers, absolute paths or commit SHAs."""
    digest = hashlib.sha256()
    for part in (rule, path, normalize_context(context), str(occurrence)):
        digest.update(part.encode("utf-8"))
        digest.update(b"\0")
    return digest.hexdigest()[:32]
