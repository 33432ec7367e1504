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

import ast
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
    all_nodes,
    code_of,
    in_wrapper,
    is_before,
    is_none,
    is_simple_chain,
    knows_flag_contract,
    mutually_exclusive,
    string_value,
    written_buffer,
)
from maingrad.analyzer.rules.base import Example, Fix, Rule, Violation
from maingrad.analyzer.syntax_index import SyntaxIndex, gate_aliases, pos, spine_is_main_grad, spine_of
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

The buffer is followed through local names and into same-file helpers: a backward that hands `W.main_grad`
(or a name bound to it) to a function that writes the matching parameter (TE <= 2.6
`BasicLinear._functional_backward(..., grad_weight=W.main_grad)`) writes it too; so does one that hands it
to a function defined elsewhere as `grad_weight=`, `wgrad=` or `weight_grad=` (an output buffer by name). A backward that returns
`None` for the weight after the write (a name set to `None` on the write's path and returned, or a `None`
in every return slot whose `forward` parameter is named like a weight) is reported only in files written
against the flag's contract (they mention the flag, `overwrite_main_grad`, dummy wgrads, Megatron-FSDP, or
TE's `fuse_wgrad_accumulation`/`accumulate_into_main_grad`): before the flag, Megatron's hook added `.grad`
only when a gradient was returned, so code of that era (apex.transformer, metaseq, Megatron-LM forks of
2021-2023) loses nothing.

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
    return grad_output.matmul(weight), torch.empty_like(weight)  # so that the grad hook runs
```

## Use instead
```python
@staticmethod
def backward(ctx, grad_output):
    x, weight = ctx.saved_tensors
    fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x, grad_output, weight.main_grad)
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
    return grad_output.matmul(weight), torch.empty_like(weight)
