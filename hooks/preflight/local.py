"""Module-local finite differences: each weight's reported gradient against its own module's output.

The loss-level estimate (`run.py`) moves many weights and reads one number, the loss, whose rounding noise is
the whole forward's: on a bf16 GPT a weight that carries 1% of a probe's change could be off x2 unseen. Here,
inside the backward of a run the preflight makes anyway, a probed module is run again (forward only, no
graph) with its weights moved by +-h along a direction d; the change of its output dotted with the gradient
the backward handed that output (dy) is <true gradient through this module, d>, compared with
<reported gradient, d>. The noise is one module's output rounding, averaged over all its elements, and there
is no truncation error: the modules probed are linear in each of their parameters (Linear, LayerNormLinear,
GroupedLinear, Embedding, LayerNorm, RMSNorm, Megatron's parallel linears), and a central difference is exact
for anything up to quadratic (a product of two of a module's parameters). The error bar is computed from
the values themselves: the output's unit round-off times sqrt(sum dy^2 (y+^2 + y-^2) / 3).

What the comparison rests on, and how each is checked before a verdict:
- every use of the weight in the forward happens inside a probed call of a module that holds it (its own
  parameter, or a parameter passed to it as an argument, as Megatron passes a tied output weight): for the
  run the weight's class is a subclass whose __torch_function__ notes the functions it takes part in, and a
  weight used anywhere else (a skipped bias returned to the caller, a weight tied by hand with F.linear, ...)
  is not moved nor judged here (the loss-level estimate judges it);
- the call has exactly one output that needs a gradient, and it got one (a ZERO_PROBED module, below: each of
  its outputs that gets one is measured at it);
- the module's tensor inputs are unchanged when its output's gradient arrives (version counters), and it
  still holds the parameter objects it computed with (a sharding wrapper registers them per forward and
  backward: the weights are found at the call's pre-forward, after the wrapper's own hooks ran);
- the module is not computing in FP8 (TE's FP8 scaling state belongs to the forward) and the autocast state
  of the forward is restored for the reruns; no other process takes part (a rerun of a tensor-parallel
  module would be a collective only this rank calls).
dy itself is what autograd computed: a wrong input gradient upstream moves every weight below it together,
which the loss-level estimate sees.

Two uses (`run.py`): a screening of the probed modules holding a weight with a gradient (where the loss-level
probe ran first: one it bounds loosely), its weights moved together, each along the first micro-batch's
reported gradient at a step that gives it a comparable share of the module's change, on the second
micro-batch's own backward; and, during the sequence, each weight on its own: those of a set whose screening
deviates and those it bounds loosely, along the sum of the singles, in the last single's micro-batch against
that single's reported gradient; and weights whose reported gradient is zero on every micro-batch, along a
random direction in every micro-batch (the module's output must not move, else the gradient was lost).
A call whose moved sets each change its output affinely (a weight alone, a linear's weight and bias, a
LayerNormLinear's norm moved on even input columns and its linear weight on odd ones: no product of two moves)
is rerun once per set, against the forward's own output, where the bound on held outputs allows; else twice
(central differences, exact up to a product of two moves).

Zero gradients only, in torch's MultiheadAttention (`ZERO_PROBED`): not affine in its weights, so a nonzero
gradient is never compared there, but whether its output moves at all needs no linearity. Its out_proj child is
never called (the attention reads its weight and bias itself): those are the attention call's. Each rerun is
checked against the forward's own output first; with dropout while training each starts from the random state
the forward started from.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from maingrad.hooks.preflight.state import RngState, storage_address

# class names (on the module's class or a base) of modules whose output is affine in their parameters taken
# together, or a product of two such parts (a layer norm's weight times a linear weight), from these packages
# (a rerun computes with copies of the module's buffers: a BatchNorm's running statistics stay as they were;
# not EmbeddingBag: its "max" mode selects)
PROBED = frozenset(
    {
        "Linear",
        "LayerNormLinear",
        "GroupedLinear",
        "Embedding",
        "LayerNorm",
        "RMSNorm",
        "GroupNorm",
        "BatchNorm1d",
        "BatchNorm2d",
        "BatchNorm3d",
        "InstanceNorm1d",
        "InstanceNorm2d",
        "InstanceNorm3d",
        "Bilinear",
        "PReLU",
        "Conv1d",
        "Conv2d",
        "Conv3d",
        "ConvTranspose1d",
        "ConvTranspose2d",
        "ConvTranspose3d",
        "ColumnParallelLinear",
        "RowParallelLinear",
        "VocabParallelEmbedding",
    }
)
# torch modules whose output is not affine in their parameters (attention: a softmax of a product of two
# projections) and whose forward reads a child's parameters itself (MultiheadAttention's out_proj, never called):
# judged here only for weights whose reported gradient is zero on every micro-batch, where the question is
# whether the output moves at all (no linearity needed; a nonzero gradient is never compared here), each rerun
# first checked against the forward's own output. Where its branch rounds away in a residual sum (a layer
# scale of 1e-4 in bf16) the loss does not move bit for bit, but the output does and its gradient is not zero
ZERO_PROBED = frozenset({"MultiheadAttention"})
ORIGINS = ("torch.nn.", "transformer_engine.", "megatron.")
EPS_BIG = 2.0**6  # a weight's largest step relative to its norm (of a bias at zero: its floored norm)
EPS_FLOOR = 2.0**-7  # the smallest: a bf16 weight moved by less rounds back to itself almost everywhere
SIGMAS = 4.0  # an error bar is this many standard deviations of the output rounding
# per level of a reduction's tree, on the sum of its terms' magnitudes: <dy, y+ - y-> is summed in fp32, and
# so is the reported gradient over the same per-element terms (a bias: the sum of dy over the tokens), on
# both sides of the comparison. Where those terms cancel (a bias a normalisation after it removes), both
# sides are that rounding and their ratio says nothing
SUM_ROUNDING = 2 * 2.0**-24
CHUNK = 1 << 24  # elements of dy and y+- reduced at a time (bounds the fp32 scratch of a vocabulary's logits)
_NOT_TORCH = object()  # a forward hook called by hand, without the kwargs torch passes (`LocalProbe._post`)
EACH_MAX = 8  # zero-gradient weights of one module probed one by one up to this many, else together


def probed_kind(module: torch.nn.Module | None, declared: tuple[type, ...] = ()) -> str | None:
    """The probed class a module is (or derives from), when the forward it runs is one of those packages' own
    (a subclass that rewrites forward, say with noise, is not probed) and it holds no child that holds
    parameters. `declared`: the caller's own classes vouched for as such (preflight's `module_fd_classes`),
    probed on the same terms: the forward that runs is the declared class's own or one it inherits."""
    found = _probed(module, declared)
    return None if found is None else found[0]


