"""MG003: truth-testing a tensor-valued `main_grad` instead of comparing it with `None`."""

from __future__ import annotations

from collections.abc import Iterator
from enum import Enum

import libcst as cst

from maingrad.analyzer.context import FileContext, RuleSettings
from maingrad.analyzer.rules._common import (
    code_of,
    enclosing_function,
    getattr_of,
    is_simple_chain,
    local_bindings,
    main_grad_receiver,
)
from maingrad.analyzer.rules.base import Example, Fix, Rule, Violation
from maingrad.analyzer.syntax_index import SyntaxIndex
from maingrad.contracts.report import Severity


class _Use(Enum):
    TRUTH = "truth"  # only the truth value matters (if/while/assert/not/bool()/ternary test)
    TESTED = "tested"  # truth-tested and its value is used (`x.main_grad or y` as a value)
    VALUE = "value"  # not truth-tested


_TRUTH_PARENTS = (cst.If, cst.While, cst.Assert, cst.CompIf)


def _is_main_grad_value(node: cst.CSTNode, bindings: dict[str, list[cst.BaseExpression]]) -> bool:
    """`R.main_grad`, `getattr(R, "main_grad"[, d])`, `R.get_main_grad()`, or a local bound only to those."""
    if main_grad_receiver(node) is not None:
        return True
    got = getattr_of(node)
    if got is not None:
        return got[1] == "main_grad"
    if (
        isinstance(node, cst.Call)
        and isinstance(node.func, cst.Attribute)
        and node.func.attr.value == "get_main_grad"
        and not node.args
    ):
        return True
    if isinstance(node, cst.Name):
        values = bindings.get(node.value)
        return values is not None and bool(values) and all(_is_main_grad_value(v, {}) for v in values)
    return False


def _is_pure(node: cst.CSTNode) -> bool:
    """Evaluating it twice is harmless: a dotted chain or `getattr(chain, "main_grad", const)`."""
    if is_simple_chain(node):
        return True
    got = getattr_of(node)
    return got is not None and is_simple_chain(got[0])


def _is_bool_call(ctx: FileContext, node: cst.CSTNode) -> bool:
    return (
        isinstance(node, cst.Call)
        and isinstance(node.func, cst.Name)
        and node.func.value == "bool"
        and "bool" not in ctx.names.aliases
        and len(node.args) == 1
        and node.args[0].keyword is None
        and not node.args[0].star
    )


