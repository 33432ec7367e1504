"""MG001: a TE op-fuser op that reads `main_grad` in its forward, with nothing exposing `main_grad` first.

Which ops (Transformer Engine 2.20.2, `transformer_engine/pytorch/ops`): `BasicLinear`, `GroupedLinear` and
`Linear` take `accumulate_into_main_grad`; the fused grouped-MLP ops (`GroupedMLP_CuTeGEMM*`) take none, they
wrap `GroupedLinear` ops. Only `GroupedLinear.fuser_forward` touches `main_grad` in forward (it raises
"MAIN GRAD NOT FOUND" / "MAIN GRAD IS NONE"). `BasicLinear`/`Linear` (and every op's backward, and the fused
grouped-MLP ops) go through `get_main_grad_from_param`, which calls `get_main_grad()` itself when the weight
has `__fsdp_param__`; so flagging them would flag correct code such as megatron-core's `TEFusedMLP`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import libcst as cst

from maingrad.analyzer import walk
from maingrad.analyzer.context import FileContext, RuleSettings
from maingrad.analyzer.facts import ACCUMULATE_FLAG as FLAG
from maingrad.analyzer.facts import FORWARD_CHECKING_OPS
from maingrad.analyzer.facts import TE_SEQUENTIAL as SEQUENTIAL
from maingrad.analyzer.names import dotted_name
from maingrad.analyzer.rules._common import (
    all_nodes,
    code_of,
    enclosing_class,
    enclosing_function,
    first_param,
    function_exposes,
    is_false_constant,
    is_helper_call,
    keyword,
    local_bindings,
    own_nodes,
    positional,
    single_binding,
    string_value,
)
from maingrad.analyzer.rules.base import Example, Fix, Rule, Violation
from maingrad.analyzer.syntax_index import SyntaxIndex
from maingrad.contracts.report import Severity

METHOD = "_expose_main_grad_for_fused_ops"
# Entry points that run without being referenced inside the class.
ENTRY_POINTS = frozenset({"forward", "__call__"})


@dataclass
class _Flagged:
    call: cst.Call
    value: cst.BaseExpression  # the accumulate_into_main_grad expression
    func: cst.FunctionDef | None


def _flag_value(call: cst.Call, func: cst.FunctionDef | None) -> cst.BaseExpression | None:
    """The expression passed as accumulate_into_main_grad (keyword, `**{...}` or `**kwargs` built locally)."""
    arg = keyword(call, FLAG)
    if arg is not None:
        return arg.value
    bindings = local_bindings(func) if func is not None else {}
    for star in (a for a in call.args if a.star == "**"):
        value = star.value
        bound = single_binding(bindings, value)
        for mapping in (value, bound):
            if isinstance(mapping, cst.Dict):
                for element in mapping.elements:
                    if isinstance(element, cst.DictElement) and string_value(element.key) == FLAG:
                        return element.value
            if isinstance(mapping, cst.Call) and dotted_name(mapping.func) == "dict":
                found = keyword(mapping, FLAG)
                if found is not None:
                    return found.value
        if isinstance(value, cst.Name) and func is not None:  # kwargs["accumulate_into_main_grad"] = v
            for assign in own_nodes(func.body, cst.Assign):
                assert isinstance(assign, cst.Assign)
                for target in assign.targets:
                    sub = target.target
                    if (
                        isinstance(sub, cst.Subscript)
                        and code_of(sub.value) == value.value
                        and len(sub.slice) == 1
                        and isinstance(sub.slice[0].slice, cst.Index)
                        and string_value(sub.slice[0].slice.value) == FLAG
                    ):
                        return assign.value
    return None


class FusedOpWithoutExposure(Rule):
    id = "MG001"
    name = "fused-op-without-main-grad-exposure"
    severity = Severity.ERROR
    summary = (
        "TE op-fuser GroupedLinear built with accumulate_into_main_grad, but nothing exposes main_grad "
        "before the fused forward"
    )
    needles = (FLAG,)
    fixable = True
    docs = """\
## What it does
Flags a Transformer Engine op-fuser `transformer_engine.pytorch.ops.GroupedLinear` constructed with
`accumulate_into_main_grad` not provably `False`, inside a class (or, outside classes, a module) where no
code reachable from the class exposes `main_grad` (`param.main_grad = param.get_main_grad()`, a call to a
configured `exposure-helpers` function, or a method that does either). Every import form is resolved
(`te.pytorch.ops.GroupedLinear`, `from transformer_engine.pytorch import ops`, aliases, `te_ops =
te.pytorch.ops`, relative imports inside TE). `BasicLinear`/`Linear` ops are not flagged: in TE 2.20 they
read `main_grad` only in backward, through `get_main_grad_from_param`, which refreshes it from
`get_main_grad()` for Megatron-FSDP parameters.

