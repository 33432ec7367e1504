"""Find the modules whose calls must be instrumented and the fused-wgrad parameters each one covers.

What is instrumented is the module that is actually *called* before the fused GEMM runs, which is not
always the one holding the flag:
- TE op-fuser ops (`accumulate_into_main_grad=True`) inside a `te.ops.Sequential` never run their own module
  hooks (the Sequential hands them to a plain fuser object), so the outermost such Sequential is the target.
- megatron-core's `TEGroupedMLP` keeps its op-fuser Sequential in the `_fused_ops` tuple, its dense
  `TEFusedMLP` / `TEFusedMLPWithGroupedLinear` in `_fused_impl` and `FusedSharedExpertMLP` in
  `_fused_grouped_swiglu_ops`, outside the module tree; the container is the target and covers every
  parameter of its fused-wgrad children.
- TE modules (`fuse_wgrad_accumulation=True`) and Megatron's own linears (`gradient_accumulation_fusion=True`)
  are called normally and are their own targets.
Classes are matched with isinstance when Transformer Engine / megatron-core are already imported (never
imported here: `import transformer_engine.pytorch` takes seconds) and by attribute duck typing otherwise.
"""

from __future__ import annotations

import fnmatch
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

# Target kinds; "strict" kinds need a main_grad buffer already at forward (TE's op-fuser checks it there).
CONTAINER = "fused_container"
OP_FUSER = "op_fuser"
TE_MODULE = "te_module"
MEGATRON_LINEAR = "megatron_linear"
EXPLICIT = "explicit"
STRICT_FORWARD_KINDS = frozenset({CONTAINER, OP_FUSER, EXPLICIT})

# Names of parameters whose gradient a fused wgrad GEMM writes (TE: weight, weight0..N, fc1_weight, ...).
_WGRAD_NAME = re.compile(r"^(?:fc\d+_)?weight\d*$")


@dataclass(frozen=True)
class Slot:
    """One covered parameter, looked up afresh at every call (Megatron-FSDP swaps Parameter objects)."""

    owner: torch.nn.Module
    name: str  # key in owner._parameters
    relname: str  # name relative to the target module, as records show it
    wgrad: bool  # a fused GEMM writes this parameter's gradient into main_grad


@dataclass
class TargetSpec:
    module: torch.nn.Module
    path: str
    kind: str
    slots: list[Slot] = field(default_factory=list)
    explicit: bool = False  # named by the user: treated as needing main_grad at forward, whatever its kind
    lenient: bool = False  # a container whose fused ops read main_grad only in backward (TEFusedMLP)

    @property
    def strict_forward(self) -> bool:
        return self.explicit or (self.kind in STRICT_FORWARD_KINDS and not self.lenient)


def _te_class(path: str, name: str) -> type | None:
    module = sys.modules.get(path)
    cls = getattr(module, name, None) if module is not None else None
    return cls if isinstance(cls, type) else None


def is_op_sequential(module: torch.nn.Module) -> bool:
    """A TE op-fuser container (`te.ops.Sequential`, or anything shaped like it)."""
    cls = _te_class("transformer_engine.pytorch.ops.sequential", "Sequential")
    if cls is not None and isinstance(module, cls):
        return True
    return "_module_groups" in vars(module) and type(module).__name__ == "Sequential"


def is_fused_op(module: torch.nn.Module) -> bool:
    """A TE op-fuser op that accumulates its wgrad into main_grad."""
    return (
        getattr(module, "_accumulate_into_main_grad", None) is True
        or getattr(module, "accumulate_into_main_grad", None) is True
    )


def has_fused_wgrad(module: torch.nn.Module) -> bool:
    """A TE module (or Megatron TE wrapper) built with fuse_wgrad_accumulation=True."""
    return getattr(module, "fuse_wgrad_accumulation", None) is True


def is_megatron_fused_linear(module: torch.nn.Module) -> bool:
    """Megatron's own Column/RowParallelLinear with gradient_accumulation_fusion (direct wgrad kernels)."""
    return getattr(module, "gradient_accumulation_fusion", None) is True and bool(module._parameters)


