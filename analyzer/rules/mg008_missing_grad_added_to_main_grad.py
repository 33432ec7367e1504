"""MG008: a backward writes the weight gradient into `W.main_grad` but never sets
`W.grad_added_to_main_grad`.

Megatron's data-parallel grad hooks (DDP `_make_backward_post_hook`, Megatron-FSDP's post-accumulate hook)
read `param.grad_added_to_main_grad` to know that a fused wgrad already landed in `main_grad`; when it is not
set they add `param.grad` into `main_grad` again. TE modules, TE op-fuser ops (through
`get_dummy_wgrads_for_params`) and megatron-core's `LinearWithGradAccumulationAndAsyncCommunication` all set
it in the same backward that writes the buffer.

Scope, for precision: only writes inside a backward (a function named `backward`, `*_backward` or
`backward_*`, nested helpers included), because the flag pairs the buffer write with the gradient that
backward returns; writes elsewhere (a pipeline-drain helper computing a wgrad whose backward already set the
flag, the grad hook itself) are not judged. A write is a `wgrad_gemm_accum_fp32/fp16(..., <main_grad>)`
kernel, any call with `out=<main_grad>` (keyword or a `{"out": ...}` kwargs literal), `<main_grad>.add_/copy_(x)`
and `<main_grad> += x`, where `x` is not a parameter's `.grad` (moving `.grad` into `main_grad` is the hook's
own job). The backward is fine when it sets or tests `grad_added_to_main_grad` anywhere, or calls TE's
`get_dummy_wgrads_for_params`, a same-file function that sets it, or anything named `*grad_added*`. The data
parallel wrapper's own code is not judged.
"""

from __future__ import annotations

from collections.abc import Iterator

import libcst as cst

from maingrad.analyzer import walk
from maingrad.analyzer.context import FileContext, RuleSettings
from maingrad.analyzer.facts import (
    BACKWARD_NAME,
    FLAG_HELPERS,
    WRAPPER_CLASS,
    is_wrapper_path,
)
from maingrad.analyzer.facts import GRAD_ADDED_FLAG as FLAG
from maingrad.analyzer.names import dotted_name
from maingrad.analyzer.rules._common import (
    MainGradScope,
    code_of,
    in_wrapper,
    is_simple_chain,
    string_value,
    written_buffer,
)
from maingrad.analyzer.rules.base import Example, Fix, Rule, Violation
from maingrad.analyzer.syntax_index import SyntaxIndex, gate_aliases, pos, spine_is_main_grad
from maingrad.contracts.report import Severity


def _is_flag_target(node: cst.CSTNode) -> bool:
    return isinstance(node, cst.Attribute) and node.attr.value == FLAG


def _sets_or_tests_flag(func: cst.CSTNode) -> bool:
    """Any mention of the flag other than resetting it to `False`."""
    resets: set[int] = set()
    for node in walk.walk(func):
        if isinstance(node, cst.Assign) and isinstance(node.value, cst.Name) and node.value.value == "False":
            resets.update(id(t.target) for t in node.targets if _is_flag_target(t.target))
        if _is_flag_target(node) and id(node) not in resets:
            return True
        if isinstance(node, cst.SimpleString) and string_value(node) == FLAG:
            return True
    return False


