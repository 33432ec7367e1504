"""MG012: a write of a computed weight gradient into `main_grad` that runs only when `grad_added_to_main_grad`
says so.

`W.grad_added_to_main_grad` is a per-iteration flag: the data-parallel wrapper clears it in
`zero_grad_buffer()` before the micro-batch loop and every backward that put its wgrad into `main_grad` sets
it. It tells the wrapper's grad hook "main_grad already holds this backward's gradient, do not add `.grad`".
Used to decide whether a backward's own gradient is written, it skips every micro-batch after the first (when
the write is gated on the flag being unset) or the first (gated on it being set): with gradient accumulation
only part of the gradient reaches `main_grad` (AMD-AGI/Primus #1046: 1 micro-batch gradient of 32).

What is judged: every write into a main_grad buffer (`rules._common.written_buffer`: `add_`/`copy_`,
`+=`, `wgrad_gemm_accum_*`, `out=`; and a function named like an in-place op, `inplace_add_(buf, x)`, whose
first argument is the buffer), through local aliases (`MainGradScope`), whose value is not a parameter's
`.grad`, against the tests that decide whether it runs (`dataflow.deciding_tests`). A test that reads the
flag's value (directly, through `getattr`, or through local names: `dataflow.reads_attribute_value`) is the
finding; so is such a test deciding a call of a same-file function or method (`helper(...)`,
`self.helper(...)`) that holds a write. `hasattr(W, "grad_added_to_main_grad")` only asks whether the wrapper
supports the flag and is fine.
The grad hook's own `if not p.grad_added_to_main_grad: p.main_grad.add_(p.grad)` moves the parameter's
autograd gradient and is not a backward's write; so does megatron-core's emulation of that hook inside a
captured CUDA graph, which adds `torch.autograd.grad(...)` results (followed through local names and loop
targets: `dataflow.derives_from`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

import libcst as cst

from maingrad.analyzer import dataflow, syntax_index
from maingrad.analyzer.context import FileContext, RuleSettings
from maingrad.analyzer.facts import GRAD_ADDED_FLAG
from maingrad.analyzer.names import dotted_name
from maingrad.analyzer.rules._common import MainGradScope, code_of, written_buffer
from maingrad.analyzer.rules.base import Example, Rule, Violation
from maingrad.analyzer.syntax_index import SyntaxIndex, gate_aliases, spine_is_main_grad, spine_of
from maingrad.contracts.report import Severity


def _written_value(node: cst.CSTNode) -> cst.BaseExpression | None:
    if isinstance(node, cst.AugAssign):
        return node.value
    if isinstance(node, cst.Call) and _inplace_helper_target(node) is not None:
        return node.args[1].value if len(node.args) > 1 else None
    if isinstance(node, cst.Call) and node.args:
        return node.args[0].value
    return None


def _inplace_helper_target(call: cst.Call) -> cst.BaseExpression | None:
    """`inplace_add_triton_(buf, x)`, `torch.add_(buf, x)`: a function (not a method) whose name ends in `_`,
    PyTorch's convention for "mutates its first argument", writes into its first argument."""
    name = (dotted_name(call.func) or "").rsplit(".", 1)[-1]
    if isinstance(call.func, cst.Attribute) and not (dotted_name(call.func.value) or "").startswith("torch"):
        return None
    if not name.endswith("_") or name.startswith("_") or not call.args or call.args[0].keyword is not None:
        return None
    return call.args[0].value


def _written(node: cst.CSTNode) -> cst.BaseExpression | None:
    target = written_buffer(node)
    if target is None and isinstance(node, cst.Call):
        return _inplace_helper_target(node)
    return target


def _is_autograd_gradient(node: cst.CSTNode) -> bool:
    """`p.grad` or a `torch.autograd.grad(...)` result: the parameter's autograd gradient, which the grad hook
    (or its emulation inside a CUDA graph) moves into `main_grad` only when no backward wrote it there."""
    if isinstance(node, cst.Attribute) and node.attr.value == "grad":
        return True
    return isinstance(node, cst.Call) and (dotted_name(node.func) or "").endswith("autograd.grad")


