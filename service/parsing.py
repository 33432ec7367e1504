"""Uploaded reports -> one normalized form: maingrad JSON (contracts/report.py) or SARIF 2.1.0 from any tool.

The format is detected by content, never by headers. SARIF is read defensively: only the fields we need
are required, everything else is kept as received so it goes back out unchanged.
"""

from __future__ import annotations

import hashlib
import posixpath
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any
from urllib.parse import unquote, urlsplit

from maingrad.contracts import sarif as sarif_contract
from maingrad.contracts.report import REPORT_VERSION, Report, normalize_context
from maingrad.service import fastjson
from maingrad.service.bodyschema import BodyLimits, maingrad_report_schema, sarif_schema
from maingrad.service.jsonscan import count_json_values
from maingrad.service.jsonvalidate import BodyInvalid, Checker, check_then_validate, compile_schema
from maingrad.service.problems import ProblemError

# Levels, the schema and the analyzer's fingerprint key are the contract's (maingrad.contracts.sarif).
LEVEL_RANK = sarif_contract.LEVEL_RANK
SARIF_SCHEMA = sarif_contract.SARIF_SCHEMA
MAINGRAD_FP_KEY = sarif_contract.FINGERPRINT_KEY


@dataclass(slots=True)
class NormFinding:
    rule: str
    level: str
    path: str
    start_line: int | None
    start_column: int | None
    end_line: int | None
    end_column: int | None
    message: str
    snippet: str
    suppressed: bool
    material: str  # what identifies the finding besides category, rule and path
    context_hash: str | None
    sarif: dict[str, Any]
    run_index: int = 0
    fingerprint: str = ""

    @property
    def severity_rank(self) -> int:
        return LEVEL_RANK.get(self.level, 1)


@dataclass
class NormAnalysis:
    format: str
    tool_name: str
    tool_version: str
    files_scanned: int | None
    execution_successful: bool
    runs_meta: list[dict[str, Any]]
    findings: list[NormFinding] = field(default_factory=list)

    @property
    def not_analyzed(self) -> int:
        """Error-level tool execution notifications in the runs: what the tool says it could not read, decode
        or parse (maingrad writes one per MG999 path). A verdict on the rest must not pass for the whole."""
        count = 0
        for run in self.runs_meta:
            for invocation in run.get("invocations") or []:
                notes = invocation.get("toolExecutionNotifications") if isinstance(invocation, dict) else None
                count += sum(1 for n in notes or [] if isinstance(n, dict) and n.get("level") == "error")
        return count


@dataclass(frozen=True)
class Limits:
    """What one upload may cost: counts, field sizes (bodyschema.BodyLimits), the number of JSON values
    parsed, the results of the whole report (over all its runs), and the characters of message and snippet
    text stored (after SARIF template expansion)."""

    max_runs: int
    max_results_per_run: int
    max_json_values: int = 2_000_000
    max_results_per_report: int = 25_000
    max_analysis_text_chars: int = 32 * 1024 * 1024
    body: BodyLimits | None = None

    @property
    def fields(self) -> BodyLimits:
        return self.body or BodyLimits(max_runs=self.max_runs, max_results_per_run=self.max_results_per_run)

    @classmethod
    def from_settings(cls, settings: Any) -> Limits:
        return cls(
            max_runs=settings.max_runs,
            max_results_per_run=settings.max_results_per_run,
            max_json_values=settings.max_json_values,
            max_results_per_report=settings.max_results_per_report,
            max_analysis_text_chars=settings.max_analysis_text_chars,
            body=BodyLimits.from_settings(settings),
        )


def _invalid(code: str, detail: str, **extra: Any) -> ProblemError:
    return ProblemError(422, code, detail, **extra)


