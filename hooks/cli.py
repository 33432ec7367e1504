"""`maingrad hooks ...` subcommands. Registration imports nothing heavy (no torch), so the CLI starts fast."""

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


def _read(paths: list[str]) -> list[dict]:
    from maingrad.contracts.records import iter_jsonl

    records: list[dict] = []
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            try:
                records.extend(iter_jsonl(handle))
            except ValueError as exc:
                raise SystemExit(f"{path}: {exc}") from None
    return records


def _summary(args: argparse.Namespace) -> int:
    from maingrad.hooks.summary import summarize_records

    result = summarize_records(_read(args.files))
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.table())
    return 0 if result.ok else 1


def _validate(args: argparse.Namespace) -> int:
    from maingrad.contracts.records import validate

    bad = 0
    records = _read(args.files)
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
