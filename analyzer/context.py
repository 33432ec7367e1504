"""What a rule sees of one file: source, CST, cheap name resolution, lazy parents and settings."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import libcst as cst

from maingrad.analyzer.names import NameResolver, package_of


@dataclass(frozen=True)
class RuleSettings:
    """Config a rule may read (from `[tool.maingrad]`)."""

    # Extra function/method names whose call counts as exposing main_grad (config `exposure-helpers`).
    exposure_helpers: frozenset[str] = frozenset()


class _ParentCollector(cst.CSTVisitor):
    def __init__(self) -> None:
        super().__init__()
        self.parents: dict[cst.CSTNode, cst.CSTNode] = {}
        self._stack: list[cst.CSTNode] = []

    def on_visit(self, node: cst.CSTNode) -> bool:
        if self._stack:
            self.parents[node] = self._stack[-1]
        self._stack.append(node)
        return True

    def on_leave(self, original_node: cst.CSTNode) -> None:
        self._stack.pop()


@dataclass
class FileContext:
    path: str  # relative to the scan root, POSIX style
    source: str
    module: cst.Module
    settings: RuleSettings = field(default_factory=RuleSettings)
    _names: NameResolver | None = field(default=None, repr=False)
    _parents: dict[cst.CSTNode, cst.CSTNode] | None = field(default=None, repr=False)

    @property
    def names(self) -> NameResolver:
        if self._names is None:
            self._names = NameResolver.for_module(self.module, package_of(self.path))
        return self._names

    def parent(self, node: cst.CSTNode) -> cst.CSTNode | None:
        if self._parents is None:
            collector = _ParentCollector()
            self.module.visit(collector)
            self._parents = collector.parents
        return self._parents.get(node)

    def ancestors(self, node: cst.CSTNode) -> Iterator[cst.CSTNode]:
        current = self.parent(node)
        while current is not None:
            yield current
            current = self.parent(current)

    def enclosing(self, node: cst.CSTNode, kind: type[cst.CSTNode]) -> cst.CSTNode | None:
        for ancestor in self.ancestors(node):
            if isinstance(ancestor, kind):
                return ancestor
        return None

    def code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node)
