"""Source positions, computed only for files that have something to report.

libcst's PositionProvider tracks line and column for every token (a regex split per token and a
CodePosition object per node): about 7x the cost of plain code generation. This module runs the same
codegen pass with a state that only counts characters, records each node's (start, end) offsets the way
PositionProvider records its ranges (syntactic ranges where a node declares one, whitespace-inclusive
otherwise), and converts offsets to lines and columns only for the nodes that are asked for. Results are
identical to PositionProvider's (tests/analyzer/test_positions.py compares them on real files).
"""

from __future__ import annotations

import re
from bisect import bisect_right

import libcst as cst
from libcst._nodes.internal import CodegenState
from libcst.metadata import CodePosition, CodeRange

_NEWLINE = re.compile(r"\r\n?|\n")


class _OffsetState(CodegenState):
    """A CodegenState that records character offsets instead of lines and columns."""

    def __init__(self, default_indent: str, default_newline: str) -> None:
        super().__init__(default_indent=default_indent, default_newline=default_newline)
        self.offset = 0
        self.popped = ""
        self.ranges: dict[cst.CSTNode, tuple[int, int]] = {}
        self.spans: dict[cst.CSTNode, tuple[int, int]] = {}  # whitespace-inclusive: all the node's text
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
        self.spans[node] = (start, self.offset)
        if node not in self.ranges:  # a syntactic range recorded inside wins
            self.ranges[node] = (start, self.offset)

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
        start = ranges[self.start_node][0] if self.start_node is not None else self.start
        end = ranges[self.end_node][1] if self.end_node is not None else self.state.offset
        ranges[self.node] = (start, end)


class LazyPositions:
    """`positions[node]` -> CodeRange (1-based lines, 0-based columns), like libcst's PositionProvider."""

    def __init__(self, module: cst.Module) -> None:
        self._module = module
        self._ranges: dict[cst.CSTNode, tuple[int, int]] | None = None
        self._spans: dict[cst.CSTNode, tuple[int, int]] = {}
        self._line_starts: list[int] = []

    def _compute(self) -> dict[cst.CSTNode, tuple[int, int]]:
        state = _OffsetState(self._module.default_indent, self._module.default_newline)
        self._module._codegen(state)
        code = "".join(state.tokens) + state.popped
        self._line_starts = [0, *(m.end() for m in _NEWLINE.finditer(code))]
        self._ranges = state.ranges
        self._spans = state.spans
        return state.ranges

    def _position(self, offset: int) -> CodePosition:
        index = bisect_right(self._line_starts, offset) - 1
        return CodePosition(index + 1, offset - self._line_starts[index])

    def __getitem__(self, node: cst.CSTNode) -> CodeRange:
        ranges = self._ranges if self._ranges is not None else self._compute()
        start, end = ranges[node]
        return CodeRange(self._position(start), self._position(end))

    def span(self, node: cst.CSTNode) -> tuple[int, int]:
        """Character offsets [start, end) of all the text `node` generates (whitespace it owns included):
        exactly what replacing the node can change."""
        if self._ranges is None:
            self._compute()
        return self._spans[node]
