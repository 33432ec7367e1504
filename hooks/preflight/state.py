"""Randomness and module state that preflight fixes during its runs and puts back afterwards.

Every micro-batch preflight runs starts from the same random state (the one the caller had), so dropout
masks, random routing noise and data augmentation repeat exactly between "A alone", "A again" and "A then B";
randomness preflight cannot see (a module's own `torch.Generator`, a call counter) shows up as a
nondeterministic gradient instead of a false accumulation verdict. Covered: torch's CPU generator, every
initialised CUDA device's default generator, Python's `random`, NumPy's global generator when NumPy is
imported, megatron-core's CUDA RNG tracker when megatron-core is imported (never imported here), and any
extra `(get_state, set_state)` pairs the caller passes.

Transformer Engine's FP8 scaling state (`fp8_meta` of each TE module: the amax history and scales that delayed
scaling updates at every forward) is fixed the same way: without it each run would quantize with the scales the
previous run left, a gradient difference that is the recipe's, not the accumulation's, and preflight would
leave the scales moved.

megatron-core's per-step switch of TE's FP8 weight cache (`is_first_microbatch`) is set the way the training
schedule sets it at the first micro-batch of every step (`StepStart`), before every run and every
finite-difference forward, and put back afterwards.

Module buffers (running statistics, routers' token counters, expert biases updated in forward) are copied
once at the start and copied back at the end; parameters are restored by the finite-difference code itself.
"""

from __future__ import annotations

import copy
import random
import sys
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

RngPair = tuple[Callable[[], Any], Callable[[Any], None]]


def _megatron_trackers() -> list[RngPair]:
    """megatron-core's model-parallel CUDA RNG tracker (dropout inside tensor-parallel regions), if loaded."""
    module = sys.modules.get("megatron.core.tensor_parallel.random")
    getter = getattr(module, "get_cuda_rng_tracker", None) if module is not None else None
    if getter is None:
        return []
    try:
        tracker = getter()
    except Exception:  # noqa: BLE001 - not initialised: nothing to fix
        return []
    get_states = getattr(tracker, "get_states", None)
    set_states = getattr(tracker, "set_states", None)
    if not callable(get_states) or not callable(set_states):
        return []

    def get() -> Any:
        states = cast(dict[Any, Any], get_states())
        return {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in states.items()}

    def put(states: Any) -> None:
        set_states({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in states.items()})

    return [(get, put)]


def fp8_state_pairs(model: torch.nn.Module, tensors: list[torch.Tensor] | None = None) -> list[RngPair]:
    """One (get_state, set_state) pair over the tensors of every TE module's `fp8_meta` (the values and the
    tensor attributes of its recipe-state objects: amax history, scale, scale_inv), restored in place.
    `tensors`: `fp8_tensors(model)` where the caller has them already (one walk of the modules, not two)."""
    tensors = fp8_tensors(model) if tensors is None else tensors
    if not tensors:
        return []

    def get() -> Any:
        return [t.detach().clone() for t in tensors]

    def put(states: Any) -> None:
        with torch.no_grad():
            for tensor, saved in zip(tensors, cast(list[torch.Tensor], states), strict=True):
                if tensor.shape == saved.shape:
                    tensor.copy_(saved)

    return [(get, put)]


