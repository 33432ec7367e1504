"""Scanning many files: read, hash, consult the cache, pre-filter, then analyze what is left (in worker
processes when that pays off) and assemble a deterministic report.

Never crashes on a file: unreadable, undecodable or unparsable files become parse errors, and a rule
that raises becomes an internal error for that file (exit code 2) while every other file and rule still
reports. Output order is by path and does not depend on `jobs` or on the cache.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from maingrad.analyzer import __version__, gcpause
from maingrad.analyzer.cache import ResultCache, content_hash
from maingrad.analyzer.catalog import UNUSED_SUPPRESSION_ID, RuleMeta, extra_rules_signature
from maingrad.analyzer.discovery import SourceFile
from maingrad.analyzer.fileio import decode_source
from maingrad.analyzer.needles import needles_match
from maingrad.analyzer.progress import Progress
from maingrad.analyzer.project import ProjectFacts
from maingrad.analyzer.project import file_facts as project_file_facts
from maingrad.analyzer.suppressions import MARKER, apply_suppressions, parse_suppressions, unused_findings
from maingrad.analyzer.syntax_index import gate_enabled
from maingrad.contracts.report import Finding, NotAnalyzed, ParseError, Report, Severity

# Below this many characters of source to parse, a process pool costs more than it saves.
POOL_MIN_CHARS = 150_000


@dataclass(frozen=True)
class ScanSettings:
    """Everything that decides a file's result besides its path and bytes (so: the cache key)."""

    rules: tuple[RuleMeta, ...]  # the selected rules
    known_ids: tuple[str, ...]  # every rule id maingrad knows (for unknown-code suppressions)
    per_file_ignores: tuple[tuple[str, tuple[str, ...]], ...] = ()
    severities: tuple[tuple[str, str], ...] = ()
    exposure_helpers: tuple[str, ...] = ()
    warn_unused_ignores: bool = False

    def cache_settings(self) -> dict[str, Any]:
        return {
            "tool": __version__,
            "rules": [r.id for r in self.rules],
            "known": list(self.known_ids),
            "per_file_ignores": [list(p) for p in self.per_file_ignores],
            "severities": list(self.severities),
            "exposure_helpers": list(self.exposure_helpers),
            "warn_unused_ignores": self.warn_unused_ignores,
            "extra_rules": extra_rules_signature(),
            # Findings do not depend on it, but `parsed` (files_parsed) does: keep the modes apart.
            "syntax_gate": gate_enabled(),
        }


@dataclass
class ScanResult:
    report: Report
    internal_errors: list[ParseError] = field(default_factory=list)
    suppressed: int = 0
    cache_hits: int = 0


class _FileRules:
    """The selected rules minus per-file ignores, per path."""

    def __init__(self, settings: ScanSettings) -> None:
        self.all = tuple(r.id for r in settings.rules)
        self.needles = {r.id: r.needles for r in settings.rules}
        self._ignores: list[tuple[Any, frozenset[str]]] = []
        if settings.per_file_ignores:  # pathspec only when needed: warm runs are import-bound
            import pathspec

            self._ignores = [
                (pathspec.GitIgnoreSpec.from_lines([glob]), frozenset(codes))
                for glob, codes in settings.per_file_ignores
            ]

    def for_path(self, relpath: str) -> tuple[str, ...]:
        dropped: set[str] = set()
        for spec, codes in self._ignores:
            if spec.match_file(relpath):
                dropped |= {
                    rid for rid in self.all if any(code == "ALL" or rid.startswith(code) for code in codes)
                }
        return tuple(rid for rid in self.all if rid not in dropped) if dropped else self.all

    def needed(self, ids: Sequence[str], text: str) -> bool:
        return any(needles_match(self.needles[rid], text) for rid in ids)


# Per-process analysis state (set in the parent for in-process runs; inherited or rebuilt in workers).
_STATE: dict[str, Any] = {}


def _init_worker(settings: ScanSettings, project: frozenset[str] = frozenset()) -> None:
    _STATE.clear()
    _STATE["settings"] = settings
    _STATE["project"] = project
    _STATE["instances"] = {}


def _rule_instances(ids: Sequence[str]) -> list[Any]:
    from maingrad.analyzer.catalog import rule_classes

    instances: dict[str, Any] = _STATE["instances"]
    registry = rule_classes()
    for rid in ids:
        if rid not in instances:
            instances[rid] = registry[rid]()
    return [instances[rid] for rid in ids]


