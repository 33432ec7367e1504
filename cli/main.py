"""Entry point of the `maingrad` command.

Each part registers its own subcommands; this module only composes them, so the analyzer never imports the
service (data flows analyzer -> report -> service) and a base install without the service extra still has a
working `maingrad check`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from maingrad.contracts.extras import install_hint

# (module, the extra that provides it, the commands it registers). Modules expose `register(subparsers)`.
_PARTS: tuple[tuple[str, str | None, tuple[str, ...]], ...] = (
    ("maingrad.analyzer.cli", None, ("check", "fix", "rules", "explain")),
    ("maingrad.hooks.cli", "runtime", ("hooks",)),
    ("maingrad.hooks.preflight.cli", "runtime", ("preflight",)),
    ("maingrad.service.cli", "service", ("serve", "upload", "gate", "token")),
)

# Exit codes of the commands whose parts do not state them in their own epilog: shown in every `--help`.
# (The analyzer's commands carry theirs; tests/test_cli_errors.py checks that every command's help has some.)
EXIT_CODES: dict[str, tuple[str, ...]] = {
    "serve": (
        "0  the server stopped normally",
        "2  a bad setting, a database that cannot be opened, a port in use",
    ),
    "upload": (
        "0  the report was stored (or had been already)",
        "2  usage error, an unreadable or refused report, the server unreachable",
    ),
    "gate": (
        "0  pass or neutral",
        "1  fail: new findings at or above the gate's fail severity (default error, as check's --fail-on),",
        "   runtime anomalies, files not analyzed, or a failed tool run",
        "2  error, or still pending when --wait ran out",
    ),
    "token": ("0  done", "2  usage error, or the request was refused"),
    "token create": ("0  the token was created (printed once)", "2  usage error, or the request was refused"),
    "token revoke": ("0  revoked", "2  no such token, usage error, or the request was refused"),
    "token list": ("0  listed", "2  usage error, or a database that cannot be opened"),
    "hooks": ("0  done", "1  see the subcommand", "2  usage error, or an unreadable file"),
    "hooks summary": (
        "0  no anomaly in the records",
        "1  anomalies",
        "2  usage error, or a file that is not records",
    ),
    "hooks validate": (
        "0  every record is valid",
        "1  some are not",
        "2  usage error, or an unreadable file",
    ),
    "preflight": (
        "0  the check passed",
        "1  it found a problem (--show: the saved result did not pass)",
        "2  usage error, no such script, or the script never called preflight_from_env",
        "3  inconclusive: no problem found, but some parameter could not be judged (--script)",
    ),
}


class _ExitCodesFormatter(argparse.HelpFormatter):
    """Keeps an `exit codes:` epilog's lines as written; wraps everything else as argparse does."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("exit codes:"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _add_exit_codes(subparsers: argparse._SubParsersAction, prefix: str = "") -> None:
    for name, parser in subparsers.choices.items():
        command = f"{prefix}{name}"
        codes = EXIT_CODES.get(command)
        if codes is not None and "exit codes:" not in (parser.epilog or ""):
            lines = "\n".join(f"  {line}" for line in codes)
            parser.epilog = f"exit codes:\n{lines}" + (f"\n\n{parser.epilog}" if parser.epilog else "")
            base = parser.formatter_class
            if not issubclass(base, _ExitCodesFormatter):
                parser.formatter_class = type("ExitCodesFormatter", (_ExitCodesFormatter, base), {})
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                _add_exit_codes(action, f"{command} ")


def _missing_part(extra: str) -> object:
    """The handler of a command whose part cannot be imported without its extra: one line, exit 2."""

    def run(args: argparse.Namespace) -> int:
        print(f'maingrad: error: `maingrad {args.command}` needs the {extra} extra: pip install "maingrad[{extra}]"',
              file=sys.stderr)  # fmt: skip
        return 2

    return run


def build_parser() -> argparse.ArgumentParser:
    from maingrad.analyzer import __version__

    parser = argparse.ArgumentParser(
        prog="maingrad",
        description="Find, fix and report main_grad contract bugs in Megatron + Transformer Engine training code.",
    )
    parser.add_argument("--version", action="version", version=f"maingrad {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name, extra, commands in _PARTS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:
            if extra is None:
                raise
            # A part whose optional dependencies are missing: its commands say which extra to install.
            for command in commands:
                stub = subparsers.add_parser(
                    command, help=f'needs pip install "maingrad[{extra}]"', add_help=False
                )
                stub.add_argument("rest", nargs=argparse.REMAINDER)
                stub.set_defaults(handler=_missing_part(extra))
            continue
        register = getattr(module, "register", None)
        if register is not None:
            register(subparsers)
    _add_exit_codes(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `maingrad check | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 1
    except ModuleNotFoundError as exc:  # a light install: name the extra to install, in one line
        hint = install_hint(exc, args.command)
        if hint is None or os.environ.get("MAINGRAD_DEBUG"):
            raise
        print(f"maingrad: error: {hint}", file=sys.stderr)
        return 2
    except Exception as exc:  # no subcommand may end in a traceback: one line, exit 2
        if os.environ.get("MAINGRAD_DEBUG"):
            raise
        print(
            f"maingrad: error: internal error: {type(exc).__name__}: {exc} "
            "(please report it; MAINGRAD_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