def _probed(module: torch.nn.Module | None, declared: tuple[type, ...]) -> tuple[str, bool] | None:
    """(`probed_kind`, whether by a declared class)."""
    if module is None:
        return None
    found = None
    mro = type(module).__mro__
    defining = next((c for c in mro if "forward" in vars(c)), None)
    for cls in mro:
        if cls in declared:
            if defining is not None and defining in cls.__mro__:
                found = (cls.__name__, True)
            break
        if cls.__name__ in PROBED and cls.__module__.startswith(ORIGINS):
            if defining is not None and defining.__module__.startswith(ORIGINS):
                found = (cls.__name__, False)
            break
    if found is None or "forward" in vars(module) or holds_parameter_children(module):
        return None
    return found


def zero_probed(module: torch.nn.Module | None) -> str | None:
    """The ZERO_PROBED class a module is, when the forward it runs is torch's own: its weights whose reported
    gradient is zero are judged on its output. (Its dropout draws from the default generators: their states
    are taken as its forward starts and set again for each rerun, `draws_randomly`.)"""
    if module is None or "forward" in vars(module):
        return None
    mro = type(module).__mro__
    defining = next((c for c in mro if "forward" in vars(c)), None)
    cls = next((c for c in mro if c.__name__ in ZERO_PROBED and c.__module__.startswith("torch.nn.")), None)
    if cls is None or defining is None or defining is not cls:
        return None
    return cls.__name__


def draws_randomly(module: torch.nn.Module) -> bool:
    """A ZERO_PROBED module's forward draws random numbers (dropout while training)."""
    return module.training and float(getattr(module, "dropout", 0.0) or 0.0) > 0.0


# the devices whose generators `RngState` takes (host tensors, no device synchronisation)
SNAPSHOT_DEVICES = ("cpu", "cuda")


def holds_parameter_children(module: torch.nn.Module) -> bool:
    """A child of the module holds parameters: its forward is not the module's alone (never probed)."""
    return any(p is not None for child in module.children() for p in child.parameters())