class MainGradTruthTest(Rule):
    id = "MG003"
    name = "main-grad-truth-test"
    severity = Severity.ERROR
    summary = "truth-testing a tensor-valued `main_grad` (`if p.main_grad:`) instead of `is None`"
    needles = ("main_grad",)
    fixable = True
    docs = """\
## What it does
Flags places where the truth value of a parameter's `main_grad` (or `getattr(p, "main_grad", None)`, or
`p.get_main_grad()`, or a local bound to one of those) is taken: `if`/`elif`/`while`/`assert` conditions,
ternary and comprehension conditions, `not p.main_grad`, `bool(p.main_grad)`, and operands of `and`/`or`.
Comparisons with `None`, `hasattr(p, "main_grad")` and `getattr(p, "main_grad", None) is None` are fine.

## Why is this bad?
`main_grad` is a tensor. `bool(tensor)` raises "Boolean value of Tensor with more than one value is
ambiguous" for any real weight, and for a one-element buffer it silently tests the *value* (a zero gradient
reads as "missing"). The question the code means to ask is whether the buffer exists: Megatron-FSDP leaves
`main_grad` absent or `None` until `get_main_grad()` exposes it.

## Example
```python
if not param.main_grad:
    param.main_grad = param.get_main_grad()
grad = param.main_grad or param.grad
```

## Use instead
```python
if param.main_grad is None:
    param.main_grad = param.get_main_grad()
grad = param.main_grad if param.main_grad is not None else param.grad
```
Truth tests are rewritten to `is not None` / `is None` (safe). `x.main_grad or y` / `x.main_grad and y` used
as values get an unsafe rewrite to a conditional expression (when `x` is a plain name chain); other value
uses are reported without a fix.

## In real code
No real instance is known: it reported nothing on the 14 code bases of `docs/real-world.md` (megatron-core
0.16.1/0.18.2/0.19.2, Transformer Engine 2.20.2, megatron-bridge, NeMo, ModelOpt, nanotron, DeepSpeed,
ColossalAI, torchtitan, and Megatron-LM, TE and Megatron-Bridge main). It guards the contract against new code.
"""

    VALID = [
        Example(
            """\
            if param.main_grad is None:
                param.main_grad = param.get_main_grad()
            """
        ),
        Example(
            """\
            if getattr(param, "main_grad", None) is not None and hasattr(param, "main_grad"):
                pass
            """
        ),
        Example(
            """\
            # a boolean flag, not the buffer
            if self.accumulate_into_main_grad and weight.grad_added_to_main_grad:
                pass
            """
        ),
        Example(
            """\
            grad = param.main_grad
            total = (param.main_grad.float() if param.main_grad is not None else 0) + 1
            """
        ),
        Example(
            """\
            def f(p, use_main_grad):
                main_grad = use_main_grad
                if main_grad:
                    return p.main_grad
            """
        ),
        Example(
            """\
            def f(p):
                value = p.grad or p.main_grad  # only the last operand: its value, not its truth, is used
                return value
            """
        ),
        Example(
            """\
            if p.main_grad.any():
                pass
            """
        ),
    ]
    INVALID = [
        Example(
            """\
            if param.main_grad:
                param.main_grad.zero_()
            """,
            line=1,
            fixed="""\
            if param.main_grad is not None:
                param.main_grad.zero_()
            """,
        ),
        Example(
            """\
            for p in params:
                if not p.main_grad:
                    p.main_grad = p.get_main_grad()
            """,
            line=2,
            fixed="""\
            for p in params:
                if p.main_grad is None:
                    p.main_grad = p.get_main_grad()
            """,
        ),
        Example(
            """\
            while getattr(p, "main_grad", None) and retries:
                retries -= 1
            """,
            line=1,
            fixed="""\
            while getattr(p, "main_grad", None) is not None and retries:
                retries -= 1
            """,
        ),
        Example(
            """\
            assert weight.main_grad, "expose main_grad first"
            """,
            line=1,
            fixed="""\
            assert weight.main_grad is not None, "expose main_grad first"
            """,
        ),
        Example(
            """\
            ready = bool(weight.main_grad) + 1
            """,
            line=1,
            fixed="""\
            ready = (weight.main_grad is not None) + 1
            """,
        ),
        Example(
            """\
            buf = x if w.main_grad else y
            """,
            line=1,
            fixed="""\
            buf = x if w.main_grad is not None else y
            """,
        ),
        Example(
            """\
            def hook(p):
                main_grad = getattr(p, "main_grad", None)
                if flag or not main_grad:
                    return None
                return main_grad
            """,
            line=3,
            fixed="""\
            def hook(p):
                main_grad = getattr(p, "main_grad", None)
                if flag or main_grad is None:
                    return None
                return main_grad
            """,
        ),
        Example(
            """\
            grad = param.main_grad or param.grad
            """,
            line=1,
            fixed="""\
            grad = param.main_grad if param.main_grad is not None else param.grad
            """,
        ),
        Example(
            """\
            norm = p.main_grad and p.main_grad.norm()
            """,
            line=1,
            fixed="""\
            norm = p.main_grad.norm() if p.main_grad is not None else p.main_grad
            """,
        ),
        Example(
            """\
            ok = [p for p in params if p.main_grad]
            """,
            line=1,
            fixed="""\
            ok = [p for p in params if p.main_grad is not None]
            """,
        ),
        Example(
            """\
            grad = weights[0].main_grad or fallback or zeros
            """,
            line=1,
        ),
    ]

    def gate(self, index: SyntaxIndex, settings: RuleSettings) -> bool:
        """Over-approximates `check`: every finding is a main_grad value (`R.main_grad`, `getattr(R,
        "main_grad"...)`, `R.get_main_grad()`) or a name assigned one, sitting directly in a truth context
        (if/while/assert/comprehension-if/ternary test, `not`, `bool()`) or as any operand of `and`/`or`
        (which covers TRUTH and TESTED uses). Names count when assigned such a value anywhere in the file."""
        return index.truth_main_grad or bool(index.truth_names & index.main_grad_value_names)

    def check(self, ctx: FileContext) -> Iterator[Violation]:
        # Locals bound to main_grad somewhere in the file: only those Names need the per-function check.
        candidates = {
            target.target.value
            for assign in ctx.nodes(cst.Assign)
            if isinstance(assign, cst.Assign) and _is_main_grad_value(assign.value, {})
            for target in assign.targets
            if isinstance(target.target, cst.Name)
        }
        nodes: list[cst.BaseExpression] = [n for n in ctx.nodes(cst.Attribute) if n.attr.value == "main_grad"]
        nodes += [n for n in ctx.nodes(cst.Call) if _is_main_grad_value(n, {})]
        nodes += [n for n in ctx.nodes(cst.Name) if n.value in candidates]
        for node in nodes:
            bindings: dict[str, list[cst.BaseExpression]] = {}
            if isinstance(node, cst.Name):
                if node.value not in candidates:
                    continue
                parent = ctx.parent(node)
                if isinstance(parent, cst.Attribute) and parent.attr is node:
                    continue
                func = enclosing_function(ctx, node)
                if func is None:
                    continue
                bindings = local_bindings(func, ctx)
            if not _is_main_grad_value(node, bindings):
                continue
            violation = self._violation(ctx, node)
            if violation is not None:
                yield violation

    def _violation(self, ctx: FileContext, node: cst.BaseExpression) -> Violation | None:
        parent = ctx.parent(node)
        what = code_of(node.with_changes(lpar=[], rpar=[])) if node.lpar else code_of(node)
        message = (
            f"truth value of tensor `{what}` is taken; test presence with `{what} is None` / "
            f"`{what} is not None` (a multi-element tensor raises, a zero one reads as missing)"
        )
        if isinstance(parent, cst.UnaryOperation) and isinstance(parent.operator, cst.Not):
            replacement = _compare(node, "is None", parent)
            return Violation(parent, message, Fix({parent: replacement}, f"`not {what}` -> `{what} is None`"))
        call = _bool_call_of(ctx, node)
        if call is not None:
            grand = ctx.parent(call)
            bare_ok = isinstance(grand, (*_TRUTH_PARENTS, cst.BooleanOperation)) or (
                isinstance(grand, cst.UnaryOperation) and isinstance(grand.operator, cst.Not)
            )
            wrap = not bare_ok
            replacement = _compare(node, "is not None", call, parens=wrap)
            return Violation(call, message, Fix({call: replacement}, f"`bool({what})` -> `is not None`"))
        use = _use(ctx, node)
        if use is _Use.VALUE:
            return None
        if use is _Use.TRUTH:
            return Violation(
                node, message, Fix({node: _compare(node, "is not None")}, "`x` -> `x is not None`")
            )
        # TESTED: the value of an `and`/`or` is used. Rewrite only a two-operand expression with a pure left.
        fix = None
        if (
            isinstance(parent, cst.BooleanOperation)
            and parent.left is node
            and _use(ctx, parent) is _Use.VALUE
            and _is_pure(node)
        ):
            test = _compare(node, "is not None")
            if isinstance(parent.operator, cst.Or):
                new: cst.BaseExpression = cst.IfExp(test=test, body=node, orelse=parent.right)
            else:
                new = cst.IfExp(test=test, body=parent.right, orelse=node)
            new = new.with_changes(lpar=parent.lpar, rpar=parent.rpar)
            fix = Fix({parent: new}, "use a conditional expression on `is not None`", safe=False)
        return Violation(node, message, fix)


