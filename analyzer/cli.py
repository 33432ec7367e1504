"""`maingrad check`, `maingrad fix`, `maingrad rules`, `maingrad explain`.

Exit codes (also in `check --help`, `fix --help` and the README): 0 no finding at or above `--fail-on`
(default: error, the service gate's default) and every file analyzed, 1 such findings or a path that could
not be analyzed (MG999) (with --diff: changes to apply), 2 usage, configuration or internal error, or no
Python file to check. Every error is one line on stderr (`maingrad: error: ...`), never a
traceback (set MAINGRAD_DEBUG=1 to get one for an internal error). libcst is imported only when some file
actually has to be parsed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator, Sequence
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
from maingrad.contracts.report import DEFAULT_FAIL_ON, Severity

EXIT_OK, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2

CHECK_EXIT_CODES = f"""\
exit codes:
  0  no finding at or above --fail-on (default: {DEFAULT_FAIL_ON.value}), and every file was analyzed
  1  findings at or above --fail-on, or a path that could not be read, decoded or parsed (MG999);
     with --diff: fixes to apply
  2  usage, configuration or internal error (e.g. a rule failed on a file), or no Python file to check
--exit-zero turns 1 into 0. --fail-on's default is the service gate's (MAINGRAD_GATE_FAIL_SEVERITY), so
what passes the gate passes check."""

FIX_EXIT_CODES = f"""\
exit codes:
  0  nothing at or above --fail-on (default: {DEFAULT_FAIL_ON.value}) left after fixing (with --diff: nothing
     to fix)
  1  such findings remain, or a path could not be analyzed (MG999); with --diff: fixes to apply
  2  usage, configuration or internal error (e.g. a fix failed on a file), or no Python file to check
