"""MG013: a gradient hook on a parameter (`W.register_hook(fn)`) that reduces or rewrites the gradient, in
Megatron / Transformer Engine code, with no handling of `main_grad`.

Under fused weight-gradient accumulation (Megatron's `gradient_accumulation_fusion`: off in megatron-core's
`ModelParallelConfig`, on by default in Megatron-LM's training arguments; TE's `fuse_wgrad_accumulation`) a linear layer's backward writes the weight gradient
straight into `W.main_grad` and hands autograd a dummy tensor (`get_dummy_wgrad`). A tensor hook on `W` then
runs on the dummy: an all-reduce that keeps replicated factors in sync synchronises nothing, and the optimizer,
which reads `main_grad`, steps with rank-local gradients (radixark/miles #2723: Megatron-Bridge's shared-outer
LoRA factor drifted apart across eight TP ranks after the second update).

What is judged: every `X.register_hook(fn)` whose receiver is a weight (`<module>.weight`, a local
bound to `getattr(module, "weight")` or to such an attribute, a loop variable over them, or a function argument
named or annotated as a parameter/weight), in a file that imports `megatron` or `transformer_engine` (or lies in
their package trees), where `fn` (a same-file function, a method of the enclosing class through `self.`, a
closure, a lambda, or `functools.partial` of one) calls a collective (`all_reduce`, `reduce_scatter`,
`all_gather`, `broadcast`, ...) or returns a new gradient. It is fine when `fn` mentions `main_grad`, or when a
test deciding whether the hook is registered reads `gradient_accumulation_fusion` / `fuse_wgrad_accumulation`
(the hook path kept for the unfused case). Hooks on autograd nodes (`grad_acc.register_hook`, the
data-parallel wrapper's own), on activations, and on biases (the linear backwards return the bias gradient
to autograd: the hook sees it) are not judged.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

import libcst as cst

from maingrad.analyzer import dataflow, walk
from maingrad.analyzer.context import FileContext, RuleSettings
from maingrad.analyzer.facts import FUSE_WGRAD_FLAG, MAIN_GRAD
from maingrad.analyzer.names import dotted_name
from maingrad.analyzer.rules._common import code_of
from maingrad.analyzer.rules.base import Example, Rule, Violation
from maingrad.analyzer.syntax_index import SyntaxIndex, local_bindings
from maingrad.contracts.report import Severity

_COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_reduce_coalesced",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_gather",
        "all_gather_into_tensor",
        "broadcast",
        "reduce",
        "all_to_all",
        "all_to_all_single",
    }
)
# Only the weight: fused wgrad accumulation writes the weight's gradient into main_grad and returns a dummy;
# TE's and megatron-core's linear backwards return the bias gradient to autograd as usual, so a bias hook sees
# the real gradient (a false alarm on Ascend/MindSpeed-MM's `linear_qkv.bias` hook, triaged in real-world.md).
_PARAM_ATTRS = frozenset({"weight"})
_FUSION_FLAGS = frozenset({FUSE_WGRAD_FLAG, "gradient_accumulation_fusion", "accumulate_into_main_grad"})
_STACKS = ("megatron", "transformer_engine")


def _uses_fused_stack(ctx: FileContext) -> bool:
    """Megatron or TE code: the stacks whose linear layers fuse the wgrad into `main_grad`."""
    path = ctx.path.replace("\\", "/")
    if any(f"{stack}/" in path for stack in _STACKS):
        return True
    for node in ctx.nodes(cst.Import, cst.ImportFrom):
        if isinstance(node, cst.Import):
            names = [dotted_name(alias.name) or "" for alias in node.names]
        elif isinstance(node, cst.ImportFrom) and node.module is not None:
            names = [dotted_name(node.module) or ""]
        else:
            continue
        if any(name.split(".", 1)[0] in _STACKS for name in names):
            return True
    return False


def _is_parameter(
    expr: cst.BaseExpression,
    bindings: dict[str, list[cst.BaseExpression]],
    params: dict[str, cst.Param],
    depth: int = 0,
) -> bool:
    if isinstance(expr, cst.Attribute):
        return expr.attr.value in _PARAM_ATTRS
    if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Name) and expr.func.value == "getattr":
        key = expr.args[1].value if len(expr.args) >= 2 else None
        return isinstance(key, cst.SimpleString) and key.evaluated_value in _PARAM_ATTRS
    if isinstance(expr, (cst.List, cst.Tuple)):
        return any(
            isinstance(e, cst.Element) and _is_parameter(e.value, bindings, params, depth)
            for e in expr.elements
        )
    if isinstance(expr, (cst.ListComp, cst.GeneratorExp)):
        return _is_parameter(expr.elt, bindings, params, depth)
    if isinstance(expr, cst.NamedExpr):
        return _is_parameter(expr.value, bindings, params, depth)
    if isinstance(expr, cst.Name):
        if expr.value in params:
            param = params[expr.value]
            annotation = code_of(param.annotation.annotation) if param.annotation is not None else ""
            return "Parameter" in annotation or expr.value in ("weight", "param", "parameter")
        if depth < 4:
            return any(_is_parameter(v, bindings, params, depth + 1) for v in bindings.get(expr.value, []))
    return False


def _walrus_bindings(func: cst.FunctionDef) -> dict[str, list[cst.BaseExpression]]:
    out: dict[str, list[cst.BaseExpression]] = {}
    for node in walk.walk(func):
        if isinstance(node, cst.NamedExpr) and isinstance(node.target, cst.Name):
            out.setdefault(node.target.value, []).append(node.value)
    return out


class GradHookOnFusedWgradParam(Rule):
    id = "MG013"
    name = "grad-hook-on-fused-wgrad-param"
    severity = Severity.WARNING
    summary = "a parameter gradient hook that reduces/rewrites the gradient: under fused wgrad it sees only the dummy"
    needles = ("register_hook",)
    docs = """\