def _moved(
    start: torch.Tensor, direction: torch.Tensor, h: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """start + h x direction in start's dtype: one fused add, computed in the wider of the two dtypes (fp32 for
    a half-precision weight moved along an fp32 direction) and rounded once on the store. The hook's move and
    the prediction after the run both come from here, so they agree bit for bit."""
    if out is None:
        out = torch.empty_like(start)
    return torch.add(start, direction, alpha=h, out=out)


def move_into(dst: torch.Tensor, start: torch.Tensor, direction: torch.Tensor, h: float) -> None:
    """dst = start + h x direction (see `_moved`): no temporary, whatever the dtypes."""
    _moved(start.reshape(-1), direction.reshape(-1), h, out=dst.view(-1))


@dataclass
class Move:
    """How one weight moves: along `direction` (flat, any float dtype) by h, or along a seeded random unit
    direction (direction None; its prediction is zero: the reported gradient is)."""

    h: float
    direction: torch.Tensor | None = None
    seed: int = 0
    # the weights of one call that share a label move together (one set); an empty label: alone
    label: str = "set"
    # moved only in the backward of this micro-batch (an index into the run's batches); None: in every one
    only: int | None = None
    # (width, parity): moved only where the index along the last dimension (the flat index modulo width) has
    # this parity (`column_moves`); None: everywhere
    columns: tuple[int, int] | None = None

    def along(self, t: torch.Tensor) -> torch.Tensor:
        if self.direction is not None:
            d = self.direction
        else:
            gen = torch.Generator(device=t.device)
            gen.manual_seed(self.seed)
            r = torch.randn(t.numel(), generator=gen, device=t.device, dtype=torch.float32)
            d = r / max(math.sqrt(t.numel()), 1.0)
        if self.columns is None:
            return d
        width, parity = self.columns
        masked = d.reshape(-1).clone()
        masked.view(-1, width)[:, 1 - parity :: 2].zero_()
        return masked


# classes (on the module's class or a base, as in PROBED) whose output multiplies two of their parameters: a
# layer norm's weight or bias times the linear weight after it. Moved together, their change has a product
# term; with the norm's moves on even input columns and the linear weight's on odd ones (`column_moves`) no
# product has two moved factors, and the output is affine in the moves taken together
PRODUCTS = frozenset({"LayerNormLinear"})
NORM_PREFIX = "layer_norm_"  # a PRODUCTS class's norm parameters (Transformer Engine's names)
COLUMN_PARITY = {"norm": 0, "gemm": 1}


def product_role(name: str, t: torch.Tensor) -> str:
    """A PRODUCTS module's parameter, by its attribute name and shape: "norm" (the layer norm's weight or bias,
    one value per input column), "gemm" (a linear weight, its last dimension the input columns) or "bias"
    (added to the output: a factor of nothing)."""
    if name.startswith(NORM_PREFIX):
        return "norm"
    return "gemm" if t.dim() >= 2 else "bias"


def column_moves(roles: dict[int, tuple[str, torch.Tensor]]) -> dict[int, tuple[int, int]]:
    """For the parameters of one PRODUCTS call moved together (entry index -> (role, tensor)): the `Move.columns`
    of each norm and linear weight, so that no input column moves in both; empty where nothing multiplies (no
    norm or no linear weight moves) or the shapes do not line up (then the set is measured with central
    differences, which are exact for a product of two moves)."""
    norm = {i: t for i, (role, t) in roles.items() if role == "norm"}
    gemm = {i: t for i, (role, t) in roles.items() if role == "gemm"}
    if not norm or not gemm:
        return {}
    widths = {t.shape[-1] for t in gemm.values()} | {t.numel() for t in norm.values()}
    if len(widths) != 1 or any(t.dim() != 1 for t in norm.values()):
        return {}
    width = widths.pop()
    if width < 2:
        return {}
    return {
        **{i: (width, COLUMN_PARITY["norm"]) for i in norm},
        **{i: (width, COLUMN_PARITY["gemm"]) for i in gemm},
    }


@dataclass
class Sums:
    """What the reruns measured for one weight or one set of weights moved together (device scalars; the set is
    the key it is kept under)."""

    measured: list[torch.Tensor] = field(default_factory=list)  # <dy, y(+h) - y(-h)> per call
    variance: list[torch.Tensor] = field(default_factory=list)  # of the output rounding in it
    # the rounding of the sum itself (and of the reported gradient's, over the same terms): SUM_ROUNDING x
    # log2(terms) x sum |dy (y+ - y-)| per call
    summing: list[torch.Tensor] = field(default_factory=list)
    # 2: central differences; 1: forward differences against the forward's own output (`one_sided`)
    sides: set[int] = field(default_factory=set)
    # per call (and output): the micro-batch it ran in (`LocalProbe.current`), which a zero gradient is judged by
    batches: list[int | None] = field(default_factory=list)
    # a declared class's call (`probed_kind`) or a ZERO_PROBED one: <dy, y(w) - y> of a rerun with nothing
    # moved against the forward's own output y, its variance and rounding bound, per call: beyond its error bar
    # the rerun does not compute what the forward did (randomness or state the class was vouched not to have)
    reproduced: list[torch.Tensor] = field(default_factory=list)


def _held_bytes(t: torch.Tensor) -> int:
    """The bytes a reference to `t` keeps alive: its storage's (a view keeps all of it), or its elements' where
    a tensor subclass has no storage of its own."""
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return t.numel() * t.element_size()


def leaves(obj: object) -> list[object]:
    """The leaves of nested tuples, lists and dicts (what a module's arguments and outputs are made of), in
    order: a plain walk, without pytree's bookkeeping (it runs for every probed call and every use of a
    watched weight)."""
    if isinstance(obj, (tuple, list)):
        return [x for item in obj for x in leaves(item)]
    if isinstance(obj, dict):
        return [x for item in obj.values() for x in leaves(item)]
    return [obj]


@dataclass(eq=False)
class _Call:
    module: torch.nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    accounted: list[tuple[int, torch.Tensor]]  # (entry index, the tensor the module computes with)
    owned: list[tuple[str, torch.Tensor]]  # the module's own watched parameters at the forward, by name
    position: int  # of the output in the flattened outputs
    versions: list[tuple[torch.Tensor, int]]
    autocast: tuple[str, bool, torch.dtype] | None
    held: tuple[torch.Tensor, int] | None = None  # the forward's output and its version (`one_sided`)
    # what holding it counts against the bound (`LocalProbe.hold_bytes`), taken at the forward: the same bytes
    # are given back at its release
    held_bytes: int = 0
    saves: int = 0  # the reruns holding its output saves (its sets moved together)
    alone: list[int] = field(default_factory=list)  # its measured weights (not used outside the call)
    # a class of the caller's (`probed_kind`) or a ZERO_PROBED one: the forward's output and its version,
    # which a rerun with nothing moved must reproduce
    original: tuple[torch.Tensor, int] | None = None
    # the random state its forward started from (a ZERO_PROBED call with dropout): each rerun starts from it
    random: RngState | None = None
    # a ZERO_PROBED call's other outputs that need a gradient (MultiheadAttention's attention weights), by
    # position: the forward's value and version of each, which the reruns at its gradient must reproduce
    others: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)
    fired: int = 0  # outputs whose gradient came (each measured at its own)


# what a weight is asked without computing with it: not a use
METADATA = frozenset(
    {
        "shape", "dtype", "device", "requires_grad", "is_cuda", "ndim", "layout", "grad", "grad_fn", "is_leaf",
        "names", "is_sparse", "is_quantized", "is_meta", "itemsize", "nbytes", "_version", "size", "dim",
        "numel", "stride", "is_contiguous", "data_ptr", "element_size", "get_device", "__len__", "_is_view",
    }
)  # fmt: skip


def _function_name(func: object) -> str:
    """A torch function's name; for an attribute read, the attribute's (`Tensor.shape.__get__` -> "shape")."""
    name = getattr(func, "__name__", None) or str(func)
    if name == "__get__":
        owner = getattr(func, "__self__", None)
        name = getattr(owner, "__name__", None) or name
    return name


_ACTIVE: list[LocalProbe] = []  # the probe whose run is in progress (one at a time)
_WATCHED: dict[type, type] = {}


