"""MG010: `grad_added_to_main_grad` and the dummy wgrad decided by the overwrite flag instead of by "the wgrad
went into `main_grad`".

A backward that writes the wgrad straight into `main_grad` must, on every such path, set
`W.grad_added_to_main_grad = True` and return a dummy gradient for `W` (TE's `get_dummy_wgrads_for_params`,
`get_dummy_wgrad`): the data-parallel wrapper's grad hook then leaves `main_grad` alone. Whether the GEMM
accumulated into the buffer or overwrote it (`overwrite_main_grad`) does not change that: in both cases the
wgrad is in `main_grad`. When the test that guards the flag or the dummy reads the overwrite flag, the
overwrite case returns the real gradient (TE's fused ops return `main_grad` itself) and leaves the flag unset,
so the wrapper adds it into `main_grad` a second time.

What is judged: every assignment `W.grad_added_to_main_grad = <not False>` and every call of TE's flag
helpers (`facts.FLAG_HELPERS`, `facts.DUMMY_WGRAD_FUNCS`), against the tests that decide whether it runs
(enclosing if/elif/while/ternary tests, `a and ...` operands) in its function. A test that reads the
overwrite flag (`rules._common.FlagDerivation`: directly, through TE's `get_accumulate_flag_in_param`, or
through local names, context attributes and same-file functions carrying it) is the finding. The
data-parallel wrapper's own code (path or class, as for MG008) is not judged. TE 2.20.2's
`ops/basic/basic_linear.py` and the fused ops built on it reuse one local, `accumulate_into_main_grad`, for
"fused into main_grad" and then for "accumulate, not overwrite"; its `GroupedLinear` op and `te.Linear` keep
them apart and are clean.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

import libcst as cst

from maingrad.analyzer import syntax_index, walk
from maingrad.analyzer.context import FileContext, RuleSettings
from maingrad.analyzer.facts import (
    DUMMY_WGRAD_FUNCS,
    FLAG_HELPERS,
    GRAD_ADDED_FLAG,
    OVERWRITE_FLAG,
    OVERWRITE_READERS,
    is_wrapper_path,
)
from maingrad.analyzer.names import dotted_name
from maingrad.analyzer.rules._common import (
    FlagDerivation,
    code_of,
    function_of,
    in_wrapper,
    is_false_constant,
    is_simple_chain,
)
from maingrad.analyzer.rules.base import Example, Fix, Rule, Violation
from maingrad.analyzer.syntax_index import SyntaxIndex
from maingrad.contracts.report import Severity

_SITES = FLAG_HELPERS | DUMMY_WGRAD_FUNCS
_SEEDS = (OVERWRITE_FLAG, *sorted(OVERWRITE_READERS))


def _site_kind(node: cst.CSTNode) -> str | None:
    """ "flag" for `W.grad_added_to_main_grad = <not False>`, "dummy" for a TE flag/dummy-wgrad helper call."""
    if isinstance(node, cst.Assign):
        if is_false_constant(node.value):
            return None
        if any(
            isinstance(t.target, cst.Attribute) and t.target.attr.value == GRAD_ADDED_FLAG
            for t in node.targets
        ):
            return "flag"
        return None
    if isinstance(node, cst.Call):
        name = (dotted_name(node.func) or "").rsplit(".", 1)[-1]
        return "dummy" if name in _SITES else None
    return None


class GradAddedDecidedByOverwriteFlag(Rule):
    id = "MG010"
    name = "grad-added-decided-by-overwrite-flag"
    severity = Severity.ERROR
    summary = (
        "`grad_added_to_main_grad` / the dummy wgrad is decided by a test that reads `overwrite_main_grad`"
    )
    needles = tuple((site, seed) for site in (GRAD_ADDED_FLAG, *sorted(DUMMY_WGRAD_FUNCS)) for seed in _SEEDS)
    fixable = True
    docs = """\