## What it does
Finds a tensor gradient hook registered on a parameter (`W.register_hook(fn)`, `W` a module's `weight` or
`bias`) in Megatron or Transformer Engine code, where `fn` reduces the gradient across ranks (an
`all_reduce`, `reduce_scatter`, `broadcast`, ...) or returns a replacement gradient, and nothing in `fn` deals
with `main_grad`.

## Why is this bad?
With fused weight-gradient accumulation (Megatron's `gradient_accumulation_fusion`, off in megatron-core's
`ModelParallelConfig`, on by default in Megatron-LM's training arguments; TE's `fuse_wgrad_accumulation`),
the layer's backward writes the weight gradient straight into `W.main_grad` and returns a dummy tensor to
autograd. The hook runs on that dummy: the all-reduce that
should keep a replicated parameter in sync reduces nothing the optimizer reads, and the replicas drift apart
silently (radixark/miles #2723: Megatron-Bridge's shared-outer LoRA factor split into eight TP versions after
the second update). Tensor hooks never see the real gradient on the fused path.

## Example
```python
import torch
from megatron.core import parallel_state


def make_replicated(weight):
    group = parallel_state.get_tensor_and_data_parallel_group()

    def _all_reduce_grad(grad):
        torch.distributed.all_reduce(grad, group=group)
        return grad

    weight.register_hook(_all_reduce_grad)
```

## Use instead
```python
import torch
from megatron.core import parallel_state


def make_replicated(weight, config):
    group = parallel_state.get_tensor_and_data_parallel_group()
    if config.gradient_accumulation_fusion:
        weight.reduce_main_grad_group = group  # reduce `weight.main_grad` after backward, before the step
        return

    def _all_reduce_grad(grad):
        torch.distributed.all_reduce(grad, group=group)
        return grad

    weight.register_hook(_all_reduce_grad)
```
Under fusion, reduce `W.main_grad` once the backward is done (for example in `finalize_model_grads`, where
Megatron reduces its own replicated gradients); keep the hook only for the unfused path, decided by the fusion
flag.

