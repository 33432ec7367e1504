"""Applying rule fixes with a libcst round trip: bytes outside the replaced nodes never change."""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from maingrad.analyzer.rules.base import Fix


class _Replacer(cst.CSTTransformer):
    def __init__(self, replacements: dict[cst.CSTNode, object]) -> None:
        super().__init__()
        self.replacements = replacements

    def on_leave(self, original_node: cst.CSTNode, updated_node: cst.CSTNode):  # pyright: ignore[reportIncompatibleMethodOverride]
        return self.replacements.get(original_node, updated_node)


def apply_fixes(module: cst.Module, fixes: Iterable[Fix]) -> cst.Module:
    """Apply non-overlapping fixes in one pass (a node replaced by two fixes keeps the first)."""
    replacements: dict[cst.CSTNode, object] = {}
    for fix in fixes:
        for old, new in fix.replacements.items():
            replacements.setdefault(old, new)
    if not replacements:
        return module
    return module.visit(_Replacer(replacements))
