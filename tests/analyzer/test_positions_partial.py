"""Positions computed per top-level statement (ast-anchored, verified) equal libcst's PositionProvider, in
any query order, and fall back to a full pass when the anchor cannot be trusted."""

from __future__ import annotations

import argparse
import inspect
import random
import typing

import libcst as cst
import pytest
from libcst.metadata import PositionProvider

from maingrad.analyzer.context import FileContext
from maingrad.analyzer.engine import _positions

CASES = {
    "argparse": inspect.getsource(argparse),
    "typing": inspect.getsource(typing),
    "decorated": "# lead\n\n@a\n# between\n@b(1)\nclass C:\n    x = 1\n\n\n# c\nasync def f():\n    pass\nx = 1; y = 2\n",
    "crlf_no_final_newline": "if a:\r\n    b = 1\r\n\r\n(c)\r\nd = [\r\n  1,\r\n]",
    "paren_expr_first": "(\n    a\n)\nb = 1\n",
    "lone_cr": "a = 1\rb = 2\r",
    "newer_syntax": "type X = int\ndef f[T](x: T) -> T:\n    return x\n",
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_partial_positions_equal_position_provider(name: str) -> None:
    source = CASES[name]
    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError:
        pytest.fail("libcst should parse every case")
    provider = PositionProvider()
    provider._gen_impl(module)
    ctx = FileContext("x.py", source, module)
    nodes = [n for n in ctx.nodes(cst.CSTNode) if n in provider._computed]
    random.Random(0).shuffle(nodes)
    positions = _positions(ctx)
    for node in nodes[:400]:
        assert positions[node] == provider._computed[node], type(node).__name__
    assert positions[module] == provider._computed[module]


def test_only_the_needed_statement_is_generated() -> None:
    source = CASES["argparse"]
    module = cst.parse_module(source)
    ctx = FileContext("x.py", source, module)
    positions = _positions(ctx)
    target = ctx.nodes(cst.ClassDef)[-1]
    assert (
        positions[target].start.line == source[: source.index(f"class {target.name.value}")].count("\n") + 1
    )
    assert not positions._full and positions._generated == {target}
