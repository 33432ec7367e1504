"""The fast tree walk and offset-based positions agree exactly with libcst's own visitor order and
PositionProvider (they replace them for speed, so any divergence would move findings)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import typing

import libcst as cst
import pytest
from libcst.metadata import PositionProvider

from maingrad.analyzer import walk
from maingrad.analyzer.context import FileContext, _ParentCollector
from maingrad.analyzer.positions import LazyPositions

SYNTHETIC = (
    "import os\r\n"
    "@decorator(1)\r\n"
    "async def f(a, /, b: int = 2, *args, c, **kw) -> None:\r\n"
    "\tasync with x as (y, z):\r\n"
    "\t\tawait g(f'{a!r:>{b}}', *args, **kw)  # comment\r\n"
    "\tmatch a:\r\n"
    "\t\tcase [1, *rest] if (n := len(rest)) > 2:\r\n"
    "\t\t\treturn {k: v for k, v in kw.items()}\r\n"
    "\t\tcase {'k': _, **others}:\r\n"
    "\t\t\tpass\r\n"
    "x = lambda q=1: q[1:2, ::3] if q else -q ** 2\r\n"
    "class C(Base, metaclass=M):\r\n"
    "    '''doc'''\r\n"
    "    y: list[int] = []; z = 1 \\\r\n"
    "        + 2\r\n"
    "try:\n    pass\nexcept* (A, B) as e:\n    raise X from e\nfinally:\n    del a, b"
)
SOURCES = [SYNTHETIC, *(inspect.getsource(m) for m in (argparse, ast, dataclasses, typing))]


class _Order(cst.CSTVisitor):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[cst.CSTNode] = []

    def on_visit(self, node: cst.CSTNode) -> bool:
        self.seen.append(node)
        return True


@pytest.mark.parametrize("source", SOURCES, ids=["synthetic", "argparse", "ast", "dataclasses", "typing"])
def test_walk_matches_libcst(source: str) -> None:
    module = cst.parse_module(source)
    order = _Order()
    module.visit(order)
    full = order.seen
    semantic = list(walk.walk(module))
    # the trivia-free walk is libcst's pre-order minus trivia subtrees, in the same order
    positions = {id(n): i for i, n in enumerate(full)}
    assert [positions[id(n)] for n in semantic] == sorted(positions[id(n)] for n in semantic)
    dropped = {type(n).__name__ for n in full} - {type(n).__name__ for n in semantic}
    assert dropped <= {
        "SimpleWhitespace", "ParenthesizedWhitespace", "TrailingWhitespace", "Newline", "EmptyLine", "Comment",
        "Comma", "Dot", "Colon", "Semicolon", "AssignEqual", "LeftParen", "RightParen", "LeftSquareBracket",
        "RightSquareBracket", "LeftCurlyBrace", "RightCurlyBrace", "ParamSlash",
    }  # fmt: skip
    for node in full[:500]:
        assert walk.children(node) == list(node.children)
    # parents agree with libcst's visitor for every indexed node
    collector = _ParentCollector()
    module.visit(collector)
    ctx = FileContext("x.py", source, module)
    for node in semantic[1:]:
        assert ctx.parent(node) is collector.parents[node]
    # a read-only visitor sees the same nodes through walk.visit
    fast = _Order()
    walk.visit(module, fast)
    assert fast.seen == full


@pytest.mark.parametrize("source", SOURCES, ids=["synthetic", "argparse", "ast", "dataclasses", "typing"])
def test_positions_match_position_provider(source: str) -> None:
    module = cst.parse_module(source)
    provider = PositionProvider()
    provider._gen_impl(module)
    lazy = LazyPositions(module)
    for node, expected in provider._computed.items():
        assert lazy[node] == expected, type(node).__name__


def test_ctx_nodes_and_index_are_in_source_order() -> None:
    module = cst.parse_module(SYNTHETIC)
    ctx = FileContext("x.py", SYNTHETIC, module)
    mixed = ctx.nodes(cst.Call, cst.Name)
    assert [ctx.index(n) for n in mixed] == sorted(ctx.index(n) for n in mixed)
    assert ctx.nodes(cst.Call) == walk.find(module, cst.Call)
    assert ctx.names.resolve_dotted("os.path") == "os.path"