## What it does
Finds the place where a backward that writes its wgrad into `main_grad` sets `W.grad_added_to_main_grad` or
builds the dummy wgrad it returns (`get_dummy_wgrads_for_params`, `get_dummy_wgrad`), when the test deciding
whether that happens reads the parameter's `overwrite_main_grad` flag: directly, through TE's
`get_accumulate_flag_in_param`, or through a local, a context attribute or a same-file function assigned
from them anywhere in the file.

## Why is this bad?
The overwrite flag only tells the GEMM whether to add to `main_grad` or replace it; either way the wgrad is
in `main_grad` afterwards, so the backward must set `grad_added_to_main_grad` and return a dummy. Decided by
"accumulate" instead, the overwrite case (Megatron-FSDP `optim_grads_params`) returns the real gradient (TE's
ops return the `main_grad` buffer itself) and leaves the flag unset: the wrapper's grad hook adds it into
`main_grad` again (the optimizer sees twice the gradient) and the weight holds an extra weight-sized `.grad`
through backward.

## Example
```python
accumulate_into_main_grad = self._accumulate_into_main_grad
if ctx.weight_requires_grad and accumulate_into_main_grad:
    main_grad = get_main_grad_from_param(self.weight)
    accumulate_into_main_grad = get_accumulate_flag_in_param(self.weight)  # now "accumulate, not overwrite"
    grad_weight = main_grad.detach()
...
if accumulate_into_main_grad:
    grad_weight = get_dummy_wgrads_for_params([self.weight])[0]
```

