"""Source positions, computed only for files that have something to report.

One codegen pass of libcst's own PositionProvider (no scope analysis) gives every node's syntactic range;
it is run lazily, the first time a rule's violation needs a line number, so clean files never pay for it.
"""

from __future__ import annotations

import libcst as cst
from libcst.metadata import CodeRange, PositionProvider


class LazyPositions:
    def __init__(self, module: cst.Module) -> None:
        self._module = module
        self._ranges: dict[cst.CSTNode, CodeRange] | None = None

    def __getitem__(self, node: cst.CSTNode) -> CodeRange:
        if self._ranges is None:
            provider = PositionProvider()
            provider._gen_impl(self._module)  # the provider's own pass, without a MetadataWrapper copy
            self._ranges = provider._computed
        return self._ranges[node]
