"""`maingrad check`, `maingrad fix`, `maingrad rules`, `maingrad explain`.

Exit codes: 0 no findings, 1 findings (or, with --diff, changes to apply), 2 usage, configuration or
internal error. libcst is imported only when some file actually has to be parsed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from maingrad.analyzer.config import (
    Config,
    ConfigError,
    check_codes,
    load_config,
    parse_codes,
    validate_codes,
)
from maingrad.contracts.report import Severity

EXIT_OK, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    check = subparsers.add_parser(
        "check", help="find main_grad contract bugs", description="Find main_grad contract bugs."
    )
    _add_scan_arguments(check)
    check.add_argument("--fix", action="store_true", help="apply fixes, then report what is left")
    check.set_defaults(handler=run_check, fix_command=False)

    fix = subparsers.add_parser(
        "fix", help="apply fixes", description="Apply fixes, then report what is left."
    )
    _add_scan_arguments(fix)
    fix.set_defaults(handler=run_check, fix_command=True, fix=True)

    rules = subparsers.add_parser("rules", help="list the rules")
    rules.add_argument("--format", choices=("text", "json"), default="text")
    rules.set_defaults(handler=run_rules)

    explain = subparsers.add_parser("explain", help="print a rule's documentation")
    explain.add_argument("rule", metavar="RULE", help="rule id, e.g. MG001")
    explain.set_defaults(handler=run_explain)


def _add_scan_arguments(parser: argparse.ArgumentParser) -> None:
    from maingrad.analyzer.reporters import FORMATS

    parser.add_argument(
        "paths", nargs="*", type=Path, metavar="PATH", help="files or directories (default: .)"
    )
    parser.add_argument(
        "--select", type=parse_codes, metavar="CODES", help="comma-separated rule codes or prefixes"
    )
    parser.add_argument(
        "--ignore", type=parse_codes, metavar="CODES", help="comma-separated rule codes to skip"
    )
    parser.add_argument("--format", choices=FORMATS, default="text", help="output format (default: text)")
    parser.add_argument("--output", "-o", type=Path, metavar="FILE", help="write the report to FILE")
    parser.add_argument("--jobs", "-j", type=int, metavar="N", help="worker processes (default: CPU count)")
    parser.add_argument("--no-cache", action="store_true", help="neither read nor write .maingrad_cache/")
    parser.add_argument(
        "--config", type=Path, metavar="FILE", help="pyproject.toml to use instead of discovery"
    )
    parser.add_argument("--diff", action="store_true", help="print fixes as a unified diff; write nothing")
    parser.add_argument("--unsafe-fixes", action="store_true", help="also apply fixes marked unsafe")
    parser.add_argument(
        "--warn-unused-ignores", action="store_true", help="report unused or unknown suppressions (MG000)"
    )
    parser.add_argument("--exit-zero", action="store_true", help="exit 0 even when there are findings")
    parser.add_argument(
        "--diff-only",
        "--changed-since",
        dest="diff_only",
        metavar="REV",
        help="only findings on lines changed since REV",
    )
    parser.add_argument("--baseline", type=Path, metavar="FILE", help="only findings not in this baseline")
    parser.add_argument(
        "--write-baseline", type=Path, metavar="FILE", help="record the current findings and exit 0"
    )
    parser.add_argument("--statistics", action="store_true", help="print counts per rule instead of findings")
    parser.add_argument("--quiet", "-q", action="store_true", help="findings only: no summary, no progress")
    parser.add_argument("--show-source", action="store_true", help="show source lines with a caret")
    parser.add_argument(
        "--force-exclude", action="store_true", help="apply excludes to explicitly named files too"
    )
    parser.add_argument(
        "--no-respect-gitignore", action="store_true", help="scan files that .gitignore excludes"
    )
    parser.add_argument("--no-progress", action="store_true", help="never show a progress bar")


@dataclass
class _Session:
    config: Config
    catalog: tuple[Any, ...]
    cache_dir: Path | None


def _error(message: str) -> int:
    print(f"maingrad: error: {message}", file=sys.stderr)
    return EXIT_ERROR


def _want_color(stream: TextIO) -> bool:
    if os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


def _jobs(value: int | None) -> int:
    if value is not None:
        if value < 1:
            raise ConfigError("--jobs must be at least 1")
        return value
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def run_check(args: argparse.Namespace) -> int:
    try:
        return _run_check(args)
    except ConfigError as exc:
        return _error(str(exc))
    except FileNotFoundError as exc:
        return _error(str(exc))
    except OSError as exc:  # e.g. --output into a missing directory
        return _error(f"{exc.filename or ''}: {exc.strerror or exc}")
    except Exception:  # a bug in maingrad: say so, with the traceback, and exit 2 (never 0 or 1)
        import traceback

        traceback.print_exc()
        return _error("internal error (please report it with the traceback above)")


def _run_check(args: argparse.Namespace) -> int:
    from maingrad.analyzer.cache import ResultCache, cache_dir, settings_key
    from maingrad.analyzer.catalog import UNUSED_SUPPRESSION_ID, load_catalog
    from maingrad.analyzer.discovery import discover
    from maingrad.analyzer.reporters import OutputOptions, render
    from maingrad.analyzer.runner import ScanSettings, scan

    paths = list(args.paths) or [Path(".")]
    for path in paths:
        if not path.exists():
            raise ConfigError(f"{path}: no such file or directory")
    config = load_config(paths, args.config).with_overrides(
        select=args.select, ignore=args.ignore, warn_unused_ignores=args.warn_unused_ignores
    )
    jobs = _jobs(args.jobs)
    directory = None if args.no_cache else cache_dir(config.root)
    catalog = load_catalog(directory)
    known = tuple(r.id for r in catalog)
    if args.select:
        check_codes(args.select, known, "--select")
    if args.ignore:
        check_codes(args.ignore, known, "--ignore")
    validate_codes(config, (*known, UNUSED_SUPPRESSION_ID))
    selected = set(config.selected(known))
    settings = ScanSettings(
        rules=tuple(r for r in catalog if r.id in selected),
        known_ids=known,
        per_file_ignores=tuple(config.per_file_ignores.items()),
        severities=tuple(sorted((k, v.value) for k, v in config.severity.items())),
        exposure_helpers=config.exposure_helpers,
        warn_unused_ignores=config.warn_unused_ignores,
    )
    files = discover(
        paths,
        config.root,
        config.include,
        config.exclude,
        respect_gitignore=not args.no_respect_gitignore,
        force_exclude=args.force_exclude,
    )
    progress = not (args.quiet or args.no_progress)

    fix_status = EXIT_OK
    if args.fix or args.diff:
        fix_status = _apply_fixes(args, files, settings, jobs, progress)
        if args.diff:
            return fix_status
    cache = ResultCache(directory, settings_key(settings.cache_settings())) if directory is not None else None
    result = scan(files, settings, jobs=jobs, cache=cache, show_progress=progress)
    report = result.report
    if args.diff_only:
        from maingrad.analyzer.changes import ChangesError, changed_lines

        try:
            changed = changed_lines(args.diff_only, config.root)
        except ChangesError as exc:
            return _error(str(exc))
        report.findings = [f for f in report.findings if changed.touches(f)]
    if args.write_baseline:
        from maingrad.analyzer.baseline import write_baseline

        write_baseline(args.write_baseline, report.findings)
        if not args.quiet:
            print(
                f"Wrote a baseline of {len(report.findings)} findings to {args.write_baseline}",
                file=sys.stderr,
            )
        return EXIT_ERROR if result.internal_errors else EXIT_OK
    if args.baseline:
        from maingrad.analyzer.baseline import BaselineError, load_baseline, new_findings

        try:
            report.findings = new_findings(report.findings, load_baseline(args.baseline))
        except BaselineError as exc:
            return _error(str(exc))

    to_file = args.output is not None
    stream = sys.stdout
    meta = tuple(r for r in catalog if r.id in selected)
    if config.warn_unused_ignores:
        from maingrad.analyzer.catalog import UNUSED_SUPPRESSION

        meta = (UNUSED_SUPPRESSION, *meta)
    options = OutputOptions(
        root=config.root,
        color=not to_file and _want_color(stream),
        show_source=args.show_source,
        statistics=args.statistics,
        quiet=args.quiet,
        rules=meta,
        fixable=frozenset(f.fingerprint for f in report.findings if f.fix_available),
    )
    fmt = "text" if args.statistics else args.format
    text = render(fmt, report, options)
    if to_file:
        from maingrad.analyzer.fileio import atomic_write

        atomic_write(args.output, text.encode("utf-8"))
    else:
        stream.write(text)
        stream.flush()
    if report.parse_errors and (fmt == "text" or to_file) and not args.quiet:
        from maingrad.analyzer.reporters.text import render_errors

        sys.stderr.write(
            render_errors(report, options.__class__(root=config.root, color=_want_color(sys.stderr)))
        )
    if result.internal_errors or fix_status == EXIT_ERROR:
        return EXIT_ERROR
    if report.findings and not args.exit_zero:
        return EXIT_FINDINGS
    return EXIT_OK


def _apply_fixes(
    args: argparse.Namespace, files: Sequence[Any], settings: Any, jobs: int, progress: bool
) -> int:
    from maingrad.analyzer.fixer import fix_files, write_fixes

    outcomes = fix_files(files, settings, unsafe=args.unsafe_fixes, jobs=jobs, show_progress=progress)
    for outcome in outcomes:
        if outcome.error is not None:
            print(
                f"maingrad: error: fixing {outcome.source.relpath} failed: {outcome.error}", file=sys.stderr
            )
    changed = [o for o in outcomes if o.changed]
    if args.diff:
        for outcome in changed:
            sys.stdout.write(outcome.diff())
        if not args.quiet:
            print(f"Would fix {len(changed)} file{'s' if len(changed) != 1 else ''}.", file=sys.stderr)
        if any(o.error for o in outcomes):
            return EXIT_ERROR
        return EXIT_FINDINGS if changed and not args.exit_zero else EXIT_OK
    written = write_fixes(changed)
    if not args.quiet and written:
        print(f"Fixed {written} file{'s' if written != 1 else ''}.", file=sys.stderr)
    return EXIT_ERROR if any(o.error for o in outcomes) else EXIT_OK


def _all_rules_meta() -> tuple[Any, ...]:
    from maingrad.analyzer.catalog import UNUSED_SUPPRESSION, load_catalog

    return (UNUSED_SUPPRESSION, *load_catalog(None))


def run_rules(args: argparse.Namespace) -> int:
    rules = _all_rules_meta()
    if args.format == "json":
        print(json.dumps([{k: v for k, v in r.to_dict().items() if k != "docs"} for r in rules], indent=2))
        return EXIT_OK
    header = ("ID", "NAME", "SEVERITY", "FIX", "SUMMARY")
    rows = [(r.id, r.name, r.severity.value, "yes" if r.fixable else "", r.summary) for r in rules]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(4)]
    for row in (header, *rows):
        print("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:4])) + "  " + row[4])
    return EXIT_OK


def run_explain(args: argparse.Namespace) -> int:
    from maingrad.analyzer.docs import render_page

    wanted = args.rule.strip().upper()
    for rule in _all_rules_meta():
        if rule.id == wanted or rule.name == args.rule.strip():
            sys.stdout.write(render_page(rule))
            return EXIT_OK
    known = ", ".join(r.id for r in _all_rules_meta())
    return _error(f"unknown rule {args.rule!r} (known: {known})")


__all__ = ["register", "run_check", "run_rules", "run_explain", "Severity"]
