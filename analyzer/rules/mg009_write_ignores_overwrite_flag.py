"""MG009: a wgrad written into `main_grad` that always accumulates, or always overwrites, whatever
`overwrite_main_grad` says.

The data-parallel wrapper decides per parameter whether the next fused wgrad accumulates into `main_grad` or
overwrites it: Megatron DDP never sets `overwrite_main_grad` (accumulate across micro-batches into the
persistent grad buffer); Megatron-FSDP sets it from its sharding strategy on every unshard (`True` where
`get_main_grad()` hands out a buffer whose old contents must be replaced). A write whose mode is fixed in the
code is right for one of those cases only.

What is judged: writes into a main_grad buffer (`rules._common.MainGradScope`: `W.main_grad`, views, local
aliases, names that say `main_grad`) inside a function named like a backward or a wgrad helper (`backward`,
`*_backward`, `backward_*`, `*wgrad*`), and calls there that hand `W.main_grad` to a same-file helper which
writes into that argument (Megatron-LM main's `_wgrad_gemm(weight.main_grad, ...)`). The mode of a write:
* always overwrite: `torch.matmul/mm/bmm(..., out=buf)`, `buf.copy_(x)`, a TE GEMM (`general_gemm`,
  `te_general_gemm`, `general_grouped_gemm`, ...) with `out=buf` and no `accumulate=` (its default is
  `False`) or `accumulate=False`;
* always accumulate: `wgrad_gemm_accum_fp32/fp16(..., buf)`, `buf.add_(x)`, `buf += x`, `buf.addmm_(...)`,
  a TE GEMM with `accumulate=True`;
* derived (fine): an `accumulate=` value, or a test deciding whether the write runs, that reads the flag
  (`rules._common.FlagDerivation`: `getattr(w, "overwrite_main_grad", False)`, TE's
  `get_accumulate_flag_in_param`, names and context attributes assigned from those, same-file functions
  returning them). An `accumulate=` value that does not read the flag (`accumulate=ctx.fuse`) is fixed.
An "always accumulate" write is reported only where the parameter is known to be a Megatron-FSDP parameter
on that path (inside `if hasattr(W, "__fsdp_param__")`, or a buffer taken from `W.get_main_grad()`), or
where `W.main_grad` may hold the Megatron-FSDP buffer: an earlier `W.main_grad = W.get_main_grad()` in the
same function, not in another branch of one `if` (megatron-core's `drain_embedding_wgrad_compute`). Under
DDP accumulating is the contract, so an accumulating write with no Megatron-FSDP evidence in its function is
not reported (a third-party FP8 bridge's unconditional `weight.main_grad.add_(...)` is such a write: see the
rule's docs). The data-parallel wrapper's own code is not judged.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import libcst as cst

from maingrad.analyzer.context import FileContext, RuleSettings
from maingrad.analyzer.facts import (
    ACCUMULATE_GEMMS,
    GET_MAIN_GRAD,
    INPLACE_GEMMS,
    KERNELS,
    MAIN_GRAD,
    MATMULS,
    OVERWRITE_FLAG,
    WGRAD_FUNCTION,
    WRAPPER_CLASS,
    is_wrapper_path,
)
from maingrad.analyzer.names import dotted_name
from maingrad.analyzer.rules._common import (
    ABSENT,
    PRESENT,
    FlagDerivation,
    MainGradScope,
    code_of,
    function_of,
    in_wrapper,
    is_before,
    is_false_constant,
    is_simple_chain,
    keyword,
    last_name,
    main_grad_receiver,
    mutually_exclusive,
    path_facts,
    positional,
    reads_param_grad,
    string_value,
)
from maingrad.analyzer.rules.base import Example, Fix, Rule, Violation
from maingrad.analyzer.syntax_index import SyntaxIndex, gate_aliases, pos, spine_is_main_grad
from maingrad.contracts.report import Severity

ACCUMULATE = "accumulates"
# GEMM wrappers that take `out=` but no `accumulate` (megatron-core's `te_general_gemm` always passes
# `accumulate=False` to TE's `general_gemm`): adding the keyword raises TypeError.
NO_ACCUMULATE_GEMMS = frozenset({"te_general_gemm"})
OVERWRITE = "overwrites"
_MAX_HELPER_DEPTH = 3


@dataclass(frozen=True)
class _Write:
    node: cst.CSTNode  # the writing call, `+=` statement or kwargs display
    target: cst.BaseExpression  # what it writes into
    mode: str | None  # ACCUMULATE / OVERWRITE when fixed; None when derived from the flag or unknown
    accumulate: cst.Arg | None = None  # the `accumulate=` keyword of a TE GEMM call, if any


def _is_true(node: cst.BaseExpression) -> bool:
    return isinstance(node, cst.Name) and node.value == "True"


def _keyword_mode(value: cst.BaseExpression | None, derived: bool) -> str | None:
    """The mode an `accumulate=` value fixes (None: derived from the flag, or unknown)."""
    if value is None:
        return OVERWRITE  # TE's GEMMs default to accumulate=False
    if derived:
        return None
    if _is_true(value):
        return ACCUMULATE
    if is_false_constant(value):
        return OVERWRITE
    return ACCUMULATE  # a value that never reads the flag: the wrapper's choice is ignored


def _dict_accumulate(display: cst.Dict) -> cst.BaseExpression | None | bool:
    """The "accumulate" value of a kwargs display; False when it has none (then it may come elsewhere)."""
    for element in display.elements:
        if isinstance(element, cst.DictElement) and string_value(element.key) == "accumulate":
            return element.value
    return False


def _candidate_writes(node: cst.CSTNode) -> tuple[cst.BaseExpression, str] | None:
    """(target, kind) of a syntactic write, before any main_grad or flag question."""
    if isinstance(node, cst.AugAssign):
        return (node.target, "aug") if isinstance(node.operator, cst.AddAssign) else None
    if isinstance(node, cst.Dict):
        for element in node.elements:
            if isinstance(element, cst.DictElement) and string_value(element.key) == "out":
                return element.value, "dict"
        return None
    if not isinstance(node, cst.Call):
        return None
    name = last_name(node)
    func = node.func
    if isinstance(func, cst.Attribute) and name in KERNELS:  # `fused_weight_gradient_mlp_cuda.<kernel>`
        args = positional(node)
        return (args[2].value, "kernel") if len(args) >= 3 else None
    if isinstance(func, cst.Attribute) and name in ("add_", "copy_"):
        args = positional(node)
        if args and not reads_param_grad(args[0].value):
            return func.value, name
        return None
    if (
        isinstance(func, cst.Attribute)
        and name in INPLACE_GEMMS
        and main_grad_receiver(func.value) is not None
    ):
        return func.value, "inplace"
    out = keyword(node, "out")
    if out is not None:
        return out.value, "out"
    return None


class WriteIgnoresOverwriteFlag(Rule):
    id = "MG009"
    name = "main-grad-write-ignores-overwrite-flag"
    severity = Severity.ERROR
    summary = "a wgrad written into `main_grad` always accumulates or always overwrites, ignoring `overwrite_main_grad`"
    needles = (("main_grad", "backward"), ("main_grad", "wgrad"))
    fixable = True
    docs = """\