class MainGradWriteGatedOnGradAdded(Rule):
    id = "MG012"
    name = "main-grad-write-gated-on-grad-added"
    severity = Severity.ERROR
    summary = "a wgrad written into `main_grad` only when `grad_added_to_main_grad` is (un)set: later micro-batches are dropped"
    needles = (GRAD_ADDED_FLAG,)
    docs = """\
## What it does
Finds a write of a computed weight gradient into `W.main_grad` (`add_`, `copy_`, `+=`, a fused
`wgrad_gemm_accum_*` kernel, a GEMM with `out=`) that runs only when a test of `W.grad_added_to_main_grad`'s
value allows it, directly, through `getattr` or through a local variable.

## Why is this bad?
`grad_added_to_main_grad` is per iteration, not per micro-batch: Megatron's `zero_grad_buffer()` clears it
before the micro-batch loop and the first backward that writes into `main_grad` sets it. It means "main_grad
already owns this gradient, so the grad hook must not add `param.grad` on top", not "an add already happened".
Gated on the flag being unset, the write happens for micro-batch 0 only; gated on it being set, micro-batch 0
is the one lost. With gradient accumulation the optimizer then sees a fraction of the gradient, silently
(AMD-AGI/Primus #1046: at global batch 512 and micro-batch 2, 1 gradient of 32). The backward returns a dummy
gradient, so nothing else recovers the lost micro-batches.

## Example
```python
def _bridge_weight_grad(weight, wgrad, fuse_wgrad_accum):
    if fuse_wgrad_accum:
        weight.grad_added_to_main_grad = True
    elif not weight.grad_added_to_main_grad:
        weight.main_grad.add_(wgrad)
        weight.grad_added_to_main_grad = True
```

## Use instead
```python
def _bridge_weight_grad(weight, wgrad, fuse_wgrad_accum):
    if not fuse_wgrad_accum:
        weight.main_grad.add_(wgrad)
    weight.grad_added_to_main_grad = True
```
Add on every micro-batch, then set the flag. `hasattr(W, "grad_added_to_main_grad")` (does the wrapper use the
flag at all?) is fine as a test; so is the grad hook's own `if not p.grad_added_to_main_grad:
p.main_grad.add_(p.grad)`, which moves `.grad` rather than a backward's gradient.

## Fix safety
No automatic fix: which branch should stay depends on whether the other branch already wrote the gradient.

## In real code
AMD-AGI/Primus main at 2026-08-22 (`primus/backends/megatron/core/extensions/primus_turbo.py`, the
Turbo bridge's backward, lines 208 and 210), fixed upstream by #1046: the last INVALID example. It reported
nothing on the 14 code bases of `docs/real-world.md`.
"""

    VALID = [
        # The fixed Primus bridge: add unconditionally, then set the flag.
        Example(
            """\
            def _bridge_weight_grad(weight, wgrad, fuse_wgrad_accum):
                if not fuse_wgrad_accum:
                    weight.main_grad.add_(wgrad)
                weight.grad_added_to_main_grad = True
            """
        ),
        # Megatron's grad hook: it moves `.grad` and skips when a backward already wrote main_grad.
        Example(
            """\
            def hook(param):
                if param.grad is not None and not param.grad_added_to_main_grad:
                    param.main_grad.add_(param.grad.data)
                param.grad = None
            """
        ),
        # megatron-core's CUDA-graph emulation of the grad hook: the value is autograd's gradient.
        Example(
            """\
            import torch

            def capture(self, outputs, inputs):
                grad_inputs = torch.autograd.grad(outputs=outputs, inputs=inputs, allow_unused=True)
                for param, wgrad in zip(self.params, grad_inputs):
                    if wgrad is not None and not getattr(param, "grad_added_to_main_grad", False):
                        param.main_grad.add_(wgrad)
            """
        ),
        # The flag is set after an unconditional write; other tests decide nothing about it.
        Example(
            """\
            def backward(ctx, dy):
                weight = ctx.weight
                if ctx.fuse_wgrad_accumulation:
                    weight.main_grad.add_(dy.t() @ ctx.x)
                weight.grad_added_to_main_grad = True
            """
        ),
        # An existence test of the flag (does the wrapper use it?) is not a test of its value.
        Example(
            """\
            def backward(ctx, dy):
                weight = ctx.weight
                if hasattr(weight, "grad_added_to_main_grad"):
                    weight.main_grad.add_(dy.t() @ ctx.x)
                    weight.grad_added_to_main_grad = True
            """
        ),
    ]
    INVALID = [
        Example(
            """\
            def _bridge_weight_grad(weight, wgrad, fuse_wgrad_accum):
                if fuse_wgrad_accum:
                    weight.grad_added_to_main_grad = True
                elif not weight.grad_added_to_main_grad:
                    weight.main_grad.add_(wgrad)
                    weight.grad_added_to_main_grad = True
            """,
            line=5,
        ),
        # Through getattr, a local flag and a local alias of the buffer, with an early return.
        Example(
            """\
            def backward(ctx, dy):
                weight = ctx.weight
                done = getattr(weight, "grad_added_to_main_grad", False)
                if done:
                    return None
                buf = weight.main_grad
                fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(ctx.x, dy, buf)
            """,
            line=7,
        ),
        # Gated on the flag being set (micro-batch 0 is the one lost), `+=` into a local alias.
        Example(
            """\
            def _apply_wgrad(param, wgrad):
                buf = param.main_grad
                if param.grad_added_to_main_grad:
                    buf += wgrad
            """,
            line=4,
        ),
        # Through a same-file helper that writes the buffer.
        Example(
            """\
            class Bridge:
                def _accumulate(self, weight, wgrad):
                    weight.main_grad.add_(wgrad)

                def backward_dw(self, weight, wgrad):
                    if not weight.grad_added_to_main_grad:
                        self._accumulate(weight, wgrad)
                    weight.grad_added_to_main_grad = True
            """,
            line=7,
        ),
        # Primus at 2026-08-22 (fixed by #1046): an in-place helper on one architecture, add_ on the others.
        Example(
            """\
            def backward(ctx, grad_x, grad_w):
                (weight,) = ctx.saved_tensors
                if ctx.fuse_wgrad_accum:
                    weight.grad_added_to_main_grad = True
                elif not weight.grad_added_to_main_grad:
                    if _is_gfx1250():
                        inplace_add_triton_(weight.main_grad, grad_w)
                    else:
                        weight.main_grad.add_(grad_w)
                    weight.grad_added_to_main_grad = True
            """,
            line=7,
        ),
    ]

    def gate(self, index: SyntaxIndex, settings: RuleSettings) -> bool:
        """Over-approximates `check` with the `ast` mirrors below. Writes: `index.writes` and in-place helpers
        whose target may be a main_grad (`spine_is_main_grad` over the file-wide aliases) and whose value does
        not derive from autograd's gradient through the outermost function's bindings (the same predicate and
        depth as `check`). Calls: `name(...)`/`self.name(...)` of a function holding such a write. Either
        must sit in an outermost function (or the module) that reads the flag's value
        (`X.grad_added_to_main_grad` loaded, or a `getattr` of it): every deciding test and every binding
        `check` consults lies there."""
        if GRAD_ADDED_FLAG not in index.source:
            return False
        aliases = gate_aliases(index)
        candidates: list[ast.AST] = [w.node for w in index.writes if spine_is_main_grad(w.spine, aliases)]
        calls: list[ast.Call] = []
        for node in ast.walk(index.tree):
            if type(node) is not ast.Call:
                continue
            calls.append(node)
            target = _ast_inplace_target(node)
            if target is not None and spine_is_main_grad(spine_of(target), aliases):
                candidates.append(node)
        writes: list[ast.AST] = []
        writers: set[str] = set()
        for node in candidates:
            outer = _ast_outermost_def(index, node)
            value = _ast_written_value(node)
            if value is not None and _ast_derives_from(
                value, syntax_index.local_bindings(outer) if outer else {}, 0
            ):
                continue
            writes.append(node)
            inner = next(
                (a for a in index.ancestors(node) if type(a) in (ast.FunctionDef, ast.AsyncFunctionDef)), None
            )
            if inner is not None:
                writers.add(inner.name)  # type: ignore[attr-defined]
        sites = writes + [c for c in calls if _ast_callee_name(c) in writers]
        for node in sites:
            outer = _ast_outermost_def(index, node)
            if _ast_reads_flag(outer if outer is not None else index.tree):
                return True
        return False

    def check(self, ctx: FileContext) -> Iterator[Violation]:
        if GRAD_ADDED_FLAG not in ctx.source:
            return
        writes: list[tuple[cst.CSTNode, cst.BaseExpression]] = []
        writers: set[str] = set()  # functions that write a computed wgrad into main_grad
        for node in ctx.nodes(cst.Call, cst.Dict, cst.AugAssign):
            target = _written(node)
            if target is None:
                continue
            func = next((a for a in ctx.ancestors(node) if isinstance(a, cst.FunctionDef)), None)
            scope = self._scope(ctx, func)
            if not scope.is_main_grad(target):
                continue
            value = _written_value(node)
            if value is not None and dataflow.derives_from(
                value, _is_autograd_gradient, self._bindings(ctx, node)
            ):
                continue
            writes.append((node, target))
            if func is not None:
                writers.add(func.name.value)
        for node, target in writes:
            test = self._flag_test(ctx, node)
            if test is not None:
                yield Violation(
                    node=node,
                    message=(
                        f"this write into `{code_of(target)}` runs only when `{code_of(test)}` allows it, a test "
                        "of `grad_added_to_main_grad`: the flag is per iteration (cleared by the wrapper's "
                        "zero_grad_buffer, set by the first backward), so every other micro-batch's gradient is "
                        "dropped; write on every micro-batch and set the flag afterwards"
                    ),
                )
        written = {id(node) for node, _ in writes}
        for call in ctx.nodes(cst.Call):
            name = _callee_name(call)
            if name is None or name not in writers or id(call) in written:
                continue
            if any(isinstance(a, cst.FunctionDef) and a.name.value == name for a in ctx.ancestors(call)):
                continue  # a recursive call inside the writer itself
            test = self._flag_test(ctx, call)
            if test is not None:
                yield Violation(
                    node=call,
                    message=(
                        f"`{name}` writes a wgrad into main_grad, and this call runs only when `{code_of(test)}` "
                        "allows it, a test of `grad_added_to_main_grad`: the flag is per iteration, so every other "
                        "micro-batch's gradient is dropped; call it on every micro-batch and set the flag afterwards"
                    ),
                )

    @staticmethod
    def _scope(ctx: FileContext, func: cst.FunctionDef | None) -> MainGradScope:
        key = ("MG012.scope", id(func))
        if key not in ctx.memo:
            ctx.memo[key] = MainGradScope.of(ctx, func)
        scope: MainGradScope = ctx.memo[key]
        return scope

    @staticmethod
    def _bindings(ctx: FileContext, node: cst.CSTNode) -> dict[str, list[cst.BaseExpression]]:
        """The bindings of the outermost function around `node` (empty at module level)."""
        outer = None
        for ancestor in ctx.ancestors(node):
            if isinstance(ancestor, cst.FunctionDef):
                outer = ancestor
        key = ("MG012.bindings", id(outer))
        if key not in ctx.memo:
            ctx.memo[key] = dataflow.local_bindings(outer)
        bindings: dict[str, list[cst.BaseExpression]] = ctx.memo[key]
        return bindings

    def _flag_test(self, ctx: FileContext, node: cst.CSTNode) -> cst.BaseExpression | None:
        bindings = self._bindings(ctx, node)
        return next(
            (
                t
                for t in dataflow.deciding_tests(ctx, node)
                if dataflow.reads_attribute_value(t, GRAD_ADDED_FLAG, bindings)
            ),
            None,
        )


