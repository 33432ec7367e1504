"""`maingrad preflight`: run a training script's preflight check, or show a saved result.

    maingrad preflight --script train.py [--json out.json] [--sink URL] -- --script-args ...
    torchrun --nproc-per-node 8 -m maingrad.cli preflight --script train.py -- ...   # every rank
    maingrad preflight --show out.json

The script must call `maingrad.hooks.preflight_from_env(model, run_microbatch, batches, loss_fn=...)` once,
after wrapping its model; this command runs it with MAINGRAD_PREFLIGHT=only, so the script stops right after
the check (exit status 0 pass, 1 fail or error, 3 inconclusive) and never trains. Registration imports nothing heavy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "preflight",
        help="prove gradient accumulation on a training script's own model (or show a saved result)",
        description=(__doc__ or "").split("\n\n")[0],
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--script", help="training script that calls maingrad.hooks.preflight_from_env()")
    what.add_argument(
        "--show", metavar="JSON", help="print the table of a saved result (exit 1 unless it passed)"
    )
    parser.add_argument("--json", help="write the result as JSON here ({rank} is filled in)")
    parser.add_argument(
        "--sink",
        action="append",
        default=[],
        help="send the records: jsonl:PATH or the service URL (repeatable)",
    )
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script (after --)")
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    if args.show:
        return _show(args.show)
    return _script(args)


def _show(path: str) -> int:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        print(f"maingrad preflight: cannot read {path}: {exc}", file=sys.stderr)
        return 2
    from maingrad.hooks.preflight.result import result_from_dict

    result = result_from_dict(data)
    print(result.table())
    return 0 if result.ok else 1


def _script(args: argparse.Namespace) -> int:
    import runpy

    if not os.path.isfile(args.script):
        print(f"maingrad preflight: no such script: {args.script}", file=sys.stderr)
        return 2
    from maingrad.hooks.preflight import run as module

    script_args = list(args.args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    saved_env = {key: os.environ.get(key) for key in (module.ENV, module.ENV_JSON, module.ENV_SINKS)}
    os.environ[module.ENV] = "only"
    if args.json:
        os.environ[module.ENV_JSON] = args.json
    if args.sink:
        os.environ[module.ENV_SINKS] = ",".join(args.sink)
    calls_before = module._CALLS["preflight_from_env"]
    saved_argv = sys.argv
    sys.argv = [args.script, *script_args]
    script_dir = os.path.dirname(os.path.abspath(args.script))
    sys.path.insert(0, script_dir)
    try:
        runpy.run_path(args.script, run_name="__main__")
    except SystemExit as exc:
        if module._CALLS["preflight_from_env"] > calls_before:
            return exc.code if isinstance(exc.code, int) else 1
        raise
    finally:
        sys.argv = saved_argv
        if sys.path and sys.path[0] == script_dir:
            sys.path.pop(0)
        for key, value in saved_env.items():  # the caller's environment as it was (in-process callers, tests)
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    if module._CALLS["preflight_from_env"] == calls_before:
        print(
            f"maingrad preflight: {args.script} never called maingrad.hooks.preflight_from_env(model, "
            "run_microbatch, batches, loss_fn=...)",
            file=sys.stderr,
        )
        return 2
    return 0