# Attributes in which megatron-core containers keep their op-fuser Sequential as a one-element tuple (so that
# it stays outside the module tree), built lazily on the first forward: TEGroupedMLP, TEFusedMLP*,
# FusedSharedExpertMLP.
FUSED_ATTRS = ("_fused_ops", "_fused_impl", "_fused_grouped_swiglu_ops")


def fused_attr(module: torch.nn.Module) -> str | None:
    """The attribute holding `module`'s fused object, if it is such a container."""
    return next((name for name in FUSED_ATTRS if hasattr(module, name)), None)


def fused_object(module: torch.nn.Module) -> torch.nn.Module | None:
    """The container's fused Sequential once built (None before its first forward)."""
    for name in FUSED_ATTRS:
        fused = module.__dict__.get(name)
        if type(fused) is tuple and len(fused) == 1 and isinstance(fused[0], torch.nn.Module):
            return fused[0]
    return None


def is_fused_container(module: torch.nn.Module) -> bool:
    """A module that runs fused ops kept outside the module tree (`_fused_ops`, `_fused_impl`).

    `_with_fused_impl is False` means the container calls its children normally (they are then targets of
    their own).
    """
    if fused_attr(module) is None:
        return False
    return getattr(module, "_with_fused_impl", True) is not False


def _needs_main_grad_at_forward(container: torch.nn.Module) -> bool:
    """Does the container's fused path check main_grad in forward (TE's op-fuser GroupedLinear does; its
    BasicLinear reads it only in backward, refreshing it from get_main_grad for Megatron-FSDP parameters)?

    Decided by the fused object's ops once built. Before that (install precedes the first forward): by the
    attribute, `_fused_ops` (TEGroupedMLP) and `_fused_grouped_swiglu_ops` (FusedSharedExpertMLP) hold
    GroupedLinear ops; `_fused_impl` by the class, megatron-core's `TEFusedMLPWithGroupedLinear` builds
    GroupedLinear ops, `TEFusedMLP` BasicLinear ones.
    """
    fused = fused_object(container)
    if fused is not None:
        return any(type(op).__name__ == "GroupedLinear" and is_fused_op(op) for op in fused.modules())
    if fused_attr(container) != "_fused_impl":
        return True
    return any("GroupedLinear" in cls.__name__ for cls in type(container).__mro__)


def _direct_slots(owner: torch.nn.Module, prefix: str, *, all_wgrad: bool = False) -> list[Slot]:
    slots = []
    for name, param in owner._parameters.items():
        if param is None:
            continue
        relname = f"{prefix}{name}"
        slots.append(Slot(owner, name, relname, all_wgrad or bool(_WGRAD_NAME.match(name))))
    return slots


def _container_spec(module: torch.nn.Module, path: str) -> TargetSpec | None:
    slots: list[Slot] = []
    for subpath, sub in module.named_modules():
        if sub is module or not has_fused_wgrad(sub):
            continue
        slots.extend(_direct_slots(sub, f"{subpath}."))
    if not slots:
        return None
    return TargetSpec(module, path, CONTAINER, slots, lenient=not _needs_main_grad_at_forward(module))


def _sequential_spec(module: torch.nn.Module, path: str) -> TargetSpec | None:
    slots: list[Slot] = []
    for subpath, sub in module.named_modules():
        if sub is not module and is_fused_op(sub):
            slots.extend(_direct_slots(sub, f"{subpath}."))
    return TargetSpec(module, path, OP_FUSER, slots) if slots else None


def _classify(module: torch.nn.Module, path: str) -> TargetSpec | None:
    """The spec for one module by the auto rules, or None when it is not a fused-wgrad target."""
    if is_fused_container(module):
        spec = _container_spec(module, path)
        if spec is not None:
            return spec
    if is_op_sequential(module):
        spec = _sequential_spec(module, path)
        if spec is not None:
            return spec
    if is_fused_op(module):
        return TargetSpec(module, path, OP_FUSER, _direct_slots(module, ""))
    if has_fused_wgrad(module):
        return TargetSpec(module, path, TE_MODULE, _direct_slots(module, ""))
    if is_megatron_fused_linear(module):
        return TargetSpec(module, path, MEGATRON_LINEAR, _direct_slots(module, ""))
    return None


