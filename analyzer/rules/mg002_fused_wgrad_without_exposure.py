"""MG002: a direct fused wgrad kernel or GEMM writes into `W.main_grad` that nothing exposed first."""

from __future__ import annotations

import ast
from collections.abc import Iterator

import libcst as cst

from maingrad.analyzer import syntax_index
from maingrad.analyzer.context import FileContext, RuleSettings
from maingrad.analyzer.facts import GEMMS, INPLACE_GEMMS, KERNELS
from maingrad.analyzer.rules._common import (
    ABSENT,
    code_of,
    enclosing_function,
    exposure_receiver,
    is_before,
    is_helper_call,
    is_simple_chain,
    keyword,
    last_name,
    local_bindings,
    main_grad_receiver,
    mutually_exclusive,
    own_nodes,
    path_facts,
)
from maingrad.analyzer.rules.base import Example, Fix, Rule, Violation
from maingrad.analyzer.syntax_index import SyntaxIndex
from maingrad.contracts.report import Severity


def _written_buffers(call: cst.Call) -> list[cst.BaseExpression]:
    """The `W.main_grad` expressions a call writes into (empty when it is not a wgrad kernel/GEMM)."""
    name = last_name(call)
    if name in KERNELS:
        return [a.value for a in call.args if main_grad_receiver(a.value) is not None]
    if name in GEMMS:
        out = keyword(call, "out")
        if out is not None and main_grad_receiver(out.value) is not None:
            return [out.value]
        return []
    inplace = name in INPLACE_GEMMS and isinstance(call.func, cst.Attribute)
    if inplace and main_grad_receiver(call.func.value) is not None:  # type: ignore[attr-defined]
        return [call.func.value]  # type: ignore[attr-defined]
    return []


