"""Applying rule fixes: bytes outside the replaced nodes never change, and the cost follows the fixes.

A whole-module libcst transform visits (and rebuilds the spine of) every node, and generating the module's
code again costs as much as parsing it; doing that once per fixed file made `maingrad fix` several times
slower than `check` on files with many fixes. Instead, each replaced node's new code is generated on its
own (with the indentation of the blocks around it) and spliced into the source at the node's span
(`LazyPositions.span`, which generates only the top-level statements asked for and verifies each against
the source), after checking that the old node generates exactly the text at that span. That is
byte-identical to transforming the whole module, which `apply_fixes` still does as the fallback whenever a
span does not verify.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import libcst as cst
from libcst._nodes.internal import CodegenState

from maingrad.analyzer.rules.base import Fix

Replacement = cst.CSTNode | cst.RemovalSentinel | cst.FlattenSentinel


class _Replacer(cst.CSTTransformer):
    def __init__(self, replacements: dict[cst.CSTNode, object]) -> None:
        super().__init__()
        self.replacements = replacements

    def on_leave(self, original_node: cst.CSTNode, updated_node: cst.CSTNode):  # pyright: ignore[reportIncompatibleMethodOverride]
        return self.replacements.get(original_node, updated_node)


def merge(fixes: Iterable[Fix]) -> tuple[dict[cst.CSTNode, object], bool]:
    """Every fix's replacements in one map (a node replaced by two fixes keeps the first); the flag says
    whether a fix lost a replacement that way (then another round must look again)."""
    replacements: dict[cst.CSTNode, object] = {}
    conflict = False
    for fix in fixes:
        for old, new in fix.replacements.items():
            if old in replacements and replacements[old] is not new:
                conflict = True
                continue
            replacements[old] = new
    return replacements, conflict


def apply_fixes(module: cst.Module, fixes: Iterable[Fix]) -> cst.Module:
    """Apply non-overlapping fixes in one whole-module pass (a node replaced by two fixes keeps the first)."""
    replacements, _ = merge(fixes)
    if not replacements:
        return module
    return module.visit(_Replacer(replacements))


@dataclass(frozen=True)
class Edit:
    """Replace `source[start:end]` (which must equal `old`) by `new`."""

    start: int
    end: int
    old: str
    new: str


def node_code(module: cst.Module, node: Replacement, indents: Sequence[str]) -> str:
    """The text `node` generates in `module` inside blocks indented by `indents` (outermost first), i.e.
    exactly what a whole-module code generation writes for it there (nothing when removed)."""
    if isinstance(node, cst.RemovalSentinel):
        return ""
    nodes = node.nodes if isinstance(node, cst.FlattenSentinel) else (node,)
    state = CodegenState(default_indent=module.default_indent, default_newline=module.default_newline)
    state.indent_tokens = list(indents)
    for item in nodes:
        item._codegen(state)
    return "".join(state.tokens)


def splice(source: str, edits: list[Edit]) -> str | None:
    """`source` with non-overlapping edits applied in one pass; None when they overlap or an edit's `old`
    text is not where it says (the caller then falls back to the whole-module transform)."""
    if not edits:
        return source
    edits = sorted(edits, key=lambda e: e.start)
    parts: list[str] = []
    position = 0
    for edit in edits:
        if edit.start < position or source[edit.start : edit.end] != edit.old:
            return None
        parts.append(source[position : edit.start])
        parts.append(edit.new)
        position = edit.end
    parts.append(source[position:])
    return "".join(parts)