def discover_auto(model: torch.nn.Module) -> list[TargetSpec]:
    """All fused-wgrad targets in `model`, each parameter covered once, outermost caller first."""
    named = list(model.named_modules())
    covered: set[int] = set()  # ids of modules whose parameters a chosen target already covers
    specs: list[TargetSpec] = []

    def take(spec: TargetSpec) -> None:
        specs.append(spec)
        covered.add(id(spec.module))
        covered.update(id(slot.owner) for slot in spec.slots)

    # 1. containers running fused ops outside the module tree
    for path, module in named:
        if id(module) not in covered and is_fused_container(module):
            spec = _container_spec(module, path)
            if spec is not None:
                take(spec)
    # 2. op-fuser Sequentials (outermost first: named_modules is pre-order) holding main_grad-accumulating ops
    for path, module in named:
        if id(module) not in covered and is_op_sequential(module):
            spec = _sequential_spec(module, path)
            if spec is not None:
                spec.slots = [s for s in spec.slots if id(s.owner) not in covered]
                if spec.slots:
                    take(spec)
    # 3. op-fuser ops called directly, TE modules, Megatron linears
    for path, module in named:
        if id(module) in covered:
            continue
        if is_fused_op(module):
            take(TargetSpec(module, path, OP_FUSER, _direct_slots(module, "")))
        elif has_fused_wgrad(module):
            take(TargetSpec(module, path, TE_MODULE, _direct_slots(module, "")))
        elif is_megatron_fused_linear(module):
            take(TargetSpec(module, path, MEGATRON_LINEAR, _direct_slots(module, "")))
    return [s for s in specs if s.slots]


def discover_explicit(
    model: torch.nn.Module, targets: Sequence[torch.nn.Module | str] | torch.nn.Module | str
) -> list[TargetSpec]:
    """Targets the user named: modules, or fnmatch patterns over qualified names (`*.experts`).

    A named module recognised by the auto rules gets that kind's coverage; any other module is covered as
    `explicit`: every parameter under it, all treated as fused-wgrad parameters. Either way a named target
    is strict: main_grad is exposed (fix) and required (check) at its forward, e.g. on `linear_fc1` whose
    pre-hooks a fused container replays.
    """
    if isinstance(targets, (torch.nn.Module, str)):
        targets = [targets]
    named = list(model.named_modules())
    path_of = {id(m): p for p, m in named}
    chosen: list[tuple[str, torch.nn.Module]] = []
    seen: set[int] = set()
    for target in targets:
        if isinstance(target, torch.nn.Module):
            matches = [(path_of.get(id(target), type(target).__name__), target)]
        elif isinstance(target, str):
            matches = [(p, m) for p, m in named if p == target or fnmatch.fnmatchcase(p, target)]
            if not matches:
                raise ValueError(f"target pattern {target!r} matches no module of the model")
        else:
            raise TypeError(f"targets must be modules or name patterns, got {type(target).__name__}")
        for path, module in matches:
            if id(module) not in seen:
                seen.add(id(module))
                chosen.append((path, module))
    specs = []
    for path, module in chosen:
        spec = _classify(module, path)
        if spec is None:
            slots = []
            for subpath, sub in module.named_modules():
                slots.extend(_direct_slots(sub, f"{subpath}." if subpath else "", all_wgrad=True))
            spec = TargetSpec(module, path, EXPLICIT, slots)
        spec.explicit = True
        if spec.slots:
            specs.append(spec)
    return specs


def discover(
    model: torch.nn.Module, targets: str | torch.nn.Module | Iterable[torch.nn.Module | str] = "auto"
) -> list[TargetSpec]:
    if isinstance(targets, str) and targets == "auto":
        return discover_auto(model)
    if not isinstance(targets, (str, torch.nn.Module)):
        targets = list(targets)
    return discover_explicit(model, targets)