def analyze_text(relpath: str, text: str, rule_ids: tuple[str, ...]) -> dict[str, Any]:
    """One file's outcome as plain data: {"parsed", "findings", "parse_error", "internal", "suppressed"}.

    The cyclic collector stays paused (see `maingrad.analyzer.gcpause`) until the engine's result is freed:
    its fixes hold pieces of the parsed trees (20 objects a finding), which the first collection after the
    engine's own pause would scan only to find them alive, for a file with 10^5 findings a second."""
    with gcpause.paused():
        return _analyze_text(relpath, text, rule_ids)


def _empty_outcome() -> dict[str, Any]:
    """One file's outcome before anything is found: what a worker sends back for each file."""
    return {"parsed": False, "findings": [], "parse_error": None, "internal": [], "suppressed": 0}


def _analyze_text(relpath: str, text: str, rule_ids: tuple[str, ...]) -> dict[str, Any]:
    from maingrad.analyzer.context import RuleSettings
    from maingrad.analyzer.engine import analyze_source

    settings: ScanSettings = _STATE["settings"]
    outcome = _empty_outcome()
    try:
        result = analyze_source(
            text,
            relpath,
            _rule_instances(rule_ids),
            RuleSettings(
                exposure_helpers=frozenset(settings.exposure_helpers),
                project=_STATE.get("project", frozenset()),
            ),
            {rid: Severity(sev) for rid, sev in settings.severities},
            catch_rule_errors=True,
        )
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # the engine itself failed on this file (even a native panic): report it
        outcome["internal"].append(f"internal error: {type(exc).__name__}: {exc}")
        return outcome
    outcome["internal"] = [f"internal error: rule {message}" for message in result.rule_errors]
    if result.parse_error is not None:
        outcome["parse_error"] = result.parse_error.to_dict()
        return outcome
    outcome["parsed"] = result.parsed
    findings, outcome["suppressed"] = _suppress(relpath, text, result.findings, result.anchors, rule_ids)
    outcome["findings"] = findings  # Finding objects (dicts only for the cache: see _cacheable)
    return outcome


def _suppress(
    relpath: str,
    text: str,
    findings: list[Finding],
    anchors: dict[str, tuple[int, ...]],
    rule_ids: Sequence[str],
) -> tuple[list[Finding], int]:
    settings: ScanSettings = _STATE["settings"]
    if MARKER not in text:
        return findings, 0
    suppressions = parse_suppressions(text)
    kept, suppressed = apply_suppressions(findings, anchors, suppressions)
    if settings.warn_unused_ignores:
        severity = dict(settings.severities).get(UNUSED_SUPPRESSION_ID)
        kept += unused_findings(
            suppressions,
            relpath,
            text,
            rule_ids,
            settings.known_ids,
            Severity(severity) if severity else None,
        )
        kept.sort(key=lambda f: f.sort_key)
    return kept, suppressed


def _analyze_task(task: tuple[str, str, tuple[str, ...]]) -> dict[str, Any]:
    return analyze_text(*task)


def run_tasks(
    func: Callable[[Any], Any],
    tasks: Sequence[tuple[str, int, Any]],
    jobs: int,
    initializer: Callable[..., None],
    initargs: tuple[Any, ...],
    progress: Progress,
) -> dict[str, Any]:
    """Run `func(arg)` for each (key, weight, arg): in this process when the work is small or jobs == 1,
    else in a pool of `jobs` processes, heaviest tasks first. Exceptions come back as values."""
    results: dict[str, Any] = {}
    total_weight = sum(weight for _, weight, _ in tasks)
    workers = min(jobs, len(tasks))
    if workers <= 1 or total_weight < POOL_MIN_CHARS:
        initializer(*initargs)
        for key, _, arg in tasks:
            try:
                results[key] = func(arg)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:
                results[key] = exc
            progress.advance()
        return results
    import multiprocessing
    from concurrent.futures import Future, ProcessPoolExecutor, as_completed

    context = multiprocessing.get_context("fork") if sys.platform.startswith("linux") else None
    ordered = sorted(tasks, key=lambda t: -t[1])
    with ProcessPoolExecutor(workers, mp_context=context, initializer=initializer, initargs=initargs) as pool:
        futures: dict[Future[Any], str] = {pool.submit(func, arg): key for key, _, arg in ordered}
        for future in as_completed(futures):
            key = futures[future]
            try:
                results[key] = future.result()
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # includes BrokenProcessPool when a worker dies
                results[key] = exc
            progress.advance()
    return results