def _callee_name(call: cst.Call) -> str | None:
    """`helper(...)` or `self.helper(...)`: a call of a same-file function or method by name."""
    func = call.func
    if isinstance(func, cst.Name):
        return func.value
    if isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name) and func.value.value == "self":
        return func.attr.value
    return None


# `ast` mirrors of the check's helpers, for the gate ------------------------------------------------------
def _ast_inplace_target(call: ast.Call) -> ast.expr | None:
    func = call.func
    name = (syntax_index.dotted(func) or "").rsplit(".", 1)[-1]
    if type(func) is ast.Attribute and not (syntax_index.dotted(func.value) or "").startswith("torch"):
        return None
    if not name.endswith("_") or name.startswith("_") or not call.args:
        return None
    first = call.args[0]
    return first.value if type(first) is ast.Starred else first


def _ast_written_value(node: ast.AST) -> ast.AST | None:
    if type(node) is ast.AugAssign:
        return node.value
    if type(node) is ast.Call:
        if _ast_inplace_target(node) is not None:
            return node.args[1] if len(node.args) > 1 else (node.keywords[0].value if node.keywords else None)
        if node.args:
            return node.args[0]
        return node.keywords[0].value if node.keywords else None
    return None


def _ast_outermost_def(index: SyntaxIndex, node: ast.AST) -> ast.AST | None:
    outer = None
    for ancestor in index.ancestors(node):
        if type(ancestor) in (ast.FunctionDef, ast.AsyncFunctionDef):
            outer = ancestor
    return outer