class FusedWgradWithoutExposure(Rule):
    id = "MG002"
    name = "fused-wgrad-without-main-grad-exposure"
    severity = Severity.ERROR
    summary = (
        "a fused wgrad kernel/GEMM writes into `W.main_grad` with no `get_main_grad()` exposure before it"
    )
    needles = ("main_grad",)
    fixable = True
    default = False  # opt-in: see "Opt-in" below
    docs = """\
## Opt-in
Not in the default selection: enable it with `select = ["MG002"]` (or `--select MG002`) in code that runs
under Megatron-FSDP. Whether a fused write needs the exposure depends on whether Megatron-FSDP wraps the
parameter, which the file does not say: on 31 Megatron/TE forks, ports and users nobody here wrote
(`docs/real-world.md`, second table) it reported 39 writes, none a bug (code that predates Megatron-FSDP, or
where `main_grad` is the eager buffer of another wrapper or a property), while the fixes it exists for
(Megatron-LM !4018, 2025) were in files that never mentioned Megatron-FSDP either.

## What it does
Flags direct fused weight-gradient kernels and GEMMs that write into a parameter's `main_grad`:
`fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32/fp16(..., W.main_grad)`, TE `general_gemm(...,
out=W.main_grad)`, `torch.matmul(..., out=W.main_grad)`, `W.main_grad.addmm_(...)`, when nothing earlier on
the same path of the same function exposes the buffer (`W.main_grad = W.get_main_grad()`, TE's
`get_main_grad_from_param(W)`, or a configured `exposure-helpers` call), and the path is not one where `W` is
known not to be a Megatron-FSDP parameter (the `else` of `if hasattr(W, "__fsdp_param__")`, after
`if hasattr(W, "__fsdp_param__"): ...; return`, ...).

## Why is this bad?
Under Megatron's DDP `main_grad` is a view into the grad buffer from wrap time on. Under Megatron-FSDP it is
absent until the first backward calls `W.get_main_grad()`, and `None` again after every
`zero_grad_buffer()`: the kernel gets `None` (or a stale buffer from an earlier step) and fails or writes the
gradient where the optimizer never reads it. Transformer Engine's modules and Megatron's own
`LinearWithGradAccumulationAndAsyncCommunication` refresh it first, on the FSDP branch.

## Example
```python
if ctx.gradient_accumulation_fusion:
    fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(total_input, grad_output, weight.main_grad)
```

## Use instead
```python
if ctx.gradient_accumulation_fusion:
    if hasattr(weight, "__fsdp_param__"):
        weight.main_grad = weight.get_main_grad()
    fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(total_input, grad_output, weight.main_grad)
```
The fix inserts exactly that guarded exposure before the outermost statement on the path that reads
`W.main_grad` (so a `W.main_grad.dtype` check sees the exposed buffer too). DDP parameters are untouched.

## In real code
It reported nothing on the 14 code bases of the first table of `docs/real-world.md` (megatron-core
0.16.1/0.18.2/0.19.2, Transformer Engine 2.20.2, megatron-bridge, NeMo, ModelOpt, nanotron, DeepSpeed,
ColossalAI, torchtitan, and Megatron-LM, TE and Megatron-Bridge main), and 39 false alarms on the 31 code
bases of the second table (hence opt-in). Megatron-LM fixed the bug it describes in
`tensor_parallel/layers.py` and `utils.py` in September 2025 (!4018).
"""

    VALID = [
        Example(
            """\
            import fused_weight_gradient_mlp_cuda

            def backward(ctx, weight, total_input, grad_output):
                if hasattr(weight, "__fsdp_param__"):
                    weight.main_grad = weight.get_main_grad()
                    torch.matmul(grad_output.t(), total_input, out=weight.main_grad)
                else:
                    if weight.main_grad.dtype == torch.float32:
                        fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(total_input, grad_output, weight.main_grad)
            """
        ),
        Example(
            """\
            def wgrad_compute(x, dy, weight):
                if hasattr(weight, "__fsdp_param__"):
                    weight.main_grad = weight.get_main_grad()
                if config.gradient_accumulation_fusion:
                    fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16(x, dy, weight.main_grad)
            """
        ),
        Example(
            """\
            from transformer_engine.pytorch.cpp_extensions import general_gemm

            def backward(ctx, x, dy):
                main_grad = ctx.main_grad_func()
                general_gemm(x, dy, out=main_grad, accumulate=True)
            """
        ),
        Example(
            """\
            from transformer_engine.pytorch.ops._common import get_main_grad_from_param

            def backward(weight, x, dy):
                get_main_grad_from_param(weight, op_label="MyOp")
                general_gemm(x, dy, out=weight.main_grad, accumulate=True)
            """
        ),
        Example(
            """\
            def backward(weight, x, dy):
                expose_main_grad(weight)
                wgrad_gemm_accum_fp32(x, dy, weight.main_grad)
            """,
            config={"exposure-helpers": ["expose_main_grad"]},
        ),
        Example(
            """\
            def backward(weight, x, dy):
                if not hasattr(weight, "__fsdp_param__"):  # DDP: main_grad exists since wrap time
                    wgrad_gemm_accum_fp32(x, dy, weight.main_grad)
            """
        ),
        Example(
            """\
            def backward(weight, x, dy):
                if hasattr(weight, "__fsdp_param__"):
                    return fsdp_backward(weight, x, dy)
                wgrad_gemm_accum_fp32(x, dy, weight.main_grad)
            """
        ),
        Example(
            """\
            def backward(weight, x, dy):
                get_main_grad = getattr(weight, "get_main_grad", None)
                if get_main_grad is not None:
                    weight.main_grad = get_main_grad()
                general_gemm(x, dy, out=weight.main_grad, accumulate=True)
            """
        ),
        Example(
            """\
            class ChunkedHead(torch.autograd.Function):
                @staticmethod
                def forward(ctx, x, weight, fusion):
                    ctx.save_for_backward(x, weight)
                    # decided in forward: the fused path is only for non-FSDP (DDP) parameters
                    ctx.use_main_grad = fusion and hasattr(weight, "main_grad") and not hasattr(weight, "__fsdp_param__")
                    ctx.main_grad = weight.main_grad if ctx.use_main_grad else None
                    return x @ weight.t()

                @staticmethod
                def backward(ctx, dy):
                    x, weight = ctx.saved_tensors
                    if ctx.use_main_grad:
                        weight.main_grad = ctx.main_grad
                        wgrad_gemm_accum_fp32(x, dy, weight.main_grad)
                    return dy @ weight, None, None
            """
        ),
        Example(
            """\
            def finalize(self, partial_grad):
                partial_grad.redistribute(self.main_grad.placements, out=self.main_grad)
            """
        ),
    ]
    INVALID = [
        Example(
            """\
            import fused_weight_gradient_mlp_cuda

            def backward(ctx, weight, total_input, grad_output):
                if ctx.gradient_accumulation_fusion:
                    fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(total_input, grad_output, weight.main_grad)
            """,
            line=5,
            fixed="""\
            import fused_weight_gradient_mlp_cuda

            def backward(ctx, weight, total_input, grad_output):
                if ctx.gradient_accumulation_fusion:
                    if hasattr(weight, "__fsdp_param__"):
                        weight.main_grad = weight.get_main_grad()
                    fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(total_input, grad_output, weight.main_grad)
            """,
        ),
        Example(
            """\
            from transformer_engine.pytorch.cpp_extensions import general_gemm

            def wgrad(weight, x, dy):
                # accumulate straight into the fp32 buffer
                general_gemm(x, dy, out=weight.main_grad, accumulate=True, out_dtype=weight.main_grad.dtype)
            """,
            line=5,
            fixed="""\
            from transformer_engine.pytorch.cpp_extensions import general_gemm

            def wgrad(weight, x, dy):
                # accumulate straight into the fp32 buffer
                if hasattr(weight, "__fsdp_param__"):
                    weight.main_grad = weight.get_main_grad()
                general_gemm(x, dy, out=weight.main_grad, accumulate=True, out_dtype=weight.main_grad.dtype)
            """,
        ),
        Example(
            """\
            def wgrad(weight, x, dy):
                if weight.main_grad.dtype == torch.float32:
                    wgrad_gemm_accum_fp32(x, dy, weight.main_grad)
                elif weight.main_grad.dtype in (torch.float16, torch.bfloat16):
                    wgrad_gemm_accum_fp16(x, dy, weight.main_grad)
            """,
            line=3,
            fixed="""\
            def wgrad(weight, x, dy):
                if hasattr(weight, "__fsdp_param__"):
                    weight.main_grad = weight.get_main_grad()
                if weight.main_grad.dtype == torch.float32:
                    wgrad_gemm_accum_fp32(x, dy, weight.main_grad)
                elif weight.main_grad.dtype in (torch.float16, torch.bfloat16):
                    wgrad_gemm_accum_fp16(x, dy, weight.main_grad)
            """,
        ),
        Example(
            """\
            def wgrad(weight, x, dy):
                weight.main_grad.addmm_(dy.t(), x)
            """,
            line=2,
            fixed="""\
            def wgrad(weight, x, dy):
                if hasattr(weight, "__fsdp_param__"):
                    weight.main_grad = weight.get_main_grad()
                weight.main_grad.addmm_(dy.t(), x)
            """,
        ),
        Example(
            """\
            def wgrad(weight, x, dy, fp32):
                if fp32:
                    weight.main_grad = weight.get_main_grad()
                else:
                    wgrad_gemm_accum_fp16(x, dy, weight.main_grad)
            """,
            line=5,
        ),
        Example(
            """\
            def wgrad(weight, x, dy):
                torch.matmul(dy.t(), x, out=weight.main_grad)
                weight.main_grad = weight.get_main_grad()
            """,
            line=2,
        ),
        Example(
            """\
            def wgrad(fc1_weight, fc2_weight, x, dy):
                fc1_weight.main_grad = fc1_weight.get_main_grad()
                wgrad_gemm_accum_fp32(x, dy, fc2_weight.main_grad)
            """,
            line=3,
        ),
        Example(
            """\
            class ChunkedHead(torch.autograd.Function):
                @staticmethod
                def forward(ctx, x, weight, fusion):
                    ctx.save_for_backward(x, weight)
                    ctx.use_main_grad = fusion and hasattr(weight, "main_grad")
                    ctx.main_grad = weight.main_grad if ctx.use_main_grad else None
                    return x @ weight.t()

                @staticmethod
                def backward(ctx, dy):
                    x, weight = ctx.saved_tensors
                    if ctx.use_main_grad:
                        weight.main_grad = ctx.main_grad  # captured at forward: None/stale under Megatron-FSDP
                        wgrad_gemm_accum_fp32(x, dy, weight.main_grad)
                    return dy @ weight, None, None
            """,
            line=14,
        ),
        Example(
            """\
            class Backward:
                def run(self, x, dy):
                    for w in self.weights:
                        wgrad_gemm_accum_fp32(x, dy, w.main_grad)
            """,
            line=4,
        ),
    ]

    def gate(self, index: SyntaxIndex, settings: RuleSettings) -> bool:
        """Over-approximates `check`: a buffer of `_written_buffers` (mirrored on `ast`) that is not provably
        exposed before the call. "Provably" is `_exposed_before` restricted to what can be decided exactly:
        an own assignment `R.main_grad = <... R.get_main_grad() ...>` of the same function, before the call
        and not in an exclusive branch, with both receivers plain dotted chains of equal text. Helper calls,
        `get_main_grad` bound to locals and the ABSENT path facts only remove more findings: ignored."""
        for call in index.main_grad_calls:
            for buffer in _ast_written_buffers(call):
                if not _ast_exposed_before(index, call, buffer):
                    return True
        return False

    def check(self, ctx: FileContext) -> Iterator[Violation]:
        helpers = ctx.settings.exposure_helpers
        for call in ctx.nodes(cst.Call):
            assert isinstance(call, cst.Call)
            for buffer in _written_buffers(call):
                weight = main_grad_receiver(buffer)
                assert weight is not None
                if self._exposed_before(ctx, call, weight, helpers):
                    continue
                if ABSENT in path_facts(ctx, call, weight):
                    continue  # on this path W is not a Megatron-FSDP parameter: DDP set main_grad
                key = code_of(weight)
                yield Violation(
                    node=call,
                    message=(
                        f"`{last_name(call)}` writes into `{key}.main_grad`, but nothing earlier on this path "
                        f"exposes it from `{key}.get_main_grad()`; under Megatron-FSDP `main_grad` is absent or "
                        f"None (stale after zero_grad_buffer) here. Refresh it first: "
                        f'`if hasattr({key}, "__fsdp_param__"): {key}.main_grad = {key}.get_main_grad()`.'
                    ),
                    fix=self._fix(ctx, call, weight),
                    context_node=ctx.enclosing(call, cst.SimpleStatementLine) or call,
                )
                break

    @staticmethod
    def _exposed_before(
        ctx: FileContext, call: cst.Call, weight: cst.BaseExpression, helpers: frozenset[str]
    ) -> bool:
        func = enclosing_function(ctx, call)
        scope: cst.CSTNode = func.body if func is not None else ctx.module
        bindings = local_bindings(func, ctx)
        key = code_of(weight)
        for node in own_nodes(scope, cst.Assign, cst.AnnAssign, cst.Call):
            if not is_before(ctx, node, call) or mutually_exclusive(ctx, node, call):
                continue
            if isinstance(node, cst.Call):
                if not is_helper_call(node, helpers):
                    continue
                configured = last_name(node) in helpers or code_of(node.func) in helpers
                if configured or any(code_of(a.value) == key for a in node.args):
                    return True
            elif exposure_receiver(node, bindings, helpers) == key:
                return True
        return False

    @staticmethod
    def _fix(ctx: FileContext, call: cst.Call, weight: cst.BaseExpression) -> Fix | None:
        if not is_simple_chain(weight):
            return None
        key = code_of(weight)
        anchor = ctx.enclosing(call, cst.SimpleStatementLine)
        if anchor is None or not isinstance(ctx.parent(anchor), (cst.IndentedBlock, cst.Module)):
            return None
        func = enclosing_function(ctx, call)
        # Climb out of compound statements whose header reads W.main_grad (`if W.main_grad.dtype == ...`).
        needle = f"{key}.main_grad"
        while True:
            block = ctx.parent(anchor)
            owner = ctx.parent(block) if block is not None else None
            while isinstance(owner, (cst.If, cst.Else)) and isinstance(ctx.parent(owner), cst.If):
                owner = ctx.parent(owner)  # an elif/else: up to the first `if` of the chain
            if owner is None or owner is func or not isinstance(owner, cst.BaseCompoundStatement):
                break
            if not isinstance(ctx.parent(owner), (cst.IndentedBlock, cst.Module)):
                break
            if needle not in _header_code(owner):
                break
            anchor = owner
        exposure = cst.parse_statement(
            f'if hasattr({key}, "__fsdp_param__"):\n    {key}.main_grad = {key}.get_main_grad()\n',
            config=ctx.module.config_for_parsing,
        )
        exposure = exposure.with_changes(leading_lines=anchor.leading_lines)  # type: ignore[attr-defined]  # a statement
        moved = anchor.with_changes(leading_lines=[])
        return Fix(
            {anchor: cst.FlattenSentinel([exposure, moved])},
            f"expose `{key}.main_grad` from `get_main_grad()` for Megatron-FSDP parameters first",
        )