## Use instead
```python
fuse_into_main_grad = ctx.weight_requires_grad and self._accumulate_into_main_grad
accumulate = False
if fuse_into_main_grad:
    main_grad = get_main_grad_from_param(self.weight)
    accumulate = get_accumulate_flag_in_param(self.weight)
    grad_weight = main_grad.detach()
...  # the GEMM takes accumulate_into_grad_weight=accumulate
if fuse_into_main_grad:
    grad_weight = get_dummy_wgrads_for_params([self.weight])[0]
```
Keep two names: one for "the wgrad goes into main_grad" (decides the flag and the dummy), one for
"accumulate rather than overwrite" (goes to the GEMM), as TE #2923 did for its `GroupedLinear` op
(`if ctx.weight_requires_grad and self._accumulate_into_main_grad: ... get_dummy_wgrads_for_params(...)`,
"regardless of overwrite vs. accumulate"). The (unsafe) fix does that where the deciding test is a local
`L` that the function first binds to a plain attribute chain (`L = self._accumulate_into_main_grad`) and
later rebinds from the flag inside `if <test on L>:`: the test deciding the dummy or the flag becomes that
`if`'s test with `L` replaced by its first value (`ctx.weight_requires_grad and
self._accumulate_into_main_grad`), i.e. "the wgrad went into main_grad". Other shapes keep the finding with no
fix.

## In real code
Transformer Engine 2.20.2 `ops/basic/basic_linear.py` (`BasicLinear.op_backward`) and the fused ops that
copy it (`ops/fused/backward_linear_add.py`, `backward_linear_scale.py`, `userbuffers_backward_linear.py`),
still on TE main. Confirmed on an H200: megatron-core `TEFusedMLP` under Megatron-FSDP `optim_grads_params`
with gradient accumulation fusion reaches the optimizer with 2.0x the true gradient.
"""

    VALID = [
        # TE's GroupedLinear op: the dummy is decided by the configuration, the GEMM by the flag.
        Example(
            """\
            def fuser_backward(self, ctx, dy):
                accumulate_into_main_grad = self._accumulate_into_main_grad
                if accumulate_into_main_grad:
                    main_grad = get_main_grad_from_param(self.weight)
                    accumulate_into_main_grad = get_accumulate_flag_in_param(self.weight)
                general_gemm(ctx.x, dy, out=main_grad, accumulate=accumulate_into_main_grad)
                if ctx.weight_requires_grad and self._accumulate_into_main_grad:
                    grads = get_dummy_wgrads_for_params([self.weight])
                return grads
            """
        ),
        # te.Linear: the flag is set under the fusion test; the overwrite flag only reaches the GEMM.
        Example(
            """\
            def _linear_backward(args, weight, x, dy):
                overwrites = getattr(weight, "overwrite_main_grad", False)
                general_gemm(x, dy, out=args.main_grad, accumulate=not overwrites)
                if args.fuse_wgrad_accumulation and hasattr(weight, "grad_added_to_main_grad"):
                    weight.grad_added_to_main_grad = True
                    wgrad = get_dummy_wgrad(list(weight.shape), weight.dtype)
                return wgrad
            """
        ),
        # Resetting the flag under an overwrite test is not setting it.
        Example(
            """\
            def zero_grad(params):
                for p in params:
                    if p.overwrite_main_grad:
                        p.grad_added_to_main_grad = False
            """
        ),
    ]
    INVALID = [
        # TE 2.20.2 BasicLinear.op_backward.
        Example(
            """\
            def op_backward(self, ctx, grad_output):
                accumulate_into_main_grad = self._accumulate_into_main_grad
                grad_weight = None
                if ctx.weight_requires_grad and accumulate_into_main_grad:
                    main_grad = get_main_grad_from_param(self.weight, op_label="BasicLinear")
                    accumulate_into_main_grad = get_accumulate_flag_in_param(self.weight)
                    grad_weight = main_grad.detach()
                else:
                    accumulate_into_main_grad = False
                grad_input, grad_weight = self._functional_backward(grad_weight=grad_weight, accumulate_into_grad_weight=accumulate_into_main_grad)
                if accumulate_into_main_grad:
                    grad_weight = get_dummy_wgrads_for_params([self.weight])[0]
                return grad_input, [grad_weight]
            """,
            line=12,
            fixed="""\
            def op_backward(self, ctx, grad_output):
                accumulate_into_main_grad = self._accumulate_into_main_grad
                grad_weight = None
                if ctx.weight_requires_grad and accumulate_into_main_grad:
                    main_grad = get_main_grad_from_param(self.weight, op_label="BasicLinear")
                    accumulate_into_main_grad = get_accumulate_flag_in_param(self.weight)
                    grad_weight = main_grad.detach()
                else:
                    accumulate_into_main_grad = False
                grad_input, grad_weight = self._functional_backward(grad_weight=grad_weight, accumulate_into_grad_weight=accumulate_into_main_grad)
                if ctx.weight_requires_grad and self._accumulate_into_main_grad:
                    grad_weight = get_dummy_wgrads_for_params([self.weight])[0]
                return grad_input, [grad_weight]
            """,
        ),
        # The flag itself, set only when accumulating.
        Example(
            """\
            def backward(ctx, dy):
                weight = ctx.weight
                accumulate = not getattr(weight, "overwrite_main_grad", False)
                general_gemm(ctx.x, dy, out=weight.main_grad, accumulate=accumulate)
                if accumulate and hasattr(weight, "grad_added_to_main_grad"):
                    weight.grad_added_to_main_grad = True
                return None
            """,
            line=6,
        ),
        # Through a context attribute set in forward.
        Example(
            """\
            class Fn(torch.autograd.Function):
                @staticmethod
                def forward(ctx, x, weight):
                    ctx.accumulate = not weight.overwrite_main_grad
                    return x @ weight.t()

                @staticmethod
                def backward(ctx, dy):
                    wgrad = None if not ctx.accumulate else get_dummy_wgrad(list(ctx.shape), dy.dtype)
                    return dy, wgrad
            """,
            line=9,
        ),
    ]

    def gate(self, index: SyntaxIndex, settings: RuleSettings) -> bool:
        """Over-approximates `check`: outside the wrapper's path (exact), a test can only carry the overwrite
        flag when the file names it or one of its readers (the seeds of `FlagDerivation`), and a site is an
        attribute store `X.grad_added_to_main_grad = ...` or a call whose last name is a helper's."""
        source = index.source
        if is_wrapper_path(index.path) or not any(seed in source for seed in _SEEDS):
            return False
        for node in ast.walk(index.tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == GRAD_ADDED_FLAG
                and isinstance(node.ctx, ast.Store)
            ):
                return True
            if isinstance(node, ast.Call) and syntax_index.last_name(node) in _SITES:
                return True
        return False

    def check(self, ctx: FileContext) -> Iterator[Violation]:
        flags: FlagDerivation | None = None
        for node in ctx.nodes(cst.Assign, cst.Call):
            kind = _site_kind(node)
            if kind is None or in_wrapper(ctx, node):
                continue
            flags = flags or FlagDerivation(ctx)
            func = function_of(ctx, node)
            test = flags.guarded_by(node, func)
            if test is None:
                continue
            what = (
                "`grad_added_to_main_grad` is set"
                if kind == "flag"
                else f"the dummy wgrad (`{(dotted_name(node.func) or '').rsplit('.', 1)[-1]}`) is returned"  # type: ignore[attr-defined]
            )
            yield Violation(
                node=node,
                message=(
                    f"{what} only when `{code_of(test)}` holds, a test that reads `{OVERWRITE_FLAG}`: with the "
                    "flag set the wgrad still lands in main_grad, but the real gradient is returned and the flag "
                    "stays unset, so the data-parallel grad hook adds it a second time; decide both by whether "
                    "the wgrad went into main_grad (e.g. `self._accumulate_into_main_grad`), not by the "
                    "accumulate/overwrite choice."
                ),
                fix=_fused_test_fix(ctx, func, test),
            )


def _fused_test_fix(ctx: FileContext, func: cst.FunctionDef | None, test: cst.BaseExpression) -> Fix | None:
    """Replace a deciding test `L` by "the wgrad went into main_grad" (TE #2923's shape): the test of the
    `if` inside which `L` was rebound from the flag, with `L` replaced by its first value in `func`."""
    if func is None or not isinstance(test, cst.Name):
        return None
    name = test.value
    first: cst.BaseExpression | None = None
    fusing: cst.If | None = None
    for node in walk.walk(func.body):
        if not isinstance(node, cst.Assign) or len(node.targets) != 1:
            continue
        target = node.targets[0].target
        if not (isinstance(target, cst.Name) and target.value == name):
            continue
        if first is None:
            first = node.value
            continue
        owner = ctx.enclosing(node, cst.If)
        if (
            isinstance(owner, cst.If)
            and any(isinstance(n, cst.Name) and n.value == name for n in walk.walk(owner.test))
            and ctx.enclosing(owner, cst.FunctionDef) is func
        ):
            fusing = owner
            break
    if first is None or fusing is None or not is_simple_chain(first):
        return None
    if not all(isinstance(n, _PURE_TEST) for n in walk.walk(fusing.test)):
        return None
    fused = fusing.test.visit(_Rename(name, first))
    if not isinstance(fused, cst.BaseExpression):
        return None
    if isinstance(fused, cst.BooleanOperation) and not fused.lpar and _needs_parens(ctx, test):
        fused = fused.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    return Fix(
        {test: fused},
        "decide by whether the wgrad went into main_grad, not by the overwrite flag",
        safe=False,
    )


def _needs_parens(ctx: FileContext, test: cst.BaseExpression) -> bool:
    """A `a and b` put where `test` was: parenthesised unless it is a whole if/while/ternary test."""
    parent = ctx.parent(test)
    return not (isinstance(parent, (cst.If, cst.While, cst.IfExp)) and parent.test is test)


# Node types of a test that is safe to evaluate again elsewhere: names, attribute chains, boolean logic.
_PURE_TEST = (
    cst.Name,
    cst.Attribute,
    cst.BooleanOperation,
    cst.And,
    cst.Or,
    cst.UnaryOperation,
    cst.Not,
    cst.Dot,
    cst.LeftParen,
    cst.RightParen,
    cst.SimpleWhitespace,
    cst.ParenthesizedWhitespace,
    cst.TrailingWhitespace,
    cst.Newline,
    cst.EmptyLine,
    cst.Comment,
)


class _Rename(cst.CSTTransformer):
    """Replace every load of the name by an expression."""

    def __init__(self, name: str, value: cst.BaseExpression) -> None:
        super().__init__()
        self.name = name
        self.value = value

    def leave_Name(self, original_node: cst.Name, updated_node: cst.Name) -> cst.BaseExpression:
        return self.value if original_node.value == self.name else updated_node