def fp8_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors of every TE module's `fp8_meta`. TE creates them at a module's first FP8 forward: a model
    that never ran one has none yet (`Check` then adopts them after its first run and starts over)."""
    tensors: list[torch.Tensor] = []
    seen: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, torch.Tensor) and id(value) not in seen:
            seen.add(id(value))
            tensors.append(value)

    for module in model.modules():
        meta = getattr(module, "fp8_meta", None)
        if not isinstance(meta, dict):
            continue
        for value in meta.values():
            add(value)
            attrs = getattr(value, "__dict__", None)
            if isinstance(attrs, dict):
                for attr in cast(dict[str, Any], attrs).values():
                    add(attr)
    return tensors


class RngState:
    """A snapshot of every random generator preflight knows of; `apply()` sets them all to it again."""

    def __init__(self, extra: Sequence[RngPair] = ()) -> None:
        self._pairs: list[RngPair] = [*_megatron_trackers(), *extra]
        self.cpu = torch.get_rng_state()
        self.cuda = (
            torch.cuda.get_rng_state_all()
            if torch.cuda.is_available() and torch.cuda.is_initialized()
            else None
        )
        self.python = random.getstate()
        numpy = sys.modules.get("numpy")
        self._numpy = numpy
        self.numpy = numpy.random.get_state() if numpy is not None else None
        self.extra = [get() for get, _ in self._pairs]

    def adopt(self, pairs: Sequence[RngPair]) -> None:
        """Fix `pairs` too from now on, at their current values (state created after the snapshot was taken)."""
        self._pairs += list(pairs)
        self.extra += [get() for get, _ in pairs]

    def apply(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.python)
        if self._numpy is not None and self.numpy is not None:
            self._numpy.random.set_state(self.numpy)
        for (_, put), state in zip(self._pairs, self.extra, strict=True):
            put(state)


def storage_address(t: torch.Tensor) -> int | None:
    """The address of a tensor's storage (None for a tensor subclass without a plain one): a buffer at a
    parameter's address holds that parameter's values."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class BufferState:
    """Copies of every buffer of the model, put back in place (same tensor objects) by `restore()`; and which
    of them a run changed (their version counters: no device sync)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._buffers: list[tuple[torch.nn.Module, str, torch.Tensor, torch.Tensor]] = []
        self._names: list[str] = []
        self._versions: list[int] = []
        # buffers that hold a parameter's storage (megatron-core's MoE experts register their weights' big
        # tensor as one): restored only at the end, never while the finite differences move the weights
        self._aliased: set[int] = set()
        storages = {storage_address(p) for p in model.parameters()} - {None}
        seen: set[int] = set()
        for prefix, module in model.named_modules():
            for name, buf in module._buffers.items():
                if buf is None or id(buf) in seen:
                    continue
                seen.add(id(buf))
                if storage_address(buf) in storages:
                    self._aliased.add(len(self._buffers))
                self._buffers.append((module, name, buf, buf.detach().clone()))
                self._names.append(f"{prefix}.{name}" if prefix else name)
        self.mark()

    def restore(self, aliased: bool = True) -> None:
        """Every buffer as it was (`aliased=False`: not those that hold a parameter's storage)."""
        with torch.no_grad():
            for k, (module, name, buf, saved) in enumerate(self._buffers):
                if not aliased and k in self._aliased:
                    continue
                module._buffers[name] = buf  # a forward may have replaced the object
                if buf.shape == saved.shape:
                    buf.copy_(saved)
                else:
                    buf.data = saved
        self.mark()

    def mark(self) -> None:
        self._versions = [buf._version for _, _, buf, _ in self._buffers]

    def moved(self) -> list[str]:
        """The buffers written (in place, or replaced) since the last `restore()` or `mark()` (not those that
        hold a parameter's storage: they are weights)."""
        return [
            self._names[k]
            for k, (module, name, buf, _) in enumerate(self._buffers)
            if k not in self._aliased
            and (module._buffers.get(name) is not buf or buf._version != self._versions[k])
        ]


class StepStart:
    """megatron-core's TE wrappers keep `is_first_microbatch`: while True, TE casts the weights to FP8 again
    (and caches them) and writes `main_grad` instead of adding to it; every forward sets it False; the training
    schedule sets it True through the model's `set_is_first_microbatch()` at the first micro-batch of each step
    (a no-op unless FP8/FP4 is on). preflight starts every run and every finite-difference forward as a new
    step in the same way: otherwise a forward after the weights moved computes with the FP8 copies cast before
    (the loss does not move with the probe) and a repeated micro-batch quantizes with another cache than its
    first run. `restore()` puts every module's flag back."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.setters: list[Callable[[], Any]] = []
        self._find(model)
        self.flags = [
            (m, m.is_first_microbatch)
            for m in model.modules()
            if isinstance(getattr(m, "is_first_microbatch", None), bool)
        ]

    def _find(self, module: torch.nn.Module) -> None:
        """The outermost modules with a callable `set_is_first_microbatch` (each covers its own subtree)."""
        setter = getattr(module, "set_is_first_microbatch", None)
        if callable(setter):
            self.setters.append(setter)
            return
        for child in module.children():
            self._find(child)

    def begin(self) -> None:
        for setter in self.setters:
            setter()

    def restore(self) -> None:
        for module, flag in self.flags:
            module.is_first_microbatch = flag