def _bool_call_of(ctx: FileContext, node: cst.CSTNode) -> cst.Call | None:
    """The `bool(node)` call around `node`, if any."""
    arg = ctx.parent(node)
    call = ctx.parent(arg) if isinstance(arg, cst.Arg) else None
    if isinstance(call, cst.Call) and _is_bool_call(ctx, call) and call.args[0] is arg:
        return call
    return None


def _use(ctx: FileContext, node: cst.CSTNode) -> _Use:
    parent = ctx.parent(node)
    if isinstance(parent, (cst.If, cst.While)) and parent.test is node:
        return _Use.TRUTH
    if isinstance(parent, cst.Assert) and parent.test is node:
        return _Use.TRUTH
    if isinstance(parent, cst.CompIf) and parent.test is node:
        return _Use.TRUTH
    if isinstance(parent, cst.IfExp) and parent.test is node:
        return _Use.TRUTH
    if isinstance(parent, cst.UnaryOperation) and isinstance(parent.operator, cst.Not):
        return _Use.TRUTH
    if _bool_call_of(ctx, node) is not None:
        return _Use.TRUTH
    if isinstance(parent, cst.BooleanOperation):
        outer = _use(ctx, parent)
        if node is parent.left:
            return _Use.TRUTH if outer is _Use.TRUTH else _Use.TESTED
        return outer
    return _Use.VALUE


def _compare(
    node: cst.BaseExpression, op: str, replaced: cst.BaseExpression | None = None, parens: bool = False
) -> cst.BaseExpression:
    """`node is None` / `node is not None`; when it replaces a larger node (`not x`, `bool(x)`), the result
    takes over that node's parentheses, or gets new ones where a bare comparison would bind wrongly."""
    operator: cst.BaseCompOp = cst.IsNot() if op == "is not None" else cst.Is()
    comparison = cst.Comparison(
        left=node, comparisons=[cst.ComparisonTarget(operator=operator, comparator=cst.Name("None"))]
    )
    if replaced is None:
        return comparison
    if replaced.lpar:
        return comparison.with_changes(lpar=replaced.lpar, rpar=replaced.rpar)
    if parens:
        return comparison.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    return comparison
