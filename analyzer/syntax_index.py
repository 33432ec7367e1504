"""The syntax gate: a second pre-filter between the text needles and the libcst parse.

`libcst.parse_module` is most of a cold scan, yet most files that pass the text needles (`main_grad` occurs
in a comment, a docstring, an unrelated attribute) cannot hold a finding. This module builds, from ONE stdlib
`ast.parse` and ONE walk per file (several times cheaper than the libcst parse), a `SyntaxIndex`: the few
syntactic facts the rules' gates ask about (calls that take `X.main_grad`, main_grad values in boolean
contexts, `get_main_grad()` calls, writes into main_grad-like buffers, `overwrite_main_grad` assignments,
container calls, imports, function and class spans), plus the tree itself so that a gate can look closer
at its few candidates (`parents`, `segment` and the `ast` mirrors of `rules._common` below).

Each rule may override `Rule.gate(index, settings)`: a *sound over-approximation* of its `check()`: it must
pass every file on which the rule could report, and may pass many more. The engine parses a file with
libcst only when some active rule passes its gate; a rule without a gate always passes. When `ast.parse`
fails for any reason (syntax it does not accept, NUL bytes, recursion or memory limits), there is no index
and every rule passes, so the file is parsed and its parse error reported exactly as without the gate
(libcst also reads a few things `ast` rejects, e.g. `(p).x: int = 1`; those files are simply not gated).
The converse, a file `ast` reads and libcst rejects that no gate passes, is treated like a file no needle
matches: not parsed, so no parse error (none exists in the real test beds).

Setting the environment variable `MAINGRAD_NO_GATE=1` (or passing `gate=False` to
`engine.analyze_source`/`engine.fix_source`) turns the gate off: tests compare both modes. This module does
not import libcst: it runs before libcst is needed.
"""

from __future__ import annotations

import ast
import io
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from maingrad.analyzer import gcpause
from maingrad.analyzer.facts import (
    BOOL_PREFIX,
    CAST_METHODS,
    CONTAINER_NAMES,
    GET_MAIN_GRAD,
    KERNELS,
    MAIN_GRAD,
    OVERWRITE_FLAG,
    VIEW_METHODS,
    is_main_grad_name,
)

NO_GATE_ENV = "MAINGRAD_NO_GATE"

# The vocabulary the walk records is `maingrad.analyzer.facts`, the rules' own: a gate and its rule cannot
# disagree on what a kernel, a view or a container is.
_MAX_DEPTH = 60  # deeper spines are "may be anything" (sound), never a RecursionError
# A dotted chain written without spaces, parentheses or comments: its text is exactly libcst's `code_of`.
_CHAIN = r"[A-Za-z_][A-Za-z_0-9]*(?:\.[A-Za-z_][A-Za-z_0-9]*)*"
TRY_NODES: tuple[type, ...] = tuple(t for t in (ast.Try, getattr(ast, "TryStar", None)) if t is not None)
FUNCTION_NODES = (ast.FunctionDef, ast.AsyncFunctionDef)
SCOPE_NODES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


def gate_enabled(gate: bool | None = None) -> bool:
    """An explicit `gate` wins; otherwise on unless `MAINGRAD_NO_GATE` is set to something but `0`/empty."""
    if gate is not None:
        return gate
    return os.environ.get(NO_GATE_ENV, "").strip() in ("", "0")


@dataclass(frozen=True)
class Spine:
    """What MG007's `MainGradScope.is_main_grad` can look at in an expression: it follows only subscripts,
    view-method receivers (`x.view(...)`), ternary branches, list/tuple elements and comprehension
    elements, and decides on what it reaches there. `wild` marks a spine too deep to follow (then it may be
    anything)."""

    attr: bool = False  # reaches an `X.main_grad` attribute
    calls: tuple[str, ...] = ()  # last names of the calls it reaches (`get_main_grad`, `view`)
    names: tuple[str, ...] = ()  # plain names it reaches
    wild: bool = False

    @property
    def empty(self) -> bool:
        return not (self.attr or self.calls or self.names or self.wild)


