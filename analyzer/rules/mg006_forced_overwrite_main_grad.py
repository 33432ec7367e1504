"""MG006: `overwrite_main_grad` forced to a constant `True` outside the data-parallel wrapper.

The flag belongs to the data-parallel wrapper: Megatron-FSDP sets it on every unshard from its sharding
strategy, DDP never sets it (TE then accumulates). Code outside the wrapper that writes a constant `True`
makes every fused wgrad GEMM that reads it overwrite `main_grad`, which with unsharded gradients and
several micro-batches per step drops the earlier micro-batches.

What is not flagged, and why:
* the wrapper's own code (a `megatron/core/distributed/` or `*fsdp*` path, a `*data_parallel*`/`*ddp*`
  module, or a class named like a wrapper): it owns the flag and knows its buffers;
* assignments whose value is not a constant, or that sit behind a test on the sharding strategy
  (any `if`/`while`/`assert`/ternary test mentioning `strategy` before the assignment in its function):
  the value is then derived from the strategy;
* constant `False` (or other falsy constants): `False` means "accumulate", which is what TE does when the
  attribute is absent (`getattr(w, "overwrite_main_grad", False)`), so it never discards gradients; it is the
  usual reset after a manual `main_grad.zero_()`;
* test files (`tests/`, `test_*.py`, `*_test.py`, `conftest.py`), which set the flag to build a scenario.

* a write inside `if hasattr(X, "overwrite_main_grad"):` on its own target `X`, when the same scan holds the
  Megatron-FSDP wrapper and it only ever sets the flag to `True` (the project fact
  `megatron-fsdp-only-sets-overwrite-main-grad-true`, `maingrad.analyzer.project`): the flag then exists only
  where the wrapper set it, already `True`, and the write changes nothing (megatron-core 0.19.2). Without
  the wrapper in the scan (one file, or a tree without it) the write is reported.

No fix is offered (see the rule's docs).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import libcst as cst

from maingrad.analyzer.context import FileContext, RuleSettings
from maingrad.analyzer.facts import OVERWRITE_FLAG as FLAG
from maingrad.analyzer.facts import WRAPPER_CLASS, is_test_path, is_wrapper_path
from maingrad.analyzer.names import dotted_name
from maingrad.analyzer.project import FSDP_ONLY_SETS_OVERWRITE_TRUE
from maingrad.analyzer.rules._common import (
    code_of,
    enclosing_function,
    in_wrapper,
    is_before,
    literal_value,
    local_bindings,
    single_binding,
    string_value,
)
from maingrad.analyzer.rules.base import Example, Rule, Violation
from maingrad.analyzer.syntax_index import SyntaxIndex, pos
from maingrad.contracts.report import Severity

_STRATEGY = re.compile(r"strateg", re.IGNORECASE)


def _is_truthy_constant(node: cst.BaseExpression, bindings: dict[str, list[cst.BaseExpression]]) -> bool:
    if isinstance(node, cst.Name) and node.value == "True":
        return True
    if isinstance(node, cst.Integer):
        return literal_value(node) != 0
    bound = single_binding(bindings, node)
    return bound is not None and bound is not node and _is_truthy_constant(bound, {})


def _forced_value(small: cst.BaseSmallStatement) -> cst.BaseExpression | None:
    """The value a statement assigns to `X.overwrite_main_grad`, else None."""
    if isinstance(small, cst.Assign):
        if any(isinstance(t.target, cst.Attribute) and t.target.attr.value == FLAG for t in small.targets):
            return small.value
    elif isinstance(small, cst.AnnAssign):
        if isinstance(small.target, cst.Attribute) and small.target.attr.value == FLAG:
            return small.value
    elif isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
        call = small.value
        args = [a for a in call.args if not a.star and a.keyword is None]
        if dotted_name(call.func) == "setattr" and len(args) == 3 and string_value(args[1].value) == FLAG:
            return args[2].value
    return None


def _target_code(small: cst.BaseSmallStatement) -> str | None:
    """The code of `X` in a write of `X.overwrite_main_grad`."""
    if isinstance(small, cst.Assign):
        for t in small.targets:
            if isinstance(t.target, cst.Attribute) and t.target.attr.value == FLAG:
                return code_of(t.target.value)
    elif isinstance(small, cst.AnnAssign) and isinstance(small.target, cst.Attribute):
        return code_of(small.target.value)
    elif isinstance(small, cst.Expr) and isinstance(small.value, cst.Call) and small.value.args:
        return code_of(small.value.args[0].value)
    return None


def _only_where_set(ctx: FileContext, line: cst.SimpleStatementLine, small: cst.BaseSmallStatement) -> bool:
    """The write sits in the body of an `if hasattr(X, "overwrite_main_grad")` on its own target `X`: it
    only re-sets a flag something else (the wrapper) already set."""
    receiver = _target_code(small)
    if receiver is None:
        return False
    guard = re.compile(rf"""hasattr\(\s*{re.escape(receiver)}\s*,\s*["']{FLAG}["']\s*\)""")
    child: cst.CSTNode = line
    for node in ctx.ancestors(line):
        if isinstance(node, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            return False
        if isinstance(node, cst.If) and child is node.body and _requires(node.test, guard):
            return True
        child = node
    return False


def _requires(test: cst.BaseExpression, guard: re.Pattern[str]) -> bool:
    """`test` is true only when `guard` (a call) is: the call itself, or one operand of an `and`."""
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
        return _requires(test.left, guard) or _requires(test.right, guard)
    return isinstance(test, cst.Call) and guard.fullmatch(code_of(test).strip()) is not None


def _strategy_guarded(ctx: FileContext, node: cst.CSTNode) -> bool:
    """A test on the sharding strategy before `node` in its function makes the value strategy-derived."""
    func = enclosing_function(ctx, node)
    scope = func if func is not None else ctx.module
    for test_owner in ctx.own_nodes(scope, cst.If, cst.While, cst.Assert, cst.IfExp):
        test = test_owner.test  # type: ignore[attr-defined]
        # The cheap order test first: rendering the test's code is what costs.
        if is_before(ctx, test_owner, node) and _STRATEGY.search(code_of(test)):
            return True
    return False


class ForcedOverwriteMainGrad(Rule):
    id = "MG006"
    name = "forced-overwrite-main-grad"
    severity = Severity.WARNING
    summary = "`overwrite_main_grad` forced to a constant `True` outside the data-parallel wrapper"
    needles = (FLAG,)
    docs = """\
## What it does
Finds code outside the data-parallel wrapper that sets `param.overwrite_main_grad` to a constant `True`
(`param.overwrite_main_grad = True`, `setattr(p, "overwrite_main_grad", True)`), whatever sharding strategy
the wrapper runs.

## Why is this bad?
The flag tells fused wgrad GEMMs (TE modules with `fuse_wgrad_accumulation`, op-fuser ops with
`accumulate_into_main_grad`) to overwrite `main_grad` instead of accumulating into it. Megatron-FSDP chooses
it per sharding strategy on every unshard; DDP leaves it unset (accumulate). With strategies that keep
gradients unsharded (DDP, Megatron-FSDP `no_shard`/`optim`) and several micro-batches per step, a backward
that reads a forced `True` discards the gradients of the earlier micro-batches, silently. It is harmless
only where the wrapper sets the flag again before the GEMM reads it (TE modules read it at forward time,
op-fuser ops at backward time), which is an accident of ordering, not a contract.

## Example
```python
for param in linear.parameters(recurse=False):
    if hasattr(param, "overwrite_main_grad"):
        param.overwrite_main_grad = True
```

## Use instead
Leave the flag to the data-parallel wrapper:
```python
for param in linear.parameters(recurse=False):
    ...
```
or derive it from the strategy (`param.overwrite_main_grad = strategy in ("optim_grads",
"optim_grads_params")`).

No automatic fix: deleting the assignment changes what the code promises its callers, and upstream pins
that promise in a test (Megatron-LM main's
`tests/unit_tests/transformer/moe/test_grouped_mlp.py::test_make_fused_impl_pre_forward_hook_exposes_fsdp_main_grad_for_fused_wgrad`
asserts the flag is `True` after the hook); the assignment, the test and the strategy the wrapper derives
the flag from have to change together, by hand.

## What it assumes
Where the flag exists on a parameter, something set it; when the scan holds the wrapper's code, the rule
looks at what the wrapper writes. If the scanned Megatron-FSDP writes the flag, and every write of it in
the wrapper's code is the constant `True` (megatron-core 0.19.2 does so on every unshard but `no_shard`'s),
a forced `True` that only runs `if hasattr(param, "overwrite_main_grad")` re-sets `True` where it already
is: not reported. That fact comes from a project-level pass over every file of the scan, before any file is
analyzed (a cached file is analyzed again when the fact changes); a file checked alone, or a tree without
the wrapper, is judged as before. An unguarded forced `True` is reported even then: under `no_shard` the
wrapper never sets the flag, and the forced `True` would turn accumulation into overwriting.

## In real code
Megatron-LM main `TEGroupedMLP._ensure_main_grad` sets `overwrite_main_grad = True` on every expert weight
before the fused forward, overriding the value Megatron-FSDP derives from its sharding strategy since
PR #6357 (`optim_grads`/`optim_grads_params` only); measured on an H200, with two micro-batches and
unsharded gradients the expert gradients are 0.71 (relative) away from autograd's own accumulation. The
same line in megatron-core 0.19.2 is harmless and not reported when the scan holds 0.19.2's Megatron-FSDP
(the whole wheel): that wrapper only ever sets the flag to `True` (on every unshard but `no_shard`'s, where
it never sets it and the line's `hasattr` test skips it), so the assignment changes nothing. Checking
`experts.py` alone still reports it.
"""

    VALID = [
        # The value comes from the sharding strategy.
        Example(
            """\
            def on_unshard(params, strategy):
                for param in params:
                    param.overwrite_main_grad = strategy in ("optim_grads", "optim_grads_params")
            """
        ),
        # A constant behind a strategy test.
        Example(
            """\
            def on_unshard(self, params):
                if self.data_parallel_sharding_strategy == "no_shard":
                    return
                for param in params:
                    param.overwrite_main_grad = True
            """
        ),
        # A reset to False after the buffer was zeroed by hand: accumulate onto zeros.
        Example(
            """\
            def begin_accumulation(params):
                for param in params:
                    param.main_grad.zero_()
                    param.overwrite_main_grad = False
            """
        ),
        # Reading the flag is fine.
        Example(
            """\
            def accumulate(weight):
                return not getattr(weight, "overwrite_main_grad", False)
            """
        ),
        # Inside the wrapper's class (Megatron-FSDP owns the flag).
        Example(
            """\
            class MegatronFSDP:
                def _unshard(self, params):
                    for param in params:
                        param.overwrite_main_grad = True
            """
        ),
        # A different attribute.
        Example(
            """\
            def setup(param):
                param.overwrite_main_grad_enabled = True
                param.grad_added_to_main_grad = True
            """
        ),
    ]
    INVALID = [
        # Megatron-LM main's TEGroupedMLP._ensure_main_grad.
        Example(
            """\
            def _ensure_main_grad(linear_module):
                for param in linear_module.parameters(recurse=False):
                    get_main_grad = getattr(param, "get_main_grad", None)
                    if get_main_grad is not None and getattr(param, "main_grad", None) is None:
                        param.main_grad = get_main_grad()
                    if hasattr(param, "overwrite_main_grad"):
                        param.overwrite_main_grad = True
                return linear_module
            """,
            line=7,
        ),
        # setattr form.
        Example(
            """\
            def force(module):
                x = 1
                for p in module.parameters():
                    setattr(p, "overwrite_main_grad", True)
                return x
            """,
            line=4,
        ),
        # A constant bound to a local still counts; one finding per assignment.
        Example(
            """\
            def force(weight, bias):
                flag = True
                weight.main_grad = weight.get_main_grad(); weight.overwrite_main_grad = flag
                bias.overwrite_main_grad: bool = True
            """,
            line=3,
        ),
        # Behind a test that is not about the sharding strategy.
        Example(
            """\
            def force(weight):
                if prepare(weight):
                    weight.overwrite_main_grad = True
                else:
                    weight.overwrite_main_grad = False
            """,
            line=3,
        ),
    ]

    def gate(self, index: SyntaxIndex, settings: RuleSettings) -> bool:
        """Over-approximates `check`: the path tests are mirrored exactly; then some `X.overwrite_main_grad =
        v` (plain or annotated) or `setattr(X, "overwrite_main_grad", v)` with `v` `True`, a non-zero int or
        any name (it may be bound to one), outside every class named like a wrapper. The strategy guard is
        not looked at: it only removes findings."""
        if is_test_path(index.path) or is_wrapper_path(index.path):
            return False
        return any(
            not any(s.kind == "class" and WRAPPER_CLASS.search(s.name) for s in index.enclosing(pos(node)))
            for node in index.overwrite_sets
        )

    def check(self, ctx: FileContext) -> Iterator[Violation]:
        if is_test_path(ctx.path):
            return
        flagged: list[tuple[cst.SimpleStatementLine, cst.BaseSmallStatement]] = []
        for line in ctx.nodes(cst.SimpleStatementLine):
            for small in line.body:
                value = _forced_value(small)
                if value is None:
                    continue
                func = enclosing_function(ctx, line)
                bindings = local_bindings(func, ctx)
                if not _is_truthy_constant(value, bindings):
                    continue
                if in_wrapper(ctx, line) or _strategy_guarded(ctx, line):
                    continue
                if FSDP_ONLY_SETS_OVERWRITE_TRUE in ctx.settings.project and _only_where_set(
                    ctx, line, small
                ):
                    continue
                flagged.append((line, small))
        for line, small in flagged:
            yield Violation(
                node=small,
                context_node=line,
                message=(
                    f"`{code_of(small)}` forces fused wgrad GEMMs to overwrite `main_grad` whatever "
                    "sharding strategy the data-parallel wrapper runs: with unsharded gradients (DDP, "
                    "Megatron-FSDP `no_shard`/`optim`) and several micro-batches per step, a backward that "
                    "reads it discards the earlier micro-batches' gradients; leave the flag to the wrapper "
                    "(delete this assignment, and the tests that pin it) or derive it from the sharding "
                    "strategy"
                ),
            )