def _read(source: SourceFile) -> tuple[bytes | None, str | None]:
    try:
        return source.path.read_bytes(), None
    except OSError as exc:
        return None, f"cannot read file: {exc.strerror or exc}"


def _decode(relpath: str, data: bytes) -> tuple[str | None, ParseError | None]:
    """The file's text, or why it is not Python source text (with the line and column of the first bad
    byte): undecodable in its declared encoding (UTF-8 by default), an unknown or malformed coding cookie,
    or a NUL byte (which the interpreter refuses too)."""
    try:
        text = decode_source(data).text
    except UnicodeDecodeError as exc:
        line, column = _line_column(data, exc.start)
        bad = data[exc.start : exc.start + 1].hex()
        message = f"cannot decode file as {exc.encoding}: byte 0x{bad} ({exc.reason}); "
        message += "re-encode it or declare its encoding (PEP 263 coding cookie)"
        return None, ParseError(relpath, message, line, column, NotAnalyzed.DECODE)
    except SyntaxError as exc:  # a malformed coding cookie
        return None, ParseError(
            relpath, f"cannot decode file: {exc.msg}", exc.lineno or 1, 1, NotAnalyzed.DECODE
        )
    except LookupError as exc:  # a coding cookie naming an unknown codec
        return None, ParseError(relpath, f"cannot decode file: {exc}", 1, 1, NotAnalyzed.DECODE)
    nul = text.find("\0")
    if nul >= 0:
        line = text.count("\n", 0, nul) + 1
        column = nul - (text.rfind("\n", 0, nul) + 1) + 1
        message = "cannot decode file: it contains a NUL byte (a binary file?)"
        return None, ParseError(relpath, message, line, column, NotAnalyzed.DECODE)
    return text, None


def _line_column(data: bytes, offset: int) -> tuple[int, int]:
    """1-based line and (byte) column of a byte offset."""
    return data.count(b"\n", 0, offset) + 1, offset - (data.rfind(b"\n", 0, offset) + 1) + 1


def scan(
    files: Sequence[SourceFile],
    settings: ScanSettings,
    jobs: int | None = None,
    cache: ResultCache | None = None,
    show_progress: bool = False,
    skipped: Sequence[ParseError] = (),
) -> ScanResult:
    """Analyze `files`; `skipped`: what discovery could not read (reported as not analyzed)."""
    started = time.perf_counter()
    jobs = jobs or os.cpu_count() or 1
    file_rules = _FileRules(settings)
    outcomes: dict[str, dict[str, Any]] = {}
    digests: dict[str, str] = {}
    pending: list[tuple[str, int, tuple[str, str, tuple[str, ...]]]] = []
    hits = 0
    # Pass 1: read every file and collect what it contributes to the project facts (cached with its result).
    # Only the texts some rule must parse are kept (in `pending`); rules run once the facts are known.
    cached_outcomes: dict[str, dict[str, Any]] = {}
    file_facts: dict[str, list[str]] = {}
    fresh: set[str] = set()  # analyzed in this scan (their outcomes get this scan's facts)
    _STATE["settings"] = settings  # pass 1 already judges suppressions of files no rule parses

    def classify(relpath: str, text: str) -> None:
        fresh.add(relpath)
        ids = file_rules.for_path(relpath)
        if file_rules.needed(ids, text):
            pending.append((relpath, len(text), (relpath, text, ids)))
        else:
            outcomes[relpath] = _unparsed_outcome(relpath, text, ids, settings)

    for source in files:
        data, error = _read(source)
        if data is None:
            failure = ParseError(source.relpath, error or "cannot read file", 1, 1, NotAnalyzed.READ)
            outcomes[source.relpath] = _error_outcome(failure)
            continue
        digest = digests[source.relpath] = content_hash(data)
        cached = cache.get(source.relpath, digest) if cache is not None else None
        if cached is not None and "facts" in cached:
            cached_outcomes[source.relpath] = cached
            file_facts[source.relpath] = list(cached["facts"])
            continue
        text, undecodable = _decode(source.relpath, data)
        if text is None:
            assert undecodable is not None
            outcomes[source.relpath] = _error_outcome(undecodable)
            fresh.add(source.relpath)
            continue
        file_facts[source.relpath] = project_file_facts(source.relpath, text)
        classify(source.relpath, text)
    project = ProjectFacts.of(file_facts.values())
    # Pass 2: a cached result computed under other project facts is analyzed again.
    by_path = {source.relpath: source for source in files}
    for relpath, cached in cached_outcomes.items():
        data = None
        if cached.get("project", []) != project.key():
            data, _ = _read(by_path[relpath])
        text, _ = _decode(relpath, data) if data is not None else (None, None)
        if text is None:  # still valid, or changed under us since pass 1: keep what the cache knew
            outcomes[relpath] = cached
            hits += 1
        else:
            classify(relpath, text)
    _STATE["settings"] = settings
    _STATE["project"] = project.facts
    _STATE.setdefault("instances", {})
    with Progress(len(pending), "maingrad check", show_progress) as progress:
        results = run_tasks(_analyze_task, pending, jobs, _init_worker, (settings, project.facts), progress)
    for relpath, value in results.items():
        if isinstance(value, BaseException):
            value = {
                "parsed": False,
                "findings": [],
                "parse_error": None,
                "internal": [f"internal error: {type(value).__name__}: {value}"],
                "suppressed": 0,
            }
        outcomes[relpath] = value
    for relpath in fresh:  # what a cache entry needs to be reused (a file that did not decode: no facts)
        outcomes[relpath]["facts"] = file_facts.get(relpath, [])
        outcomes[relpath]["project"] = project.key()
    if cache is not None:
        for relpath, outcome in outcomes.items():
            if relpath in digests and not outcome.get("internal"):
                cacheable = _cacheable(outcome)
                if cacheable is not None:
                    cache.put(relpath, digests[relpath], cacheable)
        cache.save()
    result = _assemble(files, outcomes, settings, time.perf_counter() - started, hits)
    if skipped:
        result.report.parse_errors.extend(skipped)
        result.report.parse_errors.sort(key=lambda e: (e.path, e.line or 0))
    return result


