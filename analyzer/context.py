"""What a rule sees of one file: source, CST, cheap name resolution, lazy parents and settings.

Everything here is computed lazily and at most once per file, and without libcst's visitor machinery
(see `maingrad.analyzer.walk`): rules that ask for `ctx.nodes(cst.Call)` or `ctx.parent(node)` share one
fast pass over the tree instead of each paying for a full `module.visit(...)`. For speed, rules should use
`ctx.nodes`, `ctx.parent`/`ancestors`, `walk.walk`/`walk.find`/`walk.children`, never `node.children`,
`node.visit(...)` or `libcst.matchers.findall` (each rebuilds every node it passes).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import libcst as cst

from maingrad.analyzer import walk
from maingrad.analyzer.names import NameResolver, package_of

NodeT = TypeVar("NodeT", bound=cst.CSTNode)


@dataclass(frozen=True)
class RuleSettings:
    """Config a rule may read (from `[tool.maingrad]`)."""

    # Extra function/method names whose call counts as exposing main_grad (config `exposure-helpers`).
    exposure_helpers: frozenset[str] = frozenset()
    # What the scan's files, taken together, establish (`maingrad.analyzer.project`); empty for one file.
    project: frozenset[str] = frozenset()


class _ParentCollector(cst.CSTVisitor):
    """Parent map through libcst's visitor (kept for reference and tests; `walk.parent_map` is used)."""

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
    # The index, keyed by id(node) (the module keeps every node alive): see `walk.index`.
    _parents: dict[int, cst.CSTNode] | None = field(default=None, repr=False)
    _preorder: list[cst.CSTNode] | None = field(default=None, repr=False)
    _by_type: dict[type, list[cst.CSTNode]] | None = field(default=None, repr=False)
    _order: dict[int, int] | None = field(default=None, repr=False)
    _own: dict[int, list[cst.CSTNode]] | None = field(default=None, repr=False)
    _kind_tables: dict[tuple[type, ...], dict[type, bool]] = field(default_factory=dict, repr=False)
    # Per-file results of the rules' pure helpers (keyed by helper and node id), shared by every rule: see
    # `rules._common.local_bindings`. Values are read-only for their callers.
    memo: dict[Hashable, Any] = field(default_factory=dict, repr=False)

    @property
    def names(self) -> NameResolver:
        if self._names is None:
            if self._by_type is not None:  # reuse the index: imports and assignments in source order
                self._names = NameResolver.from_nodes(
                    self.nodes(cst.Import, cst.ImportFrom, cst.Assign), package_of(self.path)
                )
            else:
                self._names = NameResolver.for_module(self.module, package_of(self.path))
        return self._names

    def _build_index(self) -> None:
        self._preorder, self._parents = walk.index(self.module)
        self._by_type = {}
        for node in self._preorder:
            self._by_type.setdefault(type(node), []).append(node)

    def parent(self, node: cst.CSTNode) -> cst.CSTNode | None:
        """The parent of a non-trivia node (trivia such as whitespace and commas are not indexed)."""
        if self._parents is None:
            self._build_index()
            assert self._parents is not None
        return self._parents.get(id(node))

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

    # Fast whole-file queries (one shared pass) -----------------------------------------------------------
    def nodes(self, *kinds: type[NodeT]) -> list[NodeT]:
        """Every node of `kinds` in the file, in source order: use instead of a `module.visit(...)` pass."""
        if self._by_type is None:
            self._build_index()
            assert self._by_type is not None
        if len(kinds) == 1 and kinds[0] in self._by_type:
            return list(self._by_type[kinds[0]])  # type: ignore[arg-type]  # indexed by exact type
        found: list[Any] = [n for kind, ns in self._by_type.items() if issubclass(kind, kinds) for n in ns]
        if len({type(n) for n in found}) > 1:
            found.sort(key=self.index)
        return found

    def index(self, node: cst.CSTNode) -> int:
        """Position of `node` in a pre-order walk: a total source order (`a` starts before `b` iff
        `ctx.index(a) < ctx.index(b)`, with ancestors before descendants)."""
        if self._order is None:
            if self._preorder is None:
                self._build_index()
            assert self._preorder is not None
            self._order = {id(node): i for i, node in enumerate(self._preorder)}
        return self._order[id(node)]

    def own_nodes(self, root: cst.CSTNode, *kinds: type[NodeT]) -> list[NodeT]:
        """`walk.find_own(root, *kinds)`: nodes of `kinds` in `root` (included), not inside the functions,
        classes and lambdas nested in it (those nodes themselves included), in source order.

        When `root` is the module or a def, class or lambda of it, the answer comes from one shared pass
        that files every node under its innermost enclosing scope, so rules that ask per function (local
        bindings, guards before a statement) do not walk each function again; any other root is walked."""
        if self._own is None:
            self._build_own()
            assert self._own is not None
        own = self._own.get(id(root))
        if own is None:
            return walk.find_own(root, *kinds)  # type: ignore[return-value]  # only nodes of `kinds`
        found: list[Any] = [root] if isinstance(root, kinds) else []
        wanted = self._kind_table(kinds)
        found += [node for node in own if wanted[type(node)]]
        return found

    def _kind_table(self, kinds: tuple[type, ...]) -> dict[type, bool]:
        """node type -> `issubclass(type, kinds)`, for every node type of the index: libcst's node classes
        are ABCs, whose instance checks cost several times a dict lookup."""
        table = self._kind_tables.get(kinds)
        if table is None:
            assert self._by_type is not None
            table = self._kind_tables[kinds] = {kind: issubclass(kind, kinds) for kind in self._by_type}
        return table

    def _build_own(self) -> None:
        """scope id -> the nodes whose innermost enclosing def/class/lambda (or the module) it is, in
        pre-order: exactly what `walk.find_own(scope)` yields after `scope` itself."""
        if self._preorder is None:
            self._build_index()
        assert self._preorder is not None and self._parents is not None
        parents = self._parents
        own: dict[int, list[cst.CSTNode]] = {id(self.module): []}
        bucket_of: dict[int, list[cst.CSTNode]] = {}  # node id -> its innermost scope's list
        is_scope = self._kind_table(walk.SCOPES)
        for node in self._preorder:
            key = id(node)
            parent = parents.get(key)
            if parent is None:
                continue  # the module
            bucket = own.get(id(parent))  # the parent is a scope itself
            if bucket is None:
                bucket = bucket_of[id(parent)]
            bucket_of[key] = bucket
            bucket.append(node)
            if is_scope[type(node)]:
                own[key] = []
        self._own = own

    def visit(self, visitor: cst.CSTVisitor, root: cst.CSTNode | None = None) -> cst.CSTVisitor:
        """Run a read-only CSTVisitor over the file (or `root`) without libcst's node rebuilding."""
        return walk.visit(root if root is not None else self.module, visitor)