def _ast_written_buffers(call: ast.Call) -> list[ast.AST]:
    """`_written_buffers` on an `ast.Call` (arguments in any order: only their existence matters)."""
    name = syntax_index.last_name(call)
    values = [a.value if isinstance(a, ast.Starred) else a for a in call.args]
    values += [kw.value for kw in call.keywords]
    if name in KERNELS:
        return [v for v in values if syntax_index.is_main_grad_attr(v)]
    if name in GEMMS:
        out = next((kw.value for kw in call.keywords if kw.arg == "out"), None)
        return [out] if out is not None and syntax_index.is_main_grad_attr(out) else []
    func = call.func
    if (
        name in INPLACE_GEMMS
        and isinstance(func, ast.Attribute)
        and syntax_index.is_main_grad_attr(func.value)
    ):
        return [func.value]
    return []


def _ast_exposed_before(index: SyntaxIndex, call: ast.Call, buffer: ast.AST) -> bool:
    """True only when `_exposed_before` is (see `gate`)."""
    key = syntax_index.chain_before(index, buffer, "main_grad")
    if key is None:
        return False
    func = syntax_index.enclosing_function(index, call)
    for getter in index.get_main_grad_calls:  # `_is_getter_call`: any `X.get_main_grad(...)` call
        child: ast.AST = getter
        stmt = index.parent(getter)
        while stmt is not None and not isinstance(stmt, ast.stmt):
            child, stmt = stmt, index.parent(stmt)
        if not isinstance(stmt, (ast.Assign, ast.AnnAssign)) or child is not stmt.value:
            continue
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        first = next((t for t in targets if syntax_index.is_main_grad_attr(t)), None)
        if first is None or syntax_index.chain_before(index, first, "main_grad") != key:
            continue
        if syntax_index.owning_scope(index, stmt) is not func:
            continue
        if syntax_index.is_before(index, stmt, call) and not syntax_index.mutually_exclusive(
            index, stmt, call
        ):
            return True
    return False


def _header_code(stmt: cst.BaseCompoundStatement) -> str:
    """Source of the parts of a compound statement evaluated before its body (tests, iterables, items),
    including every test of an if/elif chain."""
    parts: list[cst.CSTNode] = []
    node: cst.CSTNode | None = stmt
    while isinstance(node, cst.If):
        parts.append(node.test)
        node = node.orelse if isinstance(node.orelse, cst.If) else None
    if isinstance(stmt, cst.While):
        parts.append(stmt.test)
    elif isinstance(stmt, cst.For):
        parts.append(stmt.iter)
    elif isinstance(stmt, cst.With):
        parts.extend(item.item for item in stmt.items)
    return " ".join(code_of(p) for p in parts)
