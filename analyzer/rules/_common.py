"""AST helpers shared by the main_grad rules (not a rule module: the registry only loads `mgNNN_*`).

Three questions recur across rules, and answering them the same way everywhere keeps the rules consistent:

* what a condition says about a parameter `R` (`hasattr(R, "get_main_grad")`, `getattr(R, "__fsdp_param__",
  False)`, `getattr(R, "get_main_grad", None) is None`, `not ...`, `and`/`or`), and which such facts hold on the
  path to a node (enclosing branches, early exits, asserts, `try/except AttributeError`);
* whether a statement exposes `R.main_grad` from `R.get_main_grad()` (or through a configured helper);
* which expressions of a function denote a main_grad buffer (`MainGradScope`), and what a write into one
  looks like (`out_pairs`);
* small syntax utilities (string constants, dotted receivers, enclosing functions/classes).

The words themselves (kernels, flags, wrapper names) live in `maingrad.analyzer.facts`, shared with the
`ast` syntax gate; rules import helpers from here and never from each other.

Receivers are compared by their whitespace-normalised source text, so `weight` and `ctx.weight` are different
parameters and `self.linear_fc1` matches itself wherever it is written.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import libcst as cst

from maingrad.analyzer import walk
from maingrad.analyzer.context import FileContext
from maingrad.analyzer.facts import (
    BOOL_PREFIX,
    BUILTIN_EXPOSURE_FUNCS,
    FSDP_MARKERS,
    KERNELS,
    MAIN_GRAD,
    OVERWRITE_FLAG,
    OVERWRITE_READERS,
    VIEW_METHODS,
    WRAPPER_CLASS,
    is_main_grad_name,
    is_wrapper_path,
)
from maingrad.analyzer.names import dotted_name
from maingrad.analyzer.syntax_index import branch_point

PRESENT = "present"  # the parameter has get_main_grad (a Megatron-FSDP parameter)
ABSENT = "absent"  # the parameter has no get_main_grad (a DDP / plain parameter)
CAUGHT = "caught"  # an AttributeError raised here is caught by an enclosing try


def norm(code: str) -> str:
    return " ".join(code.split())


# `code_of` generates code through an empty module (only its default indent and newline are read).
_EMPTY_MODULE = cst.Module(body=[])


def code_of(node: cst.CSTNode) -> str:
    """The node's code, whitespace-normalised. Dotted chains (`self.linear_fc1.weight`), most of what rules
    render, are joined from their names: code generation costs about ten times more."""
    chain = _bare_chain(node)
    if chain is not None:
        return norm(chain)
    return norm(_EMPTY_MODULE.code_for_node(node))


def _bare_chain(node: cst.CSTNode) -> str | None:
    """The code libcst generates for a Name/Attribute chain without parentheses, whitespace or comments
    (`a.b.c`): its names joined by dots; None for anything else (code generation then decides)."""
    parts: list[str] = []
    while type(node) is cst.Attribute:
        dot = node.dot
        if (
            node.lpar
            or node.rpar
            or type(dot) is not cst.Dot
            or not _no_space(dot.whitespace_before)
            or not _no_space(dot.whitespace_after)
            or type(node.attr) is not cst.Name
            or node.attr.lpar
            or node.attr.rpar
        ):
            return None
        parts.append(node.attr.value)
        node = node.value
    if type(node) is not cst.Name or node.lpar or node.rpar:
        return None
    parts.append(node.value)
    return ".".join(reversed(parts))


def _no_space(whitespace: cst.BaseParenthesizableWhitespace) -> bool:
    return type(whitespace) is cst.SimpleWhitespace and whitespace.value == ""


def literal_value(node: cst.SimpleString | cst.Integer) -> object:
    """`node.evaluated_value` (libcst's `ast.literal_eval` of the token) without its garbage: literal_eval
    defines recursive closures on every call, reference cycles that only the cyclic collector frees, and
    the engine pauses it for a whole file (`maingrad.analyzer.gcpause`). One literal token parses to one
    Constant, whose value is what literal_eval returns."""
    body = ast.parse(node.value, mode="eval").body
    return body.value if isinstance(body, ast.Constant) else node.evaluated_value


def string_value(node: cst.CSTNode | None) -> str | None:
    if isinstance(node, cst.SimpleString):
        value = literal_value(node)
        return value if isinstance(value, str) else None
    return None


def call_name(call: cst.Call) -> str | None:
    """Dotted text of the callee (`fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32`), else None."""
    return dotted_name(call.func)


def last_name(call: cst.Call) -> str | None:
    if isinstance(call.func, cst.Name):
        return call.func.value
    if isinstance(call.func, cst.Attribute):
        return call.func.attr.value
    return None


def positional(call: cst.Call) -> list[cst.Arg]:
    return [a for a in call.args if a.keyword is None and not a.star]


def keyword(call: cst.Call, name: str) -> cst.Arg | None:
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == name:
            return arg
    return None


def attr_call(call: cst.Call, name: str, nargs: int | None = None) -> tuple[cst.BaseExpression, str] | None:
    """For `getattr(R, "name"...)`/`hasattr(R, "name")`: (R, name), when the callee is `name`."""
    if not isinstance(call.func, cst.Name) or call.func.value != name:
        return None
    args = positional(call)
    if len(args) < 2 or (nargs is not None and len(args) != nargs) or len(args) > 3:
        return None
    attr = string_value(args[1].value)
    if attr is None:
        return None
    return args[0].value, attr


def getattr_of(node: cst.CSTNode) -> tuple[cst.BaseExpression, str] | None:
    """`getattr(R, "attr")` or `getattr(R, "attr", default)` -> (R, attr)."""
    return attr_call(node, "getattr") if isinstance(node, cst.Call) else None


def hasattr_of(node: cst.CSTNode) -> tuple[cst.BaseExpression, str] | None:
    return attr_call(node, "hasattr", 2) if isinstance(node, cst.Call) else None


def is_simple_chain(node: cst.CSTNode) -> bool:
    """`a`, `a.b.c`: evaluating it twice has no side effect worth caring about."""
    return dotted_name(node) is not None


def main_grad_receiver(node: cst.CSTNode) -> cst.BaseExpression | None:
    """R for `R.main_grad` (an attribute load), else None."""
    if isinstance(node, cst.Attribute) and node.attr.value == "main_grad":
        return node.value
    return None


def is_none(node: cst.CSTNode) -> bool:
    return isinstance(node, cst.Name) and node.value == "None"


def is_false_constant(node: cst.CSTNode) -> bool:
    """Literals that are provably falsy: False, None, 0."""
    if isinstance(node, cst.Name) and node.value in ("False", "None"):
        return True
    return isinstance(node, cst.Integer) and literal_value(node) == 0


# Scopes ----------------------------------------------------------------------------------------------
FunctionLike = (cst.FunctionDef, cst.Lambda)


def enclosing_function(ctx: FileContext, node: cst.CSTNode) -> cst.FunctionDef | None:
    for ancestor in ctx.ancestors(node):
        if isinstance(ancestor, cst.FunctionDef):
            return ancestor
        if isinstance(ancestor, cst.Lambda):
            return None
    return None


def enclosing_class(ctx: FileContext, node: cst.CSTNode) -> cst.ClassDef | None:
    found = ctx.enclosing(node, cst.ClassDef)
    return found if isinstance(found, cst.ClassDef) else None


def first_param(func: cst.FunctionDef) -> str | None:
    params = list(func.params.posonly_params) + list(func.params.params)
    return params[0].name.value if params else None


NodeT = TypeVar("NodeT", bound=cst.CSTNode)


def own_nodes(root: cst.CSTNode, *kinds: type[NodeT]) -> list[NodeT]:
    """Nodes of `kinds` inside `root`, excluding those in nested function/class/lambda bodies (a nested
    def itself is included when its type is asked for)."""
    return walk.find_own(root, *kinds)  # type: ignore[return-value]  # only nodes of `kinds`


def all_nodes(root: cst.CSTNode, *kinds: type[NodeT]) -> list[NodeT]:
    """Every node of `kinds` under `root` (root included), in source order."""
    return walk.find(root, *kinds)  # type: ignore[return-value]  # only nodes of `kinds`


_BINDING_NODES = (cst.Assign, cst.AugAssign, cst.AnnAssign, cst.For, cst.WithItem, cst.NamedExpr)


def local_bindings(
    func: cst.CSTNode | None, ctx: FileContext | None = None
) -> dict[str, list[cst.BaseExpression]]:
    """name -> values assigned to it by plain `name = value` in `func` (nested scopes excluded).

    Names bound in any other way (parameters, for-targets, with-targets, augmented assignment) get a
    `None`-free empty marker by being absent; callers must treat a name with no entry as unknown.
    With the file's `ctx`, the statements come from its per-scope index (`ctx.own_nodes`) instead of a
    walk of `func`, and the answer is computed once per function and file and shared by every caller
    (`ctx.memo`): do not mutate it.
    """
    if func is None:
        return {}
    if ctx is None:
        return _bindings_of(func, own_nodes(func, *_BINDING_NODES))
    key = ("local_bindings", id(func))
    found = ctx.memo.get(key)
    if found is None:
        found = ctx.memo[key] = _bindings_of(func, ctx.own_nodes(func, *_BINDING_NODES))
    return found


def _bindings_of(func: cst.CSTNode, nodes: Sequence[cst.CSTNode]) -> dict[str, list[cst.BaseExpression]]:
    """`local_bindings` from `func`'s own binding statements."""
    bindings: dict[str, list[cst.BaseExpression]] = {}
    other: set[str] = set()
    for node in nodes:
        if isinstance(node, cst.Assign):
            for target in node.targets:
                if isinstance(target.target, cst.Name):
                    bindings.setdefault(target.target.value, []).append(node.value)
                else:
                    other.update(n.value for n in all_nodes(target.target, cst.Name))
        elif isinstance(node, cst.AnnAssign) and isinstance(node.target, cst.Name) and node.value is not None:
            bindings.setdefault(node.target.value, []).append(node.value)
        elif isinstance(node, (cst.AugAssign,)) and isinstance(node.target, cst.Name):
            other.add(node.target.value)
        elif isinstance(node, cst.For):
            other.update(n.value for n in all_nodes(node.target, cst.Name))
        elif isinstance(node, cst.WithItem) and node.asname is not None:
            other.update(n.value for n in all_nodes(node.asname.name, cst.Name))
        elif isinstance(node, cst.NamedExpr) and isinstance(node.target, cst.Name):
            other.add(node.target.value)
    if isinstance(func, cst.FunctionDef):
        for param in _all_params(func.params):
            other.add(param.name.value)
    return {name: values for name, values in bindings.items() if name not in other}


def _all_params(params: cst.Parameters) -> Iterator[cst.Param]:
    yield from params.posonly_params
    yield from params.params
    yield from params.kwonly_params
    if isinstance(params.star_arg, cst.Param):
        yield params.star_arg
    if params.star_kwarg is not None:
        yield params.star_kwarg


def single_binding(
    bindings: dict[str, list[cst.BaseExpression]], node: cst.CSTNode
) -> cst.BaseExpression | None:
    """The one value a local Name (or a dotted attribute from `attribute_bindings`) is bound to, else None."""
    key = (
        node.value
        if isinstance(node, cst.Name)
        else dotted_name(node)
        if isinstance(node, cst.Attribute)
        else None
    )
    if key is not None:
        values = bindings.get(key)
        if values and len(values) == 1:
            return values[0]
    return None


def attribute_bindings(owner: cst.ClassDef | None) -> dict[str, list[cst.BaseExpression]]:
    """`ctx.use_main_grad` -> values assigned to that dotted target anywhere in the class (autograd
    Functions decide in `forward` and read the decision from `ctx` in `backward`). Targets also updated
    by augmented assignment are dropped."""
    if owner is None:
        return {}
    bindings: dict[str, list[cst.BaseExpression]] = {}
    other: set[str] = set()
    for node in walk.find(owner.body, cst.Assign, cst.AugAssign, cst.AnnAssign):
        if isinstance(node, cst.Assign):
            for target in node.targets:
                key = dotted_name(target.target) if isinstance(target.target, cst.Attribute) else None
                if key is not None:
                    bindings.setdefault(key, []).append(node.value)
        elif (
            isinstance(node, cst.AnnAssign)
            and isinstance(node.target, cst.Attribute)
            and node.value is not None
        ):
            key = dotted_name(node.target)
            if key is not None:
                bindings.setdefault(key, []).append(node.value)
        elif isinstance(node, cst.AugAssign):
            key = dotted_name(node.target)
            if key is not None:
                other.add(key)
    return {key: values for key, values in bindings.items() if key not in other}


# Conditions about a receiver -------------------------------------------------------------------------
@dataclass
class Condition:
    """Decides what a boolean expression being true implies about receiver `key` (normalised code)."""

    key: str
    bindings: dict[str, list[cst.BaseExpression]]
    markers: frozenset[str] = FSDP_MARKERS
    _depth: int = 0

    def _is_receiver(self, node: cst.CSTNode) -> bool:
        return code_of(node) == self.key

    def _marker_probe(self, node: cst.CSTNode) -> bool:
        """`getattr(R, marker[, default])`, `R.__fsdp_param__`, or a local bound to one of them."""
        got = getattr_of(node)
        if got is not None:
            return got[1] in self.markers and self._is_receiver(got[0])
        if isinstance(node, cst.Attribute) and node.attr.value == "__fsdp_param__":
            return self._is_receiver(node.value)
        if isinstance(node, cst.Attribute) and node.attr.value == "get_main_grad":
            return self._is_receiver(node.value)
        bound = single_binding(self.bindings, node)
        return bound is not None and self._depth < 4 and self._child()._marker_probe(bound)

    def _child(self) -> Condition:
        return Condition(self.key, self.bindings, self.markers, self._depth + 1)

    def implies(self, cond: cst.BaseExpression, truth: bool = True) -> str | None:
        """PRESENT/ABSENT if `cond` evaluating to `truth` implies it; None when it says nothing."""
        if self._depth > 8:
            return None
        if isinstance(cond, cst.UnaryOperation) and isinstance(cond.operator, cst.Not):
            return self.implies(cond.expression, not truth)
        if isinstance(cond, cst.BooleanOperation):
            is_and = isinstance(cond.operator, cst.And)
            left = self.implies(cond.left, truth)
            right = self.implies(cond.right, truth)
            if is_and == truth:  # `a and b` true, or `a or b` false: both sides hold
                return left or right
            return left if left is not None and left == right else None
        if isinstance(cond, cst.Call):
            has = hasattr_of(cond)
            if has is not None:
                if has[1] in self.markers and self._is_receiver(has[0]):
                    return PRESENT if truth else ABSENT
                return None
            if isinstance(cond.func, cst.Name) and cond.func.value in ("callable", "bool"):
                args = positional(cond)
                if len(args) == 1 and self._marker_probe(args[0].value):
                    return PRESENT if truth else ABSENT
                return None
        if isinstance(cond, cst.Comparison) and len(cond.comparisons) == 1:
            target = cond.comparisons[0]
            if is_none(target.comparator) and self._marker_probe(cond.left):
                if isinstance(target.operator, cst.IsNot):
                    return PRESENT if truth else ABSENT
                if isinstance(target.operator, cst.Is):
                    return ABSENT if truth else PRESENT
            return None
        if self._marker_probe(cond):  # a truthy probe: getattr(R, "get_main_grad", None), R.__fsdp_param__
            return PRESENT if truth else None
        bound = single_binding(self.bindings, cond)
        if bound is not None:
            return self._child().implies(bound, truth)
        return None


def _exits(body: cst.BaseSuite) -> bool:
    """True when a suite always leaves the current block (return/raise/continue/break as last statement)."""
    exits = (cst.Return, cst.Raise, cst.Continue, cst.Break)
    if isinstance(body, cst.SimpleStatementSuite):
        return bool(body.body) and isinstance(body.body[-1], exits)
    if isinstance(body, cst.IndentedBlock) and body.body:
        last = body.body[-1]
        if isinstance(last, cst.SimpleStatementLine):
            return bool(last.body) and isinstance(last.body[-1], exits)
        if isinstance(last, cst.If) and last.orelse is not None:
            return _exits(last.body) and _orelse_exits(last.orelse)
    return False


def _orelse_exits(orelse: cst.If | cst.Else) -> bool:
    if isinstance(orelse, cst.Else):
        return _exits(orelse.body)
    return _exits(orelse.body) and orelse.orelse is not None and _orelse_exits(orelse.orelse)


def _catches_attribute_error(handler: cst.ExceptHandler | cst.ExceptStarHandler) -> bool:
    if handler.type is None:
        return True
    names = [
        dotted_name(n)
        for n in (
            [handler.type]
            if not isinstance(handler.type, cst.Tuple)
            else [e.value for e in handler.type.elements]
        )
    ]
    return any(n in ("AttributeError", "Exception", "BaseException") for n in names)


def path_facts(ctx: FileContext, node: cst.CSTNode, receiver: cst.CSTNode) -> set[str]:
    """Facts about `receiver` that hold whenever `node` executes, from the innermost function up.

    Looks at enclosing `if`/`elif`/`else`/`while`/ternaries/`and`/`or`, earlier statements of every
    enclosing block (`if not hasattr(R, "get_main_grad"): return`, `assert ...`) and enclosing
    `try: ... except AttributeError`.
    """
    func = enclosing_function(ctx, node)
    bindings = {**attribute_bindings(enclosing_class(ctx, node)), **local_bindings(func, ctx)}
    cond = Condition(code_of(receiver), bindings)
    facts: set[str] = set()

    def add(fact: str | None) -> None:
        if fact is not None:
            facts.add(fact)

    child: cst.CSTNode = node
    for parent in ctx.ancestors(node):
        if isinstance(parent, cst.If):
            if child is parent.body:
                add(cond.implies(parent.test, True))
            elif child is parent.orelse:
                add(cond.implies(parent.test, False))
        elif isinstance(parent, cst.Else):
            pass  # handled when we reach the If/While/For/Try owning it
        elif isinstance(parent, cst.While) and child is parent.body:
            add(cond.implies(parent.test, True))
        elif isinstance(parent, cst.IfExp):
            if child is parent.body:
                add(cond.implies(parent.test, True))
            elif child is parent.orelse:
                add(cond.implies(parent.test, False))
        elif isinstance(parent, cst.BooleanOperation) and child is parent.right:
            add(cond.implies(parent.left, isinstance(parent.operator, cst.And)))
        elif isinstance(parent, (cst.Try, cst.TryStar)) and child is parent.body:
            if any(_catches_attribute_error(h) for h in parent.handlers):
                facts.add(CAUGHT)
        elif isinstance(parent, (cst.IndentedBlock, cst.Module)):
            for stmt in parent.body:
                if stmt is child:
                    break
                add(_statement_fact(stmt, cond))
        if parent is func:
            break
        child = parent
    return facts


def _statement_fact(stmt: cst.BaseStatement, cond: Condition) -> str | None:
    """What having executed `stmt` (and fallen through) implies about the receiver."""
    if isinstance(stmt, cst.If):
        if stmt.orelse is None and _exits(stmt.body):
            return cond.implies(stmt.test, False)
        if isinstance(stmt.orelse, cst.Else) and _exits(stmt.orelse.body) and not _exits(stmt.body):
            return cond.implies(stmt.test, True)
        return None
    if isinstance(stmt, cst.SimpleStatementLine):
        for small in stmt.body:
            if isinstance(small, cst.Assert):
                fact = cond.implies(small.test, True)
                if fact is not None:
                    return fact
    return None


# Exposure ---------------------------------------------------------------------------------------------
def _is_getter_call(
    call: cst.Call, bindings: dict[str, list[cst.BaseExpression]], helpers: frozenset[str]
) -> bool:
    """`R.get_main_grad()`, `get_main_grad()` bound from `getattr(R, "get_main_grad"...)`, or a known helper."""
    func = call.func
    if isinstance(func, cst.Attribute) and func.attr.value == "get_main_grad":
        return True
    if isinstance(func, cst.Name):
        if func.value == "get_main_grad" or func.value in BUILTIN_EXPOSURE_FUNCS or func.value in helpers:
            return True
        bound = single_binding(bindings, func)
        if bound is not None:
            got = getattr_of(bound)
            if got is not None and got[1] == "get_main_grad":
                return True
            if isinstance(bound, cst.Attribute) and bound.attr.value == "get_main_grad":
                return True
    name = call_name(call)
    return name is not None and (name in helpers or name.rsplit(".", 1)[-1] in BUILTIN_EXPOSURE_FUNCS)


def exposure_receiver(
    stmt: cst.CSTNode, bindings: dict[str, list[cst.BaseExpression]], helpers: frozenset[str] = frozenset()
) -> str | None:
    """Normalised receiver R when `stmt` is `R.main_grad = <... get_main_grad() ...>`, else None."""
    if not isinstance(stmt, (cst.Assign, cst.AnnAssign)):
        return None
    targets = [t.target for t in stmt.targets] if isinstance(stmt, cst.Assign) else [stmt.target]
    value = stmt.value
    if value is None:
        return None
    calls = [value] if isinstance(value, cst.Call) else []
    calls += [c for c in all_nodes(value, cst.Call) if c is not value]
    if not any(_is_getter_call(c, bindings, helpers) for c in calls if isinstance(c, cst.Call)):
        return None
    for target in targets:
        receiver = main_grad_receiver(target)
        if receiver is not None:
            return code_of(receiver)
    return None


def is_helper_call(call: cst.Call, helpers: frozenset[str]) -> bool:
    """A call to a configured exposure helper or to TE's `get_main_grad_from_param`."""
    name = call_name(call)
    if name is None:
        return False
    tail = name.rsplit(".", 1)[-1]
    return name in helpers or tail in helpers or tail in BUILTIN_EXPOSURE_FUNCS


def function_exposes(func: cst.FunctionDef, helpers: frozenset[str]) -> bool:
    """Whether the function body itself (nested defs excluded) exposes some `main_grad`."""
    bindings = local_bindings(func)
    for node in own_nodes(func.body, cst.Assign, cst.AnnAssign, cst.Call):
        if isinstance(node, cst.Call):
            if is_helper_call(node, helpers):
                return True
        elif exposure_receiver(node, bindings, helpers) is not None:
            return True
    return False


def is_before(ctx: FileContext, first: cst.CSTNode, second: cst.CSTNode) -> bool:
    """Whether `first` comes before `second` in a pre-order walk (source order for statements)."""
    return ctx.index(first) < ctx.index(second)


def mutually_exclusive(ctx: FileContext, a: cst.CSTNode, b: cst.CSTNode) -> bool:
    """True when `a` and `b` sit in different branches of one `if`/ternary, or one is in a `try` body and
    the other in its handlers (never both run on one path)."""
    meet = branch_point([a, *ctx.ancestors(a)], [b, *ctx.ancestors(b)])
    if meet is None:
        return False
    node, child_a, child_b = meet
    if isinstance(node, (cst.If, cst.IfExp)):
        branches = (node.body, node.orelse)
        return any(child_a is x for x in branches) and any(child_b is x for x in branches)
    return isinstance(node, (cst.Try, cst.TryStar))


def statement_of(ctx: FileContext, node: cst.CSTNode) -> cst.CSTNode | None:
    """The innermost statement (simple statement line or compound statement) holding `node`."""
    for ancestor in [node, *ctx.ancestors(node)]:
        if isinstance(ancestor, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            return ancestor
    return None


def in_fsdp_only_code(ctx: FileContext, node: cst.CSTNode) -> bool:
    """Code that only ever handles Megatron-FSDP parameters: an `fsdp` package/module, or an enclosing
    class or function whose name says FSDP (`MegatronFSDP`, `_fsdp_grad_acc`)."""
    parts = ctx.path.replace("\\", "/").lower().split("/")
    if any("fsdp" in part for part in parts):
        return True
    for ancestor in ctx.ancestors(node):
        if isinstance(ancestor, (cst.ClassDef, cst.FunctionDef)):
            name = ancestor.name.value.lower()
            if "fsdp" in name or "fullyshard" in name:
                return True
    return False


def names_in(nodes: Sequence[cst.CSTNode]) -> set[str]:
    return {n.value for node in nodes for n in all_nodes(node, cst.Name)}


def function_of(ctx: FileContext, node: cst.CSTNode) -> cst.FunctionDef | None:
    """The nearest enclosing def, through lambdas (unlike `enclosing_function`)."""
    for ancestor in ctx.ancestors(node):
        if isinstance(ancestor, cst.FunctionDef):
            return ancestor
    return None


def in_wrapper(ctx: FileContext, node: cst.CSTNode) -> bool:
    """Is `node` in the data-parallel wrapper's own code (by path or by enclosing class name)?"""
    if is_wrapper_path(ctx.path):
        return True
    return any(
        isinstance(a, cst.ClassDef) and WRAPPER_CLASS.search(a.name.value) for a in ctx.ancestors(node)
    )


# main_grad buffers ------------------------------------------------------------------------------------
@dataclass
class MainGradScope:
    """Which expressions of one function (and the functions it is nested in) denote a main_grad buffer."""

    ctx: FileContext
    func: cst.FunctionDef | None
    bindings: dict[str, list[cst.BaseExpression]] = field(default_factory=dict)
    aliases: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, ctx: FileContext, func: cst.FunctionDef | None) -> MainGradScope:
        scope = cls(ctx, func)
        chain = [func] if func is not None else []
        chain += (
            [a for a in ctx.ancestors(func) if isinstance(a, cst.FunctionDef)] if func is not None else []
        )
        for owner in reversed(chain):  # inner bindings win
            for node in own_nodes(owner, cst.Assign, cst.AnnAssign):
                if isinstance(node, cst.Assign):
                    targets = [t.target for t in node.targets]
                elif isinstance(node, cst.AnnAssign):
                    targets = [node.target]
                else:
                    continue
                if node.value is None:
                    continue
                for target in targets:
                    if isinstance(target, cst.Name):
                        scope.bindings.setdefault(target.value, []).append(node.value)
        for _ in range(4):
            grew = False
            for name, values in scope.bindings.items():
                if name not in scope.aliases and any(scope.is_main_grad(v) for v in values):
                    scope.aliases.add(name)
                    grew = True
            if not grew:
                break
        return scope

    def is_main_grad(self, expr: cst.BaseExpression) -> bool:
        """Does `expr` evaluate to a main_grad buffer (or a list/view of them)?"""
        if isinstance(expr, cst.Attribute):
            return expr.attr.value == MAIN_GRAD
        if isinstance(expr, cst.Name):
            return expr.value in self.aliases or is_main_grad_name(expr.value)
        if isinstance(expr, cst.Subscript):
            return self.is_main_grad(expr.value)
        if isinstance(expr, cst.Call):
            func = expr.func
            name = func.attr.value if isinstance(func, cst.Attribute) else dotted_name(func) or ""
            if MAIN_GRAD in name.rsplit(".", 1)[-1] and not BOOL_PREFIX.match(name.rsplit(".", 1)[-1]):
                return True
            return isinstance(func, cst.Attribute) and name in VIEW_METHODS and self.is_main_grad(func.value)
        if isinstance(expr, cst.IfExp):
            return self.is_main_grad(expr.body) or self.is_main_grad(expr.orelse)
        if isinstance(expr, (cst.List, cst.Tuple)):
            return any(isinstance(e, cst.Element) and self.is_main_grad(e.value) for e in expr.elements)
        if isinstance(expr, (cst.ListComp, cst.GeneratorExp)):
            return self.is_main_grad(expr.elt)
        return False

    def mentions_main_grad(self, expr: cst.BaseExpression, depth: int = 0) -> bool:
        """Does `expr` read a main_grad buffer anywhere (`main_grad.dtype`, `dw.dtype` with `dw` an alias)?"""
        if MAIN_GRAD in code_of(expr):
            return True
        for name in all_nodes(expr, cst.Name):
            if isinstance(name, cst.Name) and name.value in self.aliases:
                return True
            if (
                depth < 3
                and isinstance(name, cst.Name)
                and any(self.mentions_main_grad(v, depth + 1) for v in self.bindings.get(name.value, []))
            ):
                return True
        return False

    def owner(self, expr: cst.BaseExpression) -> cst.BaseExpression | None:
        """`W` for `W.main_grad` (through views, subscripts and local aliases bound once), else None."""
        if isinstance(expr, cst.Attribute) and expr.attr.value == MAIN_GRAD:
            return expr.value
        if isinstance(expr, cst.Subscript):
            return self.owner(expr.value)
        if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
            if expr.func.attr.value == "get_main_grad":
                return expr.func.value
            if expr.func.attr.value in VIEW_METHODS:
                return self.owner(expr.func.value)
        if isinstance(expr, cst.Call) and (dotted_name(expr.func) or "").endswith("get_main_grad_from_param"):
            args = positional(expr)
            return args[0].value if args else None
        if isinstance(expr, cst.Name):
            values = self.bindings.get(expr.value, [])
            owners = {code_of(o): o for v in values if (o := self.owner(v)) is not None}
            if len(owners) == 1:
                return next(iter(owners.values()))
        return None


def out_pairs(node: cst.CSTNode) -> tuple[cst.BaseExpression, cst.BaseExpression | None, cst.CSTNode] | None:
    """(out, out_dtype, out_dtype holder) for a call with `out=` or a `{"out": ...}` kwargs literal."""
    if isinstance(node, cst.Call):
        out = keyword(node, "out")
        if out is None:
            return None
        dtype = keyword(node, "out_dtype")
        return out.value, dtype.value if dtype else None, dtype if dtype else node
    if isinstance(node, cst.Dict):
        found: dict[str, cst.DictElement] = {}
        for element in node.elements:
            if isinstance(element, cst.DictElement):
                key = string_value(element.key)
                if key in ("out", "out_dtype"):
                    found[key] = element
        if "out" not in found:
            return None
        dtype_element = found.get("out_dtype")
        return (
            found["out"].value,
            dtype_element.value if dtype_element else None,
            dtype_element if dtype_element else node,
        )
    return None


def reads_param_grad(expr: cst.BaseExpression) -> bool:
    """`param.grad`, `to_local(param.grad)`, `param.grad.data`: the hook moving `.grad`, not a fused write."""
    return any(isinstance(n, cst.Attribute) and n.attr.value == "grad" for n in walk.walk(expr))


def written_buffer(node: cst.CSTNode) -> cst.BaseExpression | None:
    """The expression a candidate wgrad write writes into, before deciding whether it is a main_grad: the
    third argument of a `wgrad_gemm_accum_*` kernel, the receiver of `add_`/`copy_` (unless the value
    moved is a parameter's `.grad`), the target of `+=`, an `out=` keyword or a `{"out": ...}` display."""
    if isinstance(node, cst.AugAssign):
        return node.target if isinstance(node.operator, cst.AddAssign) else None
    if isinstance(node, cst.Call):
        func = node.func
        method = func.attr.value if isinstance(func, cst.Attribute) else None
        if method in KERNELS:
            args = positional(node)
            return args[2].value if len(args) >= 3 else None
        if method in ("add_", "copy_") and isinstance(func, cst.Attribute):
            args = positional(node)
            if args and not reads_param_grad(args[0].value):
                return func.value
            return None
        if keyword(node, "out") is None:
            return None
    if isinstance(node, (cst.Call, cst.Dict)):
        pair = out_pairs(node)
        return pair[0] if pair is not None else None
    return None


# Values read from the overwrite flag ------------------------------------------------------------------
class FlagDerivation:
    """Which expressions of a file carry the value of `overwrite_main_grad` (the wrapper's per-parameter
    "overwrite, don't accumulate" flag), across the file's functions.

    Seeds: an `X.overwrite_main_grad` attribute, the string `"overwrite_main_grad"` (`getattr`), and calls
    of `facts.OVERWRITE_READERS`. Then, to a fixpoint over every assignment of the file: a local name
    (per function, visible in nested functions) or an attribute name (`bwd_args.origin_weight_overwrites`,
    by its last part, file-wide: forward and backward usually share a context object) assigned a carrying
    value carries it, and so does a call of a same-file function that returns one. Flow-insensitive on
    purpose: a name assigned the flag anywhere in a function may hold it at any later read."""

    def __init__(self, ctx: FileContext) -> None:
        self.ctx = ctx
        self.locals: set[tuple[int, str]] = set()  # (id of function or 0 for module, name)
        self.attrs: set[str] = set()
        self.readers: set[str] = set(OVERWRITE_READERS)
        if OVERWRITE_FLAG not in ctx.source and not any(r in ctx.source for r in OVERWRITE_READERS):
            return  # no seed anywhere: nothing carries the flag
        assigns = [
            n for n in ctx.nodes(cst.Assign, cst.AnnAssign, cst.AugAssign) if getattr(n, "value", None)
        ]
        functions = [f for f in ctx.nodes(cst.FunctionDef) if isinstance(f, cst.FunctionDef)]
        for _ in range(8):
            grew = False
            for node in assigns:
                owner = function_of(ctx, node)
                if not self.carries(node.value, owner):  # type: ignore[attr-defined]
                    continue
                targets = (
                    [t.target for t in node.targets] if isinstance(node, cst.Assign) else [node.target]  # type: ignore[attr-defined]
                )
                for target in targets:
                    for leaf in _target_leaves(target):
                        if isinstance(leaf, cst.Name):
                            key = (id(owner) if owner is not None else 0, leaf.value)
                            if key not in self.locals:
                                self.locals.add(key)
                                grew = True
                        elif isinstance(leaf, cst.Attribute) and leaf.attr.value not in self.attrs:
                            self.attrs.add(leaf.attr.value)
                            grew = True
            for func in functions:
                if func.name.value in self.readers:
                    continue
                returns = [r for r in own_nodes(func.body, cst.Return) if isinstance(r, cst.Return)]
                if any(r.value is not None and self.carries(r.value, func) for r in returns):
                    self.readers.add(func.name.value)
                    grew = True
            if not grew:
                break

    def carries(self, expr: cst.CSTNode, func: cst.FunctionDef | None) -> bool:
        """Whether evaluating `expr` (inside `func`) reads the overwrite flag."""
        chain = (
            [func, *(a for a in self.ctx.ancestors(func) if isinstance(a, cst.FunctionDef))] if func else []
        )
        scopes = {id(f) for f in chain} | {0}
        for node in walk.walk(expr):
            if isinstance(node, cst.Attribute):
                if node.attr.value == OVERWRITE_FLAG or node.attr.value in self.attrs:
                    return True
            elif isinstance(node, cst.Name):
                if any((scope, node.value) in self.locals for scope in scopes):
                    return True
            elif isinstance(node, cst.SimpleString):
                if string_value(node) == OVERWRITE_FLAG:
                    return True
            elif isinstance(node, cst.Call):
                name = (dotted_name(node.func) or "").rsplit(".", 1)[-1]
                if name in self.readers:
                    return True
        return False

    def guarded_by(self, node: cst.CSTNode, func: cst.FunctionDef | None) -> cst.BaseExpression | None:
        """The innermost test that decides whether `node` runs (an enclosing if/elif/while/ternary test, or
        the left operand of `a and node`/`a or node`) and that reads the flag, else None."""
        child: cst.CSTNode = node
        for parent in self.ctx.ancestors(node):
            test: cst.BaseExpression | None = None
            if (
                isinstance(parent, (cst.If, cst.IfExp))
                and (child is parent.body or child is parent.orelse)
                or isinstance(parent, cst.While)
                and child is parent.body
            ):
                test = parent.test
            elif isinstance(parent, cst.BooleanOperation) and child is parent.right:
                test = parent.left
            if test is not None and self.carries(test, func):
                return test
            if parent is func:
                break
            child = parent
        return None


def _target_leaves(target: cst.CSTNode) -> list[cst.CSTNode]:
    """Names and attributes an assignment target binds (`a`, `x.y`, both sides of `a, x.y = ...`)."""
    if isinstance(target, (cst.Tuple, cst.List)):
        return [leaf for e in target.elements for leaf in _target_leaves(e.value)]
    if isinstance(target, cst.StarredElement):
        return _target_leaves(target.value)
    return [target] if isinstance(target, (cst.Name, cst.Attribute)) else []


# What the file was written against -------------------------------------------------------------------
# Code written before Megatron-FSDP and before the `grad_added_to_main_grad` flag (Megatron-LM forks of
# 2021-2023, apex.transformer, metaseq, Megatron-DeepSpeed) fuses wgrads into a `main_grad` that its own
# optimizer creates eagerly and whose grad hook adds `.grad` only when one is returned. Rules that judge a
# write against the newer contract ask whether the file shows it knows that contract.
_FSDP_EVIDENCE = re.compile(r"\bget_main_grad\b|__fsdp_param__|\bget_main_grad_from_param\b|megatron_fsdp")
_FLAG_EVIDENCE = re.compile(
    r"\bgrad_added_to_main_grad\b|\boverwrite_main_grad\b|\bget_dummy_wgrads?(_for_params)?\b|\bzero_out_wgrad\b"
    r"|\bfuse_wgrad_accumulation\b|\baccumulate_into_main_grad\b"
)


def knows_fsdp_contract(source: str, helpers: frozenset[str] = frozenset()) -> bool:
    """Does the file handle Megatron-FSDP parameters anywhere (`get_main_grad()`, `__fsdp_param__`, TE's
    `get_main_grad_from_param`, a `megatron_fsdp` import, or a configured exposure helper)? Only such a file
    can be held to exposing `main_grad` before every fused write: in one that never mentions Megatron-FSDP
    the buffer is the one its data-parallel wrapper set at wrap time (or a property), not a lazy one."""
    if _FSDP_EVIDENCE.search(source):
        return True
    return any(h.rsplit(".", 1)[-1] in source for h in helpers)


def knows_flag_contract(source: str) -> bool:
    """Does the file show it is written against Megatron's `grad_added_to_main_grad` contract: the flag, the
    overwrite flag, dummy wgrads, Megatron-FSDP (which came after the flag), or Transformer Engine's names
    for fused wgrad accumulation (`fuse_wgrad_accumulation`, `accumulate_into_main_grad`: TE's modules are
    written for megatron-core's data-parallel hooks, which read the flag, and set it themselves)?"""
    return bool(_FLAG_EVIDENCE.search(source)) or knows_fsdp_contract(source)
