"""Source positions, computed only for files that have something to report.

libcst's PositionProvider tracks line and column for every token (a regex split per token and a
CodePosition object per node): about 7x the cost of plain code generation. This module runs the same
codegen pass with a state that only counts characters, records each node's (start, end) offsets the way
PositionProvider records its ranges (syntactic ranges where a node declares one, whitespace-inclusive
otherwise), and converts offsets to lines and columns only for the nodes that are asked for. Results are
identical to PositionProvider's (tests/analyzer/test_positions.py compares them on real files).

Offsets are kept by `id(node)`: libcst nodes hash through a Python-level `__hash__`, which cost more than
the dict operations themselves (the module keeps every node alive, so ids stay unique).
"""

from __future__ import annotations

import ast
import re
from bisect import bisect_right
from collections.abc import Callable

import libcst as cst
from libcst._nodes.internal import CodegenState
from libcst.metadata import CodePosition, CodeRange

_NEWLINE = re.compile(r"\r\n?|\n")


class _OffsetState(CodegenState):
    """A CodegenState that records character offsets instead of lines and columns, into the given dicts
    (new ones by default)."""

    def __init__(
        self,
        default_indent: str,
        default_newline: str,
        ranges: dict[int, tuple[int, int]] | None = None,
        spans: dict[int, tuple[int, int]] | None = None,
    ) -> None:
        super().__init__(default_indent=default_indent, default_newline=default_newline)
        self.offset = 0
        self.popped = ""
        self.ranges: dict[int, tuple[int, int]] = {} if ranges is None else ranges  # by id(node)
        # whitespace-inclusive: all the node's text
        self.spans: dict[int, tuple[int, int]] = {} if spans is None else spans
        self._stack: list[int] = []

    def add_indent_tokens(self) -> None:
        self.tokens.extend(self.indent_tokens)
        for token in self.indent_tokens:
            self.offset += len(token)

    def add_token(self, value: str) -> None:
        self.tokens.append(value)
        self.offset += len(value)

    def pop_trailing_newline(self) -> None:
        # Like PositionProvider, keep counting the popped newline (only the Module's end sees it).
        if self.tokens:
            self.popped = self.tokens.pop()

    def before_codegen(self, node: cst.CSTNode) -> None:
        self._stack.append(self.offset)

    def after_codegen(self, node: cst.CSTNode) -> None:
        start = self._stack.pop()
        key = id(node)
        self.spans[key] = (start, self.offset)
        if key not in self.ranges:  # a syntactic range recorded inside wins
            self.ranges[key] = (start, self.offset)

    def record_syntactic_position(  # type: ignore[override]
        self,
        node: cst.CSTNode,
        *,
        start_node: cst.CSTNode | None = None,
        end_node: cst.CSTNode | None = None,
    ) -> _Recorder:
        return _Recorder(self, node, start_node, end_node)


class _Recorder:
    """The context manager of `record_syntactic_position` (a plain class: a generator-based
    @contextmanager per node costs more than the rest of the bookkeeping together)."""

    __slots__ = ("state", "node", "start_node", "end_node", "start")

    def __init__(
        self,
        state: _OffsetState,
        node: cst.CSTNode,
        start_node: cst.CSTNode | None,
        end_node: cst.CSTNode | None,
    ) -> None:
        self.state = state
        self.node = node
        self.start_node = start_node
        self.end_node = end_node
        self.start = 0

    def __enter__(self) -> None:
        self.start = self.state.offset

    def __exit__(self, *exc: object) -> None:
        ranges = self.state.ranges
        start = ranges[id(self.start_node)][0] if self.start_node is not None else self.start
        end = ranges[id(self.end_node)][1] if self.end_node is not None else self.state.offset
        ranges[id(self.node)] = (start, end)


