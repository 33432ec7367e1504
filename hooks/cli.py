"""`maingrad hooks ...` subcommands. Registration imports nothing heavy (no torch), so the CLI starts fast.

Exit codes: 0 clean (summary: no anomaly; validate: every record valid), 1 anomalies / invalid records,
2 a file that cannot be read or is not JSON lines (one `maingrad: error:` line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("hooks", help="runtime records written by maingrad.hooks")
    commands = parser.add_subparsers(dest="hooks_command", metavar="SUBCOMMAND")
    summary = commands.add_parser(
        "summary", help="per-module counts, anomalies and overwrite flags of JSONL files"
    )
    summary.add_argument("files", nargs="+", help="JSONL record files (one per rank)")
    summary.add_argument("--json", action="store_true", help="print the summary as JSON")
    summary.set_defaults(handler=_summary)
    validate = commands.add_parser("validate", help="check JSONL records against the record schema")
    validate.add_argument("files", nargs="+")
    validate.set_defaults(handler=_validate)
    parser.set_defaults(handler=lambda args: (parser.print_help(sys.stderr), 2)[1])


class _InputError(Exception):
    """A file that cannot be read as records: one line on stderr, exit 2."""


def _read(paths: list[str]) -> list[dict]:
    from maingrad.contracts.records import iter_jsonl

    records: list[dict] = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as handle:
                records.extend(iter_jsonl(handle))
        except OSError as exc:
            raise _InputError(f"{path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise _InputError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        except ValueError as exc:  # a line that is not JSON (iter_jsonl names it)
            raise _InputError(f"{path}: {exc}") from None
    return records


def _fail(message: str) -> int:
    print(f"maingrad: error: {message}", file=sys.stderr)
    return 2


def _summary(args: argparse.Namespace) -> int:
    from maingrad.hooks.summary import summarize_records

    try:
        records = _read(args.files)
    except _InputError as exc:
        return _fail(str(exc))
    non_objects = sum(1 for record in records if not isinstance(record, dict))
    if non_objects:
        return _fail(
            f"{non_objects} line(s) are JSON but not record objects: check with `maingrad hooks validate`"
        )
    result = summarize_records(records)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.table())
    return 0 if result.ok else 1


def _validate(args: argparse.Namespace) -> int:
    from maingrad.contracts.records import validate

    bad = 0
    try:
        records = _read(args.files)
    except _InputError as exc:
        return _fail(str(exc))
    for index, record in enumerate(records):
        problems = validate(record)
        if problems:
            bad += 1
            if bad <= 20:
                print(
                    f"record {index} ({record.get('id', '?') if isinstance(record, dict) else '?'}): "
                    + "; ".join(problems)
                )
    print(f"{len(records)} records, {bad} invalid")
    return 1 if bad else 0