def load_json(data: bytes | bytearray, max_values: int | None = None) -> Any:
    """Parse a report body: UTF-8 (a BOM is tolerated), RFC 8259 numbers only (NaN, Infinity and numbers
    that overflow a double are refused, as are integers past 64 bits, which arrive as doubles and fail the
    schema's integer type), and at most `max_values` values, counted before anything is built."""
    if data[:3] == b"\xef\xbb\xbf":
        data = data[3:]
    if max_values is not None:
        values = count_json_values(data, max_values)
        if values > max_values:
            raise ProblemError(
                413,
                "too_many_json_values",
                f"the body holds more than {max_values} JSON values",
                limit=max_values,
            )
    try:
        return fastjson.loads_strict(data)
    except UnicodeDecodeError as exc:
        raise _invalid("invalid_encoding", f"body is not UTF-8: {exc}") from None
    except fastjson.DecodeError as exc:
        if "utf-8" in str(exc).lower() or "surrogate" in str(exc).lower():
            raise _invalid("invalid_encoding", f"body is not UTF-8: {exc}") from None
        raise _invalid("invalid_json", f"body is not JSON: {exc}") from None
    except RecursionError:
        raise _invalid("invalid_json", "JSON nested too deeply") from None


def without_nul(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {without_nul(k): without_nul(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_nul(v) for v in value]
    return value


def detect_format(doc: Any) -> str:
    """`version` decides, exactly as the published schemas do (maingrad: 1, SARIF: "2.1.0"); anything else
    is refused with the code of the format it resembles most."""
    if not isinstance(doc, dict):
        raise _invalid(
            "unknown_format", "report must be a JSON object (maingrad report or SARIF 2.1.0 log)", pointer=""
        )
    version = doc.get("version")
    if version == REPORT_VERSION and type(version) is int:
        return "maingrad"
    if version == "2.1.0":
        return "sarif"
    tool = doc.get("tool")
    if "runs" in doc or isinstance(version, str) or "sarif" in str(doc.get("$schema", "")).lower():
        raise _invalid(
            "invalid_sarif",
            f"unsupported SARIF version {version!r} (expected '2.1.0')",
            pointer="/version",
        )
    if (isinstance(tool, dict) and tool.get("name") == "maingrad") or type(version) is int:
        raise _invalid(
            "invalid_report",
            f"unsupported maingrad report version {version!r} (expected {REPORT_VERSION})",
            pointer="/version",
        )
    raise _invalid(
        "unknown_format",
        "not a maingrad report (version 1, tool.name 'maingrad') nor a SARIF 2.1.0 log (version '2.1.0', runs)",
        pointer="",
    )


@lru_cache(maxsize=8)
def _schema_and_checker(which: str, fields: BodyLimits) -> tuple[dict[str, Any], Checker]:
    """A report schema for these limits and its compiled checker (built once per configuration)."""
    schema = sarif_schema(fields) if which == "sarif" else maingrad_report_schema(fields)
    return schema, compile_schema(schema)


def _check(doc: Any, which: str, fields: BodyLimits, code: str) -> None:
    schema, checker = _schema_and_checker(which, fields)
    try:
        check_then_validate(doc, schema, checker)
    except BodyInvalid as exc:
        raise _invalid(code, f"{exc.pointer or '/'}: {exc.message}", pointer=exc.pointer) from None


def parse_report(data: bytes | bytearray, limits: Limits) -> NormAnalysis:
    # Cheap bounds first: the counts that the schema caps are checked before the schema walks the document,
    # so a report with a million results is refused without validating a single one.
    doc = load_json(data, limits.max_json_values)
    if b"\\u0000" in data:  # escaped NUL: PostgreSQL text cannot hold it
        doc = without_nul(doc)
    kind = detect_format(doc)
    fields = limits.fields
    if kind == "sarif":
        _check_counts_sarif(doc, limits)
        _check(doc, "sarif", fields, "invalid_sarif")
        return parse_sarif(doc, limits)
    findings = doc.get("findings")
    if isinstance(findings, list) and len(findings) > limits.max_results_per_run:
        raise _too_many_results(
            f"{len(findings)} findings exceed {limits.max_results_per_run} per run", limits
        )
    if isinstance(findings, list):
        _check_report_total(len(findings), limits)
    _check(doc, "maingrad", fields, "invalid_report")
    return parse_maingrad(doc, limits)


def _too_many_results(detail: str, limits: Limits) -> ProblemError:
    return ProblemError(413, "too_many_results", detail, limit=limits.max_results_per_run)


def _check_run_count(runs: list[Any], limits: Limits) -> None:
    if len(runs) > limits.max_runs:
        raise ProblemError(
            413,
            "too_many_runs",
            f"{len(runs)} runs exceed the limit of {limits.max_runs}",
            limit=limits.max_runs,
        )


def _check_counts_sarif(doc: dict[str, Any], limits: Limits) -> None:
    runs = doc.get("runs")
    if not isinstance(runs, list):
        return
    _check_run_count(runs, limits)
    total = 0
    for i, run in enumerate(runs):
        results = run.get("results") if isinstance(run, dict) else None
        if isinstance(results, list) and len(results) > limits.max_results_per_run:
            raise _too_many_results(
                f"runs[{i}] has {len(results)} results; the limit is {limits.max_results_per_run}", limits
            )
        total += len(results) if isinstance(results, list) else 0
    _check_report_total(total, limits)


def _check_report_total(total: int, limits: Limits) -> None:
    """The per-run cap alone let 20 runs x 25,000 results through (+1 GB of server memory, a 28 s write)."""
    if total > limits.max_results_per_report:
        raise ProblemError(
            413,
            "too_many_results",
            f"the report has {total} results over all its runs; the limit is {limits.max_results_per_report}",
            limit=limits.max_results_per_report,
        )


def context_hash(snippet: str) -> str | None:
    norm = normalize_context(snippet)
    return hashlib.sha256(norm.encode("utf-8")).hexdigest()[:32] if norm else None


def normalize_path(uri: str, bases: dict[str, str] | None = None) -> str:
    """Repo-relative POSIX path from a SARIF URI or a report path (never an absolute prefix if avoidable)."""
    text = uri.strip()
    if text.startswith("file:"):
        try:
            text = urlsplit(text).path
        except ValueError:  # e.g. "file://[x/a.py": an unbalanced IPv6 host; keep what follows the scheme
            text = text[len("file:") :].lstrip("/")
    text = unquote(text).replace("\\", "/")
    for base in (bases or {}).values():
        if base and text.startswith(base):
            text = text[len(base) :]
            break
    while text.startswith("./"):
        text = text[2:]
    if text and not text.startswith("/"):
        text = posixpath.normpath(text)
    return text


# --- maingrad JSON ------------------------------------------------------------------------------------


def parse_maingrad(doc: dict[str, Any], limits: Limits) -> NormAnalysis:
    try:
        report = Report.from_dict(doc)
    except (ValueError, KeyError, TypeError) as exc:
        raise _invalid("invalid_report", f"malformed maingrad report: {type(exc).__name__}: {exc}") from None
    if len(report.findings) > limits.max_results_per_run:
        raise ProblemError(
            413,
            "too_many_results",
            f"{len(report.findings)} findings exceed {limits.max_results_per_run} per run",
            limit=limits.max_results_per_run,
        )
    rules = [sarif_contract.rule_descriptor(r) for r in report.rules]
    successful = not any(e.internal for e in report.parse_errors)  # as maingrad's own SARIF says
    notifications = [
        {
            "level": "error",
            "message": {"text": e.message},
            "locations": [{"physicalLocation": {"artifactLocation": {"uri": e.path}}}],
        }
        for e in report.parse_errors
    ]
    meta = {
        "tool": {
            "driver": {
                "name": "maingrad",
                "version": report.tool_version,
                "rules": rules,
            }
        },
        "invocations": [{"executionSuccessful": successful, "toolExecutionNotifications": notifications}],
    }
    findings = []
    stored_chars = sum(len(f.message) + len(f.snippet) for f in report.findings)
    if stored_chars > limits.max_analysis_text_chars:
        raise _text_budget(limits)
    for f in report.findings:
        path = normalize_path(f.path)
        result = sarif_contract.result(f, path=path)
        level = result["level"]
        findings.append(
            NormFinding(
                rule=f.rule,
                level=level,
                path=path,
                start_line=f.line,
                start_column=f.column,
                end_line=f.end_line,
                end_column=f.end_column,
                message=f.message,
                snippet=f.snippet,
                suppressed=False,
                material=f"{MAINGRAD_FP_KEY}:{f.fingerprint}",
                context_hash=context_hash(f.snippet),
                sarif=result,
            )
        )
    return NormAnalysis(
        format="maingrad",
        tool_name="maingrad",
        tool_version=report.tool_version,
        files_scanned=report.files_scanned,
        execution_successful=successful,
        runs_meta=[meta],
        findings=findings,
    )


# --- SARIF 2.1.0 --------------------------------------------------------------------------------------


def _obj(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _invalid("invalid_sarif", f"{where} must be an object")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _invalid("invalid_sarif", f"{where} must be an array")
    return value


def _int(value: Any) -> int | None:
    return value if type(value) is int else None  # JSON: an int, or a bool (which is not one here)


def _text(message: Any, rule: dict[str, Any] | None, max_chars: int, where: str) -> str:
    """A result's message: its text, or its rule's `messageStrings` template with the arguments filled in.

    The expansion is sized before it is built (placeholder count x argument length): a 100 KB template with
    `{0}` repeated, expanded for every result, was how a 13 KiB upload stored 195 MB of messages."""
    if not isinstance(message, dict):
        return ""
    if isinstance(message.get("text"), str):
        return message["text"]
    if not (isinstance(message.get("id"), str) and rule):
        return ""
    strings = rule.get("messageStrings")
    template = strings.get(message["id"]) if isinstance(strings, dict) else None
    if not (isinstance(template, dict) and isinstance(template.get("text"), str)):
        return ""
    text = template["text"]
    arguments = message.get("arguments")
    args: list[Any] = arguments if isinstance(arguments, list) else []
    for i, arg in enumerate(args):
        placeholder = "{" + str(i) + "}"
        count = text.count(placeholder)
        if not count:
            continue
        value = str(arg)
        if len(text) + count * (len(value) - len(placeholder)) > max_chars:
            raise _invalid(
                "message_too_long",
                f"{where}/message: the expanded message exceeds {max_chars} characters",
                pointer=f"{where}/message",
                limit=max_chars,
            )
        text = text.replace(placeholder, value)
    return text


def parse_sarif(doc: dict[str, Any], limits: Limits) -> NormAnalysis:
    version = doc.get("version")
    if version != "2.1.0":
        raise _invalid("invalid_sarif", f"unsupported SARIF version {version!r} (expected '2.1.0')")
    runs = _list(doc.get("runs"), "runs")
    if not runs:
        raise _invalid("invalid_sarif", "a SARIF log needs at least one run")
    _check_run_count(runs, limits)
    findings: list[NormFinding] = []
    metas: list[dict[str, Any]] = []
    tool_name = tool_version = ""
    execution_ok = True
    stored_chars = 0
    for run_index, raw_run in enumerate(runs):
        run = _obj(raw_run, f"runs[{run_index}]")
        results = _list(run.get("results"), f"runs[{run_index}].results")
        if len(results) > limits.max_results_per_run:
            raise ProblemError(
                413,
                "too_many_results",
                f"runs[{run_index}] has {len(results)} results; the limit is {limits.max_results_per_run}",
                limit=limits.max_results_per_run,
            )
        tool = _obj(run.get("tool"), f"runs[{run_index}].tool")
        driver = _obj(tool.get("driver"), f"runs[{run_index}].tool.driver")
        if not isinstance(driver.get("name"), str) or not driver["name"]:
            raise _invalid("invalid_sarif", f"runs[{run_index}].tool.driver.name must be a non-empty string")
        if run_index == 0:
            tool_name = driver["name"]
            tool_version = str(driver.get("semanticVersion") or driver.get("version") or "")
        rules = [r for r in _list(driver.get("rules"), "tool.driver.rules") if isinstance(r, dict)]
        rules_by_id = {r["id"]: r for r in rules if isinstance(r.get("id"), str)}
        for inv in _list(run.get("invocations"), "invocations"):
            if isinstance(inv, dict) and inv.get("executionSuccessful") is False:
                execution_ok = False
        bases = (
            {
                k: normalize_path(v["uri"])
                for k, v in (run.get("originalUriBaseIds") or {}).items()
                if isinstance(v, dict) and isinstance(v.get("uri"), str)
            }
            if isinstance(run.get("originalUriBaseIds"), dict)
            else {}
        )
        paths: dict[str, str] = {}  # uri -> normalized path, for this run's bases (reports repeat paths)
        for result_index, raw in enumerate(results):
            finding = _sarif_result(raw, run_index, result_index, rules, rules_by_id, bases, paths, limits)
            if finding is not None:
                findings.append(finding)
                stored_chars += len(finding.message) + len(finding.snippet)
                if stored_chars > limits.max_analysis_text_chars:
                    raise _text_budget(limits)
        metas.append({k: v for k, v in run.items() if k != "results"})
    return NormAnalysis(
        format="sarif",
        tool_name=tool_name,
        tool_version=tool_version[:100],
        files_scanned=None,
        execution_successful=execution_ok,
        runs_meta=metas,
        findings=findings,
    )


def _sarif_result(
    raw: Any,
    run_index: int,
    result_index: int,
    rules: list[dict[str, Any]],
    rules_by_id: dict[str, dict[str, Any]],
    bases: dict[str, str],
    paths: dict[str, str],
    limits: Limits,
) -> NormFinding | None:
    """One result, normalized. The hot loop of a large upload (25,000 calls): error locations are spelled out
    only when there is an error, and a run's paths are normalized once per distinct URI (`paths`)."""
    if not isinstance(raw, dict):
        raise _invalid("invalid_sarif", f"{_where(run_index, result_index)} must be an object")
    result: dict[str, Any] = raw
    get = result.get
    if get("kind") in ("pass", "notApplicable"):
        return None
    rule_id = get("ruleId")
    if not isinstance(rule_id, str):
        rule_ref = get("rule")
        rule_id = rule_ref.get("id") if isinstance(rule_ref, dict) else None
    rule_index = _int(get("ruleIndex"))
    rule = None
    if rule_index is not None and 0 <= rule_index < len(rules):
        rule = rules[rule_index]
        if not isinstance(rule_id, str):
            rule_id = rule.get("id")
    if not isinstance(rule_id, str) or not rule_id:
        rule_id = "(none)"
    if not rule:
        rule = (rules_by_id.get(rule_id) or rules_by_id.get(rule_id.split("/")[0])) if rules_by_id else None
    raw_message = get("message")
    if not isinstance(raw_message, dict):
        raise _invalid("invalid_sarif", f"{_where(run_index, result_index)}.message must be an object")
    message = raw_message.get("text")
    if not isinstance(message, str):
        message = _text(raw_message, rule, limits.fields.max_message_chars, _where(run_index, result_index))
    level = get("level")
    if level not in LEVEL_RANK:
        default = (rule or {}).get("defaultConfiguration") or {}
        level = default.get("level") if isinstance(default, dict) else None
        level = level if level in LEVEL_RANK else "warning"
    path, snippet = "", ""
    region: dict[str, Any] = {}
    locations = get("locations")
    if locations is not None and not isinstance(locations, list):
        raise _invalid("invalid_sarif", f"{_where(run_index, result_index)}.locations must be an array")
    if locations:
        loc = locations[0]
        if not isinstance(loc, dict):
            raise _invalid(
                "invalid_sarif", f"{_where(run_index, result_index)}.locations[0] must be an object"
            )
        phys = loc.get("physicalLocation") or {}
        if isinstance(phys, dict):
            art = phys.get("artifactLocation") or {}
            uri = art.get("uri") if isinstance(art, dict) else None
            if isinstance(uri, str):
                known = paths.get(uri)
                if known is None:
                    known = paths[uri] = normalize_path(uri, bases)
                path = known
            found = phys.get("region")
            region = found if isinstance(found, dict) else {}
            snippet = _snippet(region) or _snippet(phys.get("contextRegion"))
    start_line = region.get("startLine")
    if type(start_line) is not int:  # _int, inline: four calls per result
        start_line = None
    start_column = region.get("startColumn")
    end_line = region.get("endLine")
    end_column = region.get("endColumn")
    suppressions = get("suppressions")
    if suppressions is not None and not isinstance(suppressions, list):
        raise _invalid("invalid_sarif", f"{_where(run_index, result_index)}.suppressions must be an array")
    suppressed = (
        any(isinstance(s, dict) and s.get("status", "accepted") == "accepted" for s in suppressions)
        if suppressions
        else False
    )
    ctx = context_hash(snippet) if snippet else None
    return NormFinding(
        rule_id[:255],
        level,
        path,
        start_line,
        start_column if type(start_column) is int else None,
        (end_line if type(end_line) is int else None) or start_line,
        end_column if type(end_column) is int else None,
        message,
        snippet,
        suppressed,
        _material(result, ctx, message),
        ctx,
        result,
        run_index,
    )


def _snippet(region: Any) -> str:
    """A region's snippet text, or "" (a region that is no object, or has no text)."""
    snippet = region.get("snippet") if isinstance(region, dict) else None
    text = snippet.get("text") if isinstance(snippet, dict) else None
    return text if isinstance(text, str) else ""


def _where(run_index: int, result_index: int) -> str:
    return f"/runs/{run_index}/results/{result_index}"


def _text_budget(limits: Limits) -> ProblemError:
    return ProblemError(
        413,
        "analysis_too_large",
        f"the analysis would store more than {limits.max_analysis_text_chars} characters of messages and snippets",
        limit=limits.max_analysis_text_chars,
    )


def _pairs(value: Any) -> list[tuple[str, str]]:
    if not isinstance(value, dict) or not value:
        return []
    if len(value) == 1:  # the common case (e.g. one primaryLocationLineHash): nothing to sort
        ((k, v),) = value.items()
        return [(str(k), str(v))] if isinstance(v, (str, int)) else []
    return sorted((str(k), str(v)) for k, v in value.items() if isinstance(v, (str, int)))


def _material(result: dict[str, Any], ctx: str | None, message: str) -> str:
    """Identity beyond (category, rule, path): the tool's fingerprints when it has them, else the code."""
    given = result.get("partialFingerprints")
    if isinstance(given, dict) and given:
        # The analyzer's key (or, for one release, its legacy spelling): the same material as the analyzer's
        # JSON, so JSON and SARIF uploads of the same findings match.
        ours = sarif_contract.maingrad_fingerprint(given)
        if ours:
            return f"{MAINGRAD_FP_KEY}:{ours}"
    else:
        given = None
    full = result.get("fingerprints")
    if full:
        pairs = _pairs(full)
        if pairs:
            return "fp:" + "|".join([f"{k}={v}" for k, v in pairs])
    if given:
        legacy = sarif_contract.LEGACY_FINGERPRINT_KEYS
        partial = [f"{k}={v}" for k, v in _pairs(given) if k != "maingrad/alert" and k not in legacy]
        if partial:
            return "pfp:" + "|".join(partial)
    if ctx:
        return f"context:{ctx}"
    return f"message:{normalize_context(message)}"


def assign_fingerprints(findings: list[NormFinding], category: str) -> None:
    """Fingerprint = H(category, rule, path, material, occurrence); occurrence separates true duplicates."""
    seen: dict[tuple[str, str, str], int] = {}
    for f in findings:
        key = (f.rule, f.path, f.material)
        occurrence = seen.get(key, 0)
        seen[key] = occurrence + 1
        # Each part followed by NUL, hashed in one call (the same bytes as one update per part).
        material = f"v1\0{category}\0{f.rule}\0{f.path}\0{f.material}\0{occurrence}\0"
        f.fingerprint = hashlib.sha256(material.encode("utf-8")).hexdigest()[:32]
