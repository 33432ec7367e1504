"""Fixtures for the analyzer framework tests: test-local rules (independent of the real MG rules) and an
in-process `maingrad` runner."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import libcst as cst
import pytest

from maingrad.analyzer.catalog import register_rule, unregister_rule
from maingrad.analyzer.rules.base import Fix, Rule, Violation
from maingrad.cli.main import main
from maingrad.contracts.report import Severity

_DOCS = "## What it does\nTest rule.\n\n## Why is this bad?\nTest.\n\n## Example\n\n## Use instead\n"


class AttrRule(Rule):
    """MG901: every `X.main_grad` attribute; safe fix renames it to `X.main_grad_ok`."""

    id = "MG901"
    name = "test-main-grad-attribute"
    severity = Severity.ERROR
    summary = "test rule: flags X.main_grad"
    docs = _DOCS
    needles = ("main_grad",)
    fixable = True

    def check(self, ctx):  # type: ignore[no-untyped-def]
        for node in ctx.nodes(cst.Attribute):
            if node.attr.value == "main_grad":
                fix = Fix({node.attr: node.attr.with_changes(value="main_grad_ok")}, "rename")
                statement = ctx.enclosing(node, cst.SimpleStatementLine) or node
                yield Violation(node, f"`{ctx.code(node)}` is used", fix=fix, context_node=statement)


class CallRule(Rule):
    """MG902: calls of `bad_call()`; the fix (unsafe) renames them to `good_call()`."""

    id = "MG902"
    name = "test-bad-call"
    severity = Severity.WARNING
    summary = "test rule: flags bad_call()"
    docs = _DOCS
    needles = ("bad_call",)
    fixable = True

    def check(self, ctx):  # type: ignore[no-untyped-def]
        for node in ctx.nodes(cst.Call):
            if isinstance(node.func, cst.Name) and node.func.value == "bad_call":
                fix = Fix({node.func: node.func.with_changes(value="good_call")}, "rename", safe=False)
                yield Violation(node, "bad_call() is called", fix=fix)


class CrashRule(Rule):
    """MG903: raises on any file that contains `explode`."""

    id = "MG903"
    name = "test-crash"
    severity = Severity.ERROR
    summary = "test rule: crashes"
    docs = _DOCS
    needles = ("explode",)

    def check(self, ctx):  # type: ignore[no-untyped-def]
        raise RuntimeError("boom")
        yield  # pragma: no cover


class HelperRule(Rule):
    """MG904: calls of a configured `exposure-helpers` name (shows settings reach rules)."""

    id = "MG904"
    name = "test-helper-call"
    severity = Severity.INFO
    summary = "test rule: flags configured helper calls"
    docs = _DOCS
    needles = ("(",)

    def check(self, ctx):  # type: ignore[no-untyped-def]
        for node in ctx.nodes(cst.Call):
            if isinstance(node.func, cst.Name) and node.func.value in ctx.settings.exposure_helpers:
                yield Violation(node, f"helper {node.func.value}() called")


TEST_RULES = (AttrRule, CallRule, CrashRule, HelperRule)


@pytest.fixture
def test_rules() -> Iterator[None]:
    """Register the test rules (not autouse: other test modules must see only the real rules)."""
    for rule in TEST_RULES:
        register_rule(rule)
    yield
    for rule in TEST_RULES:
        unregister_rule(rule.id)


@dataclass
class Run:
    code: int
    out: str
    err: str

    def json(self) -> dict:
        return json.loads(self.out)


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str]) -> Callable[..., Run]:
    """`run("check", ".", ...)`: the CLI in this process (default: only the test rules selected)."""

    def _run(*args: str) -> Run:
        capsys.readouterr()
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return Run(code, captured.out, captured.err)

    return _run


def write(root: Path, files: dict[str, str]) -> None:
    for relpath, text in files.items():
        path = root / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Path]:
    """A project directory (the working directory) with a pyproject selecting the test rules."""

    def _project(files: dict[str, str], config: str = 'select = ["MG90"]\n') -> Path:
        root = tmp_path / "proj"
        root.mkdir(exist_ok=True)
        (root / "pyproject.toml").write_text(f"[tool.maingrad]\n{config}", encoding="utf-8")
        write(root, files)
        monkeypatch.chdir(root)
        return root

    return _project


@pytest.fixture
def write_tree() -> Callable[[Path, dict[str, str]], None]:
    return write