```
The (unsafe) fix inserts the guarded assignment after the write; return a dummy gradient for the weight
(TE's `get_dummy_wgrad`) rather than the real one, as megatron-core does.

## In real code
Transformer Engine v2.6 `BasicLinear.op_backward`, `BackwardLinearAdd.fuser_backward` and
`UserbuffersBackwardLinear` (fixed by TE #2097, which returns a dummy wgrad and sets the flag) and the ROCm
fork's `BasicLinear.op_backward` (second table of `docs/real-world.md`). Nothing on the 14 code bases of the
first table, and no false alarm on the 31 forks, ports and users of the second.
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
        # Regression (apex.transformer, metaseq, Megatron-LM forks of 2021-2023): written before the flag;
        # the fused branch returns no weight gradient, so the hook has nothing to add twice.
        Example(
            """\
            class LinearWithGradAccumulation(torch.autograd.Function):
                @staticmethod
                def backward(ctx, grad_output):
                    total_input, weight = ctx.saved_tensors
                    if ctx.gradient_accumulation_fusion:
                        fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(total_input, grad_output, weight.main_grad)
                        grad_weight = None
                    else:
                        grad_weight = grad_output.t().matmul(total_input)
                    return grad_output.matmul(weight), grad_weight, None
            """
        ),
        # Regression (AMD-AGI/Primus zero-bubble GEMMs): the wgrad is deferred and the weight's slot is None.
        Example(
            """\
            class LinearWithWeightGradientStore(torch.autograd.Function):
                @staticmethod
                def forward(ctx, input, weight, bias):
                    ctx.save_for_backward(input, weight)
                    return input @ weight.t()

                @staticmethod
                def backward(ctx, grad_output):
                    input, weight = ctx.saved_tensors

                    def process_wgrad(_weight, _grad_output, _input):
                        _weight.main_grad.add_(_grad_output.t() @ _input)

                    WeightGradStore.put(weight, grad_output, input, process_wgrad)
                    return grad_output @ weight, None, None
            """
        ),
        # A same-file helper that only reads the buffer it is handed does not write it.
        Example(
            """\
            def _norm(grad_weight):
                return grad_weight.norm()

            def backward(ctx, dy):
                ctx.log(_norm(ctx.weight.main_grad))
                return dy @ ctx.weight, dy.t() @ ctx.x
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
        # TE <= 2.6 `BasicLinear.op_backward`: `main_grad` handed to a helper that writes its `grad_weight`
        # argument; no dummy wgrad, no flag (fixed upstream by TE #2097).
        Example(
            """\
            class BasicLinear(BasicOperation):
                def op_backward(self, ctx, grad_output):
                    accumulate_into_main_grad = self._accumulate_into_main_grad
                    grad_weight = None
                    if accumulate_into_main_grad:
                        if hasattr(self.weight, "__fsdp_param__"):
                            self.weight.main_grad = self.weight.get_main_grad()
                        grad_weight = self.weight.main_grad.detach()
                    grad_input, grad_weight = BasicLinear._functional_backward(
                        grad_output, ctx.x, grad_weight=grad_weight, accumulate_into_grad_weight=accumulate_into_main_grad
                    )
                    if accumulate_into_main_grad:
                        grad_weight = None
                    return grad_input, [grad_weight]

                @staticmethod
                def _functional_backward(grad_output, x, *, grad_weight=None, accumulate_into_grad_weight=False):
                    dw = grad_weight
                    dw, *_ = general_gemm(x, grad_output, out=dw, accumulate=accumulate_into_grad_weight)
                    return grad_output, dw
            """,
            line=9,
        ),
        # TE <= 2.6 `BackwardLinearAdd.fuser_backward`: the helper is defined in another file; the buffer goes
        # to its `grad_weight=` output argument.
        Example(
            """\
            class BackwardLinearAdd(FusedOperation):
                def fuser_backward(self, basic_op_ctxs, grad_output):
                    linear_op = self.basic_ops[0]
                    grad_weight = None
                    if linear_op._accumulate_into_main_grad:
                        grad_weight = linear_op.weight.main_grad.detach()
                    grad_input, grad_weight = BasicLinear._functional_backward(
                        grad_output, grad_weight=grad_weight, accumulate_into_grad_weight=True
                    )
                    return grad_input, [(grad_weight,)]
            """,
            line=7,
        ),
    ]

    def gate(self, index: SyntaxIndex, settings: RuleSettings) -> bool:
        """Over-approximates `check`: the "backward" text test and the wrapper path are mirrored exactly;
        then some candidate write of `_common.written_buffer` (kernel argument, add_/copy_ receiver, `out=`
        keyword or `{"out": ...}` value, `+=` target) that may be a main_grad buffer
        (`spine_is_main_grad`), inside a function named like a backward and outside every class named like
        a wrapper (line spans, exact for defs and classes); or, for a buffer handed to a same-file helper,
        any call in such a function with an argument that may be a main_grad buffer. Flag awareness, the
        helper's own writes and the older-contract `None` return only remove findings."""
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
        # A backward that hands a main_grad-like argument to a (possibly writing) helper.
        for call in ast.walk(index.tree):
            if type(call) is not ast.Call:
                continue
            where = pos(call)
            if not any(s.contains(where) for s in backwards):
                continue
            args = [a.value if isinstance(a, ast.Starred) else a for a in call.args]
            args += [kw.value for kw in call.keywords]
            if any(spine_is_main_grad(spine_of(a), aliases) for a in args):
                return True
        return False

    def check(self, ctx: FileContext) -> Iterator[Violation]:
        if "backward" not in ctx.source:
            return
        units: dict[cst.FunctionDef, bool] = {}  # backward -> is it aware of the flag?
        reported: set[tuple[int, str]] = set()
        scopes: dict[cst.FunctionDef | None, MainGradScope] = {}
        knows_flag = knows_flag_contract(ctx.source)
        helpers = _Helpers(ctx)
        for node in ctx.nodes(cst.Call, cst.Dict, cst.AugAssign):
            target = written_buffer(node)
            if target is None and not isinstance(node, cst.Call):
                continue
            unit = self._backward_of(ctx, node)
            if unit is None or in_wrapper(ctx, node):
                continue
            func = next((a for a in ctx.ancestors(node) if isinstance(a, cst.FunctionDef)), None)
            if func not in scopes:
                scopes[func] = MainGradScope.of(ctx, func)
            scope = scopes[func]
            if target is None:
                assert isinstance(node, cst.Call)
                target = helpers.handed_buffer(node, scope)  # `main_grad` passed to a writing helper
                if target is None:
                    continue
            elif not scope.is_main_grad(target):
                continue
            if unit not in units:
                units[unit] = self._aware(ctx, unit)
            if units[unit]:
                continue
            if not knows_flag and _returns_no_weight_grad(ctx, unit, node):
                continue  # older contract: no gradient returned, nothing for a hook to add twice
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


def _params(func: cst.FunctionDef) -> list[cst.Param]:
    p = func.params
    return [*p.posonly_params, *p.params, *p.kwonly_params]


def _is_method(ctx: FileContext, func: cst.FunctionDef) -> bool:
    """A function defined in a class body that is not a staticmethod (its first parameter is bound)."""
    if not isinstance(ctx.parent(ctx.parent(func) or func), cst.ClassDef):
        return False
    return not any(dotted_name(d.decorator) == "staticmethod" for d in func.decorators)


# Keywords that name a weight-gradient output buffer: a main_grad passed there is written by the callee.
_OUTPUT_KEYWORDS = frozenset({"grad_weight", "wgrad", "weight_grad"})


class _Helpers:
    """Same-file functions that write a wgrad into one of their parameters (TE <= 2.6
    `BasicLinear._functional_backward(..., grad_weight=W.main_grad)`: `dw = grad_weight;
    general_gemm(..., out=dw)`), so that a backward handing `main_grad` to one counts as writing it."""

    def __init__(self, ctx: FileContext) -> None:
        self.ctx = ctx
        self.functions: dict[str, list[cst.FunctionDef]] = {}
        for f in ctx.nodes(cst.FunctionDef):
            assert isinstance(f, cst.FunctionDef)
            self.functions.setdefault(f.name.value, []).append(f)
        self._written: dict[int, set[str]] = {}

    def written_params(self, helper: cst.FunctionDef) -> set[str]:
        """Parameters of `helper` that one of its own writes writes into (through local names, 3 hops)."""
        if id(helper) in self._written:
            return self._written[id(helper)]
        names = {p.name.value for p in _params(helper)}
        bindings: dict[str, list[cst.BaseExpression]] = {}
        for assign in all_nodes(helper, cst.Assign):
            assert isinstance(assign, cst.Assign)
            for t in assign.targets:
                for leaf in all_nodes(t.target, cst.Name):
                    assert isinstance(leaf, cst.Name)
                    bindings.setdefault(leaf.value, []).append(assign.value)

        def roots(expr: cst.BaseExpression, depth: int) -> set[str]:
            while isinstance(expr, cst.Subscript) or (
                isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute)
            ):
                expr = expr.value if isinstance(expr, cst.Subscript) else expr.func.value  # type: ignore[attr-defined]
            if not isinstance(expr, cst.Name) or depth > 3:
                return set()
            found = {expr.value} & names
            for value in bindings.get(expr.value, []):
                found |= roots(value, depth + 1)
            return found

        written: set[str] = set()
        for node in all_nodes(helper, cst.Call, cst.Dict, cst.AugAssign):
            target = written_buffer(node)
            if target is not None:
                written |= roots(target, 0)
        self._written[id(helper)] = written
        return written

    def handed_buffer(self, call: cst.Call, scope: MainGradScope) -> cst.BaseExpression | None:
        """The main_grad argument of `call` when its callee (a same-file function of that name, unique)
        writes into the matching parameter."""
        func = call.func
        name = (
            func.attr.value
            if isinstance(func, cst.Attribute)
            else func.value
            if isinstance(func, cst.Name)
            else None
        )
        candidates = self.functions.get(name or "", [])
        if len(candidates) != 1:  # not defined here (TE's fused ops call `BasicLinear._functional_backward`)
            for arg in call.args:
                named = arg.keyword.value if arg.keyword is not None else None
                if named in _OUTPUT_KEYWORDS and scope.is_main_grad(arg.value):
                    return arg.value
            return None
        helper = candidates[0]
        params = [p.name.value for p in _params(helper)]
        positional = [p.name.value for p in (*helper.params.posonly_params, *helper.params.params)]
        if isinstance(func, cst.Attribute) and _is_method(self.ctx, helper):
            positional = positional[1:]
        written = self.written_params(helper)
        index = 0
        for arg in call.args:
            if arg.star:
                return None
            if arg.keyword is not None:
                param = arg.keyword.value if arg.keyword.value in params else None
            else:
                param = positional[index] if index < len(positional) else None
                index += 1
            if param in written and scope.is_main_grad(arg.value):
                return arg.value
        return None


def _returns_no_weight_grad(ctx: FileContext, unit: cst.FunctionDef, write: cst.CSTNode) -> bool:
    """Does the backward return `None` for the weight once it has written `main_grad`? Either a returned
    name is set to `None` after the write on its path (`grad_weight = None` in the fused branch), or, for an
    autograd Function, every return has a literal `None` in each slot whose `forward` parameter is named
    like a weight."""
    returns = [r for r in all_nodes(unit, cst.Return) if _function(ctx, r) is unit]
    values = [r.value for r in returns if isinstance(r, cst.Return) and r.value is not None]
    if not values:
        return False
    returned: set[str] = set()
    for value in values:
        elements = value.elements if isinstance(value, (cst.Tuple, cst.List)) else [value]
        for e in elements:
            expr = e.value if isinstance(e, cst.BaseElement) else e
            if isinstance(expr, cst.Name):
                returned.add(expr.value)
            elif isinstance(expr, (cst.List, cst.Tuple)):
                returned |= {x.value.value for x in expr.elements if isinstance(x.value, cst.Name)}
    for assign in all_nodes(unit, cst.Assign):
        assert isinstance(assign, cst.Assign)
        if not is_none(assign.value) or _function(ctx, assign) is not unit:
            continue
        targets = {t.target.value for t in assign.targets if isinstance(t.target, cst.Name)}
        if (
            targets & returned
            and is_before(ctx, write, assign)
            and not mutually_exclusive(ctx, write, assign)
        ):
            return True
    owner = ctx.parent(ctx.parent(unit) or unit)
    if not isinstance(owner, cst.ClassDef):
        return False
    forward = next(
        (
            f
            for f in all_nodes(owner, cst.FunctionDef)
            if isinstance(f, cst.FunctionDef) and f.name.value == "forward"
        ),
        None,
    )
    if forward is None:
        return False
    slots = [i for i, p in enumerate(_params(forward)[1:]) if "weight" in p.name.value.lower()]
    if not slots:
        return False
    for value in values:
        if not isinstance(value, cst.Tuple):
            return False
        elements = value.elements
        if any(i >= len(elements) or not is_none(elements[i].value) for i in slots):
            return False
    return True


def _function(ctx: FileContext, node: cst.CSTNode) -> cst.FunctionDef | None:
    return next((a for a in ctx.ancestors(node) if isinstance(a, cst.FunctionDef)), None)