## What it does
Finds a weight gradient written into a parameter's `main_grad` (in an autograd backward or a wgrad helper)
whose accumulate/overwrite behaviour is fixed in the code instead of taken from the parameter's
`overwrite_main_grad` flag: `torch.matmul(..., out=W.main_grad)`, `W.main_grad.copy_(g)`, a TE GEMM
(`general_gemm`, `te_general_gemm`, ...) with `out=W.main_grad` and no `accumulate=` (it overwrites), or with
a constant one; and, for Megatron-FSDP parameters, `wgrad_gemm_accum_*`, `add_`, `+=` (they accumulate): a
parameter known to be one on the write's path, or whose `main_grad` an earlier statement of the function may
have set from `get_main_grad()` (the write then may land in the Megatron-FSDP buffer). A
call that hands `W.main_grad` to a same-file helper writing into that argument is judged like the write
itself.

## Why is this bad?
Whether the wgrad must be added to what `main_grad` holds or replace it is the data-parallel wrapper's
decision, per parameter and per step: Megatron DDP, and Megatron-FSDP with unsharded gradients (`no_shard`,
`optim`, or data-parallel size 1), keep `main_grad` as the persistent accumulation buffer across
micro-batches and leave the flag `False`; Megatron-FSDP sets it `True` where `get_main_grad()` returns a
buffer whose old contents must be replaced. A write that always overwrites keeps only the last micro-batch's
gradient under gradient accumulation; one that always accumulates adds stale contents where the wrapper asked
for an overwrite. Nothing fails: the optimizer just steps on the wrong gradient.