Unsafe fixes (listed as hidden fixes) are applied only with --unsafe-fixes."""

RULES_EXIT_CODES = """\
exit codes:
  0  the rules were listed
  2  usage error"""

EXPLAIN_EXIT_CODES = """\
exit codes:
  0  the rule's documentation was printed
  2  unknown rule, or usage error"""

# Explicitly named files are analyzed only when they are Python source: these suffixes, the configured
# `include` patterns, or a script whose first line is a python shebang.
PYTHON_SUFFIXES = (".py", ".pyi")


def register(subparsers: argparse._SubParsersAction) -> None:
    check = _add_command(
        subparsers, "check", "find main_grad contract bugs", "Find main_grad contract bugs.", CHECK_EXIT_CODES
    )
    _add_scan_arguments(check)
    check.add_argument("--fix", action="store_true", help="apply fixes, then report what is left")
    check.set_defaults(handler=run_check, fix_command=False)

    fix = _add_command(
        subparsers, "fix", "apply fixes", "Apply fixes, then report what is left.", FIX_EXIT_CODES
    )
    _add_scan_arguments(fix)
    fix.set_defaults(handler=run_check, fix_command=True, fix=True)

    rules = _add_command(
        subparsers,
        "rules",
        "list the rules",
        "List the rules (FIX: safe, unsafe (needs --unsafe-fixes), or both, case by case).",
        RULES_EXIT_CODES,
    )
    rules.add_argument("--format", choices=("text", "json"), default="text")
    rules.set_defaults(handler=run_rules)

    explain = _add_command(
        subparsers,
        "explain",
        "print a rule's documentation",
        "Print a rule's documentation.",
        EXPLAIN_EXIT_CODES,
    )
    explain.add_argument("rule", metavar="RULE", help="rule id or name, e.g. MG001")
    explain.add_argument(
        "--format",
        choices=("terminal", "markdown"),
        default="terminal",
        help="terminal: rendered (default; plain text when not on a terminal); markdown: the page's source",
    )
    explain.set_defaults(handler=run_explain)


def _add_command(
    subparsers: argparse._SubParsersAction, name: str, summary: str, description: str, exit_codes: str
) -> argparse.ArgumentParser:
    """A subcommand whose help ends with its exit codes, laid out as written."""
    return subparsers.add_parser(
        name,
        help=summary,
        description=description,
        epilog=exit_codes,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


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
        "--fail-on",
        type=Severity,
        choices=list(Severity),
        default=DEFAULT_FAIL_ON,
        metavar="{info,warning,error}",
        help=f"the lowest severity that makes the exit status 1 (default: {DEFAULT_FAIL_ON.value}, as the "
        "service gate); findings below it are still reported",
    )
    parser.add_argument(
        "--diff-only",
        "--changed-since",
        dest="diff_only",
        metavar="REV",
        help="only findings on lines changed since REV",
    )
    parser.add_argument("--baseline", type=Path, metavar="FILE", help="only findings not in this baseline")
    parser.add_argument(
        "--write-baseline",
        type=Path,
        metavar="FILE",
        help="record the current findings and exit 0 (1 when a path could not be analyzed)",
    )
    parser.add_argument("--statistics", action="store_true", help="print counts per rule instead of findings")
    parser.add_argument("--quiet", "-q", action="store_true", help="findings only: no summary, no progress")
    parser.add_argument(
        "--concise",
        action="store_true",
        help="one line per finding: no code frame, no detail, no `maingrad explain` pointer",
    )
    parser.add_argument(
        "--show-source",
        action="store_true",
        help="show the code frame (the default for text output; kept for scripts that pass it)",
    )
    parser.add_argument(
        "--force-exclude", action="store_true", help="apply excludes to explicitly named files too"
    )
    parser.add_argument(
        "--no-respect-gitignore", action="store_true", help="scan files that .gitignore excludes"
    )
    parser.add_argument("--no-progress", action="store_true", help="never show a progress bar")


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
    except Exception as exc:  # a bug in maingrad: say so in one line and exit 2 (never 0 or 1)
        return _internal_error(exc)


def _internal_error(exc: BaseException) -> int:
    if os.environ.get("MAINGRAD_DEBUG"):
        import traceback

        traceback.print_exc()
    return _error(
        f"internal error: {type(exc).__name__}: {exc} (please report it; MAINGRAD_DEBUG=1 shows the traceback)"
    )


def _is_python(path: Path, relpath: str, include: Sequence[str]) -> bool:
    if path.suffix in PYTHON_SUFFIXES:
        return True
    from maingrad.analyzer.discovery import _spec

    spec = _spec(include)
    if spec is not None and spec.match_file(relpath):
        return True
    if path.suffix:
        return False
    try:
        with path.open("rb") as handle:
            first = handle.readline(200)
    except OSError:
        return True  # let the scan report why it cannot be read (MG999)
    return first.startswith(b"#!") and b"python" in first


def _refuse_non_python(paths: Sequence[Path], config: Config) -> None:
    from maingrad.analyzer.discovery import relpath_of

    for path in paths:
        if path.is_dir():
            continue
        if not _is_python(path, relpath_of(path.resolve(), config.root), config.include):
            raise ConfigError(
                f"{path}: not a Python file (expected {' or '.join('*' + s for s in PYTHON_SUFFIXES)}, "
                "a python script, or a pattern under [tool.maingrad] include); nothing was checked"
            )


def _scan_settings(args: argparse.Namespace, config: Config, catalog: tuple[Any, ...]) -> Any:
    """The selected rules and per-file settings, after validating every rule code the user gave."""
    from maingrad.analyzer.catalog import UNUSED_SUPPRESSION_ID
    from maingrad.analyzer.runner import ScanSettings

    known = tuple(r.id for r in catalog)
    if args.select:
        check_codes(args.select, known, "--select")
    if args.ignore:
        check_codes(args.ignore, known, "--ignore")
    validate_codes(config, (*known, UNUSED_SUPPRESSION_ID))
    selected = set(config.selected(known, opt_in=(r.id for r in catalog if not r.default)))
    return ScanSettings(
        rules=tuple(r for r in catalog if r.id in selected),
        known_ids=known,
        per_file_ignores=tuple(config.per_file_ignores.items()),
        severities=tuple(sorted((k, v.value) for k, v in config.severity.items())),
        exposure_helpers=config.exposure_helpers,
        warn_unused_ignores=config.warn_unused_ignores,
    )


def _run_check(args: argparse.Namespace) -> int:
    from maingrad.analyzer.cache import ResultCache, cache_dir, settings_key
    from maingrad.analyzer.catalog import load_catalog
    from maingrad.analyzer.discovery import discover
    from maingrad.analyzer.runner import scan
    from maingrad.contracts.report import ParseError

    paths = list(args.paths) or [Path(".")]
    for path in paths:
        if not path.exists():
            raise ConfigError(f"{path}: no such file or directory")
    config = load_config(paths, args.config).with_overrides(
        select=args.select, ignore=args.ignore, warn_unused_ignores=args.warn_unused_ignores
    )
    _refuse_non_python(paths, config)
    jobs = _jobs(args.jobs)
    directory = None if args.no_cache else cache_dir(config.root)
    catalog = load_catalog(directory)
    settings = _scan_settings(args, config, catalog)
    skipped: list[ParseError] = []
    files = discover(
        paths,
        config.root,
        config.include,
        config.exclude,
        respect_gitignore=not args.no_respect_gitignore,
        force_exclude=args.force_exclude,
        skipped=skipped,
    )
    if not files and not skipped:
        return _nothing_to_check(args, paths)
    changed = None
    if args.diff_only:  # before any work: a bad revision is a usage error
        from maingrad.analyzer.changes import ChangesError, changed_lines

        try:
            changed = changed_lines(args.diff_only, config.root)
        except ChangesError as exc:
            return _error(str(exc))
    progress = not (args.quiet or args.no_progress)

    def cache() -> ResultCache | None:
        if directory is None:
            return None
        return ResultCache(directory, settings_key(settings.cache_settings()))

    fix_status = EXIT_OK
    if args.fix or args.diff:
        fix_status, would_fix = _apply_fixes(args, files, settings, jobs, progress)
        if args.diff:
            if not args.quiet:
                hidden = 0
                if not args.unsafe_fixes:  # what --unsafe-fixes would add (findings with an unsafe fix)
                    found = scan(files, settings, jobs=jobs, cache=cache(), show_progress=progress)
                    hidden = sum(1 for f in found.report.findings if f.fix_applicability == "unsafe")
                print(_would_fix(would_fix, hidden), file=sys.stderr)
            return fix_status
    result = scan(files, settings, jobs=jobs, cache=cache(), show_progress=progress, skipped=skipped)
    report = result.report
    if changed is not None:
        report.findings = [f for f in report.findings if changed.touches(f)]
        report.parse_errors = [e for e in report.parse_errors if changed.touches_path(e.path)]
    if args.write_baseline:
        from maingrad.analyzer.baseline import write_baseline

        write_baseline(args.write_baseline, report.findings)
        if not args.quiet:
            print(
                f"Wrote a baseline of {len(report.findings)} findings to {args.write_baseline}",
                file=sys.stderr,
            )
        return _errors_to_stderr(report, config, args) or EXIT_OK
    if args.baseline:
        from maingrad.analyzer.baseline import BaselineError, load_baseline, new_findings

        try:
            report.findings = new_findings(report.findings, load_baseline(args.baseline))
        except BaselineError as exc:
            return _error(str(exc))
    _write_report(args, config, catalog, settings, report)
    if result.internal_errors or fix_status == EXIT_ERROR:
        return EXIT_ERROR
    failing = any(f.severity.rank >= args.fail_on.rank for f in report.findings)
    if (failing or report.parse_errors) and not args.exit_zero:
        return EXIT_FINDINGS
    return EXIT_OK


def _nothing_to_check(args: argparse.Namespace, paths: Sequence[Path]) -> int:
    """No file to analyze: a usage error (exit 2, with the reason), unless every path is a file the project
    excludes and --force-exclude says to honour that (pre-commit passing excluded files: exit 0)."""
    if args.force_exclude and all(p.is_file() for p in paths):
        if not args.quiet:
            print(
                "maingrad: every file named is excluded ([tool.maingrad] exclude or .gitignore)",
                file=sys.stderr,
            )
        return EXIT_OK
    shown = " ".join(str(p) for p in paths)
    return _error(
        f"no Python file to check in {shown} (files ending in {' or '.join(PYTHON_SUFFIXES)} or matching "
        "[tool.maingrad] include, not excluded by [tool.maingrad] exclude or .gitignore); nothing was checked"
    )


def _would_fix(files: int, hidden: int) -> str:
    message = f"Would fix {files} file{'s' if files != 1 else ''}"
    if hidden:
        message += f" ({hidden} hidden fix{'es' if hidden != 1 else ''} can be enabled with `--unsafe-fixes`)"
    return message + "."


def _write_report(
    args: argparse.Namespace, config: Config, catalog: tuple[Any, ...], settings: Any, report: Any
) -> None:
    """Render the report in the requested format to --output or stdout, piece by piece."""
    from maingrad.analyzer.reporters import OutputOptions, iter_render

    to_file = args.output is not None
    stream = sys.stdout
    meta = tuple(settings.rules)
    if config.warn_unused_ignores:
        from maingrad.analyzer.catalog import UNUSED_SUPPRESSION

        meta = (UNUSED_SUPPRESSION, *meta)
    applied = ("safe", "unsafe") if args.unsafe_fixes else ("safe",)
    options = OutputOptions(
        root=config.root,
        color=not to_file and _want_color(stream),
        show_source=not args.concise,
        statistics=args.statistics,
        quiet=args.quiet,
        rules=meta,
        fixable=frozenset(f.fingerprint for f in report.findings if f.fix_applicability in applied),
        hidden_fixes=0
        if args.unsafe_fixes
        else sum(1 for f in report.findings if f.fix_applicability == "unsafe"),
        fail_on=None if args.exit_zero else args.fail_on,
    )
    fmt = "text" if args.statistics else args.format
    pieces = iter_render(fmt, report, options)  # written piece by piece: never the whole text at once
    if to_file:
        from maingrad.analyzer.fileio import atomic_writer

        with atomic_writer(args.output) as handle:
            for batch in _batches(pieces):
                handle.write(batch.encode("utf-8"))
        _errors_to_stderr(report, config, args)
    else:
        for batch in _batches(pieces):
            stream.write(batch)
        stream.flush()


def _batches(pieces: Iterator[str], size: int = 1 << 16) -> Iterator[str]:
    """Join small pieces into writes of about `size` characters."""
    buffer: list[str] = []
    length = 0
    for piece in pieces:
        buffer.append(piece)
        length += len(piece)
        if length >= size:
            yield "".join(buffer)
            buffer, length = [], 0
    if buffer:
        yield "".join(buffer)


def _errors_to_stderr(report: Any, config: Config, args: argparse.Namespace) -> int:
    """Print the MG999 diagnostics on stderr (when the report itself does not go to the terminal); the
    exit code they call for (2 when a rule failed, 1 otherwise, 0 when there are none)."""
    if not report.parse_errors:
        return EXIT_OK
    if not args.quiet:
        from maingrad.analyzer.reporters import OutputOptions
        from maingrad.analyzer.reporters.text import render_errors

        sys.stderr.write(
            render_errors(report, OutputOptions(root=config.root, color=_want_color(sys.stderr)))
        )
    if any(e.internal for e in report.parse_errors):
        return EXIT_ERROR
    return EXIT_OK if args.exit_zero else EXIT_FINDINGS


def _apply_fixes(
    args: argparse.Namespace, files: Sequence[Any], settings: Any, jobs: int, progress: bool
) -> tuple[int, int]:
    """Apply (or, with --diff, print) the fixes; (exit status, number of files changed)."""
    from maingrad.analyzer.fixer import fix_files, write_fixes

    outcomes = fix_files(files, settings, unsafe=args.unsafe_fixes, jobs=jobs, show_progress=progress)
    for outcome in outcomes:
        if outcome.error is not None:
            print(
                f"maingrad: error: fixing {outcome.source.relpath} failed: {outcome.error}", file=sys.stderr
            )
    changed = [o for o in outcomes if o.changed]
    failed = any(o.error for o in outcomes)
    if args.diff:
        for outcome in changed:
            sys.stdout.write(outcome.diff())
        if failed:
            return EXIT_ERROR, len(changed)
        return (EXIT_FINDINGS if changed and not args.exit_zero else EXIT_OK), len(changed)
    written = write_fixes(changed)
    if not args.quiet and written:
        print(f"Fixed {written} file{'s' if written != 1 else ''}.", file=sys.stderr)
    return (EXIT_ERROR if failed else EXIT_OK), written


def _all_rules_meta() -> tuple[Any, ...]:
    from maingrad.analyzer.catalog import UNUSED_SUPPRESSION, load_catalog
    from maingrad.analyzer.not_analyzed import NOT_ANALYZED

    return (UNUSED_SUPPRESSION, *load_catalog(None), NOT_ANALYZED)


def run_rules(args: argparse.Namespace) -> int:
    rules = _all_rules_meta()
    if args.format == "json":
        print(json.dumps([{k: v for k, v in r.to_dict().items() if k != "docs"} for r in rules], indent=2))
        return EXIT_OK
    from maingrad.analyzer.docs import fix_safety

    header = ("ID", "NAME", "SEVERITY", "FIX", "SUMMARY")
    rows = [
        (
            r.id,
            r.name,
            r.severity.value,
            _fix_column(r.fixable, fix_safety(r.id)),
            r.summary + ("" if r.default else " (opt-in)"),
        )
        for r in rules
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(4)]
    for row in (header, *rows):
        print("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:4])) + "  " + row[4])
    return EXIT_OK


def _fix_column(fixable: bool, safety: frozenset[str]) -> str:
    if not fixable:
        return ""
    if safety == {"unsafe"}:
        return "unsafe"
    return "both" if safety == {"safe", "unsafe"} else "safe"


def run_explain(args: argparse.Namespace) -> int:
    from maingrad.analyzer.docs import render_markdown

    wanted = args.rule.strip().upper()
    rules = _all_rules_meta()
    for rule in rules:
        if rule.id == wanted or rule.name == args.rule.strip():
            markdown = render_markdown(rule)
            if args.format == "markdown":
                sys.stdout.write(markdown)
            else:
                _print_markdown(markdown)
            return EXIT_OK
    known = ", ".join(r.id for r in rules)
    return _error(f"unknown rule {args.rule!r} (known: {known})")


def _print_markdown(markdown: str) -> None:
    """Markdown rendered by rich: styled on a terminal, plain text (no escape codes) in a pipe."""
    from rich.console import Console
    from rich.markdown import Markdown

    console = Console(
        file=sys.stdout,
        no_color=bool(os.environ.get("NO_COLOR")),
        force_terminal=bool(os.environ.get("FORCE_COLOR")) or None,
        width=None if _want_color(sys.stdout) else 100,
    )
    console.print(Markdown(markdown, code_theme="ansi_dark"))


__all__ = ["register", "run_check", "run_rules", "run_explain", "Severity"]
