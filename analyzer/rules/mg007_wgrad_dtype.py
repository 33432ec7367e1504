"""MG007: a weight gradient written into `main_grad` with a dtype not taken from `main_grad.dtype`.

What a main_grad buffer is comes from `rules._common.MainGradScope` (shared with MG008, so both rules
recognise the same writes): `W.main_grad`, `W.get_main_grad()`, TE's `get_main_grad_from_param(W)`, views and
subscripts of those, ternaries with such a branch, lists of them, local names bound to any of these, and
names that say they hold one (`main_grad`, `fc1_weight_main_grad`, `main_grads`).

Four shapes are checked, each only where the dtype provably does not come from the buffer:
* a GEMM with `out=<main_grad>` and an `out_dtype=` (keyword, `dict(...)` or a `{"out": ...}` kwargs
  literal) that is a constant dtype or an activation/parameter dtype; an `out_dtype` that mentions the
  buffer anywhere (TE's `main_grad.dtype if fuse else activation_dtype`) or is unknown (a parameter named
  `dtype`) is accepted;
* `torch.matmul/mm/bmm/addmm/baddbmm/addbmm(..., out=<main_grad>)`: these require `out` to have the
  inputs' (activation) dtype, so bf16 inputs into an fp32 buffer raise; accepted behind a test of the
  buffer's dtype or when every input is cast with `main_grad`'s dtype;
* `fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32/fp16(..., <main_grad>)` with no test of the buffer's
  dtype on the path (Megatron dispatches on `main_grad.dtype`), or under a test that contradicts the kernel;
* `<main_grad>.add_/copy_(g.to(low))`, `+= g.half()`: the wgrad is rounded to a fixed low precision or to
  the activation/parameter dtype before it reaches the accumulator.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

import libcst as cst

from maingrad.analyzer import syntax_index
from maingrad.analyzer.context import FileContext, RuleSettings
from maingrad.analyzer.facts import (
    CAST_METHODS,
    DTYPES,
    FP32_DTYPES,
    KERNEL_PRECISION,
    LOW_DTYPES,
    MATMULS,
)
from maingrad.analyzer.names import dotted_name
from maingrad.analyzer.rules._common import (
    MainGradScope,
    code_of,
    function_of,
    is_before,
    is_simple_chain,
    keyword,
    out_pairs,
    own_nodes,
    positional,
    string_value,
)
from maingrad.analyzer.rules.base import Example, Fix, Rule, Violation
from maingrad.analyzer.syntax_index import SyntaxIndex, gate_aliases, spine_is_main_grad
from maingrad.contracts.report import Severity

_ACTIVATION_DTYPE = re.compile(r"(activation|act|param|params|input|inp|compute|autocast|amp|weight)_?dtype$")
_GUARD_TEXT = ("grad_dtype", "grads_in_fp32")


def _ast_maybe_matmul(call: ast.Call) -> bool:
    """Whether `ctx.names.qualified_name(call.func)` may be `torch.<matmul>`: its last part is the callee's
    attribute, or anything for a plain name (an alias)."""
    return isinstance(call.func, ast.Name) or (
        isinstance(call.func, ast.Attribute) and call.func.attr in MATMULS
    )


def _ast_kernel_cleared(index: SyntaxIndex, call: ast.Call) -> bool:
    """True only when `_check_call` reports nothing on this kernel call: `_dtype_tests` finds a test (an
    enclosing if/ternary/while test whose text reads the buffer's dtype; its `ast` text is part of libcst's
    `code_of`, so the substrings are there too) and `_kernel_contradiction` cannot fire."""
    func = syntax_index.function_of(index, call)
    tested = False
    for ancestor in index.ancestors(call):
        if isinstance(ancestor, (ast.If, ast.IfExp, ast.While)):
            code = index.segment(ancestor.test) or ""
            if ("main_grad" in code and "dtype" in code) or any(t in code for t in _GUARD_TEXT):
                tested = True
                break
        if ancestor is func:
            break
    if not tested:
        return False
    method = call.func.attr  # type: ignore[attr-defined]
    wanted = FP32_DTYPES if KERNEL_PRECISION[method] == "fp32" else LOW_DTYPES
    child: ast.AST = call
    for ancestor in index.ancestors(call):  # the innermost `if` holding the call in its body decides
        if isinstance(ancestor, ast.If) and any(s is child for s in ancestor.body):
            return not _ast_may_contradict(ancestor.test, wanted)
        if isinstance(ancestor, (*syntax_index.FUNCTION_NODES, ast.Lambda)):
            return True
        child = ancestor
    return True


def _ast_may_contradict(test: ast.AST, wanted: frozenset[str]) -> bool:
    """Whether `_kernel_contradiction` may return a dtype for this `if` test. It needs every compared
    element to resolve (`torch_dtype_name`) and one outside `wanted`; an element's resolved name, if any,
    is its attribute or its string (a plain name may alias anything)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    comparator = test.comparators[0]
    if isinstance(test.ops[0], ast.Eq):
        elements = [comparator]
    elif isinstance(test.ops[0], ast.In) and isinstance(comparator, (ast.Tuple, ast.List)):
        elements = [e.value if isinstance(e, ast.Starred) else e for e in comparator.elts]
    else:
        return False
    verdicts = [_ast_dtype_verdict(e, wanted) for e in elements]
    return "none" not in verdicts and "bad" in verdicts