@dataclass(frozen=True)
class Write:
    """A place where MG007/MG008 may see a write into a buffer: `kind` is "kernel" (the third positional
    argument of `x.wgrad_gemm_accum_*`), "add_copy" (the receiver of `x.add_(...)`/`x.copy_(...)`), "out"
    (an `out=` keyword), "dict_out" (a `{"out": ...}` display) or "aug" (the target of `+=`)."""

    kind: str
    node: ast.AST  # the call, dict display or augmented assignment
    spine: Spine
    cast: bool = False  # add_/copy_'s first argument or +='s value is `y.to(...)`/`.type/.half/.bfloat16()`
    out_dtype: bool = False  # "out"/"dict_out": the call or display also passes `out_dtype`


@dataclass(frozen=True)
class Scope:
    """A function or class: name and span, decorators included. Nothing else shares a def's or class's
    lines, so a position inside the span is inside the definition (and the converse)."""

    kind: str  # "def" or "class"
    name: str
    start: tuple[int, int]
    end: tuple[int, int]
    defines_get_main_grad: bool = False  # a class whose body defines `get_main_grad` itself

    def contains(self, pos: tuple[int, int]) -> bool:
        return self.start <= pos <= self.end


@dataclass
class SyntaxIndex:
    """Syntactic facts of one file, shared by all gates (see the module docstring)."""

    path: str
    source: str
    tree: ast.Module
    keywords: set[str] = field(default_factory=set)  # keyword-argument names of calls
    double_star_call: bool = False  # some call passes `**mapping`
    imports: list[ast.Import | ast.ImportFrom] = field(default_factory=list)
    alias_assigns: list[ast.Assign] = field(default_factory=list)  # `name = dotted.chain`
    called_names: set[str] = field(default_factory=set)  # callees written as a plain name
    # Calls of `...Sequential(...)` / `...OperationFuser(...)`.
    container_calls: list[ast.Call] = field(default_factory=list)
    main_grad_calls: list[ast.Call] = field(default_factory=list)  # take `X.main_grad` or are called on it
    truth_main_grad: bool = False  # a MG003 main_grad value is truth-tested somewhere
    truth_names: set[str] = field(default_factory=set)  # plain names that are truth-tested
    main_grad_value_names: set[str] = field(default_factory=set)  # names assigned a MG003 main_grad value
    get_main_grad_calls: list[ast.Call] = field(default_factory=list)  # `R.get_main_grad(...)`
    overwrite_sets: list[ast.AST] = field(default_factory=list)  # `X.overwrite_main_grad = <truthy>`
    writes: list[Write] = field(default_factory=list)
    bindings: list[tuple[str, Spine]] = field(default_factory=list)  # `name = <expr>` with a non-empty spine
    scopes: list[Scope] = field(default_factory=list)
    memo: dict[str, Any] = field(default_factory=dict)  # for gates to cache derived facts
    _parents: dict[ast.AST, ast.AST] | None = None
    _lines: list[str] | None = None

    def enclosing(self, pos: tuple[int, int]) -> list[Scope]:
        """The functions and classes around `pos`, outermost first."""
        found = [s for s in self.scopes if s.contains(pos)]
        found.sort(key=lambda s: s.start)
        return found

    def parent(self, node: ast.AST) -> ast.AST | None:
        """The parent node (the map is built on first use: only gates that look closer pay for it)."""
        if self._parents is None:
            self._parents = parents = {}
            for owner in ast.walk(self.tree):
                for child in ast.iter_child_nodes(owner):
                    parents[child] = owner
        return self._parents.get(node)

    def ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        current = self.parent(node)
        while current is not None:
            yield current
            current = self.parent(current)

    def segment(self, node: ast.AST) -> str | None:
        """The source text of `node`'s span (its own enclosing parentheses excluded, as `ast` reports it)."""
        if self._lines is None:
            # Lines as the tokenizer counts them: only \n, \r\n and \r end one (str.splitlines also
            # splits at form feeds and other separators, which would shift every later line).
            self._lines = io.StringIO(self.source, newline="").readlines()
        first, last = getattr(node, "lineno", None), getattr(node, "end_lineno", None)
        start, end = getattr(node, "col_offset", None), getattr(node, "end_col_offset", None)
        if first is None or last is None or start is None or end is None:
            return None
        first, last = first - 1, last - 1
        if not (0 <= first <= last < len(self._lines)):
            return None
        # Offsets are in UTF-8 bytes.
        if first == last:
            return self._lines[first].encode()[start:end].decode(errors="replace")
        head = self._lines[first].encode()[start:].decode(errors="replace")
        tail = self._lines[last].encode()[:end].decode(errors="replace")
        return head + "".join(self._lines[first + 1 : last]) + tail