## Example
```python
if hasattr(weight, "__fsdp_param__"):
    weight.main_grad = weight.get_main_grad()
    te_general_gemm(total_input, grad_output, out_dtype=weight.main_grad.dtype, layout="NT",
                    out=weight.main_grad, grad=True)
```

## Use instead
```python
if hasattr(weight, "__fsdp_param__"):
    weight.main_grad = weight.get_main_grad()
    if getattr(weight, "overwrite_main_grad", False):
        te_general_gemm(total_input, grad_output, out_dtype=weight.main_grad.dtype, layout="NT",
                        out=weight.main_grad, grad=True)
    else:
        weight.main_grad.add_(te_general_gemm(total_input, grad_output,
                                              out_dtype=weight.main_grad.dtype, layout="NT", grad=True)[0])
```
megatron-core's `te_general_gemm` wrapper has no `accumulate` parameter (it passes `accumulate=False` to
TE's `general_gemm` itself), so the (unsafe) fix branches on the flag as above: overwrite when the flag says
so, otherwise add the GEMM's freshly allocated output (`[0]` of what it returns) into the buffer. A TE GEMM
that takes `accumulate` (`general_gemm`, `general_grouped_gemm`, or a same-file function with that
parameter) gets `accumulate=not getattr(W, "overwrite_main_grad", False)` instead. Anything else keeps its
finding without a fix: for `torch.matmul(..., out=...)` and `copy_`, which cannot accumulate, branch on the
flag yourself (`W.main_grad.addmm_(a, b)` when it is `False`). Writes whose `accumulate=` value, or whose
enclosing test, reads the flag (directly, through TE's `get_accumulate_flag_in_param`, or through names and
context attributes assigned from them, anywhere in the file) are not reported. The fix only changes
behaviour where the data-parallel wrapper leaves the flag `False` for a Megatron-FSDP parameter: megatron-core
0.19.2's Megatron-FSDP sets it `True` on every unshard, so there the fixed and the original code behave
alike; Megatron-LM main derives it from the sharding strategy (PR #6357).

## In real code
megatron-core 0.19.2 `LinearWithGradAccumulationAndAsyncCommunication.backward`, Megatron-FSDP branch: both
`te_general_gemm(..., out=weight.main_grad)` and `torch.matmul(..., out=weight.main_grad)` always overwrite;
Megatron-LM main moves them into `_wgrad_gemm(out, ...)` and calls it with `weight.main_grad` (reported at
that call). Confirmed on an H200: with two micro-batches the optimizer sees micro-batch 1's gradient only.

megatron-core 0.16.1-0.19.2 (and main) `drain_embedding_wgrad_compute`'s `wgrad_compute`: `if hasattr(weight,
"__fsdp_param__"): weight.main_grad = weight.get_main_grad()`, then `wgrad_gemm_accum_fp32/fp16(...,
weight.main_grad)` for every parameter: on a Megatron-FSDP parameter it always accumulates, whatever the
flag (the Megatron-FSDP branch of the `LinearWithGradAccumulationAndAsyncCommunication.backward` it defers
always overwrites instead). From source; not run.

## What it does not report
An always-accumulating write with no Megatron-FSDP evidence in its function (no `__fsdp_param__`/
`get_main_grad` test or call for that parameter) is not reported, even where a Megatron-FSDP parameter
could reach it at run time: under Megatron DDP accumulating is the contract, and nothing in the code tells
the two apart. One known instance: AMD-AGI/Primus's Turbo FP8 bridge (`primus_turbo.py`,
`_WeightGradBridge.backward`) adds the quantized GEMM's wgrad with `weight.main_grad.add_(...)` on every
micro-batch and never reads `overwrite_main_grad`; it is wrong only if a Megatron-FSDP parameter whose flag
is `True` reaches it, which the file does not show. A rule that reported every always-accumulating write
in a backward regardless of that evidence would report 17 writes on the 11 pinned releases, of which 6
are the `drain_embedding_wgrad_compute` ones already reported and 11 are DDP paths where accumulating is
right (precision 6/17, 35%), so it is not a rule here.
"""

    VALID = [
        # The buffer may be Megatron-FSDP's, but whether the kernel accumulates is decided by the flag.
        Example(
            """\
            def wgrad_compute(x, grad_output, weight):
                if hasattr(weight, "__fsdp_param__"):
                    weight.main_grad = weight.get_main_grad()
                if getattr(weight, "overwrite_main_grad", False):
                    torch.matmul(grad_output.t(), x, out=weight.main_grad)
                else:
                    fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x, grad_output, weight.main_grad)
            """
        ),
        # An unconditional add with no Megatron-FSDP evidence for the parameter: DDP's contract.
        Example(
            """\
            def backward(ctx, grad_x, grad_w):
                (weight,) = ctx.saved_tensors
                weight.main_grad.add_(grad_w)
                weight.grad_added_to_main_grad = True
                return grad_x, None
            """
        ),
        # TE 2.20 te.Linear style: the GEMM's accumulate comes from the flag through a context object.
        Example(
            """\
            def _linear_forward(ctx, weight):
                ctx.overwrites = getattr(weight, "overwrite_main_grad", False)

            def _linear_backward(ctx, x, dy):
                main_grad = ctx.main_grad_func()
                general_gemm(x, dy, out=main_grad, accumulate=ctx.fuse and not ctx.overwrites)
            """
        ),
        # The op fuser's helper reads the flag.
        Example(
            """\
            def fuser_backward(self, ctx, x, dy):
                main_grad = get_main_grad_from_param(self.weight)
                accumulate = get_accumulate_flag_in_param(self.weight)
                general_gemm(x, dy, out=main_grad, accumulate=accumulate)
            """
        ),
        # DDP branch: accumulating is the contract (the accumulating kernel runs only in the other branch of
        # the Megatron-FSDP test, where an earlier get_main_grad() cannot reach it).
        Example(
            """\
            def backward(ctx, dy):
                weight = ctx.weight
                if hasattr(weight, "__fsdp_param__"):
                    weight.main_grad = weight.get_main_grad()
                    general_gemm(ctx.x, dy, out=weight.main_grad, accumulate=not getattr(weight, "overwrite_main_grad", False))
                else:
                    fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(ctx.x, dy, weight.main_grad)
            """
        ),
        # The mode is chosen by a test on the flag.
        Example(
            """\
            def backward(ctx, dy):
                wgrad = dy.t() @ ctx.x
                if ctx.weight.overwrite_main_grad:
                    ctx.weight.main_grad.copy_(wgrad)
                else:
                    ctx.weight.main_grad.add_(wgrad)
            """
        ),
        # Not a wgrad function: the wrapper's grad hook moving .grad is its own business.
        Example(
            """\
            def finish_grad_sync(params):
                for p in params:
                    p.main_grad.copy_(p.grad)
            """
        ),
    ]
    INVALID = [
        # megatron-core 0.19.2 layers.py, Megatron-FSDP branch.
        Example(
            """\
            def backward(ctx, grad_output):
                weight = ctx.weight
                if hasattr(weight, "__fsdp_param__"):
                    weight.main_grad = weight.get_main_grad()
                    te_general_gemm(ctx.x, grad_output, out_dtype=weight.main_grad.dtype, layout="NT", out=weight.main_grad, grad=True)
            """,
            line=5,
            fixed="""\
            def backward(ctx, grad_output):
                weight = ctx.weight
                if hasattr(weight, "__fsdp_param__"):
                    weight.main_grad = weight.get_main_grad()
                    if getattr(weight, "overwrite_main_grad", False):
                        te_general_gemm(ctx.x, grad_output, out_dtype=weight.main_grad.dtype, layout="NT", out=weight.main_grad, grad=True)
                    else:
                        weight.main_grad.add_(te_general_gemm(ctx.x, grad_output, out_dtype=weight.main_grad.dtype, layout="NT", grad=True)[0])
            """,
        ),
        # torch.matmul cannot accumulate.
        Example(
            """\
            import torch

            def backward(ctx, grad_output):
                torch.matmul(grad_output.t(), ctx.x, out=ctx.weight.main_grad)
            """,
            line=4,
        ),
        # Megatron-LM main: a same-file helper that overwrites its `out`.
        Example(
            """\
            def _wgrad_gemm(out, grad_output, total_input):
                if te_general_gemm is not None:
                    te_general_gemm(total_input, grad_output, out_dtype=out.dtype, layout="NT", out=out, grad=True)
                else:
                    out.copy_(grad_output.t().matmul(total_input))
                return out

            def backward(ctx, grad_output):
                weight = ctx.weight
                if hasattr(weight, "__fsdp_param__"):
                    weight.main_grad = weight.get_main_grad()
                    _wgrad_gemm(weight.main_grad, grad_output, ctx.x)
            """,
            line=12,
        ),
        # Always accumulating into a Megatron-FSDP buffer, whatever the sharding strategy asks.
        Example(
            """\
            def backward(ctx, grad_output):
                weight = ctx.weight
                if hasattr(weight, "__fsdp_param__"):
                    weight.main_grad = weight.get_main_grad()
                    general_gemm(ctx.x, grad_output, out=weight.main_grad, accumulate=True)
            """,
            line=5,
            fixed="""\
            def backward(ctx, grad_output):
                weight = ctx.weight
                if hasattr(weight, "__fsdp_param__"):
                    weight.main_grad = weight.get_main_grad()
                    general_gemm(ctx.x, grad_output, out=weight.main_grad, accumulate=not getattr(weight, "overwrite_main_grad", False))
            """,
        ),
        # megatron-core's drain_embedding_wgrad_compute: main_grad may be the Megatron-FSDP buffer here.
        Example(
            """\
            def wgrad_compute(all_gathered_input, grad_output, weight):
                if hasattr(weight, "__fsdp_param__"):
                    weight.main_grad = weight.get_main_grad()
                if config.gradient_accumulation_fusion:
                    fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(all_gathered_input, grad_output, weight.main_grad)
            """,
            line=5,
        ),
        # A kwargs display with a constant accumulate.
        Example(
            """\
            def _wgrad_backward(ctx, dy):
                main_grad = ctx.main_grad_func()
                kwargs = {"out": main_grad, "accumulate": False}
                general_gemm(ctx.x, dy, **kwargs)
            """,
            line=3,
        ),
    ]

    def gate(self, index: SyntaxIndex, settings: RuleSettings) -> bool:
        """Over-approximates `check`: a candidate write recorded by the index (kernel argument, add_/copy_
        receiver, `out=` keyword, `{"out": ...}` value, `+=` target) that may be a main_grad buffer
        (`spine_is_main_grad`), or a call taking `X.main_grad` (an in-place GEMM on it, or a helper it is
        handed to), inside a def named like a wgrad function, outside the wrapper's path (exact) and
        classes (line spans). The mode and the flag only remove findings."""
        if is_wrapper_path(index.path):
            return False
        defs = [s for s in index.scopes if s.kind == "def" and WGRAD_FUNCTION.search(s.name)]
        if not defs:
            return False
        wrappers = [s for s in index.scopes if s.kind == "class" and _wrapper_class(s.name)]

        def inside(node: object) -> bool:
            where = pos(node)  # type: ignore[arg-type]
            return any(s.contains(where) for s in defs) and not any(s.contains(where) for s in wrappers)

        aliases = gate_aliases(index)
        if any(inside(w.node) and spine_is_main_grad(w.spine, aliases) for w in index.writes):
            return True
        return any(inside(call) for call in index.main_grad_calls)

    def check(self, ctx: FileContext) -> Iterator[Violation]:
        analysis = _Analysis(ctx)
        for write, via in analysis.reports():
            yield analysis.violation(write, via)


def _wrapper_class(name: str) -> bool:
    return WRAPPER_CLASS.search(name) is not None


class _Analysis:
    def __init__(self, ctx: FileContext) -> None:
        self.ctx = ctx
        self.flags = FlagDerivation(ctx)
        self.scopes: dict[cst.FunctionDef | None, MainGradScope] = {}
        self.functions = {
            f.name.value: f
            for f in ctx.nodes(cst.FunctionDef)
            if isinstance(f, cst.FunctionDef) and not isinstance(ctx.parent(ctx.parent(f) or f), cst.ClassDef)
        }
        self._helper_cache: dict[tuple[int, str], _Write | None] = {}

    def scope(self, func: cst.FunctionDef | None) -> MainGradScope:
        if func not in self.scopes:
            self.scopes[func] = MainGradScope.of(self.ctx, func)
        return self.scopes[func]

    def in_wgrad_function(self, node: cst.CSTNode) -> bool:
        return any(
            isinstance(a, cst.FunctionDef) and WGRAD_FUNCTION.search(a.name.value)
            for a in self.ctx.ancestors(node)
        )

    def write_of(self, node: cst.CSTNode, func: cst.FunctionDef | None) -> _Write | None:
        """The write `node` performs and its fixed mode (None mode: derived or unknown)."""
        found = _candidate_writes(node)
        if found is None:
            return None
        target, kind = found
        if self.flags.guarded_by(node, func) is not None:
            return _Write(node, target, None)
        if kind in ("kernel", "add_", "aug", "inplace"):
            return _Write(node, target, ACCUMULATE)
        if kind == "copy_":
            return _Write(node, target, OVERWRITE)
        if kind == "dict":
            assert isinstance(node, cst.Dict)
            value = _dict_accumulate(node)
            if value is False:
                return _Write(node, target, None)  # accumulate may be added to the kwargs elsewhere
            assert not isinstance(value, bool)
            return _Write(
                node, target, _keyword_mode(value, value is not None and self.flags.carries(value, func))
            )
        assert isinstance(node, cst.Call)
        name = last_name(node)
        if name in MATMULS:
            qualified = self.ctx.names.qualified_name(node.func) or ""
            if name in ("matmul", "mm", "bmm") and (
                qualified.startswith("torch.") or isinstance(node.func, cst.Attribute)
            ):
                return _Write(node, target, OVERWRITE)
            return None
        if name in ACCUMULATE_GEMMS:
            arg = keyword(node, "accumulate")
            value = arg.value if arg is not None else None
            derived = value is not None and self.flags.carries(value, func)
            return _Write(node, target, _keyword_mode(value, derived), arg)
        return None

    def reports(self) -> Iterator[tuple[_Write, _Write | None]]:
        """(write, None) for a direct write; (call, helper's write) for a buffer handed to a helper."""
        ctx = self.ctx
        for node in ctx.nodes(cst.Call, cst.Dict, cst.AugAssign):
            if not self.in_wgrad_function(node) or in_wrapper(ctx, node):
                continue
            func = function_of(ctx, node)
            write = self.write_of(node, func)
            if write is not None and write.mode is not None:
                if self.scope(func).is_main_grad(write.target) and self._judged(write, func):
                    yield write, None
                continue
            if isinstance(node, cst.Call):
                handed = self._handed_to_helper(node, func)
                if handed is not None:
                    yield handed

    def _judged(self, write: _Write, func: cst.FunctionDef | None) -> bool:
        """Always-overwrite writes are always judged; always-accumulate ones only on an FSDP parameter."""
        if write.mode == OVERWRITE:
            return True
        owner = self.scope(func).owner(write.target)
        if owner is None:
            return False
        if isinstance(write.target, cst.Call) and last_name(write.target) == GET_MAIN_GRAD:
            return True
        facts = path_facts(self.ctx, write.node, owner)
        if PRESENT in facts:
            return True
        return ABSENT not in facts and self._may_hold_fsdp_buffer(write, owner, func)

    def _may_hold_fsdp_buffer(
        self, write: _Write, owner: cst.BaseExpression, func: cst.FunctionDef | None
    ) -> bool:
        """An earlier `W.main_grad = W.get_main_grad()` in the same function, on a path that can reach the
        write (not in another branch of one `if`): after it, `W.main_grad` may be the Megatron-FSDP buffer
        (megatron-core's `drain_embedding_wgrad_compute`: `if hasattr(weight, "__fsdp_param__"): weight.main_grad
        = weight.get_main_grad()`, then the accumulating kernels on `weight.main_grad` for every parameter)."""
        if func is None:
            return False
        receiver = code_of(owner)
        for assign in self.ctx.own_nodes(func, cst.Assign):
            if not (isinstance(assign.value, cst.Call) and last_name(assign.value) == GET_MAIN_GRAD):
                continue
            if not any(
                isinstance(t.target, cst.Attribute)
                and t.target.attr.value == MAIN_GRAD
                and code_of(t.target.value) == receiver
                for t in assign.targets
            ):
                continue
            if is_before(self.ctx, assign, write.node) and not mutually_exclusive(
                self.ctx, assign, write.node
            ):
                return True
        return False

    def _handed_to_helper(self, call: cst.Call, func: cst.FunctionDef | None) -> tuple[_Write, _Write] | None:
        """A call of a same-file module-level function that gets `W.main_grad` for a parameter it writes
        into with a fixed mode."""
        if not isinstance(call.func, cst.Name) or call.func.value not in self.functions:
            return None
        helper = self.functions[call.func.value]
        params = [p.name.value for p in (*helper.params.posonly_params, *helper.params.params)]
        for index, arg in enumerate(call.args):
            if arg.star or main_grad_receiver(arg.value) is None:
                continue
            if arg.keyword is not None:
                param = arg.keyword.value
            elif index < len(params):
                param = params[index]
            else:
                continue
            inner = self._helper_write(helper, param, 0)
            if inner is None:
                continue
            carrier = _Write(call, arg.value, inner.mode)
            if inner.mode == OVERWRITE or self._judged(carrier, func):
                return carrier, inner
        return None

    def _helper_write(self, helper: cst.FunctionDef, param: str, depth: int) -> _Write | None:
        """The first fixed-mode write of `helper` into its parameter `param` (or a view of it)."""
        key = (id(helper), param)
        if key in self._helper_cache:
            return self._helper_cache[key]
        self._helper_cache[key] = None
        found: _Write | None = None
        for node in self.ctx.nodes(cst.Call, cst.Dict, cst.AugAssign):
            if function_of(self.ctx, node) is not helper:
                continue
            write = self.write_of(node, helper)
            if write is None or write.mode is None:
                continue
            if _root_name(write.target) == param:
                found = write
                break
        self._helper_cache[key] = found
        return found

    def violation(self, write: _Write, via: _Write | None) -> Violation:
        owner = self.scope(function_of(self.ctx, write.node)).owner(write.target)
        subject = code_of(owner) if owner is not None else "W"
        buffer = code_of(write.target)
        if via is None:
            what = f"`{_describe(write)}` writes the wgrad into `{buffer}` and always {write.mode} it"
        else:
            what = (
                f"`{_describe(write)}` hands `{buffer}` to a helper whose `{_describe(via)}` always "
                f"{via.mode} it"
            )
        if write.mode == OVERWRITE:
            consequence = (
                "where gradients are not sharded (DDP, Megatron-FSDP `no_shard`/`optim`, data-parallel size 1) "
                "`main_grad` is the persistent accumulation buffer, so every earlier micro-batch is lost"
            )
        else:
            consequence = (
                "where Megatron-FSDP sets the flag, the buffer's stale contents are added to the new wgrad"
            )
        gemm = via or write
        remedy = (
            f'pass `accumulate=not getattr({subject}, "{OVERWRITE_FLAG}", False)`'
            if isinstance(gemm.node, cst.Call)
            and last_name(gemm.node) in ACCUMULATE_GEMMS
            and self._takes_accumulate(gemm.node)
            else f"branch on `{subject}.{OVERWRITE_FLAG}` (overwrite when it is set, accumulate otherwise)"
        )
        message = f"{what}, whatever `{subject}.{OVERWRITE_FLAG}` says: {consequence}; {remedy}."
        return Violation(
            node=write.node, message=message, fix=self._fix(write, owner) if via is None else None
        )

    def _fix(self, write: _Write, owner: cst.BaseExpression | None) -> Fix | None:
        """`accumulate=<from the flag>` for a GEMM that takes `accumulate`; for megatron-core's
        `te_general_gemm` wrapper, which has no such parameter (it always passes `accumulate=False` to TE),
        a branch on the flag that adds the GEMM's fresh output into the buffer when not overwriting; no fix
        otherwise (the finding stays)."""
        node = write.node
        if owner is None or not is_simple_chain(owner) or not isinstance(node, cst.Call):
            return None
        if last_name(node) not in ACCUMULATE_GEMMS or any(a.star for a in node.args):
            return None
        flag = f'getattr({code_of(owner)}, "{OVERWRITE_FLAG}", False)'
        if not self._takes_accumulate(node):
            return self._branch_fix(write, flag)
        value = cst.parse_expression(f"not {flag}")
        replacements: dict[cst.CSTNode, cst.CSTNode]
        if write.accumulate is not None:
            replacements = {write.accumulate: write.accumulate.with_changes(value=value)}
        else:
            last = node.args[-1]
            tight = cst.AssignEqual(
                whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
            )
            new_arg = cst.Arg(keyword=cst.Name("accumulate"), value=value, equal=tight)
            args = [*node.args[:-1], last.with_changes(comma=cst.MaybeSentinel.DEFAULT), new_arg]
            replacements = {node: node.with_changes(args=args)}
        return Fix(replacements, "take accumulate from the parameter's overwrite_main_grad flag", safe=False)

    def _takes_accumulate(self, call: cst.Call) -> bool:
        """Whether the called GEMM has an `accumulate` parameter: a same-file def says so itself;
        megatron-core's `te_general_gemm` wrapper (A, B, out_dtype, layout, out, bias, grad) does not; TE's
        own GEMMs do."""
        name = last_name(call)
        local = self.functions.get(name or "")
        if local is not None:
            params = local.params
            names = {p.name.value for p in (*params.posonly_params, *params.params, *params.kwonly_params)}
            return "accumulate" in names or isinstance(params.star_kwarg, cst.Param)
        return name not in NO_ACCUMULATE_GEMMS

    def _branch_fix(self, write: _Write, flag: str) -> Fix | None:
        """`if <flag>: <the call> else: <buffer>.add_(<the call without out=>[0])`, when the call is a
        statement of its own (its result unused) writing into a side-effect-free buffer expression."""
        node = write.node
        assert isinstance(node, cst.Call)
        if write.mode != OVERWRITE or not is_simple_chain(write.target):
            return None
        line = self.ctx.parent(self.ctx.parent(node) or node)
        expr = self.ctx.parent(node)
        if not (
            isinstance(expr, cst.Expr)
            and isinstance(line, cst.SimpleStatementLine)
            and len(line.body) == 1
            and isinstance(self.ctx.parent(line), cst.IndentedBlock)
        ):
            return None
        out = keyword(node, "out")
        assert out is not None
        kept = [a for a in node.args if a is not out]
        if node.args[-1] is out and kept:
            kept[-1] = kept[-1].with_changes(comma=out.comma)
        fresh = node.with_changes(args=kept)
        add = cst.Call(
            func=cst.Attribute(value=write.target, attr=cst.Name("add_")),
            args=[cst.Arg(cst.Subscript(fresh, [cst.SubscriptElement(cst.Index(cst.Integer("0")))]))],
        )
        branch = cst.If(
            test=cst.parse_expression(flag),
            body=cst.IndentedBlock([line.with_changes(leading_lines=())]),
            orelse=cst.Else(cst.IndentedBlock([cst.SimpleStatementLine([cst.Expr(add)])])),
            leading_lines=line.leading_lines,
        )
        return Fix(
            {line: branch},
            f"overwrite only when the flag says so; otherwise add `{last_name(node)}`'s fresh output into the "
            "buffer (the wrapper has no accumulate parameter)",
            safe=False,
        )


def _root_name(expr: cst.BaseExpression) -> str | None:
    """`out` for `out`, `out[0]`, `out.view(...)`."""
    while True:
        if isinstance(expr, cst.Subscript):
            expr = expr.value
        elif isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
            expr = expr.func.value
        else:
            break
    return expr.value if isinstance(expr, cst.Name) else None


def _describe(write: _Write) -> str:
    node = write.node
    if isinstance(node, cst.AugAssign):
        return f"{code_of(node.target)} += ..."
    if isinstance(node, cst.Dict):
        return '{"out": ..., "accumulate": ...}'
    assert isinstance(node, cst.Call)
    name = dotted_name(node.func) or last_name(node) or "call"
    if write.accumulate is not None:
        return f"{name}(..., accumulate={code_of(write.accumulate.value)})"
    return f"{name}(...)"
