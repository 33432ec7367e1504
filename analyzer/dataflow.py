"""Control and data flow within one function, for rules that ask "which tests decide whether this statement
runs, and what do those tests read?".

Kept apart from `rules/_common.py` (the helpers the existing rules share) so that rules MG012+ can follow a
flag's value through local names without changing what the older rules see.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import libcst as cst

from maingrad.analyzer import walk
from maingrad.analyzer.context import FileContext

_EXITS = (cst.Return, cst.Raise, cst.Continue, cst.Break)


def _always_exits(body: cst.BaseSuite) -> bool:
    if isinstance(body, cst.SimpleStatementSuite):
        return bool(body.body) and isinstance(body.body[-1], _EXITS)
    if isinstance(body, cst.IndentedBlock) and body.body:
        last = body.body[-1]
        return (
            isinstance(last, cst.SimpleStatementLine)
            and bool(last.body)
            and isinstance(last.body[-1], _EXITS)
        )
    return False


def deciding_tests(ctx: FileContext, node: cst.CSTNode) -> Iterator[cst.BaseExpression]:
    """The tests, inside `node`'s function, whose value decides whether `node` runs: enclosing `if`/`elif`
    (and the earlier tests of an `elif` chain), `while` and ternary tests, the left operand of an `and`/`or`
    whose right operand holds `node`, and `if <test>: return/continue/raise/break` guards before it in an
    enclosing block."""
    child: cst.CSTNode = node
    for ancestor in ctx.ancestors(node):
        if isinstance(ancestor, (cst.FunctionDef, cst.Lambda, cst.ClassDef)):
            return
        if isinstance(ancestor, (cst.If, cst.While, cst.IfExp)) and child is not ancestor.test:
            yield ancestor.test
        elif isinstance(ancestor, cst.BooleanOperation) and child is ancestor.right:
            yield ancestor.left
        elif isinstance(ancestor, cst.IndentedBlock | cst.Module):
            for stmt in ancestor.body:
                if stmt is child:
                    break
                if isinstance(stmt, cst.If) and _always_exits(stmt.body):
                    yield stmt.test
        child = ancestor


def local_bindings(func: cst.FunctionDef | None) -> dict[str, list[cst.BaseExpression]]:
    """`name -> values` of the assignments and loop targets in `func` (nested functions included: a closure
    reads the enclosing function's names)."""
    out: dict[str, list[cst.BaseExpression]] = {}
    if func is None:
        return out
    for node in walk.walk(func):
        if isinstance(node, cst.Assign):
            for target in node.targets:
                if isinstance(target.target, cst.Name):
                    out.setdefault(target.target.value, []).append(node.value)
        elif isinstance(node, cst.AnnAssign) and node.value is not None and isinstance(node.target, cst.Name):
            out.setdefault(node.target.value, []).append(node.value)
        elif isinstance(node, (cst.For, cst.CompFor)):
            # `for p, g in zip(params, grads)`: each name of the target is bound (over-approximately) to the
            # whole iterable.
            for name in walk.walk(node.target):
                if isinstance(name, cst.Name):
                    out.setdefault(name.value, []).append(node.iter)
    return out


def derives_from(
    expr: cst.CSTNode,
    predicate: Callable[[cst.CSTNode], bool],
    bindings: dict[str, list[cst.BaseExpression]],
    depth: int = 0,
) -> bool:
    """Does `expr`, or a value a local name in it is bound to (through up to four names, loop targets
    included), contain a node satisfying `predicate`?"""
    for node in walk.walk(expr):
        if predicate(node):
            return True
        if (
            depth < 4
            and isinstance(node, cst.Name)
            and node.value in bindings
            and any(derives_from(v, predicate, bindings, depth + 1) for v in bindings[node.value])
        ):
            return True
    return False


def reads_attribute_value(
    expr: cst.CSTNode, attr: str, bindings: dict[str, list[cst.BaseExpression]], depth: int = 0
) -> bool:
    """Does `expr` read the value of attribute `attr` of some object: `X.attr`, `getattr(X, "attr"[, d])`, or a
    local name bound to such an expression (through up to four names)? `hasattr(X, "attr")` asks whether the
    attribute exists, not what it holds, and does not count."""

    def reads(node: cst.CSTNode) -> bool:
        if isinstance(node, cst.Attribute):
            return node.attr.value == attr
        if isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "getattr":
            key = node.args[1].value if len(node.args) >= 2 else None
            return isinstance(key, cst.SimpleString) and key.evaluated_value == attr
        return False

    return derives_from(expr, reads, bindings, depth)