## Fix safety
No automatic fix: where to reduce `main_grad` depends on the training loop.

## In real code
Megatron-Bridge main (2026-08-22) `peft/utils.py`: the replicated-factor hook of `_make_cross_ep_replicated`
(the code radixark/miles #2723 works around) and `ParallelLinearAdapter`'s shared-expert gradient sync
(`docs/real-world.md`). Nothing on the 11 pinned releases.
"""

    VALID = [
        # A bias: the linear backward returns its gradient to autograd, fused or not (Ascend/MindSpeed-MM's
        # `linear_qkv.bias` hook zeroing the K part; was a false alarm).
        Example(
            """\
            from megatron.core.transformer.attention import SelfAttention

            class Encoder(SelfAttention):
                def __init__(self, config, submodules, layer_number):
                    super().__init__(config, submodules, layer_number)

                    def freeze_k_bias_grad_hook(grad):
                        grad_clone = grad.clone()
                        grad_clone[:4] = 0
                        return grad_clone

                    self.linear_qkv.bias.register_hook(freeze_k_bias_grad_hook)
            """
        ),
        # The unfused path only: the registration is decided by the fusion flag.
        Example(
            """\
            import torch
            from megatron.core import parallel_state

            def make_replicated(weight, config):
                if config.gradient_accumulation_fusion:
                    return
                def _all_reduce_grad(grad):
                    torch.distributed.all_reduce(grad)
                    return grad
                weight.register_hook(_all_reduce_grad)
            """
        ),
        # Megatron's DDP: a hook on the autograd accumulator node, not on the parameter.
        Example(
            """\
            from megatron.core import parallel_state

            def register(self, param):
                param_tmp = param.expand_as(param)
                grad_acc = param_tmp.grad_fn.next_functions[0][0]
                grad_acc.register_hook(self._make_backward_post_hook(param))
            """
        ),
        # The hook handles main_grad itself.
        Example(
            """\
            import torch
            import transformer_engine

            def sync(module):
                def hook(grad):
                    torch.distributed.all_reduce(module.weight.main_grad)
                    return grad
                module.weight.register_hook(hook)
            """
        ),
        # Not Megatron / TE code: no fused wgrad can bypass the hook.
        Example(
            """\
            import torch

            def sync(module):
                def hook(grad):
                    torch.distributed.all_reduce(grad)
                    return grad
                module.weight.register_hook(hook)
            """
        ),
        # A hook that only records the gradient it got.
        Example(
            """\
            import transformer_engine.pytorch as te

            def test_hook(model):
                seen = []

                def save_grad(grad):
                    seen.append(grad)
                    return grad

                model.weight.register_hook(save_grad)
            """
        ),
        # A hook on an activation.
        Example(
            """\
            from megatron.core import tensor_parallel

            def forward(self, x):
                hook_tensor = x.detach().requires_grad_()
                hook_tensor.register_hook(self._recompute)
                return hook_tensor
            """
        ),
    ]
    INVALID = [
        Example(
            """\
            import torch
            from megatron.core import parallel_state

            def make_replicated(weight):
                group = parallel_state.get_tensor_and_data_parallel_group()

                def _all_reduce_grad(grad):
                    torch.distributed.all_reduce(grad, group=group)
                    return grad

                weight.register_hook(_all_reduce_grad)
            """,
            line=11,
        ),
        # A method through `self.`, the weight through getattr and a loop.
        Example(
            """\
            import torch
            from megatron.core.tensor_parallel import ColumnParallelLinear

            class Adapter(torch.nn.Module):
                def _allreduce(self, grad):
                    torch.distributed.all_reduce(grad, group=self.ep_group)
                    return grad

                def _register(self):
                    for module in (self.linear_in, self.linear_out):
                        weight = getattr(module, "weight", None)
                        if weight is not None and weight.requires_grad:
                            weight.register_hook(self._allreduce)
            """,
            line=13,
        ),
        # Through functools.partial, on a TE module's weight.
        Example(
            """\
            import functools

            import torch
            import transformer_engine.pytorch as te

            def _scale(grad, factor):
                return grad * factor

            def build(hidden):
                layer = te.Linear(hidden, hidden, fuse_wgrad_accumulation=True)
                layer.weight.register_hook(functools.partial(_scale, factor=0.5))
                return layer
            """,
            line=11,
        ),
    ]

    def gate(self, index: SyntaxIndex, settings: RuleSettings) -> bool:
        """Over-approximates `check` with `ast` mirrors: a Megatron/TE file (path or any import), and a
        `X.register_hook(arg)` call inside a function whose receiver may be a parameter (`_ast_is_parameter`:
        the same forms as `check`, through the bindings and parameters of every enclosing function, a
        superset of the innermost function's). The hook's body and the fusion-flag tests only remove
        findings and are left to `check`."""
        path = index.path.replace("\\", "/")
        stack = any(f"{s}/" in path for s in _STACKS)
        calls: list[ast.Call] = []
        for node in ast.walk(index.tree):
            if type(node) is ast.Import:
                stack = stack or any(alias.name.split(".", 1)[0] in _STACKS for alias in node.names)
            elif type(node) is ast.ImportFrom and node.module is not None:
                stack = stack or node.module.split(".", 1)[0] in _STACKS
            elif (
                type(node) is ast.Call
                and type(node.func) is ast.Attribute
                and node.func.attr == "register_hook"
                and (node.args or node.keywords)
            ):
                calls.append(node)
        if not stack:
            return False
        for call in calls:
            defs = [a for a in index.ancestors(call) if type(a) in (ast.FunctionDef, ast.AsyncFunctionDef)]
            if not defs:
                continue
            bindings: dict[str, list[ast.AST]] = {}
            params: dict[str, ast.arg] = {}
            for func in defs:
                # with the walrus bindings `check` adds
                for name, values in local_bindings(func, walrus=True).items():
                    bindings.setdefault(name, []).extend(values)
                args = func.args  # type: ignore[attr-defined]
                for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                    if arg is not None:
                        params[arg.arg] = arg
            receiver = call.func.value  # type: ignore[attr-defined]
            if _ast_is_parameter(receiver, bindings, params, 0):
                return True
        return False

    def check(self, ctx: FileContext) -> Iterator[Violation]:
        if not _uses_fused_stack(ctx):
            return
        functions = {f.name.value: f for f in ctx.nodes(cst.FunctionDef) if isinstance(f, cst.FunctionDef)}
        for call in ctx.nodes(cst.Call):
            func = call.func
            if not (isinstance(func, cst.Attribute) and func.attr.value == "register_hook") or not call.args:
                continue
            enclosing = next((a for a in ctx.ancestors(call) if isinstance(a, cst.FunctionDef)), None)
            if enclosing is None:
                continue
            bindings = dataflow.local_bindings(enclosing)
            for name, values in _walrus_bindings(enclosing).items():
                bindings.setdefault(name, []).extend(values)
            params = {p.name.value: p for p in walk.walk(enclosing.params) if isinstance(p, cst.Param)}
            if not _is_parameter(func.value, bindings, params):
                continue
            hook = self._hook_function(call.args[0].value, functions, bindings)
            if hook is None or MAIN_GRAD in code_of(hook) or not self._uses_gradient(hook):
                continue
            if any(
                any(dataflow.reads_attribute_value(t, flag, bindings) for flag in _FUSION_FLAGS)
                for t in dataflow.deciding_tests(ctx, call)
            ):
                continue
            yield Violation(
                node=call,
                message=(
                    f"`{code_of(func.value)}.register_hook(...)` reduces or rewrites the parameter's gradient, but "
                    "under fused wgrad (Megatron `gradient_accumulation_fusion`, TE `fuse_wgrad_accumulation`) the "
                    "backward writes the gradient into `main_grad` and this hook sees only the dummy: the optimizer "
                    "steps with the unreduced gradient; reduce `main_grad` after the backward when fusion is on"
                ),
            )

    @staticmethod
    def _hook_function(
        expr: cst.BaseExpression,
        functions: dict[str, cst.FunctionDef],
        bindings: dict[str, list[cst.BaseExpression]],
        depth: int = 0,
    ) -> cst.CSTNode | None:
        """The code of the hook: a lambda, a same-file function or method (by name, `self.name`), through
        `functools.partial` and local names."""
        if isinstance(expr, cst.Lambda):
            return expr
        if (
            isinstance(expr, cst.Call)
            and (dotted_name(expr.func) or "").rsplit(".", 1)[-1] == "partial"
            and expr.args
        ):
            return GradHookOnFusedWgradParam._hook_function(expr.args[0].value, functions, bindings, depth)
        if (
            isinstance(expr, cst.Attribute)
            and isinstance(expr.value, cst.Name)
            and expr.value.value == "self"
        ):
            return functions.get(expr.attr.value)
        if isinstance(expr, cst.Name):
            if expr.value in functions:
                return functions[expr.value]
            if depth < 3:
                for value in bindings.get(expr.value, []):
                    found = GradHookOnFusedWgradParam._hook_function(value, functions, bindings, depth + 1)
                    if found is not None:
                        return found
        return None

    @staticmethod
    def _uses_gradient(hook: cst.CSTNode) -> bool:
        """Does the hook reduce the gradient across ranks or return a new one (not the one it got)?"""
        params = hook.params if isinstance(hook, (cst.FunctionDef, cst.Lambda)) else None
        names = [p.name.value for p in params.params] if params is not None else []
        received = names[1] if names[:1] == ["self"] and len(names) > 1 else (names[0] if names else None)

        def replaces(value: cst.BaseExpression | None) -> bool:
            if value is None or code_of(value) == "None":
                return False
            return not (isinstance(value, cst.Name) and value.value == received)

        for node in walk.walk(hook):
            if isinstance(node, cst.Call):
                name = (dotted_name(node.func) or "").rsplit(".", 1)[-1]
                if name in _COLLECTIVES:
                    return True
            if isinstance(node, cst.Return) and replaces(node.value):
                return True
        return isinstance(hook, cst.Lambda) and replaces(hook.body)


# `ast` mirrors for the gate ------------------------------------------------------------------------------
def _ast_is_parameter(
    expr: ast.AST, bindings: dict[str, list[ast.AST]], params: dict[str, ast.arg], depth: int
) -> bool:
    """`_is_parameter` on `ast`, where a parameter name also follows its bindings (a superset)."""
    if type(expr) is ast.Attribute:
        return expr.attr in _PARAM_ATTRS
    if type(expr) is ast.Call:
        func = expr.func
        if type(func) is ast.Name and func.id == "getattr" and len(expr.args) >= 2:
            key = expr.args[1]
            return type(key) is ast.Constant and key.value in _PARAM_ATTRS
        return False
    if type(expr) in (ast.List, ast.Tuple):
        return any(_ast_is_parameter(e, bindings, params, depth) for e in expr.elts)  # type: ignore[attr-defined]
    if type(expr) in (ast.ListComp, ast.GeneratorExp):
        return _ast_is_parameter(expr.elt, bindings, params, depth)  # type: ignore[attr-defined]
    if type(expr) is ast.NamedExpr:
        return _ast_is_parameter(expr.value, bindings, params, depth)
    if type(expr) is ast.Starred:
        return _ast_is_parameter(expr.value, bindings, params, depth)
    if type(expr) is ast.Name:
        if expr.id in params:
            arg = params[expr.id]
            annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
            if "Parameter" in annotation or expr.id in ("weight", "param", "parameter"):
                return True
        if depth < 6:
            return any(_ast_is_parameter(v, bindings, params, depth + 1) for v in bindings.get(expr.id, []))
    return False
