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

# (module, human name of the extra that provides it). Modules expose `register(subparsers) -> None`.
_PARTS: tuple[tuple[str, str | None], ...] = (
    ("maingrad.analyzer.cli", None),
    ("maingrad.hooks.cli", "runtime"),
    ("maingrad.hooks.preflight.cli", "runtime"),
    ("maingrad.service.cli", "service"),
)


def build_parser() -> argparse.ArgumentParser:
    from maingrad.analyzer import __version__

    parser = argparse.ArgumentParser(
        prog="maingrad",
        description="Find, fix and report main_grad contract bugs in Megatron + Transformer Engine training code.",
    )
    parser.add_argument("--version", action="version", version=f"maingrad {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name, _extra in _PARTS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:
            # A part whose optional dependencies are missing (see its extra) registers nothing; its commands
            # then fail with argparse's "invalid choice", which names the valid ones.
            continue
        register = getattr(module, "register", None)
        if register is not None:
            register(subparsers)
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