def _ast_derives_from(expr: ast.AST, bindings: dict[str, list[ast.AST]], depth: int) -> bool:
    for node in ast.walk(expr):
        if type(node) is ast.Attribute and node.attr == "grad":
            return True
        if type(node) is ast.Call and (syntax_index.dotted(node.func) or "").endswith("autograd.grad"):
            return True
        if (
            depth < 4
            and type(node) is ast.Name
            and node.id in bindings
            and any(_ast_derives_from(v, bindings, depth + 1) for v in bindings[node.id])
        ):
            return True
    return False


def _ast_reads_flag(root: ast.AST) -> bool:
    for node in ast.walk(root):
        if type(node) is ast.Attribute and node.attr == GRAD_ADDED_FLAG and type(node.ctx) is ast.Load:
            return True
        if (
            type(node) is ast.Call
            and type(node.func) is ast.Name
            and node.func.id == "getattr"
            and len(node.args) >= 2
            and syntax_index.is_str(node.args[1], GRAD_ADDED_FLAG)
        ):
            return True
    return False


def _ast_callee_name(call: ast.Call) -> str | None:
    func = call.func
    if type(func) is ast.Name:
        return func.id
    if type(func) is ast.Attribute and type(func.value) is ast.Name and func.value.id == "self":
        return func.attr
    return None