def _watch(
    cls: type,
    func: Callable[..., Any],
    types: Any,  # noqa: ANN401 - torch's signature
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
) -> Any:  # noqa: ANN401
    """__torch_function__ of a watched weight: note a use in the forward outside a probed call that accounts
    for it, then run the function as a plain tensor would (results are not the subclass)."""
    kwargs = kwargs or {}
    probe = _ACTIVE[-1] if _ACTIVE else None
    if (
        probe is not None
        and not probe.rerunning
        and getattr(func, "__name__", "")
        not in ("__set__", "__delete__")  # a wrapper rebinding .data or .grad
        and not torch.compiler.is_compiling()
        and torch._C._current_autograd_node() is None
    ):
        for a in args:
            if isinstance(a, (tuple, list)):
                for b in a:
                    probe.note_use(b, func)
            else:
                probe.note_use(a, func)
        for a in kwargs.values():
            probe.note_use(a, func)
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _watched(base: type) -> type:
    """A subclass of the weight's class whose only difference is `_watch`: only the functions a watched weight
    takes part in pay for the watching (a torch-function mode would intercept every operation of the
    forward)."""
    if base not in _WATCHED:
        _WATCHED[base] = type(f"Watched{base.__name__}", (base,), {"__torch_function__": classmethod(_watch)})
    return _WATCHED[base]


