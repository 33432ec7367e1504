"""Runs every rule's VALID/INVALID examples: the examples are the rules' executable specification."""

from __future__ import annotations

import textwrap
from itertools import pairwise

import libcst as cst
import pytest

from maingrad.analyzer.context import RuleSettings
from maingrad.analyzer.engine import analyze_source, fix_source
from maingrad.analyzer.rules import all_rules
from maingrad.analyzer.rules.base import Example, Rule


def _cases(kind: str) -> list[pytest.param]:
    params = []
    for rule in all_rules():
        for index, example in enumerate(getattr(rule, kind)):
            params.append(pytest.param(rule, example, id=f"{rule.id}-{kind.lower()}-{index}"))
    return params


def _settings(example: Example) -> RuleSettings:
    helpers = example.config.get("exposure-helpers", ())
    return RuleSettings(exposure_helpers=frozenset(helpers))  # type: ignore[arg-type]


def _run(rule: type[Rule], example: Example):
    source = textwrap.dedent(example.code)
    return source, analyze_source(source, "example.py", [rule()], _settings(example))


def test_every_rule_has_examples_and_docs() -> None:
    rules = all_rules()
    assert len(rules) >= 5
    for rule in rules:
        assert rule.VALID and rule.INVALID, rule.id
        for section in ("What it does", "Why is this bad?", "Example", "Use instead"):
            assert section in rule.docs, (rule.id, section)


@pytest.mark.parametrize(("rule", "example"), _cases("VALID"))
def test_valid_examples_are_clean(rule: type[Rule], example: Example) -> None:
    _, result = _run(rule, example)
    assert result.parse_error is None
    assert [f for f in result.findings if f.rule == rule.id] == []


@pytest.mark.parametrize(("rule", "example"), _cases("INVALID"))
def test_invalid_examples_are_flagged_at_their_line(rule: type[Rule], example: Example) -> None:
    _, result = _run(rule, example)
    assert result.parse_error is None
    ours = [f for f in result.findings if f.rule == rule.id]
    assert ours, f"{rule.id} did not flag:\n{example.code}"
    if example.line is not None:
        assert ours[0].line == example.line


@pytest.mark.parametrize(("rule", "example"), [p for p in _cases("INVALID") if p.values[1].fixed is not None])
def test_fixes_are_exact_idempotent_and_clean(rule: type[Rule], example: Example) -> None:
    source = textwrap.dedent(example.code)
    fixed = fix_source(source, "example.py", [rule()], _settings(example), unsafe=True)
    assert fixed == textwrap.dedent(example.fixed or "")
    cst.parse_module(fixed)
    assert fix_source(fixed, "example.py", [rule()], _settings(example), unsafe=True) == fixed
    after = analyze_source(fixed, "example.py", [rule()], _settings(example))
    assert [f for f in after.findings if f.rule == rule.id] == []


def _fix_cases() -> list[pytest.param]:
    return [p for p in _cases("INVALID") if p.values[0].fixable or p.values[1].fixed is not None]


@pytest.mark.parametrize(("rule", "example"), _fix_cases())
def test_each_fix_changes_only_its_replaced_nodes(rule: type[Rule], example: Example) -> None:
    """Every fix a rule offers on its INVALID examples, applied alone: the bytes outside the replaced nodes'
    text are unchanged (the libcst round trip keeps everything else), and the result parses."""
    from maingrad.analyzer.context import FileContext
    from maingrad.analyzer.fixes import apply_fixes
    from maingrad.analyzer.positions import LazyPositions

    source = textwrap.dedent(example.code)
    module = cst.parse_module(source)
    ctx = FileContext("example.py", source, module, _settings(example))
    fixes = [v.fix for v in rule().check(ctx) if v.fix is not None]
    positions = LazyPositions(module)
    for fix in fixes:
        fixed = apply_fixes(module, [fix]).code
        cst.parse_module(fixed)
        spans = sorted(positions.span(node) for node in fix.replacements)
        kept = [source[: spans[0][0]]]
        kept += [source[end:start] for (_, end), (start, _) in pairwise(spans) if start > end]
        kept.append(source[spans[-1][1] :])
        assert fixed.startswith(kept[0]) and fixed.endswith(kept[-1]), fix.description
        cursor = len(kept[0])
        for segment in kept[1:-1]:
            found = fixed.find(segment, cursor)
            assert found >= 0, (fix.description, segment)
            cursor = found + len(segment)