class LazyPositions:
    """`positions[node]` -> CodeRange (1-based lines, 0-based columns), like libcst's PositionProvider.

    Given the source and a way to find a node's top-level statement, only the top-level statements that
    hold asked-for nodes are generated: each one's start offset comes from Python's own (C) parser, via
    `ast` line numbers of top-level statements, and is verified by comparing the generated text with the
    source at that offset. Anything that does not verify falls back to one full pass over the module.
    """

    def __init__(
        self,
        module: cst.Module,
        source: str | None = None,
        top_level: Callable[[cst.CSTNode], cst.CSTNode | None] | None = None,
        tree: ast.Module | None = None,
    ) -> None:
        self._module = module
        self._tree = tree  # the stdlib tree of `source`, when the caller already has one
        self._source = source
        self._top_level = top_level
        self._ranges: dict[int, tuple[int, int]] = {}  # by id(node)
        self._spans: dict[int, tuple[int, int]] = {}
        self._line_starts: list[int] | None = None
        self._full = False
        self._starts: dict[cst.CSTNode, int] | None = None
        self._generated: set[cst.CSTNode] = set()

    def _compute(self) -> None:
        """One codegen pass over the whole module."""
        state = _OffsetState(self._module.default_indent, self._module.default_newline)
        self._module._codegen(state)
        code = "".join(state.tokens) + state.popped
        self._line_starts = [0, *(m.end() for m in _NEWLINE.finditer(code))]
        self._ranges = state.ranges
        self._spans = state.spans
        self._full = True

    def _statement_starts(self) -> dict[cst.CSTNode, int]:
        """Source offset where each top-level statement's text (its leading blank and comment lines
        included) begins, from `ast` line numbers; empty when `ast` cannot parse the source."""
        if self._starts is not None:
            return self._starts
        self._starts = {}
        assert self._source is not None
        tree = self._tree
        if tree is None:
            try:
                tree = ast.parse(self._source)
            except (SyntaxError, ValueError, RecursionError, MemoryError):
                return self._starts
        if self._line_starts is None:
            self._line_starts = [0, *(m.end() for m in _NEWLINE.finditer(self._source))]
        body, index = tree.body, 0
        for statement in self._module.body:
            if index >= len(body):
                return self._starts
            first = body[index]
            if isinstance(statement, cst.SimpleStatementLine):
                index += len(statement.body)
            else:
                index += 1
            line = first.lineno
            blank = len(statement.leading_lines)
            decorators = getattr(statement, "decorators", ())
            decorator_list = getattr(first, "decorator_list", None)
            if decorators and decorator_list:
                line = decorator_list[0].lineno  # the first `@` line
                blank += len(decorators[0].leading_lines)
            if 1 <= line - blank <= len(self._line_starts):
                self._starts[statement] = self._line_starts[line - blank - 1]
        return self._starts

    def _generate_statement(self, statement: cst.CSTNode) -> bool:
        """Generate one top-level statement, recording straight into the shared offsets (copying each
        statement's into them cost a fifth of the generation). False when its text is not at the
        ast-derived start: the offsets then hold garbage, and the caller must replace them all."""
        start = self._statement_starts().get(statement)
        if start is None:
            return False
        state = _OffsetState(
            self._module.default_indent, self._module.default_newline, self._ranges, self._spans
        )
        state.offset = start
        statement._codegen(state)
        code = "".join(state.tokens)
        assert self._source is not None
        if self._source[start : start + len(code)] != code:
            return False  # the ast-derived start was wrong: never guess
        self._generated.add(statement)
        return True

    def _ensure(self, node: cst.CSTNode) -> None:
        if id(node) in self._ranges or self._full:
            return
        if self._source is not None and self._top_level is not None:
            statement = self._top_level(node)
            if (
                statement is not None
                and statement not in self._generated
                and self._generate_statement(statement)
                and id(node) in self._ranges
            ):
                return
        self._compute()  # replaces every offset recorded so far

    def _position(self, offset: int) -> CodePosition:
        assert self._line_starts is not None
        index = bisect_right(self._line_starts, offset) - 1
        return CodePosition(index + 1, offset - self._line_starts[index])

    def __getitem__(self, node: cst.CSTNode) -> CodeRange:
        self._ensure(node)
        start, end = self._ranges[id(node)]
        return CodeRange(self._position(start), self._position(end))

    def span(self, node: cst.CSTNode) -> tuple[int, int]:
        """Character offsets [start, end) of all the text `node` generates (whitespace it owns included):
        exactly what replacing the node can change."""
        self._ensure(node)
        return self._spans[id(node)]