## Why is this bad?
`GroupedLinear`'s fused forward checks `weight0.main_grad` (or `weight.main_grad`) and raises `MAIN GRAD NOT
FOUND` / `MAIN GRAD IS NONE`. Under Megatron-FSDP the attribute is absent until the first backward calls
`get_main_grad()`, and `None` after every `zero_grad_buffer()`: the first training step fails (Megatron-LM
PR #5209, megatron-core 0.18's `TEGroupedMLP._make_fused_ops`). Under DDP it works, so the bug hides until
someone switches to Megatron-FSDP.

## Example
```python
class GroupedMLP(torch.nn.Module):
    def _make_fused_ops(self):
        ops = te.pytorch.ops.Sequential()
        op = te.pytorch.ops.GroupedLinear(
            self.linear_fc1.num_gemms, self.linear_fc1.in_features, self.linear_fc1.out_features,
            device="meta", accumulate_into_main_grad=self.linear_fc1.fuse_wgrad_accumulation,
        )
        ops.append(op)
        return ops
```

## Use instead
```python
class GroupedMLP(torch.nn.Module):
    def _make_fused_ops(self):
        ...
        ops.register_forward_pre_hook(lambda *_: self._expose_main_grad_for_fused_ops())
        return ops

    def _expose_main_grad_for_fused_ops(self) -> None:
        for linear in (self.linear_fc1,):
            if not getattr(linear, "fuse_wgrad_accumulation", False):
                continue
            for param in linear.parameters(recurse=False):
                get_main_grad = getattr(param, "get_main_grad", None)
                if get_main_grad is not None and getattr(param, "main_grad", None) is None:
                    param.main_grad = get_main_grad()