def build_index(source: str, path: str) -> SyntaxIndex | None:
    """The index of `source`, or None when the stdlib parser cannot read it (the caller then skips the gate).

    The cyclic garbage collector is paused meanwhile: parsing allocates hundreds of thousands of acyclic
    nodes (freed by reference counting), and collections triggered by them cost a third of the time."""
    with gcpause.paused():
        try:
            tree = ast.parse(source, filename=path)
            index = SyntaxIndex(path=path, source=source, tree=tree)
            _Builder(index).run(tree)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # SyntaxError, ValueError (NUL bytes), RecursionError, MemoryError, ...
            return None
    return index


# Expression helpers -------------------------------------------------------------------------------------
def is_main_grad_attr(node: ast.AST) -> bool:
    return type(node) is ast.Attribute and node.attr == MAIN_GRAD


def positional(call: ast.Call) -> list[ast.expr]:
    """Positional arguments without `*args` (libcst's `positional`)."""
    return [a for a in call.args if type(a) is not ast.Starred]


def is_str(node: ast.AST, value: str) -> bool:
    return type(node) is ast.Constant and isinstance(node.value, str) and node.value == value


def last_name(call: ast.Call) -> str | None:
    func = call.func
    if type(func) is ast.Name:
        return func.id
    if type(func) is ast.Attribute:
        return func.attr
    return None


def dotted(node: ast.AST) -> str | None:
    """`a.b.c` for a Name/Attribute chain, else None (libcst's `dotted_name`)."""
    parts: list[str] = []
    while type(node) is ast.Attribute:
        parts.append(node.attr)
        node = node.value
    if type(node) is ast.Name:
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def is_main_grad_value(node: ast.AST) -> bool:
    """MG003's main_grad value: `R.main_grad`, `getattr(R, "main_grad"[, d])`, `R.get_main_grad()`
    (a string constant here also covers implicitly concatenated literals, which libcst does not)."""
    if is_main_grad_attr(node):
        return True
    if type(node) is not ast.Call:
        return False
    func = node.func
    if type(func) is ast.Name and func.id == "getattr":
        args = positional(node)
        return 2 <= len(args) <= 3 and is_str(args[1], MAIN_GRAD)
    return type(func) is ast.Attribute and func.attr == GET_MAIN_GRAD and not node.args and not node.keywords


def spine_of(node: ast.AST) -> Spine:
    attrs: list[bool] = []
    calls: list[str] = []
    names: list[str] = []
    wild: list[bool] = []
    _spine_visit(node, 0, attrs, calls, names, wild)
    if not (attrs or calls or names or wild):
        return _EMPTY
    return Spine(bool(attrs), tuple(calls), tuple(names), bool(wild))