def _ast_dtype_verdict(expr: ast.AST, wanted: frozenset[str]) -> str:
    """How `torch_dtype_name(expr)` may come out: surely None ("none"), None or a wanted dtype ("ok"), or
    maybe another dtype ("bad")."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        text = expr.value
    elif isinstance(expr, ast.Attribute):
        if syntax_index.dotted(expr) is None:
            return "none"
        text = expr.attr
    elif isinstance(expr, ast.Name):
        return "bad"
    else:
        return "none"
    if text not in DTYPES:
        return "none"
    return "ok" if text in wanted else "bad"


def torch_dtype_name(ctx: FileContext, expr: cst.BaseExpression) -> str | None:
    """`float16` for `torch.float16` (any import form) or the string `"float16"`, else None."""
    text = string_value(expr)
    if text is not None:
        return text if text in DTYPES else None
    name = ctx.names.qualified_name(expr)
    if name is not None and name.startswith("torch.") and name.rsplit(".", 1)[-1] in DTYPES:
        return name.rsplit(".", 1)[-1]
    return None


class _Source:
    MAIN_GRAD = "main_grad"
    FIXED = "fixed"
    ACTIVATION = "activation"


def dtype_source(
    ctx: FileContext, scope: MainGradScope, expr: cst.BaseExpression, depth: int = 0
) -> str | None:
    """Where a dtype expression comes from: the buffer, a constant, activations/parameters, or unknown."""
    if scope.mentions_main_grad(expr):
        return _Source.MAIN_GRAD
    if isinstance(expr, cst.IfExp):
        sides = {
            dtype_source(ctx, scope, expr.body, depth + 1),
            dtype_source(ctx, scope, expr.orelse, depth + 1),
        }
        if None in sides:
            return None
        return _Source.FIXED if sides == {_Source.FIXED} else _Source.ACTIVATION
    if torch_dtype_name(ctx, expr) is not None:
        return _Source.FIXED
    if isinstance(expr, cst.Attribute) and expr.attr.value == "dtype":
        return _Source.ACTIVATION
    dotted = dotted_name(expr)
    if dotted is not None and _ACTIVATION_DTYPE.search(dotted.rsplit(".", 1)[-1]):
        return _Source.ACTIVATION
    if isinstance(expr, cst.Name) and depth < 3:
        values = scope.bindings.get(expr.value, [])
        sources = {dtype_source(ctx, scope, v, depth + 1) for v in values}
        if values and None not in sources and _Source.MAIN_GRAD not in sources:
            return _Source.FIXED if sources == {_Source.FIXED} else _Source.ACTIVATION
    return None


def _dtype_tests(
    ctx: FileContext, node: cst.CSTNode, func: cst.FunctionDef | None
) -> list[cst.BaseExpression]:
    """Tests that hold on the path to `node` or ran before it in its function and that read the main_grad
    dtype (enclosing if/elif/ternary tests, earlier asserts and early-exit ifs)."""
    tests: list[cst.BaseExpression] = []
    for ancestor in ctx.ancestors(node):
        if isinstance(ancestor, (cst.If, cst.IfExp, cst.While)):
            tests.append(ancestor.test)
        if ancestor is func:
            break
    if func is not None:
        for owner in own_nodes(func, cst.Assert, cst.If):
            test = owner.test  # type: ignore[attr-defined]
            if owner not in tests and is_before(ctx, owner, node):
                tests.append(test)
    return [t for t in tests if _reads_buffer_dtype(t)]


def _reads_buffer_dtype(test: cst.BaseExpression) -> bool:
    code = code_of(test)
    return ("main_grad" in code and "dtype" in code) or any(t in code for t in _GUARD_TEXT)


_PRECISION_FLAG = re.compile(r"16bit|fp16|bf16|fp32|half|float16|float32|bfloat16", re.IGNORECASE)
_OTHER_KERNEL = {"fp32": "wgrad_gemm_accum_fp16", "fp16": "wgrad_gemm_accum_fp32"}
_VARYING_PRECISION = re.compile(
    r"main_grad\.dtype|grad_reduce_in_fp32|accumulate_allreduce_grads_in_fp32|main_grads_dtype"
)


def _dispatched(
    ctx: FileContext, call: cst.CSTNode, buffer: cst.BaseExpression, func: cst.FunctionDef | None
) -> bool:
    """Is the kernel chosen by a test on the path that reads the buffer's dtype through its local name
    (`grad = weight.main_grad; if grad.dtype == torch.float32:`) or by a flag that names a precision
    (apex's `if not ctx.use_16bit_in_wgrad_accum_fusion:`)? Both are a dispatch, not an assumption."""
    needle = f"{code_of(buffer)}.dtype"
    for ancestor in ctx.ancestors(call):
        if isinstance(ancestor, (cst.If, cst.IfExp, cst.While)):
            code = code_of(ancestor.test)
            if needle in code or _PRECISION_FLAG.search(code):
                return True
        if ancestor is func:
            break
    return False


def _precision_varies(source: str, kind: str) -> bool:
    """Does the file show that a main_grad can come in more than one precision (it also uses the other
    kernel, reads a `main_grad.dtype`, or names Megatron's switches that make the buffer bf16)? Code that
    uses one kernel and never mentions another precision (metaseq's fp32-only `fused_dense_cuda` path) is
    written for the one buffer dtype its optimizer creates."""
    return _OTHER_KERNEL[kind] in source or bool(_VARYING_PRECISION.search(source))


def _kernel_contradiction(ctx: FileContext, call: cst.Call, kind: str) -> str | None:
    """The dtype named by the innermost enclosing `if <main_grad>.dtype == torch.X` whose body holds
    `call`, when it contradicts the kernel (fp32 kernel for a half buffer or the reverse)."""
    child: cst.CSTNode = call
    for ancestor in ctx.ancestors(call):
        if isinstance(ancestor, cst.If) and child is ancestor.body:
            test = ancestor.test
            if (
                isinstance(test, cst.Comparison)
                and len(test.comparisons) == 1
                and "main_grad" in code_of(test.left)
            ):
                target = test.comparisons[0]
                names: list[str | None]
                if isinstance(target.operator, cst.Equal):
                    names = [torch_dtype_name(ctx, target.comparator)]
                elif isinstance(target.operator, cst.In) and isinstance(
                    target.comparator, (cst.Tuple, cst.List)
                ):
                    names = [torch_dtype_name(ctx, e.value) for e in target.comparator.elements]
                else:
                    return None
                if None in names:
                    return None
                wanted = FP32_DTYPES if kind == "fp32" else LOW_DTYPES
                wrong = [n for n in names if n not in wanted]
                return wrong[0] if wrong else None
            return None
        if isinstance(ancestor, (cst.FunctionDef, cst.Lambda)):
            return None
        child = ancestor
    return None


def _looks_like_cast(expr: cst.BaseExpression) -> bool:
    """Cheap syntactic test before any scope work: `x.to(...)`, `x.type(...)`, `x.half()`, `x.bfloat16()`."""
    return (
        isinstance(expr, cst.Call)
        and isinstance(expr.func, cst.Attribute)
        and expr.func.attr.value in CAST_METHODS
    )


def _cast_target(
    ctx: FileContext, scope: MainGradScope, expr: cst.BaseExpression
) -> tuple[str, cst.Call] | None:
    """For `g.to(low)`, `g.half()`, `g.type(x.dtype)`: (description of the dtype, the cast call)."""
    if not isinstance(expr, cst.Call) or not isinstance(expr.func, cst.Attribute):
        return None
    method = expr.func.attr.value
    if method in ("half", "bfloat16") and not expr.args:
        return (method, expr)
    if method not in ("to", "type"):
        return None
    args = positional(expr)
    dtype_arg = keyword(expr, "dtype")
    candidate = dtype_arg.value if dtype_arg is not None else (args[0].value if args else None)
    if candidate is None:
        return None
    name = torch_dtype_name(ctx, candidate)
    if name is not None:
        return (code_of(candidate), expr) if name in LOW_DTYPES else None
    if isinstance(candidate, cst.Attribute) and candidate.attr.value == "dtype":
        # `p.grad.to(p.dtype)`: a parameter's .grad already has the parameter's dtype (a no-op cast).
        source = expr.func.value
        if (
            isinstance(source, cst.Attribute)
            and source.attr.value == "grad"
            and code_of(source.value) == code_of(candidate.value)
        ):
            return None
    if dtype_source(ctx, scope, candidate) == _Source.ACTIVATION:
        return (code_of(candidate), expr)
    return None


class WgradDtypeNotFromMainGrad(Rule):
    id = "MG007"
    name = "wgrad-dtype-not-from-main-grad"
    severity = Severity.ERROR
    summary = "a weight gradient written into `main_grad` with a dtype not taken from `main_grad.dtype`"
    needles = ("main_grad",)
    fixable = True
    docs = """\
## What it does
Finds weight-gradient writes into `main_grad` whose output dtype is fixed or comes from the activations or
parameters instead of from `main_grad.dtype`: a GEMM with `out=w.main_grad` and a constant or activation
`out_dtype`; `torch.matmul(..., out=w.main_grad)` (its `out` must have the inputs' dtype); Megatron's
`wgrad_gemm_accum_fp32/fp16` kernels used without checking `w.main_grad.dtype`; `w.main_grad.add_(g.to(bf16))`.

A kernel counts as checked when a test on its path reads the buffer's dtype (also through a local name:
`grad = w.main_grad; if grad.dtype == torch.float32:`) or a flag that names a precision
(`if not ctx.use_16bit_in_wgrad_accum_fusion:`). An unchecked kernel is reported only in a file that shows
`main_grad` can have another precision (it also uses the other kernel, reads a `main_grad.dtype`, or names
`grad_reduce_in_fp32`/`accumulate_allreduce_grads_in_fp32`): a file with one kernel and no other precision
is written for the one buffer dtype its optimizer creates.

## Why is this bad?
`main_grad` is usually fp32 while activations and parameters are bf16, but it can be bf16 (Megatron without
`accumulate_allreduce_grads_in_fp32`) or be replaced by Megatron-FSDP's buffers. A mismatched output dtype
either raises (`torch.matmul` with a bf16 input and an fp32 `out`), makes the fp32 kernel reinterpret a bf16
buffer, or rounds each micro-batch's gradient to bf16 before it reaches the fp32 accumulator, losing
precision silently.

## Example
```python
general_gemm(x, dy, out=weight.main_grad, out_dtype=ctx.activation_dtype, accumulate=True)
fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x, dy, weight.main_grad)
```

## Use instead
```python
general_gemm(x, dy, out=weight.main_grad, out_dtype=weight.main_grad.dtype, accumulate=True)
if weight.main_grad.dtype == torch.float32:
    fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x, dy, weight.main_grad)
elif weight.main_grad.dtype in (torch.float16, torch.bfloat16):
    fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16(x, dy, weight.main_grad)
else:
    raise RuntimeError("Unsupported gradient type for gradient accumulation fusion")
```
Fixes (unsafe: they change control flow, memory or numerics): the kernel call is wrapped in that dtype
dispatch, a `torch.matmul(..., out=buf)` statement becomes `buf.copy_(torch.matmul(...))`, and a downcast
before `add_`/`copy_` is dropped. Each is run on CPU in `tests/analyzer/test_fixes_run.py`; the kernel
stand-ins take their dtype contract (`wgrad_gemm_accum_fp32` for a float32 buffer, `wgrad_gemm_accum_fp16`
for float16/bfloat16) from megatron-core 0.19.2's own dispatch, read from the wheel at test time.

`out_dtype` becomes `<out>.dtype` (safe). Measured on the H200 with TE 2.20.2 (`tests/gpu/mg007_out_dtype.py`,
docs/gpu-evidence.md): `general_gemm` with an `out=` buffer raises `RuntimeError` in its compiled GEMM when
`out_dtype` differs from the buffer's dtype (fp32 buffer with bf16, bf16 buffer with fp32), and with a matching
`out_dtype` (or `None`) writes into the buffer itself, accumulating when asked. So the fix only changes a call
that raises into one that accumulates; `tests/analyzer/test_fixes_run.py` runs it against a stand-in with that
contract.

## In real code
megatron-core 0.16.1, 0.18.2 and 0.19.2 `LinearWithGradAccumulationAndAsyncCommunication.backward`, Megatron-FSDP
branch without TE: `torch.matmul(grad_output.t(), total_input, out=weight.main_grad)` with bf16 inputs and an
fp32 buffer raises. Megatron-LM main replaced it (`_wgrad_gemm` computes in the inputs' dtype and copies).
The same code in HYGON-AI/Megatron-LM-das and krafton-ai/Megatron-Dion (second table of
`docs/real-world.md`, no false alarm on its 31 code bases).
"""

    VALID = [
        # megatron-core 0.19.2: out_dtype from the buffer; kernels dispatched on main_grad.dtype.
        Example(
            """\
            import torch
            import fused_weight_gradient_mlp_cuda

            def backward(ctx, weight, total_input, grad_output):
                te_general_gemm(total_input, grad_output, out_dtype=weight.main_grad.dtype, out=weight.main_grad)
                if weight.main_grad.dtype == torch.float32:
                    fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(total_input, grad_output, weight.main_grad)
                elif weight.main_grad.dtype in (torch.float16, torch.bfloat16):
                    fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16(total_input, grad_output, weight.main_grad)
            """
        ),
        # TE 2.20 style: a kwargs dict whose out_dtype follows the (conditional) buffer.
        Example(
            """\
            def _linear_backward(bwd_args, x, dy):
                main_grad = bwd_args.main_grad_func()
                kwargs = {
                    "out_dtype": main_grad.dtype if bwd_args.fuse_wgrad_accumulation else bwd_args.activation_dtype,
                    "out": main_grad if bwd_args.fuse_wgrad_accumulation else None,
                }
                return general_gemm(x, dy, **kwargs)
            """
        ),
        # out_dtype from a local bound to the buffer's dtype; an unknown `dtype` parameter is not judged.
        Example(
            """\
            def wgrad(w, x, dy, dtype):
                dw = w.main_grad
                dw_dtype = dw.dtype
                general_gemm(x, dy, out=dw, out_dtype=dw_dtype, accumulate=True)
                general_gemm(x, dy, out=w.main_grad, out_dtype=dtype)
            """
        ),
        # matmul into main_grad behind a dtype test; add_ of an fp32 upcast is fine.
        Example(
            """\
            import torch

            def wgrad(w, x, dy):
                if w.main_grad.dtype == x.dtype:
                    torch.matmul(dy.t(), x, out=w.main_grad)
                w.main_grad.add_(dy.t().matmul(x).float())
                w.main_grad.copy_(w.grad)
            """
        ),
        # The fp32 kernel checked by an assert; an out= that is not a main_grad buffer.
        Example(
            """\
            import torch

            def wgrad(w, x, dy, buf):
                assert w.main_grad.dtype == torch.float32
                fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x, dy, w.main_grad)
                torch.matmul(dy.t(), x, out=buf)
                general_gemm(x, dy, out=buf, out_dtype=torch.bfloat16)
            """
        ),
        # Regression (alibaba/Megatron-LLaMA): the dispatch reads the dtype through a local alias.
        Example(
            """\
            def backward(ctx, weight, total_input, grad_output):
                grad = weight.main_grad if hasattr(weight, "main_grad") else weight.grad
                if grad.dtype == torch.float32:
                    fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(total_input, grad_output, grad)
                elif grad.dtype == torch.float16:
                    fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16(total_input, grad_output, grad)
            """
        ),
        # Regression (apex.transformer, ROCm/apex): the kernel is chosen by a flag that names the precision.
        Example(
            """\
            def backward(ctx, weight, total_input, grad_output):
                if not ctx.use_16bit_in_wgrad_accum_fusion:
                    fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(total_input, grad_output, weight.main_grad)
                else:
                    fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16(total_input, grad_output, weight.main_grad)
            """
        ),
        # Regression (facebookresearch/metaseq): one kernel, one buffer precision in the whole file.
        Example(
            """\
            def backward(ctx, weight, total_input, grad_output):
                if ctx.gradient_accumulation_fusion:
                    fused_dense_cuda.wgrad_gemm_accum_fp32(total_input, grad_output, weight.main_grad)
                    grad_weight = None
                return grad_output.matmul(weight), grad_weight
            """
        ),
    ]
    INVALID = [
        # A constant out_dtype for an out=main_grad GEMM (safe fix: take it from the buffer).
        Example(
            """\
            import torch

            def backward(ctx, weight, x, dy):
                general_gemm(x, dy, out=weight.main_grad, out_dtype=torch.bfloat16, accumulate=True)
            """,
            line=4,
            fixed="""\
            import torch

            def backward(ctx, weight, x, dy):
                general_gemm(x, dy, out=weight.main_grad, out_dtype=weight.main_grad.dtype, accumulate=True)
            """,
        ),
        # The activation dtype in a kwargs literal.
        Example(
            """\
            def backward(ctx, x, dy):
                main_grad = ctx.weight.main_grad
                kwargs = {"out": main_grad, "out_dtype": ctx.activation_dtype, "layout": "NT"}
                return general_gemm(x, dy, **kwargs)
            """,
            line=3,
            fixed="""\
            def backward(ctx, x, dy):
                main_grad = ctx.weight.main_grad
                kwargs = {"out": main_grad, "out_dtype": main_grad.dtype, "layout": "NT"}
                return general_gemm(x, dy, **kwargs)
            """,
        ),
        # megatron-core's fallback: torch.matmul into an fp32 buffer raises for bf16 inputs.
        Example(
            """\
            import torch

            def backward(weight, total_input, grad_output):
                weight.main_grad = weight.get_main_grad()
                torch.matmul(grad_output.t(), total_input, out=weight.main_grad)
            """,
            line=5,
            fixed="""\
            import torch

            def backward(weight, total_input, grad_output):
                weight.main_grad = weight.get_main_grad()
                weight.main_grad.copy_(torch.matmul(grad_output.t(), total_input))
            """,
        ),
        # The fp32 kernel with no dtype check (unsafe fix: dispatch on main_grad.dtype).
        Example(
            """\
            import torch
            import fused_weight_gradient_mlp_cuda

            def backward(weight, x, dy):
                fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x, dy, weight.main_grad)

            def buffer_dtype(weight):
                return weight.main_grad.dtype  # the file knows main_grad can be fp32 or bf16
            """,
            line=5,
            fixed="""\
            import torch
            import fused_weight_gradient_mlp_cuda

            def backward(weight, x, dy):
                if weight.main_grad.dtype == torch.float32:
                    fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x, dy, weight.main_grad)
                elif weight.main_grad.dtype in (torch.float16, torch.bfloat16):
                    fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16(x, dy, weight.main_grad)
                else:
                    raise RuntimeError("Unsupported gradient type for gradient accumulation fusion")

            def buffer_dtype(weight):
                return weight.main_grad.dtype  # the file knows main_grad can be fp32 or bf16
            """,
        ),
        # A dtype test that contradicts the kernel.
        Example(
            """\
            import torch
            import fused_weight_gradient_mlp_cuda as fwg

            def backward(weight, x, dy):
                if weight.main_grad.dtype == torch.bfloat16:
                    fwg.wgrad_gemm_accum_fp32(x, dy, weight.main_grad)
            """,
            line=6,
        ),
        # The wgrad rounded to bf16 / to the parameter dtype before it reaches the accumulator.
        Example(
            """\
            import torch

            def backward(ctx, w, x, dy):
                grad = dy.t().matmul(x)
                w.main_grad.add_(grad.to(torch.bfloat16))
                w.main_grad += grad.to(dtype=w.dtype)
            """,
            line=5,
            fixed="""\
            import torch

            def backward(ctx, w, x, dy):
                grad = dy.t().matmul(x)
                w.main_grad.add_(grad)
                w.main_grad += grad
            """,
        ),
    ]

    def gate(self, index: SyntaxIndex, settings: RuleSettings) -> bool:
        """Over-approximates `check`'s four shapes by their syntax, on buffers that may be a main_grad
        (`spine_is_main_grad`): a kernel call's third positional argument, unless `_ast_kernel_cleared`; an
        `out=` keyword with an `out_dtype=` or a callee that may resolve to a torch matmul; a `{"out": ...,
        "out_dtype": ...}` display; an `add_`/`copy_` receiver or `+=` target written from a cast
        (`.to/.type/.half/.bfloat16`). Dtype sources only remove findings: ignored."""
        aliases: set[str] | None = None
        for write in index.writes:
            if write.kind == "kernel":
                relevant = not _ast_kernel_cleared(index, write.node)  # type: ignore[arg-type]
            elif write.kind == "out":
                relevant = write.out_dtype or _ast_maybe_matmul(write.node)  # type: ignore[arg-type]
            elif write.kind == "dict_out":
                relevant = write.out_dtype
            else:  # add_copy, aug
                relevant = write.cast
            if relevant:
                aliases = gate_aliases(index) if aliases is None else aliases
                if spine_is_main_grad(write.spine, aliases):
                    return True
        return False

    def check(self, ctx: FileContext) -> Iterator[Violation]:
        scopes: dict[cst.FunctionDef | None, MainGradScope] = {}

        def scope_of(node: cst.CSTNode) -> MainGradScope:
            func = function_of(ctx, node)
            if func not in scopes:
                scopes[func] = MainGradScope.of(ctx, func)
            return scopes[func]

        for node in ctx.nodes(cst.Call):
            assert isinstance(node, cst.Call)
            func = node.func
            method = func.attr.value if isinstance(func, cst.Attribute) else None
            if method in KERNEL_PRECISION or method in ("add_", "copy_"):
                yield from self._check_call(ctx, node, scope_of)
            elif any(a.keyword is not None and a.keyword.value == "out" for a in node.args):
                yield from self._check_out(ctx, node, scope_of)
        for mapping in ctx.nodes(cst.Dict):
            if any(isinstance(e, cst.DictElement) and string_value(e.key) == "out" for e in mapping.elements):
                yield from self._check_out(ctx, mapping, scope_of)
        for aug in ctx.nodes(cst.AugAssign):
            if isinstance(aug.operator, cst.AddAssign) and _looks_like_cast(aug.value):
                scope = scope_of(aug)
                if scope.is_main_grad(aug.target):
                    yield from self._check_cast(ctx, scope, aug.value, aug)

    # out= / out_dtype= ---------------------------------------------------------------------------------
    def _check_out(self, ctx: FileContext, node: cst.Call | cst.Dict, scope_of) -> Iterator[Violation]:
        pair = out_pairs(node)
        if pair is None:
            return
        out, dtype, holder = pair
        if isinstance(out, (cst.Name, cst.Integer, cst.SimpleString)) and out.value == "None":
            return
        scope = scope_of(node)
        if not scope.is_main_grad(out):
            return
        if dtype is not None:
            source = dtype_source(ctx, scope, dtype)
            if source in (_Source.FIXED, _Source.ACTIVATION):
                what = "a fixed dtype" if source == _Source.FIXED else "the activation/parameter dtype"
                # TE 2.20.2's compiled GEMM raises when `out_dtype` differs from `out`'s dtype and honours a
                # matching one (measured on the H200: docs/gpu-evidence.md, MG007): take it from the buffer.
                fix = None
                if is_simple_chain(out):
                    new_dtype = cst.Attribute(value=out, attr=cst.Name("dtype"))
                    fix = Fix({dtype: new_dtype}, "take out_dtype from the output buffer")
                yield Violation(
                    node=holder,
                    context_node=node,
                    message=(
                        f"the wgrad is written into `{code_of(out)}` with `out_dtype={code_of(dtype)}`, "
                        f"{what} instead of the buffer's: fp32 `main_grad` buffers get a mismatched GEMM "
                        f"output (an error or a silent rounding); use `out_dtype={code_of(out)}.dtype`"
                        if is_simple_chain(out)
                        else f"the wgrad is written into `{code_of(out)}` with `out_dtype={code_of(dtype)}`, "
                        f"{what} instead of the buffer's; take `out_dtype` from `main_grad.dtype`"
                    ),
                    fix=fix,
                )
        if isinstance(node, cst.Call):
            name = ctx.names.qualified_name(node.func) or ""
            if name.startswith("torch.") and name.rsplit(".", 1)[-1] in MATMULS:
                yield from self._check_matmul(ctx, scope, node, out)

    def _check_matmul(
        self, ctx: FileContext, scope: MainGradScope, call: cst.Call, out: cst.BaseExpression
    ) -> Iterator[Violation]:
        inputs = [a.value for a in positional(call)]
        if _dtype_tests(ctx, call, scope.func):
            return
        if inputs and all(scope.mentions_main_grad(i) for i in inputs):
            return
        fix = None
        line = ctx.parent(ctx.parent(call) or call)
        statement = ctx.parent(call)
        if (
            isinstance(statement, cst.Expr)
            and isinstance(line, cst.SimpleStatementLine)
            and is_simple_chain(out)
            and not any(a.keyword is not None and a.keyword.value != "out" for a in call.args)
        ):
            product = call.with_changes(
                args=[a for a in call.args if a.keyword is None],
            )
            last = product.args[-1]
            product = product.with_changes(
                args=[*product.args[:-1], last.with_changes(comma=cst.MaybeSentinel.DEFAULT)]
            )
            copy = cst.Call(
                func=cst.Attribute(value=out, attr=cst.Name("copy_")),
                args=[cst.Arg(value=product)],
            )
            fix = Fix({call: copy}, "write through copy_, which casts to the buffer's dtype", safe=False)
        yield Violation(
            node=call,
            message=(
                f"`{code_of(call.func)}(..., out={code_of(out)})` requires `out` to have the inputs' "
                "(activation) dtype: with bf16 inputs and an fp32 `main_grad` it raises; check "
                f"`{code_of(out)}.dtype` first, or compute the product and `{code_of(out)}.copy_()`/`add_()` it"
            ),
            fix=fix,
        )

    # kernels and add_/copy_ ----------------------------------------------------------------------------
    def _check_call(self, ctx: FileContext, call: cst.Call, scope_of) -> Iterator[Violation]:
        func = call.func
        if not isinstance(func, cst.Attribute):
            return
        method = func.attr.value
        if method in KERNEL_PRECISION:
            args = positional(call)
            if len(args) < 3:
                return
            scope = scope_of(call)
            buffer = args[2].value
            if not scope.is_main_grad(buffer):
                return
            kind = KERNEL_PRECISION[method]
            wrong = _kernel_contradiction(ctx, call, kind)
            if wrong is not None:
                yield Violation(
                    node=call,
                    message=(
                        f"`{method}` is the {kind} kernel but runs under a test that `{code_of(buffer)}` is "
                        f"{wrong}: the kernel must match `main_grad.dtype` (fp32 kernel for float32 buffers, "
                        "fp16 kernel for float16/bfloat16)"
                    ),
                )
                return
            if _dtype_tests(ctx, call, scope.func) or _dispatched(ctx, call, buffer, scope.func):
                return
            if not _precision_varies(ctx.source, kind):
                return  # one fixed main_grad precision in this file: nothing says the buffer can differ
            yield Violation(
                node=call,
                message=(
                    f"`{method}` assumes a {'float32' if kind == 'fp32' else 'float16/bfloat16'} "
                    f"`{code_of(buffer)}` but nothing on this path checks its dtype; dispatch on "
                    f"`{code_of(buffer)}.dtype` (fp32 kernel for float32, fp16 kernel for float16/bfloat16) as "
                    "megatron-core does"
                ),
                fix=_dispatch_fix(ctx, call, buffer),
            )
            return
        first = positional(call)
        if method in ("add_", "copy_") and first and _looks_like_cast(first[0].value):
            scope = scope_of(call)
            if scope.is_main_grad(func.value):
                yield from self._check_cast(ctx, scope, first[0].value, call)

    def _check_cast(
        self, ctx: FileContext, scope: MainGradScope, value: cst.BaseExpression, where: cst.CSTNode
    ) -> Iterator[Violation]:
        cast = _cast_target(ctx, scope, value)
        if cast is None:
            return
        described, cast_call = cast
        inner = cast_call.func.value  # type: ignore[attr-defined]
        yield Violation(
            node=where,
            message=(
                f"the wgrad is cast to `{described}` before it is written into `main_grad`: each micro-batch's "
                "gradient is rounded to that precision before it reaches the accumulator; write it as is "
                "(`add_`/`copy_` cast to the buffer's dtype) or cast to `main_grad.dtype`"
            ),
            fix=Fix(
                {cast_call: inner}, "drop the cast: add_/copy_ convert to the buffer's dtype", safe=False
            ),
        )


def _dispatch_fix(ctx: FileContext, call: cst.Call, buffer: cst.BaseExpression) -> Fix | None:
    """Wrap a lone kernel statement in megatron-core's dispatch on `main_grad.dtype` (needs `torch`)."""
    expr = ctx.parent(call)
    line = ctx.parent(expr) if expr is not None else None
    if not (
        isinstance(expr, cst.Expr)
        and isinstance(line, cst.SimpleStatementLine)
        and len(line.body) == 1
        and isinstance(ctx.parent(line), cst.IndentedBlock)
        and ctx.names.aliases.get("torch") == "torch"
        and is_simple_chain(buffer)
        and isinstance(call.func, cst.Attribute)
    ):
        return None
    dtype = cst.Attribute(value=buffer, attr=cst.Name("dtype"))
    fp32 = call.with_changes(func=call.func.with_changes(attr=cst.Name("wgrad_gemm_accum_fp32")))
    fp16 = call.with_changes(func=call.func.with_changes(attr=cst.Name("wgrad_gemm_accum_fp16")))

    def torch_attr(name: str) -> cst.Attribute:
        return cst.Attribute(value=cst.Name("torch"), attr=cst.Name(name))

    def body(node: cst.BaseSmallStatement) -> cst.IndentedBlock:
        return cst.IndentedBlock(body=[cst.SimpleStatementLine(body=[node])])

    raise_stmt = cst.Raise(
        exc=cst.Call(
            func=cst.Name("RuntimeError"),
            args=[cst.Arg(cst.SimpleString('"Unsupported gradient type for gradient accumulation fusion"'))],
        )
    )
    dispatch = cst.If(
        test=cst.Comparison(dtype, [cst.ComparisonTarget(cst.Equal(), torch_attr("float32"))]),
        body=body(cst.Expr(fp32)),
        orelse=cst.If(
            test=cst.Comparison(
                dtype,
                [
                    cst.ComparisonTarget(
                        cst.In(),
                        cst.Tuple([cst.Element(torch_attr("float16")), cst.Element(torch_attr("bfloat16"))]),
                    )
                ],
            ),
            body=body(cst.Expr(fp16)),
            orelse=cst.Else(body=body(raise_stmt)),
        ),
        leading_lines=line.leading_lines,
    )
    return Fix({line: dispatch}, "dispatch the kernel on main_grad.dtype", safe=False)