```
The fix adds that method and calls it at the end of the class's existing pre-forward hook of the fused
container (the one that replays the submodules' hooks, so FSDP has unsharded the weights), or registers a new
pre-forward hook on the container just before it is returned. It never sets `overwrite_main_grad` (see
MG006) and leaves DDP parameters (no `get_main_grad`) and already-exposed buffers untouched. It applies when
every flagged op takes its flag from `self.<child>.fuse_wgrad_accumulation`; otherwise the finding explains
the remedy.

## In real code
megatron-core 0.18.2 `TEGroupedMLP._make_fused_ops` is the bug of Megatron-LM #5209 (seen on an H200:
`MAIN GRAD NOT FOUND` on the first forward under Megatron-FSDP). 0.19.2 fixes `TEGroupedMLP` but keeps the
pattern in `TEFusedMLPWithGroupedLinear._make_fused_impl` (dense MLPs with `use_grouped_gemm_for_dense_mlp`
and the op fuser) and in `FusedSharedExpertMLP._make_fused_grouped_swiglu_ops` (shared experts with
`use_grouped_gemm_for_shared_expert`). Both run under an MXFP8 or NVFP4 recipe, so they need a Blackwell GPU.
Transformer Engine 2.20.2 replaces the three ops by its CuTe grouped-MLP op, which exposes `main_grad` itself
in backward (`get_main_grad_from_param`), only when `NVTE_CUTEDSL_FUSED_GROUPED_MLP=1` is set on an SM 10.x
GPU with cuDNN's frontend kernels installed (`_GroupedMLP_CuTeGEMMBase.is_supported`). Neither class asks for
that variable (0.19.2's `TEGroupedMLP` asserts it), so by default the basic `GroupedLinear.fuser_forward`
runs and raises `MAIN GRAD NOT FOUND` under Megatron-FSDP. Both are reported, and both were measured on an
H200 (2026-12-03, TE 2.20.2, Megatron-FSDP, their recipe set to FP8 current scaling, which SM 9.0 runs; the
`main_grad` check comes before any quantization): as shipped, the first forward of each raises
`MAIN GRAD NOT FOUND` (grouped_linear.py:1013); with `maingrad.hooks.install(model)` the dense one trains.
"""

    VALID = [
        Example(
            """\
            import transformer_engine as te

            class Experts(torch.nn.Module):
                def _make_fused_ops(self):
                    ops = te.pytorch.ops.Sequential()
                    ops.append(te.pytorch.ops.GroupedLinear(4, 8, 8, accumulate_into_main_grad=self.linear_fc1.fuse_wgrad_accumulation))
                    ops.register_forward_pre_hook(self._make_hook())
                    return ops

                def _make_hook(self):
                    def forward_pre_hook(module, *_):
                        self._ensure_main_grad(self.linear_fc1)

                    return forward_pre_hook

                @staticmethod
                def _ensure_main_grad(linear):
                    if not getattr(linear, "fuse_wgrad_accumulation", False):
                        return
                    for param in linear.parameters(recurse=False):
                        get_main_grad = getattr(param, "get_main_grad", None)
                        if get_main_grad is not None and getattr(param, "main_grad", None) is None:
                            param.main_grad = get_main_grad()
            """
        ),
        Example(
            """\
            from transformer_engine.pytorch import ops

            class Experts(torch.nn.Module):
                def build(self):
                    return ops.GroupedLinear(4, 8, 8, accumulate_into_main_grad=False)
            """
        ),
        Example(
            """\
            import transformer_engine as te

            class Experts(torch.nn.Module):
                def build(self):
                    return te.pytorch.ops.GroupedLinear(4, 8, 8, device="meta")  # default: False
            """
        ),
        Example(
            """\
            import transformer_engine as te

            class FusedMLP(torch.nn.Module):
                # BasicLinear refreshes main_grad from get_main_grad() in backward: nothing needed in forward
                def build(self):
                    return te.pytorch.ops.BasicLinear(8, 8, accumulate_into_main_grad=self.fc1.fuse_wgrad_accumulation)
            """
        ),
        Example(
            """\
            import transformer_engine as te

            class Experts(torch.nn.Module):
                def build(self):
                    ops = te.pytorch.ops.Sequential(
                        te.pytorch.ops.GroupedLinear(4, 8, 8, accumulate_into_main_grad=True)
                    )
                    ops.register_forward_pre_hook(lambda *_: expose_all_main_grads(self))
                    return ops
            """,
            config={"exposure-helpers": ["expose_all_main_grads"]},
        ),
        Example(
            """\
            class GroupedLinear(torch.nn.Module):  # a local class, not TE's op
                pass

            layer = GroupedLinear(4, 8, 8, accumulate_into_main_grad=True)
            """
        ),
        Example(
            """\
            from transformer_engine.pytorch.ops import GroupedLinear as GL

            def build(params):
                for p in params:
                    if getattr(p, "main_grad", None) is None and hasattr(p, "get_main_grad"):
                        p.main_grad = p.get_main_grad()
                return GL(4, 8, 8, accumulate_into_main_grad=True)
            """
        ),
    ]
    INVALID = [
        Example(
            """\
            import transformer_engine as te

            class Experts(torch.nn.Module):
                def _make_fused_ops(self):
                    ops = te.pytorch.ops.Sequential()
                    op = te.pytorch.ops.GroupedLinear(
                        4, 8, 8, device="meta", accumulate_into_main_grad=self.linear_fc1.fuse_wgrad_accumulation
                    )
                    ops.append(op)
                    ops.register_forward_pre_hook(self._make_pre_forward_hook())
                    return ops

                def _make_pre_forward_hook(self):
                    def forward_pre_hook(module, *_):
                        for hook in self.linear_fc1._forward_pre_hooks.values():
                            hook(self.linear_fc1, None)

                    return forward_pre_hook
            """,
            line=6,
            fixed="""\
            import transformer_engine as te

            class Experts(torch.nn.Module):
                def _make_fused_ops(self):
                    ops = te.pytorch.ops.Sequential()
                    op = te.pytorch.ops.GroupedLinear(
                        4, 8, 8, device="meta", accumulate_into_main_grad=self.linear_fc1.fuse_wgrad_accumulation
                    )
                    ops.append(op)
                    ops.register_forward_pre_hook(self._make_pre_forward_hook())
                    return ops

                def _make_pre_forward_hook(self):
                    def forward_pre_hook(module, *_):
                        for hook in self.linear_fc1._forward_pre_hooks.values():
                            hook(self.linear_fc1, None)
                        # Megatron-FSDP creates main_grad lazily; the fused GroupedLinear checks it in forward.
                        self._expose_main_grad_for_fused_ops()

                    return forward_pre_hook

                def _expose_main_grad_for_fused_ops(self) -> None:
                    \"\"\"Expose Megatron-FSDP main_grad buffers before the fused ops' forward reads them.

                    Only parameters with `get_main_grad` (Megatron-FSDP) and no buffer yet are touched: DDP
                    parameters and already-exposed buffers stay as they are. Added by `maingrad fix` (MG001).
                    \"\"\"
                    for linear in (self.linear_fc1,):
                        if not getattr(linear, "fuse_wgrad_accumulation", False):
                            continue
                        for param in linear.parameters(recurse=False):
                            get_main_grad = getattr(param, "get_main_grad", None)
                            if get_main_grad is not None and getattr(param, "main_grad", None) is None:
                                param.main_grad = get_main_grad()
            """,
        ),
        Example(
            """\
            from transformer_engine.pytorch import ops as te_ops

            class SharedExperts(torch.nn.Module):
                def _make_ops(self):
                    seq = te_ops.Sequential()
                    seq.append(te_ops.GroupedLinear(num_groups=1, in_features=8, out_features=8,
                                                    accumulate_into_main_grad=self.fc1.fuse_wgrad_accumulation))
                    seq.append(te_ops.GroupedLinear(num_groups=1, in_features=8, out_features=8,
                                                    accumulate_into_main_grad=self.fc2.fuse_wgrad_accumulation))

                    def forward_pre_hook(_module, *_):
                        for source in (self.fc1, self.fc2):
                            for hook in source._forward_pre_hooks.values():
                                hook(source, ())

                    seq.register_forward_pre_hook(forward_pre_hook)
                    return seq
            """,
            line=6,
            fixed="""\
            from transformer_engine.pytorch import ops as te_ops

            class SharedExperts(torch.nn.Module):
                def _make_ops(self):
                    seq = te_ops.Sequential()
                    seq.append(te_ops.GroupedLinear(num_groups=1, in_features=8, out_features=8,
                                                    accumulate_into_main_grad=self.fc1.fuse_wgrad_accumulation))
                    seq.append(te_ops.GroupedLinear(num_groups=1, in_features=8, out_features=8,
                                                    accumulate_into_main_grad=self.fc2.fuse_wgrad_accumulation))

                    def forward_pre_hook(_module, *_):
                        for source in (self.fc1, self.fc2):
                            for hook in source._forward_pre_hooks.values():
                                hook(source, ())
                        # Megatron-FSDP creates main_grad lazily; the fused GroupedLinear checks it in forward.
                        self._expose_main_grad_for_fused_ops()

                    seq.register_forward_pre_hook(forward_pre_hook)
                    return seq

                def _expose_main_grad_for_fused_ops(self) -> None:
                    \"\"\"Expose Megatron-FSDP main_grad buffers before the fused ops' forward reads them.

                    Only parameters with `get_main_grad` (Megatron-FSDP) and no buffer yet are touched: DDP
                    parameters and already-exposed buffers stay as they are. Added by `maingrad fix` (MG001).
                    \"\"\"
                    for linear in (self.fc1, self.fc2):
                        if not getattr(linear, "fuse_wgrad_accumulation", False):
                            continue
                        for param in linear.parameters(recurse=False):
                            get_main_grad = getattr(param, "get_main_grad", None)
                            if get_main_grad is not None and getattr(param, "main_grad", None) is None:
                                param.main_grad = get_main_grad()
            """,
        ),
        Example(
            """\
            from transformer_engine.pytorch.ops import GroupedLinear as GL, Sequential

            class FusedMLP(torch.nn.Module):
                def _make_fused_impl(self):
                    fused_impl = Sequential()
                    op = GL(1, 8, 8, device="meta", accumulate_into_main_grad=self.linear_fc1.fuse_wgrad_accumulation)
                    op.weight0 = self.linear_fc1.weight
                    fused_impl.append(op)
                    self._register_hooks_on_fused_impl(fused_impl)
                    return fused_impl
            """,
            line=6,
            fixed="""\
            from transformer_engine.pytorch.ops import GroupedLinear as GL, Sequential

            class FusedMLP(torch.nn.Module):
                def _make_fused_impl(self):
                    fused_impl = Sequential()
                    op = GL(1, 8, 8, device="meta", accumulate_into_main_grad=self.linear_fc1.fuse_wgrad_accumulation)
                    op.weight0 = self.linear_fc1.weight
                    fused_impl.append(op)
                    self._register_hooks_on_fused_impl(fused_impl)
                    # Megatron-FSDP creates main_grad lazily; the fused GroupedLinear checks it in forward.
                    fused_impl.register_forward_pre_hook(lambda *_: self._expose_main_grad_for_fused_ops())
                    return fused_impl

                def _expose_main_grad_for_fused_ops(self) -> None:
                    \"\"\"Expose Megatron-FSDP main_grad buffers before the fused ops' forward reads them.

                    Only parameters with `get_main_grad` (Megatron-FSDP) and no buffer yet are touched: DDP
                    parameters and already-exposed buffers stay as they are. Added by `maingrad fix` (MG001).
                    \"\"\"
                    for linear in (self.linear_fc1,):
                        if not getattr(linear, "fuse_wgrad_accumulation", False):
                            continue
                        for param in linear.parameters(recurse=False):
                            get_main_grad = getattr(param, "get_main_grad", None)
                            if get_main_grad is not None and getattr(param, "main_grad", None) is None:
                                param.main_grad = get_main_grad()
            """,
        ),
        Example(
            """\
            import transformer_engine as te

            te_ops = te.pytorch.ops
            layer = te_ops.GroupedLinear(4, 8, 8, accumulate_into_main_grad=True)
            """,
            line=4,
        ),
        Example(
            """\
            from transformer_engine.pytorch.ops.basic.grouped_linear import GroupedLinear

            class Experts(torch.nn.Module):
                def build(self, fuse):
                    kwargs = {"device": "meta", "accumulate_into_main_grad": fuse}
                    return GroupedLinear(4, 8, 8, **kwargs)

                def _ensure_main_grad(self):  # defined, but never called: no exposure happens
                    for p in self.parameters():
                        if hasattr(p, "get_main_grad"):
                            p.main_grad = p.get_main_grad()
            """,
            line=6,
        ),
        Example(
            """\
            import transformer_engine as te

            class Experts(torch.nn.Module):
                def _make_fused_ops(self):
                    ops = te.pytorch.ops.Sequential()
                    ops.append(te.pytorch.ops.GroupedLinear(4, 8, 8, accumulate_into_main_grad=self.flag))
                    return ops

            class Other(torch.nn.Module):  # exposure in another class does not help Experts
                def forward_pre_hook(self, *_):
                    for p in self.parameters():
                        if hasattr(p, "get_main_grad"):
                            p.main_grad = p.get_main_grad()
            """,
            line=6,
        ),
    ]

    def gate(self, index: SyntaxIndex, settings: RuleSettings) -> bool:
        """Over-approximates `check`: a finding needs a call that `ctx.names` resolves to `GroupedLinear`,
        and a resolved name ends with an identifier written in the file (the callee's last attribute, an
        imported name, or the source of an alias such as `GL = ops.GroupedLinear`), so the text must hold
        "GroupedLinear". The call then passes the flag as a keyword, or passes `**mapping` (the mapping
        naming it is not followed). Exposure helpers only remove findings, so they are ignored here."""
        if "GroupedLinear" not in index.source:
            return False
        return FLAG in index.keywords or index.double_star_call

    def check(self, ctx: FileContext) -> Iterator[Violation]:
        flagged_by_class: dict[cst.ClassDef | None, list[_Flagged]] = {}
        for call in ctx.nodes(cst.Call):
            assert isinstance(call, cst.Call)
            if not any(
                a.star == "**" or (a.keyword is not None and a.keyword.value == FLAG) for a in call.args
            ):
                continue
            if not ctx.names.matches(call.func, *FORWARD_CHECKING_OPS):
                continue
            func = enclosing_function(ctx, call)
            value = _flag_value(call, func)
            if value is None or is_false_constant(value):
                continue
            flagged_by_class.setdefault(enclosing_class(ctx, call), []).append(_Flagged(call, value, func))
        helpers = ctx.settings.exposure_helpers
        for owner, flagged in flagged_by_class.items():
            if owner is not None and _class_exposes(ctx, owner, helpers):
                continue
            if owner is None and _module_exposes(ctx, helpers):
                continue
            fix = _build_fix(ctx, owner, flagged) if owner is not None else None
            where = f"class `{owner.name.value}`" if owner is not None else "this module"
            for item in flagged:
                yield Violation(
                    node=item.call,
                    message=(
                        f"TE op-fuser `{code_of(item.call.func)}` is built with accumulate_into_main_grad="
                        f"`{code_of(item.value)}`, but nothing in {where} exposes main_grad "
                        "(`param.main_grad = param.get_main_grad()` for Megatron-FSDP parameters) before the "
                        "fused forward, which raises 'MAIN GRAD NOT FOUND'/'MAIN GRAD IS NONE' under "
                        "Megatron-FSDP. Expose it in the fused container's pre-forward hook."
                    ),
                    fix=fix,
                )


# Exposure reachability ------------------------------------------------------------------------------
def _module_functions(ctx: FileContext) -> dict[str, cst.FunctionDef]:
    return {s.name.value: s for s in ctx.module.body if isinstance(s, cst.FunctionDef)}


def _same_file_bases(ctx: FileContext, owner: cst.ClassDef) -> list[cst.ClassDef]:
    """`owner` and its base classes defined in this file (by simple name), nearest first."""
    classes = {n.name.value: n for n in ctx.nodes(cst.ClassDef) if isinstance(n, cst.ClassDef)}
    seen: list[cst.ClassDef] = []
    pending = [owner]
    while pending:
        current = pending.pop(0)
        if any(current is s for s in seen):
            continue
        seen.append(current)
        for base in current.bases:
            name = dotted_name(base.value)
            if name is not None and name.rsplit(".", 1)[-1] in classes:
                pending.append(classes[name.rsplit(".", 1)[-1]])
    return seen


def _class_exposes(ctx: FileContext, owner: cst.ClassDef, helpers: frozenset[str]) -> bool:
    """Whether some live function of the class (or its same-file bases, or module functions they call)
    exposes main_grad. Live: nested (a hook or closure that is referenced), an entry point, or referenced
    from elsewhere in the class."""
    classes = _same_file_bases(ctx, owner)
    functions: list[cst.FunctionDef] = []
    for cls in classes:
        functions += [f for f in all_nodes(cls.body, cst.FunctionDef) if isinstance(f, cst.FunctionDef)]
    module_funcs = _module_functions(ctx)
    functions += [f for f in module_funcs.values() if all(f is not g for g in functions)]
    methods: dict[str, list[cst.FunctionDef]] = {}
    for f in functions:
        methods.setdefault(f.name.value, []).append(f)

    exposes = {id(f) for f in functions if function_exposes(f, helpers)}
    callees = {id(f): _called_names(f) for f in functions}
    # Lambdas (`register_forward_pre_hook(lambda *_: self._expose())`) run where they are registered.
    for cls in classes:
        for lam in all_nodes(cls.body, cst.Lambda):
            calls = [c for c in all_nodes(lam, cst.Call) if isinstance(c, cst.Call)]
            if any(is_helper_call(c, helpers) for c in calls):
                return True
            called = {n for c in calls for n in _callee_names(c)}
            if _reaches_exposure(called, methods, functions, exposes, callees):
                return True
    changed = True
    while changed:
        changed = False
        for f in functions:
            if id(f) in exposes:
                continue
            if any(id(g) in exposes for name in callees[id(f)] for g in methods.get(name, ())):
                exposes.add(id(f))
                changed = True
    if not exposes:
        return False
    referenced = _referenced_names(classes)
    for f in functions:
        if id(f) not in exposes:
            continue
        if f.name.value in ENTRY_POINTS or _referenced_outside(f, referenced):
            if any(f is g for g in module_funcs.values()) and not _module_function_used(
                f, callees, functions
            ):
                continue
            return True
    return False


def _callee_names(call: cst.Call) -> set[str]:
    if isinstance(call.func, cst.Attribute):
        return {call.func.attr.value}
    if isinstance(call.func, cst.Name):
        return {call.func.value}
    return set()


def _reaches_exposure(
    called: set[str],
    methods: dict[str, list[cst.FunctionDef]],
    functions: list[cst.FunctionDef],
    exposes: set[int],
    callees: dict[int, set[str]],
) -> bool:
    """Whether calling any of `called` leads (through same-file calls) to an exposing function."""
    seen: set[int] = set()
    pending = [g for name in called for g in methods.get(name, ())]
    while pending:
        g = pending.pop()
        if id(g) in seen:
            continue
        seen.add(id(g))
        if id(g) in exposes:
            return True
        pending += [h for name in callees[id(g)] for h in methods.get(name, ())]
    return False


def _module_function_used(
    f: cst.FunctionDef, callees: dict[int, set[str]], functions: list[cst.FunctionDef]
) -> bool:
    """A module-level function counts only when a class function calls it."""
    return any(f.name.value in callees[id(g)] for g in functions if g is not f)


def _called_names(func: cst.FunctionDef) -> set[str]:
    """Names of functions/methods called (or passed as hooks) from `func`'s own body."""
    names: set[str] = set()
    for node in own_nodes(func.body, cst.Call, cst.Attribute, cst.Name):
        if isinstance(node, cst.Call):
            target = node.func
            if isinstance(target, cst.Attribute):
                names.add(target.attr.value)
            elif isinstance(target, cst.Name):
                names.add(target.value)
        elif isinstance(node, cst.Attribute):
            names.add(node.attr.value)  # `register_forward_pre_hook(self._expose)`
        elif isinstance(node, cst.Name):
            names.add(node.value)  # a nested hook returned or registered by name
    return names


def _referenced_names(classes: list[cst.ClassDef]) -> list[tuple[str, cst.CSTNode]]:
    found: list[tuple[str, cst.CSTNode]] = []
    for cls in classes:
        for node in all_nodes(cls.body, cst.Attribute, cst.Name):
            if isinstance(node, cst.Attribute):
                found.append((node.attr.value, node))
            elif isinstance(node, cst.Name):
                found.append((node.value, node))
    return found


def _referenced_outside(func: cst.FunctionDef, referenced: list[tuple[str, cst.CSTNode]]) -> bool:
    inside = {id(n) for n in walk.walk(func)}
    name = func.name.value
    return any(n == name and id(node) not in inside for n, node in referenced)


def _module_exposes(ctx: FileContext, helpers: frozenset[str]) -> bool:
    functions = [f for f in ctx.nodes(cst.FunctionDef) if isinstance(f, cst.FunctionDef)]
    if any(function_exposes(f, helpers) for f in functions):
        return True
    top = cst.FunctionDef(name=cst.Name("_module"), params=cst.Parameters(), body=cst.IndentedBlock(body=[]))
    return function_exposes(
        top.with_changes(body=cst.IndentedBlock(body=list(_top_statements(ctx)))), helpers
    )


def _top_statements(ctx: FileContext) -> Iterator[cst.BaseStatement]:
    for stmt in ctx.module.body:
        if not isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            yield stmt


# Fix ---------------------------------------------------------------------------------------------------
_COMMENT = "# Megatron-FSDP creates main_grad lazily; the fused GroupedLinear checks it in forward."
_METHOD_TEMPLATE = '''\
def {name}(self) -> None:
    """Expose Megatron-FSDP main_grad buffers before the fused ops' forward reads them.

{doc}Only parameters with `get_main_grad` (Megatron-FSDP) and no buffer yet are touched: DDP
{doc}parameters and already-exposed buffers stay as they are. Added by `maingrad fix` (MG001).
{doc}"""
    for linear in ({children}):
        if not getattr(linear, "fuse_wgrad_accumulation", False):
            continue
        for param in linear.parameters(recurse=False):
            get_main_grad = getattr(param, "get_main_grad", None)
            if get_main_grad is not None and getattr(param, "main_grad", None) is None:
                param.main_grad = get_main_grad()
'''


def _child_of(item: _Flagged, owner: cst.ClassDef, ctx: FileContext) -> str | None:
    """`self.linear_fc1` for accumulate_into_main_grad=self.linear_fc1.fuse_wgrad_accumulation (with the
    method's own name for `self`), rewritten onto `self`."""
    value = item.value
    if not (isinstance(value, cst.Attribute) and value.attr.value == "fuse_wgrad_accumulation"):
        return None
    chain = dotted_name(value.value)
    method = item.func
    if chain is None or method is None or ctx.parent(ctx.parent(method) or method) is not owner:
        return None
    me = first_param(method)
    head, _, rest = chain.partition(".")
    if me is None or head != me or not rest:
        return None
    return f"self.{rest}"


def _method(owner: cst.ClassDef, name: str) -> cst.FunctionDef | None:
    for stmt in owner.body.body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == name:
            return stmt
    return None


def _nested_def(func: cst.FunctionDef, name: str) -> cst.FunctionDef | None:
    if not isinstance(func.body, cst.IndentedBlock):
        return None
    for stmt in func.body.body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == name:
            return stmt
    return None


def _returned_nested_def(func: cst.FunctionDef) -> cst.FunctionDef | None:
    if not isinstance(func.body, cst.IndentedBlock):
        return None
    for stmt in func.body.body:
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(small, cst.Return) and isinstance(small.value, cst.Name):
                    return _nested_def(func, small.value.value)
    return None


def _safe_to_append(target: cst.FunctionDef, self_name: str) -> bool:
    """Appending a statement runs on every call: no early return/yield, and `self` not shadowed (a method's
    own first parameter is `self` itself; a nested hook must not take a parameter of that name)."""
    if not isinstance(target.body, cst.IndentedBlock):
        return False
    if own_nodes(target.body, cst.Return, cst.Yield, cst.Await):
        return False
    params = [p.name.value for p in [*target.params.posonly_params, *target.params.params]]
    params += [p.name.value for p in target.params.kwonly_params]
    if params and params[0] == self_name:
        return self_name not in params[1:]
    return self_name not in params


@dataclass
class _Plan:
    append_to: dict[cst.FunctionDef, str]  # hook function -> name of `self` inside it
    insert_before: dict[cst.BaseStatement, str]  # statement in the op function -> registration code
    after: cst.FunctionDef  # the class member after which the method is added


def _hook_plan(ctx: FileContext, owner: cst.ClassDef, func: cst.FunctionDef, method: str) -> _Plan | None:
    """Where to call the exposure method for the fused container built in `func`."""
    me = first_param(func)
    if me is None or not isinstance(func.body, cst.IndentedBlock):
        return None
    for stmt in func.body.body:
        if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
            continue
        small = stmt.body[0]
        call = small.value if isinstance(small, cst.Expr) else None
        if not (
            isinstance(call, cst.Call)
            and isinstance(call.func, cst.Attribute)
            and call.func.attr.value == "register_forward_pre_hook"
            and positional(call)
        ):
            continue
        hook = positional(call)[0].value
        target: cst.FunctionDef | None = None
        self_name = me
        after = func
        if isinstance(hook, cst.Call) and not hook.args and _is_self_attr(hook.func, me):
            factory = _method(owner, hook.func.attr.value)  # type: ignore[attr-defined]
            if factory is not None and first_param(factory):
                target, self_name, after = _returned_nested_def(factory), first_param(factory) or me, factory
        elif isinstance(hook, cst.Name):
            target = _nested_def(func, hook.value)
        elif _is_self_attr(hook, me):
            found = _method(owner, hook.attr.value)  # type: ignore[attr-defined]
            if found is not None and first_param(found):
                target, self_name, after = found, first_param(found) or me, found
        if target is not None and _safe_to_append(target, self_name):
            return _Plan({target: self_name}, {}, after)
    # No usable hook: register one on the container just before it is returned.
    container = _container_name(ctx, func)
    if container is None:
        return None
    for stmt in func.body.body:
        if (
            isinstance(stmt, cst.SimpleStatementLine)
            and len(stmt.body) == 1
            and isinstance(stmt.body[0], cst.Return)
        ):
            value = stmt.body[0].value
            if value is not None and any(n.value == container for n in all_nodes(value, cst.Name)):
                code = f"{container}.register_forward_pre_hook(lambda *_: {me}.{method}())"
                return _Plan({}, {stmt: code}, func)
    return None


def _is_self_attr(node: cst.BaseExpression, me: str) -> bool:
    return isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name) and node.value.value == me


def _container_name(ctx: FileContext, func: cst.FunctionDef) -> str | None:
    """The local holding the fused `Sequential` built in `func`."""
    for assign in own_nodes(func.body, cst.Assign):
        assert isinstance(assign, cst.Assign)
        if (
            isinstance(assign.value, cst.Call)
            and ctx.names.matches(assign.value.func, SEQUENTIAL)
            and len(assign.targets) == 1
            and isinstance(assign.targets[0].target, cst.Name)
        ):
            return assign.targets[0].target.value
    return None


def _build_fix(ctx: FileContext, owner: cst.ClassDef, flagged: list[_Flagged]) -> Fix | None:
    children: list[str] = []
    for item in flagged:
        child = _child_of(item, owner, ctx)
        if child is None:
            return None
        if child not in children:
            children.append(child)
    name = METHOD
    suffix = 2
    while _method(owner, name) is not None:
        name = f"{METHOD}_{suffix}"
        suffix += 1
    plans: list[_Plan] = []
    for func in {id(i.func): i.func for i in flagged if i.func is not None}.values():
        assert func is not None
        plan = _hook_plan(ctx, owner, func, name)
        if plan is None:
            return None
        plans.append(plan)
    if not plans:
        return None
    tuple_code = ", ".join(children) + ("," if len(children) == 1 else "")
    # A docstring is not re-indented with its block: write its continuation lines at the final depth.
    doc = _absolute_indent(ctx, owner.body) + ctx.module.default_indent  # type: ignore[arg-type]  # a class body
    method = cst.parse_statement(
        _METHOD_TEMPLATE.format(name=name, children=tuple_code, doc=doc), config=ctx.module.config_for_parsing
    )
    assert isinstance(method, cst.FunctionDef)
    method = method.with_changes(leading_lines=[cst.EmptyLine(indent=False)])
    new_owner = owner.visit(_ApplyPlan(plans, name, method, ctx))
    assert isinstance(new_owner, cst.ClassDef)
    return Fix({owner: new_owner}, f"expose main_grad in the fused container's pre-forward hook ({name})")


def _absolute_indent(ctx: FileContext, block: cst.IndentedBlock) -> str:
    """The indentation of the statements in `block`, from the module down."""
    indent = ""
    for node in [block, *ctx.ancestors(block)]:
        if isinstance(node, cst.IndentedBlock):
            indent = (node.indent if node.indent is not None else ctx.module.default_indent) + indent
    return indent


class _ApplyPlan(cst.CSTTransformer):
    def __init__(self, plans: list[_Plan], name: str, method: cst.FunctionDef, ctx: FileContext) -> None:
        super().__init__()
        self.append_to = {id(k): v for p in plans for k, v in p.append_to.items()}
        self.insert_before = {id(k): v for p in plans for k, v in p.insert_before.items()}
        self.after = id(plans[0].after)
        self.name = name
        self.method = method
        self.config = ctx.module.config_for_parsing

    def _comment_line(self) -> cst.EmptyLine:
        return cst.EmptyLine(comment=cst.Comment(_COMMENT))

    def leave_FunctionDef(
        self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef
    ) -> cst.FunctionDef:
        original, updated = original_node, updated_node  # libcst's parameter names (an override keeps them)
        self_name = self.append_to.get(id(original))
        if self_name is None or not isinstance(updated.body, cst.IndentedBlock):
            return updated
        call = cst.parse_statement(f"{self_name}.{self.name}()\n", config=self.config)
        call = call.with_changes(leading_lines=[self._comment_line()])
        return updated.with_changes(body=updated.body.with_changes(body=[*updated.body.body, call]))

    def leave_IndentedBlock(
        self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        original, updated = original_node, updated_node
        body: list[cst.BaseStatement] = []
        changed = False
        for old, new in zip(original.body, updated.body, strict=True):
            code = self.insert_before.get(id(old))
            if code is not None:
                hook = cst.parse_statement(code + "\n", config=self.config)
                lines = new.leading_lines  # type: ignore[attr-defined]  # every statement has leading_lines
                body.append(hook.with_changes(leading_lines=[*lines, self._comment_line()]))
                new = new.with_changes(leading_lines=[])
                changed = True
            body.append(new)
            if id(old) == self.after and isinstance(new, cst.FunctionDef):
                body.append(self.method)
                changed = True
        return updated.with_changes(body=body) if changed else updated