def _spine_visit(
    expr: ast.AST, depth: int, attrs: list[bool], calls: list[str], names: list[str], wild: list[bool]
) -> None:
    """`spine_of`'s walk. A module-level function, not a closure: a recursive closure refers to itself
    through its cell, a reference cycle per call that only the cyclic collector frees."""
    if depth > _MAX_DEPTH:
        wild.append(True)
        return
    kind = type(expr)
    if kind is ast.Attribute:
        if expr.attr == MAIN_GRAD:  # type: ignore[attr-defined]
            attrs.append(True)
    elif kind is ast.Name:
        names.append(expr.id)  # type: ignore[attr-defined]
    elif kind is ast.Subscript:
        _spine_visit(expr.value, depth + 1, attrs, calls, names, wild)  # type: ignore[attr-defined]
    elif kind is ast.Call:
        func = expr.func  # type: ignore[attr-defined]
        if type(func) is ast.Attribute:
            calls.append(func.attr)
            if func.attr in VIEW_METHODS:
                _spine_visit(func.value, depth + 1, attrs, calls, names, wild)
        elif type(func) is ast.Name:
            calls.append(func.id)
    elif kind is ast.IfExp:
        _spine_visit(expr.body, depth + 1, attrs, calls, names, wild)  # type: ignore[attr-defined]
        _spine_visit(expr.orelse, depth + 1, attrs, calls, names, wild)  # type: ignore[attr-defined]
    elif kind is ast.List or kind is ast.Tuple:
        for element in expr.elts:  # type: ignore[attr-defined]
            if type(element) is not ast.Starred:  # libcst: a StarredElement is not an Element
                _spine_visit(element, depth + 1, attrs, calls, names, wild)
    elif kind is ast.ListComp or kind is ast.GeneratorExp:
        _spine_visit(expr.elt, depth + 1, attrs, calls, names, wild)  # type: ignore[attr-defined]


_EMPTY = Spine()


def is_cast(node: ast.AST) -> bool:
    return type(node) is ast.Call and type(node.func) is ast.Attribute and node.func.attr in CAST_METHODS


def _maybe_truthy(node: ast.AST | None) -> bool:
    """MG006's `_is_truthy_constant`, widened: `True`, a non-zero int, or any name (it may be bound to one)."""
    if node is None:
        return False
    if type(node) is ast.Name:
        return True
    if type(node) is ast.Constant:
        value = node.value
        return isinstance(value, int) and bool(value)  # bools are ints: True passes, False does not
    return False


def pos(node: ast.AST) -> tuple[int, int]:
    return (node.lineno, node.col_offset)  # type: ignore[attr-defined]


# `ast` mirrors of rules._common, for gates that look closer at a candidate. Each answers True only when
# libcst's version would, so a gate may use them to *drop* a candidate. ---------------------------------
def chain_before(index: SyntaxIndex, attribute: ast.AST, attr: str) -> str | None:
    """For `R.<attr>` written as a plain dotted chain (no spaces, parentheses or comments), R's text, which
    then equals libcst's `code_of(R)`; else None (the caller must assume nothing)."""
    if type(attribute) is not ast.Attribute or attribute.attr != attr:
        return None
    text = index.segment(attribute)
    match = re.fullmatch(rf"({_CHAIN})\.{re.escape(attr)}", text or "")
    return match.group(1) if match else None


def enclosing_function(index: SyntaxIndex, node: ast.AST) -> ast.AST | None:
    """`_common.enclosing_function`: the nearest def, or None when a lambda comes first."""
    for ancestor in index.ancestors(node):
        if isinstance(ancestor, FUNCTION_NODES):
            return ancestor
        if isinstance(ancestor, ast.Lambda):
            return None
    return None


def function_of(index: SyntaxIndex, node: ast.AST) -> ast.AST | None:
    """MG007's `function_of`: the nearest def, through lambdas."""
    return next((a for a in index.ancestors(node) if isinstance(a, FUNCTION_NODES)), None)


def owning_scope(index: SyntaxIndex, node: ast.AST) -> ast.AST | None:
    """The nearest def/class/lambda around `node` (None at module level): `own_nodes` of a function body
    (or of the module) holds exactly the nodes whose owning scope is that function (or None)."""
    return next((a for a in index.ancestors(node) if isinstance(a, SCOPE_NODES)), None)


def is_before(index: SyntaxIndex, first: ast.AST, second: ast.AST) -> bool:
    """`_common.is_before` for a statement `first`: pre-order is source order, ancestors first."""
    return pos(first) < pos(second) or any(a is first for a in index.ancestors(second))


def _branch(owner: ast.AST, child: ast.AST) -> object:
    """Which part of an if/ternary/try `child` belongs to (libcst holds each part in its own node)."""
    for name in ("body", "orelse", "finalbody", "test"):
        value = getattr(owner, name, None)
        if value is child or (type(value) is list and any(c is child for c in value)):
            return name
    return child  # an except handler is its own part