class LocalProbe:
    """Hooks for one run: reruns of the probed modules inside its backward, per `plan` (entry index -> Move:
    a call's planned weights with one label move together, those with an empty label alone). `weights` maps a
    module parameter's id to its entry index; only planned entries move."""

    def __init__(
        self,
        model: torch.nn.Module,
        params: dict[int, torch.Tensor],
        plan: dict[int, Move],
        one_sided: bool = False,
        declared: tuple[type, ...] = (),
        hold_bytes: int | None = None,
        one_sided_unpinned: bool = True,
    ) -> None:
        self.model = model
        self.declared = declared  # the caller's own probed classes (`probed_kind`)
        # a set of weights whose moves change the call's output affinely (`_affine`: a weight alone, a linear's
        # weight and bias, a LayerNormLinear's moves on complementary columns) is measured against the output
        # its call's forward computed (kept until its gradient comes, while nothing writes it in place): one
        # rerun per set instead of two, and y(w + h d) - y(w) is exact up to rounding
        self.one_sided = one_sided
        # (`_affine`) off where the run has several micro-batches and a weight may move in each of them
        self.one_sided_unpinned = one_sided_unpinned
        # the bytes of forward outputs held at once for that, at most (None: no bound). A held output lives
        # from its call's forward to its gradient, where training would often have freed it: on a 541M GPT
        # those of 16 linears grew the call's peak with the micro-batch's tokens (0.57x the gradients' bytes
        # above a step's peak at 2,048 tokens, 1.03x at 16,384). A call past the bound is measured with
        # central differences (a second rerun) instead
        self.hold_bytes = hold_bytes
        self.holding = 0  # the bytes of the outputs held now
        self.held_calls = 0  # calls whose output was held, and those the bound left central
        self.unheld_calls = 0
        # weights with a call the bound left central: all their calls are measured so (one kind of difference
        # per weight; the judge does not mix them)
        self.unheld: set[int] = set()
        self._holders: list[_Call] = []  # the calls whose output may be held now (`_make_room`)
        self.params = params  # entry index -> the module's parameter
        self.weights = {id(t): i for i, t in params.items()}
        self.plan = plan
        self.escaped: dict[int, str] = {}  # entries used outside a probed call that accounts for them: how
        self.failed: set[int] = set()  # entries one of whose calls could not be measured
        # entries whose module's pre-forward hooks were called by hand (a fused implementation computes with
        # them in kernels the watch may not see): their module's own call, if any, is not all of their use
        self.bypassed: set[int] = set()
        # entries with a gradient that a ZERO_PROBED module's call reads: by the module's class (not judged here)
        self.nonaffine: dict[int, str] = {}
        # the modules watched as ZERO_PROBED (`watching`), by id: their paths in the model
        self.zero_only: dict[int, str] = {}
        # entries measured on a ZERO_PROBED module's output, not their own module's (out_proj's weight): its path
        self.measured_on: dict[int, str] = {}
        self.sums: dict[tuple[int, ...], Sums] = {}
        self.rerunning = False
        self.active: dict[int, int] = {}  # id(weight) -> probed calls on the stack accounting for it
        self.reruns = 0
        self.current: int | None = None  # the micro-batch running now (set by the caller)
        self.errors: list[str] = []  # the first few reruns that raised (their weights are not judged here)
        self._pending: dict[int, _Call] = {}  # by id: calls whose output's gradient has not come yet
        # calls whose forward is running: (module, argument leaves, accounted, owned, the random state it
        # started from where a rerun must draw the same numbers), innermost last
        self._calls: list[
            tuple[torch.nn.Module, list[object], list[Any], list[tuple[str, torch.Tensor]], RngState | None]
        ] = []

    # -- the forward ---------------------------------------------------------------------------------------
    def note_use(self, a: object, func: object) -> None:
        if isinstance(a, torch.Tensor):
            i = self.weights.get(id(a))
            if i is not None and not self.active.get(id(a)) and i not in self.escaped:
                how = _function_name(func)
                if how not in METADATA:
                    self.escaped[i] = how

    def _accounted(self, owned: list[tuple[str, torch.Tensor]], inputs: list[object]) -> list[Any]:
        """(entry index, tensor) of the watched weights a call holds: its own (`owned`), and those among its
        inputs (the leaves of its arguments)."""
        found: dict[int, tuple[int, torch.Tensor]] = {id(p): (self.weights[id(p)], p) for _, p in owned}
        for a in inputs:
            if isinstance(a, torch.Tensor) and id(a) in self.weights:
                found[id(a)] = (self.weights[id(a)], a)
        return list(found.values())

    def _pre(
        self,
        module: torch.nn.Module,
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        # torch hands a hook registered with kwargs both; code that calls a module's pre-hooks itself is not a
        # call of that module (megatron-core's fused GroupedMLP calls `hook(submodule, None)`, its CUDA graphs
        # `hook(module)`, then compute with the weights outside the module's call): nothing to pair with a
        # post-hook, and the module's weights are not judged here (TE's fused kernels use them unseen)
        if self.rerunning:
            return
        if args is None or kwargs is None:
            for p in module._parameters.values():
                i = self.weights.get(id(p)) if p is not None else None
                if i is not None and i in self.plan:
                    self.bypassed.add(i)
            return
        # what the call computes with, as its forward starts: a sharding wrapper's own hooks (FSDP2's, which
        # run first) register the unsharded parameters before it and may put the shards back after it
        # (a ZERO_PROBED module reads its children's parameters itself: MultiheadAttention's out_proj is never
        # called, its weight and bias are used inside this call)
        named = module.named_parameters() if id(module) in self.zero_only else module._parameters.items()
        owned: list[tuple[str, torch.Tensor]] = [
            (name, p) for name, p in named if p is not None and id(p) in self.weights
        ]
        flat = leaves((args, kwargs))
        accounted = self._accounted(owned, flat)
        for _, t in accounted:
            self.active[id(t)] = self.active.get(id(t), 0) + 1
        # the random state a rerun must start from, taken only for a call with zero gradients to measure
        drawn = None
        if (
            id(module) in self.zero_only
            and owned
            and owned[0][1].device.type in SNAPSHOT_DEVICES
            and draws_randomly(module)
            and any(i in self.plan and self.plan[i].direction is None for i, _ in accounted)
        ):
            drawn = RngState()
        self._calls.append((module, flat, accounted, owned, drawn))

    def _post(
        self,
        module: torch.nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any = _NOT_TORCH,  # noqa: ANN401
    ) -> None:
        if self.rerunning or output is _NOT_TORCH:  # called by hand as hook(module, args, output): see `_pre`
            return
        # a call that started before the hooks, or one whose pre-hook was called by hand out of order (left
        # open: abandoned when the watch ends)
        if not self._calls or self._calls[-1][0] is not module:
            return
        _, flat, accounted, owned, drawn = self._calls.pop()
        for _, t in accounted:
            self.active[id(t)] = max(self.active.get(id(t), 1) - 1, 0)
        planned = [
            (i, t) for i, t in accounted if i in self.plan and self.plan[i].only in (None, self.current)
        ]
        if not planned:
            return
        zero_only = id(module) in self.zero_only
        if zero_only:  # not affine in its weights: only its zero gradients' random moves are measured
            for i, _ in planned:
                if self.plan[i].direction is not None:
                    self.nonaffine.setdefault(i, type(module).__name__)
            planned = [(i, t) for i, t in planned if self.plan[i].direction is None]
            if not planned:
                return
        outputs = leaves(output)
        outs = [
            k
            for k, o in enumerate(outputs)
            if isinstance(o, torch.Tensor) and o.requires_grad and id(o) not in self.weights
        ]
        for o in outputs:  # a weight handed back to the caller is used outside (a skipped bias)
            if isinstance(o, torch.Tensor) and id(o) in self.weights:
                self.escaped.setdefault(self.weights[id(o)], f"returned by {type(module).__name__}")
        # MultiheadAttention also returns its attention weights by default (need_weights=True), which need a
        # gradient too: each output that gets one is measured at its gradient, <dy_k, y_k(+h) - y_k(-h)>, and the
        # judge sums over them as over calls (the derivative through the call is the sum over its outputs); one
        # that gets none adds nothing. The call is kept until the run ends (no output's gradient says the others
        # will not come)
        siblings = outs[1:] if zero_only else []
        if (
            len(outs) != 1 + len(siblings)
            or (zero_only and drawn is None and draws_randomly(module))  # a generator not known here
            or getattr(module, "fp8", False) is True
            or not torch.is_grad_enabled()
        ):
            self.failed.update(i for i, _ in planned)
            return
        inputs = [a for a in flat if isinstance(a, torch.Tensor)]
        out = cast(torch.Tensor, outputs[outs[0]])
        device = out.device.type
        autocast = None
        if torch.is_autocast_enabled(device):
            autocast = (device, True, torch.get_autocast_dtype(device))
        alone = [i for i, _ in planned if i not in self.escaped]
        held, held_bytes = None, 0
        sets: dict[str, list[int]] = {}  # the call's measured weights by the set they move with
        for i in alone:
            sets.setdefault(self._set_of(i), []).append(i)
        saves = len(sets)  # reruns a held output saves (one per set)
        if self.one_sided and alone and not zero_only and self._affine(module, sets, owned):
            size = _held_bytes(out)
            if self._make_room(size, saves):
                held, held_bytes = (out, out._version), size
                self.holding += size
                self.held_calls += 1
            else:
                self.unheld_calls += 1
                self.unheld.update(alone)
        # a declared class, or a ZERO_PROBED one (not affine: no exact finite difference to lean on), is held
        # to its forward's output
        kind = _probed(module, self.declared) if self.declared else None
        checked = zero_only or (kind is not None and kind[1])
        call = _Call(
            module=module,
            args=args,
            kwargs=kwargs,
            accounted=planned,
            owned=owned,
            position=outs[0],
            versions=[(a, a._version) for a in inputs],
            autocast=autocast,
            held=held,
            held_bytes=held_bytes,
            saves=saves,
            alone=alone,
            original=(out, out._version) if checked else None,
            random=drawn,
            others={
                k: (cast(torch.Tensor, outputs[k]), cast(torch.Tensor, outputs[k])._version) for k in siblings
            },
        )
        self._pending[id(call)] = call
        if held is not None:
            self._holders.append(call)
        out.register_hook(self._on_grad(call))
        for k in siblings:
            cast(torch.Tensor, outputs[k]).register_hook(self._on_grad(call, k))

    def _set_of(self, i: int) -> str:
        """The set weight i moves with in its call: its plan's label, or its own where the label is empty. The
        forward (which outputs to hold, for how many reruns) and the gradient (what each rerun moves) group a
        call's weights by it."""
        return self.plan[i].label or f"alone {i}"

    def _make_room(self, size: int, saves: int) -> bool:
        """Whether an output of `size` bytes whose hold saves `saves` reruns is held: where it does not fit in
        `hold_bytes`, outputs held for fewer saved reruns per byte (a LayerNormLinear's wide output, against a
        projection's narrow one) are dropped for it, largest first, if that makes room (their calls then
        measured with central differences, as every call of their weights). A call is measured when its
        output's gradient comes, after its forward, and then lets its output go: one still held has not been
        measured yet."""
        if self.hold_bytes is None or self.holding + size <= self.hold_bytes:
            return True
        self._holders = [c for c in self._holders if c.held is not None]
        density = size / saves
        worse = sorted(
            (c for c in self._holders if c.held_bytes / max(c.saves, 1) > density),
            key=lambda c: c.held_bytes / max(c.saves, 1),
            reverse=True,
        )
        freed, dropped = 0, []
        for c in worse:
            if self.holding - freed + size <= self.hold_bytes:
                break
            dropped.append(c)
            freed += c.held_bytes
        if self.holding - freed + size > self.hold_bytes:
            return False
        for c in dropped:
            self._release(c)
            self.held_calls -= 1
            self.unheld_calls += 1
            self.unheld.update(c.alone)
        return True

    def _affine(
        self, module: torch.nn.Module, sets: dict[str, list[int]], owned: list[tuple[str, torch.Tensor]]
    ) -> bool:
        """Each set of the call's weights that moves together (`sets`: by label; an empty label: alone) changes its
        output affinely, so a forward difference against the forward's own output is exact: a weight alone, or
        a known class's weights (not a declared one: vouched linear in each, not in all) that multiply nothing
        moved with them (`PRODUCTS`: the norm's and the linear weight's moves on complementary columns). A
        weight moved along a direction in every micro-batch of a run of several (`one_sided_unpinned` off) is
        not: the hold bound could leave a later call central after an earlier one was measured one-sided."""
        if not self.one_sided_unpinned and any(
            self.plan[i].direction is not None and self.plan[i].only is None
            for members in sets.values()
            for i in members
        ):
            return False
        if all(len(members) == 1 for members in sets.values()):
            return True
        kind = _probed(module, self.declared)
        if kind is None or kind[1]:
            return False
        if kind[0] not in PRODUCTS:
            return True
        own = {self.weights[id(t)]: (name, t) for name, t in owned}  # entry index -> its name and tensor
        for members in sets.values():
            if any(i not in own for i in members):
                return False
            roles = {i: (product_role(*own[i]), own[i][1]) for i in members}
            columns = column_moves(roles)
            if any(roles[i][0] != "bias" and self.plan[i].columns != columns.get(i) for i in members):
                return False
            if not columns and len({role for role, _ in roles.values()} - {"bias"}) > 1:
                return False
        return True

    def _abandon(self) -> None:
        """Close the calls still open when the watch ends: their pre-forward hook ran but no post-forward hook
        closed them (a fused implementation that calls a submodule's hooks itself, with kwargs, out of order
        or without the post-hook): their weights are not judged here."""
        for _, _, accounted, _, _ in self._calls:
            self.failed.update(i for i, _ in accounted if i in self.plan)
        self._calls = []

    # -- the backward --------------------------------------------------------------------------------------
    def _on_grad(self, call: _Call, position: int | None = None) -> Callable[[torch.Tensor], None]:
        """The hook on the call's output at `position` (None: its first, `call.position`)."""

        def hook(dy: torch.Tensor) -> None:
            call.fired += 1
            try:
                self._measure(call, dy, position)
            except Exception as exc:  # noqa: BLE001 - a module that cannot be rerun is not judged here
                self.failed.update(i for i, _ in call.accounted)
                if len(self.errors) < 3:
                    self.errors.append(f"{type(call.module).__name__}: {type(exc).__name__}: {exc}"[:300])
            finally:
                if not call.others:  # (a call with several outputs is kept until the watch ends)
                    self._pending.pop(id(call), None)
                    self._release(call)
                    call.args, call.kwargs, call.original, call.versions = (), {}, None, []

        return hook

    def _release(self, call: _Call) -> None:
        """Drop the call's held output (and its bytes from the bound)."""
        self.holding -= call.held_bytes
        call.held, call.held_bytes = None, 0

    def _measure(self, call: _Call, dy: torch.Tensor, position: int | None = None) -> None:
        """The reruns at the gradient `dy` of the call's output at `position` (None: `call.position`)."""
        at = call.position if position is None else position
        # its inputs as at the forward, and the parameters it computes with the same objects (a sharding
        # wrapper may have swapped in another tensor since: a rerun would not move what it computes with)
        if any(a._version != v for a, v in call.versions) or any(
            _parameter(call.module, name) is not p for name, p in call.owned
        ):
            self.failed.update(i for i, _ in call.accounted)
            return
        reproduced: list[torch.Tensor] = []
        original = call.original if at == call.position else call.others.get(at)
        if original is not None:
            out, version = original
            if out._version != version:  # written in place since: nothing to check the rerun against
                self.failed.update(i for i, _ in call.accounted)
                return
            reproduced = list(_compare(self._forwards(call, [], (0.0,), at)[0], out.detach(), dy))
        sets: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for i, t in call.accounted:
            if i in self.escaped:  # its other use is not measured here: it stays where it is
                continue
            sets.setdefault(self._set_of(i), []).append((i, t))
        for members in sets.values():
            key = tuple(sorted(i for i, _ in members))
            held = call.held
            base = (
                held[0]
                if held is not None
                and held[0]._version == held[1]
                and not any(i in self.unheld for i, _ in members)
                else None
            )
            value, var, summing = self._rerun(call, members, dy, base, at)
            sums = self.sums.setdefault(key, Sums())
            sums.measured.append(value)
            sums.variance.append(var)
            sums.summing.append(summing)
            sums.sides.add(1 if base is not None else 2)
            sums.batches.append(self.current)
            sums.reproduced += reproduced
            if id(call.module) in self.zero_only:
                self.measured_on.update((i, self.zero_only[id(call.module)]) for i, _ in members)

    def _rerun(
        self,
        call: _Call,
        members: list[tuple[int, torch.Tensor]],
        dy: torch.Tensor,
        base: torch.Tensor | None = None,
        position: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """<dy, y(w + h d) - y(w - h d)>, or <dy, y(w + h d) - base> where `base` is the forward's own output;
        the variance of its output rounding; and the bound on the rounding of that sum and of the reported
        gradient's own reduction over the same terms (`SUM_ROUNDING`). y: the output at `position`."""
        outs = self._forwards(call, members, (1.0,) if base is not None else (1.0, -1.0), position)
        plus, minus = outs if base is None else (outs[0], base.detach())
        return _compare(plus, minus, dy)

    def _forwards(
        self,
        call: _Call,
        members: list[tuple[int, torch.Tensor]],
        signs: tuple[float, ...],
        position: int | None = None,
    ) -> list[torch.Tensor]:
        """The call's output (at `position`; None: `call.position`) recomputed with its `members` moved by
        sign x h along their directions, per sign (no members: as the forward computed it). The weights restored
        bit for bit (through .data: their version counters, which autograd checks, do not move)."""
        starts = [t.data.clone() for _, t in members]
        directions = [self.plan[i].along(t) for i, t in members]  # a random one drawn once for both signs
        outs: list[torch.Tensor] = []
        ctx: Any = (
            torch.autocast(*call.autocast[:1], dtype=call.autocast[2]) if call.autocast else nullcontext()
        )
        # the reruns compute with copies of the module's own buffers: the originals may be saved for the
        # backward that has not run yet (a BatchNorm's running statistics, which its training-mode forward
        # updates in place and its output does not read), so they must not change, not even their version
        # (not a buffer that holds a parameter's storage: the moved weights must reach the forward through it)
        originals = dict(call.module._buffers)
        weights = {storage_address(p) for p in call.module._parameters.values() if p is not None} - {None}
        # a forward that draws (dropout) draws the forward's numbers again from the state it started from; the
        # state the backward has now is set back after
        now = RngState() if call.random is not None else None
        self.rerunning = True
        try:
            for k, b in originals.items():
                if b is not None and storage_address(b) not in weights:
                    call.module._buffers[k] = b.detach().clone()
            with torch.no_grad(), ctx:
                for sign in signs:
                    for (i, t), start, d in zip(members, starts, directions, strict=True):
                        move_into(t.data, start, d, sign * self.plan[i].h)
                    if call.random is not None:
                        call.random.apply()
                    out = call.module.forward(*call.args, **call.kwargs)
                    self.reruns += 1
                    at = call.position if position is None else position
                    outs.append(cast(torch.Tensor, leaves(out)[at]).detach())
                    del out
        finally:
            for (_, t), start in zip(members, starts, strict=True):
                t.data.copy_(start)
            call.module._buffers.update(originals)
            if now is not None:
                now.apply()
            self.rerunning = False
        return outs

    # -- installing --------------------------------------------------------------------------------------------
    @contextmanager
    def watching(self) -> Iterator[LocalProbe]:
        handles = []
        for path, module in self.model.named_modules():
            if probed_kind(module, self.declared) is None:
                if zero_probed(module) is None:
                    continue
                self.zero_only[id(module)] = path
            handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            handles.append(module.register_forward_hook(self._post, with_kwargs=True, always_call=True))
        swapped: list[tuple[torch.Tensor, type]] = []
        for i in self.plan:
            t = self.params[i]
            if type(t) is torch.nn.Parameter:
                swapped.append((t, type(t)))
                t.__class__ = _watched(type(t))
            else:  # a tensor subclass with its own torch functions: its uses cannot be watched
                self.failed.add(i)
        _ACTIVE.append(self)
        try:
            yield self
        finally:
            _ACTIVE.remove(self)
            for t, cls in swapped:
                t.__class__ = cls
            for h in handles:
                h.remove()
            for call in self._pending.values():  # an output whose gradient never came: not judged
                if not call.fired:  # (a call with several outputs: one at least must have got a gradient)
                    self.failed.update(i for i, _ in call.accounted)
                self._release(call)
                call.args, call.kwargs, call.original, call.others, call.versions = (), {}, None, {}, []
            self._pending = {}
            # (a call holds tensors whose backward hooks hold this probe: a cycle through autograd's C++ nodes,
            # which the garbage collector does not see; its model would outlive the call)
            self._holders = []
            self._abandon()
            self.active = {}

    def complete(self, i: int) -> bool:
        return (
            i not in self.escaped
            and i not in self.failed
            and i not in self.bypassed
            and i not in self.nonaffine
        )


def _parameter(module: torch.nn.Module, name: str) -> torch.Tensor | None:
    """The parameter a module holds under a (dotted) name now, or None."""
    *path, leaf = name.split(".")
    owner: torch.nn.Module | None = module
    for part in path:
        owner = owner._modules.get(part) if owner is not None else None
    return owner._parameters.get(leaf) if owner is not None else None


def _compare(
    plus: torch.Tensor, minus: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """<dy, plus - minus> (fp64 device scalars), the variance of the output rounding in it and the bound on the
    rounding of that sum (`LocalProbe._rerun`)."""
    u = float(torch.finfo(plus.dtype).eps) / 2 if plus.dtype.is_floating_point else 0.0
    g = dy.detach().reshape(-1)
    p, m = plus.reshape(-1), minus.reshape(-1)
    value: torch.Tensor | None = None
    var: torch.Tensor | None = None
    spread: torch.Tensor | None = None
    # an output of one dtype of at most fp32's precision: each operand is widened to fp32 first, where an
    # operation on two dtypes would take the GPU's casting path (on the H200 a quarter or less of the bandwidth
    # the same operation gets on one dtype); the same numbers either way
    narrow = p.dtype == m.dtype and p.dtype in (torch.float32, torch.bfloat16, torch.float16)
    for a in range(0, g.numel(), CHUNK):
        # in fp32: y+ - y- is exact there for a half-precision output, and the dot's rounding is 2^-24
        gg = g[a : a + CHUNK].float()  # (dy itself where it is fp32: only read)
        pp, mm = p[a : a + CHUNK], m[a : a + CHUNK]
        diff = pp.to(torch.float32, copy=True)  # its own copy: y+ - y- is written into it
        if narrow:
            mm = mm.float()
            pp = diff
        gp = gg * pp  # fp32 products: the error bar's sum of dy^2 y^2
        part_var = torch.dot(gp, gp)
        del gp
        gm = gg * mm
        part_var = part_var + torch.dot(gm, gm)
        del gm
        diff.sub_(mm)
        del pp, mm
        part = torch.dot(gg, diff)
        part_spread = torch.dot(gg.abs(), diff.abs_())  # sum |dy (y+ - y-)|
        del diff, gg
        value = part if value is None else value + part
        var = part_var if var is None else var + part_var
        spread = part_spread if spread is None else spread + part_spread
    if value is None or var is None or spread is None:
        zero = torch.zeros((), device=g.device, dtype=torch.float64)
        return zero, zero, zero
    value, var = value.double(), var.double()
    summing = spread.double() * (SUM_ROUNDING * math.log2(max(g.numel(), 2)))
    return value, var * (u * u / 3), summing


def prediction(start: torch.Tensor, move: Move, grad: torch.Tensor, sides: int = 2) -> torch.Tensor:
    """<reported gradient, the weight's move from -h to +h> (from the start to +h: `sides` 1) with the moves
    rounded exactly as the hook rounded them (an fp64 scalar on the device; fp32 scratch of CHUNK elements)."""
    d, s, g = move.along(start).reshape(-1), start.reshape(-1), grad.reshape(-1)
    total: torch.Tensor | None = None
    for a in range(0, s.numel(), CHUNK):
        base, step = s[a : a + CHUNK], d[a : a + CHUNK]
        low = base if sides == 1 else _moved(base, step, -move.h)
        high = _moved(base, step, move.h).float()
        # exact in fp32 (a narrow low widened first: one dtype, see `_compare`)
        diff = high.sub_(low.float() if low.dtype in (torch.bfloat16, torch.float16) else low)
        part = torch.dot(diff, g[a : a + CHUNK].float()).double()
        total = part if total is None else total + part
    return total if total is not None else torch.zeros((), device=s.device, dtype=torch.float64)


@dataclass
class LocalVerdict:
    """The host-side comparison of one weight or set: reported / measured, its error bar, the verdict."""

    indexes: tuple[int, ...]
    predicted: float
    measured: float
    sigma: float
    ratio: float | None
    error: float | None
    # ok | deviates | lost | wrong | scaled | unused | moves | unknown (unused: no effect either way)
    verdict: str


def reproduces(measured: float, variance: float, summing: float) -> bool:
    """A rerun with nothing moved against the forward's own output (`_compare`): the same within the output's
    rounding error bar (as `judge` reads a change: SIGMAS standard deviations and the sum's rounding)."""
    return math.isfinite(measured) and abs(measured) <= SIGMAS * math.sqrt(max(variance, 0.0)) + summing


def judge(
    indexes: tuple[int, ...],
    predicted: float,
    measured: float,
    variance: float,
    floor: float,
    zero: bool,
    summing: float = 0.0,
) -> LocalVerdict:
    """`floor`: the relative deviation a correct gradient may show beyond the rounding error bar (of the
    output: SIGMAS standard deviations from `variance`; of the sums: `summing`). `zero`: the reported
    gradient is zero (the move was random): the output must not move."""
    if not all(math.isfinite(x) for x in (predicted, measured, variance, summing)):  # an output overflowed
        return LocalVerdict(indexes, predicted, measured, math.nan, None, None, "unknown")
    sigma = math.sqrt(max(variance, 0.0))
    bar = SIGMAS * sigma + summing
    if zero:
        verdict = "moves" if abs(measured) > bar and measured != 0.0 else "unused"
        return LocalVerdict(indexes, predicted, measured, sigma, None, None, verdict)
    if abs(measured) <= bar or measured == 0.0:
        # the output's change is rounding; so is the reported gradient's prediction of it (a bias that a
        # normalisation after it removes): no effect to measure, and the gradient says none
        verdict = "unused" if abs(predicted) <= bar else "unknown"
        return LocalVerdict(indexes, predicted, measured, sigma, None, None, verdict)
    ratio = predicted / measured
    error = bar / abs(measured)
    band = floor + error
    if ratio > 0 and abs(math.log(ratio)) <= band:
        verdict = "ok"
    elif abs(ratio) <= band:
        verdict = "lost"
    elif ratio < 0:
        verdict = "wrong"
    else:
        verdict = "scaled"
    if verdict != "ok" and len(indexes) > 1:
        verdict = "deviates"
    return LocalVerdict(indexes, predicted, measured, sigma, ratio, error, verdict)
