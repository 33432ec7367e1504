"""The pre-commit hook definitions at the repository root run real `maingrad` commands."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from maingrad.cli.main import build_parser

HOOKS = Path(__file__).resolve().parents[2] / ".pre-commit-hooks.yaml"


def test_hooks_are_valid_commands() -> None:
    hooks = yaml.safe_load(HOOKS.read_text())
    assert [h["id"] for h in hooks] == ["maingrad", "maingrad-fix"]
    parser = build_parser()
    for hook in hooks:
        assert hook["language"] == "python" and "python" in hook["types_or"]
        program, *args = shlex.split(hook["entry"])
        assert program == "maingrad"
        parsed = parser.parse_args([*args, "changed_file.py"])  # pre-commit appends the staged files
        assert parsed.handler is not None and parsed.force_exclude