def local_bindings(func: ast.AST, *, walrus: bool = False) -> dict[str, list[ast.AST]]:
    """`dataflow.local_bindings` on `ast`, for the gates: name -> the expressions bound to it in `func` by
    assignments, annotated assignments and for/comprehension targets; with `walrus`, also by `:=`."""
    out: dict[str, list[ast.AST]] = {}
    for node in ast.walk(func):
        if type(node) is ast.Assign:
            for target in node.targets:
                if type(target) is ast.Name:
                    out.setdefault(target.id, []).append(node.value)
        elif type(node) is ast.AnnAssign or (walrus and type(node) is ast.NamedExpr):
            target, value = node.target, node.value
            if type(target) is ast.Name and value is not None:
                out.setdefault(target.id, []).append(value)
        elif type(node) in (ast.For, ast.AsyncFor, ast.comprehension):
            for name in ast.walk(node.target):  # type: ignore[attr-defined]
                if type(name) is ast.Name:
                    out.setdefault(name.id, []).append(node.iter)  # type: ignore[attr-defined]
    return out


N = TypeVar("N")


def branch_point(chain_a: Sequence[N], chain_b: Sequence[N]) -> tuple[N, N, N] | None:
    """Where two ancestor chains (a node, then its ancestors up to the root) part: their lowest common
    ancestor and its child on each chain. None when they share no node, when one node is an ancestor of the
    other (or both are one node), or when both go through the same child (for `ast`, one list field)."""
    on_b = {id(n): i for i, n in enumerate(chain_b)}
    for i, node in enumerate(chain_a):
        j = on_b.get(id(node))
        if j is None:
            continue
        if not i or not j or chain_a[i - 1] is chain_b[j - 1]:
            return None
        return node, chain_a[i - 1], chain_b[j - 1]
    return None


def mutually_exclusive(index: SyntaxIndex, a: ast.AST, b: ast.AST) -> bool:
    """`_common.mutually_exclusive`: different branches of one if/ternary, or different parts of one try.
    An `ast` list field (`If.body`) is one libcst node (`IndentedBlock`): two statements of the same
    list have that block as their common ancestor, which is never exclusive."""
    meet = branch_point([a, *index.ancestors(a)], [b, *index.ancestors(b)])
    if meet is None:
        return False
    node, child_a, child_b = meet
    part_a, part_b = _branch(node, child_a), _branch(node, child_b)
    if isinstance(node, (ast.If, ast.IfExp)):
        return {part_a, part_b} == {"body", "orelse"}
    if isinstance(node, TRY_NODES):
        return part_a != part_b
    return False


_SKIPPED_FIELDS = frozenset({"ctx", "type_comment", "kind"})
_FIELDS: dict[type, tuple[str, ...]] = {}
# Leaves never hold anything the index records: not pushed at all (most of a tree's nodes).
_LEAVES = frozenset({ast.Name, ast.Constant, ast.alias, ast.Load, ast.Store, ast.Del})


def _fields(kind: type) -> tuple[str, ...]:
    fields = _FIELDS.get(kind)
    if fields is None:
        fields = _FIELDS[kind] = tuple(f for f in kind._fields if f not in _SKIPPED_FIELDS)  # type: ignore[attr-defined]
    return fields