class MissingGradAddedToMainGrad(Rule):
    id = "MG008"
    name = "missing-grad-added-to-main-grad"
    severity = Severity.ERROR
    summary = "a backward writes the wgrad into `W.main_grad` but never sets `W.grad_added_to_main_grad`"
    needles = ("main_grad",)
    fixable = True
    docs = """\
## What it does
Finds an autograd backward (or a `*_backward` helper) that writes a weight gradient straight into
`W.main_grad` (a fused `wgrad_gemm_accum_*` kernel, a GEMM with `out=W.main_grad`, `W.main_grad.add_(...)`)
but never sets `W.grad_added_to_main_grad = True`.

## Why is this bad?
Megatron's DDP and Megatron-FSDP grad hooks run after the backward: when `grad_added_to_main_grad` is not set
they add `param.grad` into `main_grad` (counting the gradient twice when the backward also returned it, or
adding a dummy/garbage tensor), and with `overlap_grad_reduce` a `None` gradient trips their checks. TE and
megatron-core set the flag in the same backward that writes the buffer.

## Example
```python
@staticmethod
def backward(ctx, grad_output):
    x, weight = ctx.saved_tensors
    fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x, grad_output, weight.main_grad)
    return grad_output.matmul(weight), None
```

## Use instead
```python
@staticmethod
def backward(ctx, grad_output):
    x, weight = ctx.saved_tensors
    fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x, grad_output, weight.main_grad)
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
    return grad_output.matmul(weight), None
```
The (unsafe) fix inserts the guarded assignment after the write; return a dummy gradient for the weight
(TE's `get_dummy_wgrad`) rather than the real one, as megatron-core does.

## In real code
No real instance is known: it reported nothing on the 14 code bases of `docs/real-world.md` (megatron-core
0.16.1/0.18.2/0.19.2, Transformer Engine 2.20.2, megatron-bridge, NeMo, ModelOpt, nanotron, DeepSpeed,
ColossalAI, torchtitan, and Megatron-LM, TE and Megatron-Bridge main). It guards the contract against new code.
"""

    VALID = [
        # megatron-core 0.19.2 style.
        Example(
            """\
            import torch

            class LinearWithGradAccumulation(torch.autograd.Function):
                @staticmethod
                def backward(ctx, grad_output):
                    total_input, weight = ctx.saved_tensors
                    if weight.main_grad.dtype == torch.float32:
                        fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(total_input, grad_output, weight.main_grad)
                    if hasattr(weight, "grad_added_to_main_grad"):
                        weight.grad_added_to_main_grad = True
                        grad_weight = get_dummy_wgrad(list(weight.main_grad.shape), total_input.dtype)
                    else:
                        grad_weight = None
                    return grad_output.matmul(weight), grad_weight
            """
        ),
        # TE 2.20 style: GEMM kwargs in a nested closure; the flag set at the end of the backward.
        Example(
            """\
            def _linear_backward(bwd_args, x, dy, weight):
                main_grad = bwd_args.main_grad_func()
                kwargs = {"out": main_grad, "out_dtype": main_grad.dtype, "accumulate": True}

                def wgrad_gemm(a, b):
                    return general_gemm(a, b, **kwargs)

                wgrad_gemm(x, dy)
                if hasattr(weight, "grad_added_to_main_grad"):
                    weight.grad_added_to_main_grad = True
            """
        ),
        # TE op-fuser style: the helper sets the flag.
        Example(
            """\
            def op_backward(self, ctx, grad_output):
                main_grad = get_main_grad_from_param(self.weight)
                general_gemm(ctx.x, grad_output, out=main_grad, accumulate=True)
                return grad_output, get_dummy_wgrads_for_params([self.weight])
            """
        ),
        # Not a backward: a pipeline-drain helper whose backward already set the flag.
        Example(
            """\
            def drain_embedding_wgrad_compute(x, dy, weight):
                fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x, dy, weight.main_grad)
            """
        ),
        # The grad hook's own job: moving .grad into main_grad.
        Example(
            """\
            def _process_post_backward_gradients(params):
                for param in params:
                    param.main_grad.add_(param.grad)
                    param.main_grad.copy_(to_local(param.grad))
            """
        ),
        # A same-file helper sets the flag.
        Example(
            """\
            def _mark(weight):
                weight.grad_added_to_main_grad = True

            def backward(ctx, dy):
                ctx.weight.main_grad.add_(dy.t() @ ctx.x)
                _mark(ctx.weight)
            """
        ),
    ]
    INVALID = [
        Example(
            """\
            import torch

            class Fused(torch.autograd.Function):
                @staticmethod
                def backward(ctx, grad_output):
                    x, weight = ctx.saved_tensors
                    fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x, grad_output, weight.main_grad)
                    return grad_output.matmul(weight), None
            """,
            line=7,
            fixed="""\
            import torch

            class Fused(torch.autograd.Function):
                @staticmethod
                def backward(ctx, grad_output):
                    x, weight = ctx.saved_tensors
                    fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x, grad_output, weight.main_grad)
                    if hasattr(weight, "grad_added_to_main_grad"):
                        weight.grad_added_to_main_grad = True
                    return grad_output.matmul(weight), None
            """,
        ),
        # add_ into a local alias; a reset to False does not count as setting the flag.
        Example(
            """\
            def _wgrad_backward(ctx, dy):
                ctx.weight.grad_added_to_main_grad = False
                buf = ctx.weight.main_grad
                buf.add_(dy.t().matmul(ctx.x))
                return None
            """,
            line=4,
            fixed="""\
            def _wgrad_backward(ctx, dy):
                ctx.weight.grad_added_to_main_grad = False
                buf = ctx.weight.main_grad
                buf.add_(dy.t().matmul(ctx.x))
                if hasattr(ctx.weight, "grad_added_to_main_grad"):
                    ctx.weight.grad_added_to_main_grad = True
                return None
            """,
        ),
        # out= GEMM inside a closure of the backward; owner unknown, so no fix.
        Example(
            """\
            def backward(ctx, dy):
                main_grad = ctx.main_grad_func()

                def wgrad():
                    general_gemm(ctx.x, dy, out=main_grad, accumulate=True)

                wgrad()
                return None
            """,
            line=5,
        ),
    ]

    def gate(self, index: SyntaxIndex, settings: RuleSettings) -> bool:
        """Over-approximates `check`: the "backward" text test and the wrapper path are mirrored exactly;
        then some candidate write of `_common.written_buffer` (kernel argument, add_/copy_ receiver, `out=`
        keyword or `{"out": ...}` value, `+=` target) that may be a main_grad buffer
        (`spine_is_main_grad`), inside a function named like a backward and outside every class named like
        a wrapper (line spans, exact for defs and classes). Flag awareness only removes findings."""
        if "backward" not in index.source or is_wrapper_path(index.path):
            return False
        backwards = [s for s in index.scopes if s.kind == "def" and BACKWARD_NAME.search(s.name)]
        if not backwards:
            return False
        aliases = gate_aliases(index)
        for write in index.writes:
            where = pos(write.node)
            if not any(s.contains(where) for s in backwards):
                continue
            if not spine_is_main_grad(write.spine, aliases):
                continue
            if any(s.kind == "class" and WRAPPER_CLASS.search(s.name) for s in index.enclosing(where)):
                continue
            return True
        return False

    def check(self, ctx: FileContext) -> Iterator[Violation]:
        if "backward" not in ctx.source:
            return
        units: dict[cst.FunctionDef, bool] = {}  # backward -> is it aware of the flag?
        reported: set[tuple[int, str]] = set()
        scopes: dict[cst.FunctionDef | None, MainGradScope] = {}
        for node in ctx.nodes(cst.Call, cst.Dict, cst.AugAssign):
            target = written_buffer(node)
            if target is None:
                continue
            unit = self._backward_of(ctx, node)
            if unit is None or in_wrapper(ctx, node):
                continue
            func = next((a for a in ctx.ancestors(node) if isinstance(a, cst.FunctionDef)), None)
            if func not in scopes:
                scopes[func] = MainGradScope.of(ctx, func)
            scope = scopes[func]
            if not scope.is_main_grad(target):
                continue
            if unit not in units:
                units[unit] = self._aware(ctx, unit)
            if units[unit]:
                continue
            owner = scope.owner(target)
            key = (id(unit), code_of(owner) if owner is not None else "")
            if key in reported:
                continue
            reported.add(key)
            subject = f"`{code_of(owner)}`" if owner is not None else "the weight"
            yield Violation(
                node=node,
                message=(
                    f"this backward writes the wgrad into `{code_of(target)}` but never sets "
                    f"{subject}`.grad_added_to_main_grad`: Megatron's DDP/FSDP grad hook then adds the returned "
                    "gradient into main_grad again (or trips on a None gradient); after the write, set it where "
                    'the attribute exists (`if hasattr(W, "grad_added_to_main_grad"): '
                    "W.grad_added_to_main_grad = True`) and return a dummy gradient for W"
                ),
                fix=self._fix(ctx, node, owner),
            )

    @staticmethod
    def _backward_of(ctx: FileContext, node: cst.CSTNode) -> cst.FunctionDef | None:
        """The innermost enclosing function named like a backward (the unit whose flag handling counts)."""
        for ancestor in ctx.ancestors(node):
            if isinstance(ancestor, cst.FunctionDef) and BACKWARD_NAME.search(ancestor.name.value):
                return ancestor
        return None

    def _aware(self, ctx: FileContext, unit: cst.FunctionDef) -> bool:
        if _sets_or_tests_flag(unit):
            return True
        setters = {
            f.name.value
            for f in ctx.nodes(cst.FunctionDef)
            if isinstance(f, cst.FunctionDef) and f is not unit and _sets_or_tests_flag(f)
        }
        for node in walk.walk(unit):
            if isinstance(node, cst.Call):
                name = (dotted_name(node.func) or "").rsplit(".", 1)[-1]
                if name in FLAG_HELPERS or name in setters or "grad_added" in name:
                    return True
        return False

    @staticmethod
    def _fix(ctx: FileContext, node: cst.CSTNode, owner: cst.BaseExpression | None) -> Fix | None:
        """Insert the guarded flag assignment right after the writing statement (unsafe)."""
        if owner is None or not is_simple_chain(owner):
            return None
        line = next((a for a in ctx.ancestors(node) if isinstance(a, cst.SimpleStatementLine)), None)
        if line is None or not isinstance(ctx.parent(line), cst.IndentedBlock):
            return None
        if any(isinstance(a, cst.Lambda) for a in ctx.ancestors(node)):
            return None
        guard = cst.If(
            test=cst.Call(
                func=cst.Name("hasattr"),
                args=[cst.Arg(owner), cst.Arg(cst.SimpleString(f'"{FLAG}"'))],
            ),
            body=cst.IndentedBlock(
                body=[
                    cst.SimpleStatementLine(
                        body=[
                            cst.Assign(
                                targets=[cst.AssignTarget(cst.Attribute(value=owner, attr=cst.Name(FLAG)))],
                                value=cst.Name("True"),
                            )
                        ]
                    )
                ]
            ),
        )
        return Fix(
            {line: cst.FlattenSentinel([line, guard])},
            "set grad_added_to_main_grad after the fused write",
            safe=False,
        )
