"""Fast read-only traversal of libcst trees.

`node.visit(visitor)` rebuilds every node it passes through (libcst's `_visit_and_replace_children`
constructs a new dataclass per node even for read-only visitors), which costs about as much as parsing
(measured: one empty visitor pass over megatron-core's 27 `main_grad` files 2.8 s, the parse 4.1 s). Rules
only read the tree, so these helpers walk the dataclass fields directly, in the same order libcst visits
them (source order), without constructing anything.

`walk`, `find`, `find_own` and `index` also skip trivia: whitespace, newlines, comments,
blank lines and punctuation tokens (`lpar`/`rpar`, commas, dots, colons, `=`...), which are about two
thirds of all nodes and never what a rule looks for. `children` and `visit` keep every node, exactly as
libcst's `node.children` and `node.visit(visitor)` do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import libcst as cst

_CHILD_FIELDS: dict[type, tuple[str, ...]] = {}
_SEMANTIC_FIELDS: dict[type, tuple[str, ...]] = {}

# Fields that only ever hold trivia (whitespace, comments, blank lines, punctuation tokens).
TRIVIA_FIELDS = frozenset(
    {
        "lpar",
        "rpar",
        "lbracket",
        "rbracket",
        "lbrace",
        "rbrace",
        "comma",
        "trailing_comma",
        "dot",
        "colon",
        "first_colon",
        "second_colon",
        "semicolon",
        "equal",
        "header",
        "footer",
        "leading_lines",
        "lines_after_decorators",
        "empty_lines",
        "first_line",
        "last_line",
        "trailing_whitespace",
        "newline",
        "comment",
        "posonly_ind",
    }
)


def _fields_of(kind: type) -> tuple[str, ...]:
    """The fields that may hold child nodes, in libcst's visiting order (the order in which
    `_visit_and_replace_children` names them, read from its code object)."""
    names = [f.name for f in dataclasses.fields(kind)]
    order: list[str] = []
    code = getattr(getattr(kind, "_visit_and_replace_children", None), "__code__", None)
    if code is not None:
        for const in code.co_consts:
            if isinstance(const, str) and const in names and const not in order:
                order.append(const)
    order += [name for name in names if name not in order]  # non-node fields: harmless, filtered at run time
    _CHILD_FIELDS[kind] = fields = tuple(order)
    _SEMANTIC_FIELDS[kind] = tuple(
        name for name in order if name not in TRIVIA_FIELDS and not name.startswith("whitespace")
    )
    return fields


def _semantic_fields(kind: type) -> tuple[str, ...]:
    if kind not in _SEMANTIC_FIELDS:
        _fields_of(kind)
    return _SEMANTIC_FIELDS[kind]


def children(node: cst.CSTNode) -> list[cst.CSTNode]:
    """Direct children in source order (same as `node.children`, without rebuilding the node)."""
    fields = _CHILD_FIELDS.get(type(node)) or _fields_of(type(node))
    out: list[cst.CSTNode] = []
    for name in fields:
        value = getattr(node, name)
        if isinstance(value, cst.CSTNode):
            out.append(value)
        elif type(value) is tuple or type(value) is list:
            out.extend(item for item in value if isinstance(item, cst.CSTNode))
    return out


# type -> is it a CSTNode subclass. `isinstance(x, cst.CSTNode)` goes through ABCMeta (CSTNode is an ABC),
# which costs more than the rest of the walk; a dict lookup on the exact type does not.
_IS_NODE: dict[type, bool] = {tuple: False, list: False, str: False, type(None): False}


def _is_node_type(kind: type) -> bool:
    flag = _IS_NODE.get(kind)
    if flag is None:
        flag = _IS_NODE[kind] = issubclass(kind, cst.CSTNode)
    return flag


def _semantic_kids(node: cst.CSTNode, fields: tuple[str, ...]) -> list[cst.CSTNode]:
    kids: list[cst.CSTNode] = []
    is_node = _IS_NODE.get
    for name in fields:
        value = getattr(node, name)
        kind = value.__class__
        if kind is tuple or kind is list:
            for item in value:
                flag = is_node(item.__class__)
                if flag or (flag is None and _is_node_type(item.__class__)):
                    kids.append(item)
        else:
            flag = is_node(kind)
            if flag or (flag is None and _is_node_type(kind)):
                kids.append(value)
    return kids


def walk(root: cst.CSTNode, prune: Callable[[cst.CSTNode], bool] | None = None) -> Iterator[cst.CSTNode]:
    """Every non-trivia node under `root` (included) in pre-order/source order. `prune(node)` true: do not
    descend below `node` (it is still yielded)."""
    stack = [root]
    get = _SEMANTIC_FIELDS.get
    while stack:
        node = stack.pop()
        yield node
        if prune is not None and node is not root and prune(node):
            continue
        fields = get(type(node))
        if fields is None:
            fields = _semantic_fields(type(node))
        kids = _semantic_kids(node, fields)
        kids.reverse()
        stack.extend(kids)


def find(root: cst.CSTNode, *kinds: type[cst.CSTNode]) -> list[cst.CSTNode]:
    """Nodes of `kinds` under `root` (included), in source order."""
    return [node for node in walk(root) if isinstance(node, kinds)]


SCOPES = (cst.FunctionDef, cst.ClassDef, cst.Lambda)  # what `find_own` does not descend into


def find_own(root: cst.CSTNode, *kinds: type[cst.CSTNode]) -> list[cst.CSTNode]:
    """Like `find`, but not inside function/class/lambda definitions nested in `root` (the nested
    definition node itself is still returned when it is of `kinds`)."""
    return [node for node in walk(root, lambda n: isinstance(n, SCOPES)) if isinstance(node, kinds)]


def index(root: cst.CSTNode) -> tuple[list[cst.CSTNode], dict[int, cst.CSTNode]]:
    """One pass: every non-trivia node in pre-order, and each one's parent by `id(node)` (libcst nodes
    hash through a Python-level `__hash__`, which costs more than the dict itself; the tree keeps every
    node alive, so ids stay unique while the caller holds `root`)."""
    order: list[cst.CSTNode] = []
    parents: dict[int, cst.CSTNode] = {}
    stack = [root]
    get = _SEMANTIC_FIELDS.get
    while stack:
        node = stack.pop()
        order.append(node)
        fields = get(type(node))
        if fields is None:
            fields = _semantic_fields(type(node))
        kids = _semantic_kids(node, fields)
        for kid in kids:
            parents[id(kid)] = node
        kids.reverse()
        stack.extend(kids)
    return order, parents


def visit(root: cst.CSTNode, visitor: cst.CSTVisitor) -> cst.CSTVisitor:
    """Run a read-only `CSTVisitor`'s `visit_<Node>`/`leave_<Node>` methods (and `on_visit`/`on_leave`
    overrides) over `root` like `root.visit(visitor)` does, without rebuilding nodes. Attribute hooks
    (`visit_<Node>_<field>`) are not called."""
    own_on_visit = type(visitor).on_visit is not cst.CSTVisitor.on_visit
    own_on_leave = type(visitor).on_leave is not cst.CSTVisitor.on_leave
    visit_cache: dict[type, Callable[[cst.CSTNode], object] | None] = {}
    leave_cache: dict[type, Callable[[cst.CSTNode], object] | None] = {}

    def enter(node: cst.CSTNode) -> bool:
        if own_on_visit:
            return visitor.on_visit(node) is not False
        kind = type(node)
        if kind not in visit_cache:
            visit_cache[kind] = getattr(visitor, f"visit_{kind.__name__}", None)
        method = visit_cache[kind]
        return method is None or method(node) is not False

    def leave(node: cst.CSTNode) -> None:
        if own_on_leave:
            visitor.on_leave(node)
            return
        kind = type(node)
        if kind not in leave_cache:
            leave_cache[kind] = getattr(visitor, f"leave_{kind.__name__}", None)
        method = leave_cache[kind]
        if method is not None:
            method(node)

    # Iterative to survive deep trees: (node, children iterator or None before entering)
    stack: list[tuple[cst.CSTNode, Iterator[cst.CSTNode] | None]] = [(root, None)]
    while stack:
        node, kids = stack[-1]
        if kids is None:
            if not enter(node):
                stack.pop()
                leave(node)
                continue
            kids = iter(children(node))
            stack[-1] = (node, kids)
        child = next(kids, None)
        if child is None:
            stack.pop()
            leave(node)
        else:
            stack.append((child, None))
    return visitor