class _Builder:
    """One iterative walk (no recursion, leaves and `ctx` fields skipped) that fills a SyntaxIndex.

    Its handlers live in the module-level `_HANDLERS` (plain functions, called with the builder): a
    per-instance dict of bound methods would make a reference cycle builder -> dict -> method -> builder,
    which keeps the builder, its index and the whole `ast` tree alive until the cyclic collector runs
    (while the engine pauses it, until the end of the file or piece)."""

    def __init__(self, index: SyntaxIndex) -> None:
        self.index = index

    def run(self, tree: ast.AST) -> None:
        handlers = _HANDLERS
        leaves = _LEAVES
        stack: list[Any] = [tree]
        pop, push = stack.pop, stack.append
        attribute_t, ast_t = ast.Attribute, ast.AST
        while stack:
            node = pop()
            kind = type(node)
            if kind is attribute_t:
                value = node.value
                if type(value) not in leaves:
                    push(value)
                continue
            handler = handlers.get(kind)
            if handler is not None:
                handler(self, node)
            for name in _FIELDS.get(kind) or _fields(kind):
                value = getattr(node, name)
                if type(value) is list:
                    for item in value:
                        if type(item) not in leaves and isinstance(item, ast_t):
                            push(item)
                elif type(value) not in leaves and isinstance(value, ast_t):
                    push(value)

    # Truth contexts (MG003) --------------------------------------------------------------------------
    def _truth(self, node: ast.AST) -> None:
        if is_main_grad_value(node):
            self.index.truth_main_grad = True
        elif type(node) is ast.Name:
            self.index.truth_names.add(node.id)

    def _test(self, node: Any) -> None:
        self._truth(node.test)

    def _comprehension(self, node: ast.comprehension) -> None:
        for test in node.ifs:
            self._truth(test)

    def _unary(self, node: ast.UnaryOp) -> None:
        if type(node.op) is ast.Not:
            self._truth(node.operand)

    def _boolop(self, node: ast.BoolOp) -> None:
        for value in node.values:
            self._truth(value)

    # Statements --------------------------------------------------------------------------------------
    def _bind(self, target: ast.AST, value: ast.AST) -> None:
        if type(target) is ast.Name:
            if is_main_grad_value(value):
                self.index.main_grad_value_names.add(target.id)
            spine = spine_of(value)
            if not spine.empty:
                self.index.bindings.append((target.id, spine))
        elif type(target) is ast.Attribute and target.attr == OVERWRITE_FLAG and _maybe_truthy(value):
            self.index.overwrite_sets.append(target)

    def _assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._bind(target, node.value)
        if (
            len(node.targets) == 1
            and type(node.targets[0]) is ast.Name
            and type(node.value) in (ast.Name, ast.Attribute)
        ):
            self.index.alias_assigns.append(node)

    def _ann_assign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self._bind(node.target, node.value)

    def _aug_assign(self, node: ast.AugAssign) -> None:
        if type(node.op) is ast.Add:
            spine = spine_of(node.target)
            if not spine.empty:
                self.index.writes.append(Write("aug", node, spine, cast=is_cast(node.value)))

    def _dict(self, node: ast.Dict) -> None:
        outs: list[ast.AST] = []  # every "out" value: which one libcst's string_value keeps may differ
        out_dtype = False
        for key, value in zip(node.keys, node.values, strict=True):
            if key is None:
                continue
            if is_str(key, "out"):
                outs.append(value)
            elif is_str(key, "out_dtype"):
                out_dtype = True
        for out in outs:
            spine = spine_of(out)
            if not spine.empty:
                self.index.writes.append(Write("dict_out", node, spine, out_dtype=out_dtype))

    def _call(self, node: ast.Call) -> None:  # noqa: C901 - one pass per call on the gate's hot path
        index = self.index
        func = node.func
        func_kind = type(func)
        takes_main_grad = False
        for arg in node.args:
            if is_main_grad_attr(arg.value if type(arg) is ast.Starred else arg):
                takes_main_grad = True
        out: ast.AST | None = None
        out_dtype = False
        for kw in node.keywords:
            if kw.arg is None:
                index.double_star_call = True
            else:
                index.keywords.add(kw.arg)
                if kw.arg == "out":
                    out = kw.value
                elif kw.arg == "out_dtype":
                    out_dtype = True
            if is_main_grad_attr(kw.value):
                takes_main_grad = True
        if out is not None:
            spine = spine_of(out)
            if not spine.empty:
                index.writes.append(Write("out", node, spine, out_dtype=out_dtype))
        if func_kind is ast.Attribute:
            attr = func.attr  # type: ignore[attr-defined]
            receiver = func.value  # type: ignore[attr-defined]
            if is_main_grad_attr(receiver):
                takes_main_grad = True
            if attr == GET_MAIN_GRAD:
                index.get_main_grad_calls.append(node)
            elif attr in KERNELS:
                args = positional(node)
                if len(args) >= 3:
                    spine = spine_of(args[2])
                    if not spine.empty:
                        index.writes.append(Write("kernel", node, spine))
            elif attr in ("add_", "copy_"):
                args = positional(node)
                if args:
                    spine = spine_of(receiver)
                    if not spine.empty:
                        index.writes.append(Write("add_copy", node, spine, cast=is_cast(args[0])))
            elif attr in CONTAINER_NAMES:
                index.container_calls.append(node)
        elif func_kind is ast.Name:
            name = func.id  # type: ignore[attr-defined]
            index.called_names.add(name)
            if name == "bool":
                for arg in node.args:
                    self._truth(arg)
            elif name == "setattr":
                args = positional(node)
                if len(args) == 3 and is_str(args[1], OVERWRITE_FLAG) and _maybe_truthy(args[2]):
                    index.overwrite_sets.append(node)
            elif name in CONTAINER_NAMES:
                index.container_calls.append(node)
        if takes_main_grad:
            index.main_grad_calls.append(node)

    # Definitions and imports -------------------------------------------------------------------------
    def _span(self, node: Any) -> tuple[tuple[int, int], tuple[int, int]]:
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        return (first, 0), (node.end_lineno, node.end_col_offset)

    def _def(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        start, end = self._span(node)
        self.index.scopes.append(Scope("def", node.name, start, end))

    def _class(self, node: ast.ClassDef) -> None:
        start, end = self._span(node)
        defines = any(isinstance(s, FUNCTION_NODES) and s.name == GET_MAIN_GRAD for s in node.body)
        self.index.scopes.append(Scope("class", node.name, start, end, defines))

    def _import(self, node: ast.Import | ast.ImportFrom) -> None:
        self.index.imports.append(node)


_HANDLERS: dict[type, Any] = {
    ast.Call: _Builder._call,
    ast.Assign: _Builder._assign,
    ast.AnnAssign: _Builder._ann_assign,
    ast.AugAssign: _Builder._aug_assign,
    ast.Dict: _Builder._dict,
    ast.If: _Builder._test,
    ast.While: _Builder._test,
    ast.Assert: _Builder._test,
    ast.IfExp: _Builder._test,
    ast.comprehension: _Builder._comprehension,
    ast.UnaryOp: _Builder._unary,
    ast.BoolOp: _Builder._boolop,
    ast.FunctionDef: _Builder._def,
    ast.AsyncFunctionDef: _Builder._def,
    ast.ClassDef: _Builder._class,
    ast.Import: _Builder._import,
    ast.ImportFrom: _Builder._import,
}


# Gate helpers shared by the rules that judge writes into main_grad buffers (MG007, MG008, ...) ---------
def spine_is_main_grad(spine: Spine, aliases: set[str]) -> bool:
    """Over-approximates `rules._common.MainGradScope.is_main_grad` on an expression: the spine holds
    exactly the nodes it decides on (an `X.main_grad` attribute, a call's last name, a plain name), and
    `aliases` is a superset of every scope's aliases."""
    if spine.wild or spine.attr:
        return True
    if any(MAIN_GRAD in name and not BOOL_PREFIX.match(name) for name in spine.calls):
        return True
    return any(name in aliases or is_main_grad_name(name) for name in spine.names)


def gate_aliases(index: SyntaxIndex) -> set[str]:
    """Names that may hold a main_grad buffer: the fixpoint over every `name = <expr>` in the file. Each
    scope's `MainGradScope.aliases` comes from a subset of these bindings in at most four rounds."""
    cached = index.memo.get("main_grad_aliases")
    if cached is None:
        cached = set()
        grew = True
        while grew:
            grew = False
            for name, spine in index.bindings:
                if name not in cached and spine_is_main_grad(spine, cached):
                    cached.add(name)
                    grew = True
        index.memo["main_grad_aliases"] = cached
    return cached