# A file with more findings than this is not cached: its cache entry (one JSON document with every other
# file's) would cost more memory than the report itself, and re-analyzing it is what its findings cost anyway.
CACHE_MAX_FINDINGS = 10_000


def _cacheable(outcome: dict[str, Any]) -> dict[str, Any] | None:
    findings = outcome["findings"]
    if len(findings) > CACHE_MAX_FINDINGS:
        return None
    return {**outcome, "findings": [f if isinstance(f, dict) else f.to_dict() for f in findings]}


def _error_outcome(error: ParseError) -> dict[str, Any]:
    return {
        "parsed": False,
        "findings": [],
        "parse_error": error.to_dict(),
        "internal": [],
        "suppressed": 0,
    }


def _unparsed_outcome(
    relpath: str, text: str, ids: tuple[str, ...], settings: ScanSettings
) -> dict[str, Any]:
    """A file no selected rule needs to parse: only its suppression comments can produce findings."""
    outcome = _empty_outcome()
    if settings.warn_unused_ignores and MARKER in text:
        findings, _ = _suppress(relpath, text, [], {}, ids)
        outcome["findings"] = findings
    return outcome


def _assemble(
    files: Sequence[SourceFile],
    outcomes: dict[str, dict[str, Any]],
    settings: ScanSettings,
    duration: float,
    hits: int,
) -> ScanResult:
    report = Report(tool_version=__version__)
    report.files_scanned = len(files)
    internal: list[ParseError] = []
    suppressed = 0
    for source in files:
        outcome = outcomes[source.relpath]
        report.files_parsed += bool(outcome["parsed"])
        if outcome["parse_error"]:
            report.parse_errors.append(ParseError.from_dict(outcome["parse_error"]))
        for message in outcome["internal"]:
            error = ParseError(source.relpath, message, kind=NotAnalyzed.INTERNAL)
            report.parse_errors.append(error)
            internal.append(error)
        report.findings.extend(
            f if isinstance(f, Finding) else Finding.from_dict(f) for f in outcome["findings"]
        )
        outcome["findings"] = ()  # the report holds them now
        suppressed += outcome["suppressed"]
    report.findings.sort(key=lambda f: f.sort_key)
    severities = dict(settings.severities)
    infos = [r.info(Severity(severities[r.id]) if r.id in severities else None) for r in settings.rules]
    if settings.warn_unused_ignores:
        from maingrad.analyzer.catalog import UNUSED_SUPPRESSION

        sev = severities.get(UNUSED_SUPPRESSION_ID)
        infos.insert(0, UNUSED_SUPPRESSION.info(Severity(sev) if sev else None))
    report.rules = infos
    report.duration_s = duration
    return ScanResult(report=report, internal_errors=internal, suppressed=suppressed, cache_hits=hits)
