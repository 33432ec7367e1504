"""The hooks themselves: one `Site` per instrumented module, sharing one `Runtime` per handle.

Hot-path rules (DESIGN.md §4): metadata only. Hooks read attributes, `dtype`, `shape`, `device` and
`data_ptr()`; never `.item()`, `bool(tensor)` or a tensor comparison, so they never synchronize the device.
Rows hold no tensor (dtype/shape/device objects and ints only), so no main_grad buffer outlives its owner
because of us. Parameters are looked up in their owner's `_parameters` at every call, because Megatron-FSDP
swaps the Parameter objects (raw <-> distributed) every step.

Every hook body is wrapped: an internal failure becomes a `hook_error` record and a counter, never an
exception into training. The only exception that leaves a hook is `MainGradContractError`, in `check` mode.
"""

from __future__ import annotations

import warnings
import weakref
from functools import partial
from itertools import repeat
from operator import attrgetter, is_, itemgetter
from time import time_ns
from typing import Any

import torch

from .discovery import CONTAINER, TargetSpec, fused_object
from .errors import MainGradContractError, MainGradHooksWarning
from .records import (
    A_ERROR,
    A_EXPOSED,
    A_NONE,
    A_RAISED,
    BACKWARD,
    FATAL_ANOMALIES,
    FORWARD,
    PHASES,
    RecordRing,
)

_MISSING = object()
_Tensor = torch.Tensor
_SLOW = object()  # the vectorised path's answer: this call needs the per-parameter path

# Constant iterables for the vectorised path's C-level passes (map/zip stop at the parameter list's end;
# an endless `repeat` holds no position, so one object serves every call).
_R_MAIN_GRAD = repeat("main_grad")
_R_OW = repeat("overwrite_main_grad")
_R_GAM = repeat("grad_added_to_main_grad")
_R_FSDP = repeat("__fsdp_param__")
_R_GBUF = repeat("_gbuf")
_R_DISTRIBUTED = repeat("is_data_distributed")
_R_MISSING = repeat(_MISSING)
_R_NONE = repeat(None)
_R_TRUE = repeat(True)
_R_FALSE = repeat(False)
_TENSOR_ONLY = frozenset({_Tensor})
_FLAG_TYPES = frozenset({bool, type(None)})
_data_ptr = _Tensor.data_ptr
_dtype_of = attrgetter("dtype")
_shape_of = attrgetter("shape")
_device_of = attrgetter("device")
# Sites with at least this many parameters take the vectorised path first. Against the per-parameter path
# (fix + records, CPU): 2.7x slower at 2 parameters (a few us more to set up), even at 16, 22% faster at 128.
VECTORISED_MIN_PARAMS = 32


MISSING = "main_grad_missing"
NONE = "main_grad_none"
NOT_TENSOR = "main_grad_not_tensor"
GET_FAILED = "get_main_grad_failed"
SHAPE = "main_grad_shape_mismatch"
PARAM_MISSING = "param_missing"
FLAG = "flag_not_bool"
OVERWRITE = "overwrite_discards_microbatch"
HOOK_ERROR = "hook_error"


def _refreshable(param: Any) -> bool:
    """TE and Megatron refresh main_grad from get_main_grad() in backward when the param has __fsdp_param__."""
    return hasattr(param, "__fsdp_param__") and callable(getattr(param, "get_main_grad", None))


def _is_distributed(param: Any) -> bool:
    return hasattr(param, "_local_tensor") or hasattr(param, "to_local")


def _overwrites_accumulation(param: Any, forward_ptr: int, previous_backward_ptr: int) -> bool:
    """Backward of micro-batch >= 1 with overwrite_main_grad=True: does it discard an earlier micro-batch?

    Megatron-FSDP says it exactly: the parameter's gradient buffer (`param._gbuf`) is not sharded
    (`is_data_distributed` False: no_shard/optim, and every strategy at data-parallel size 1), so main_grad
    is a view of the persistent accumulation buffer and an overwrite replaces what earlier micro-batches put
    there. Elsewhere: this micro-batch's forward found main_grad still pointing at the buffer the previous
    backward wrote (nothing consumed or reset it).
    """
    distributed = getattr(getattr(param, "_gbuf", None), "is_data_distributed", None)
    if type(distributed) is bool:
        return not distributed
    return forward_ptr != 0 and forward_ptr == previous_backward_ptr


# Methods through which a fused container exposes main_grad itself, in its fused object's pre-forward hook:
# megatron-core >= 0.19 TEGroupedMLP's, and the one `maingrad fix` (rule MG001) adds to older sources.
_EXPOSING_METHODS = ("_ensure_main_grad", "_expose_main_grad_for_fused_ops")


_NO_META: tuple = (0, None, None, None)


def _self_exposing(cls: type) -> bool:
    """Does `cls` expose main_grad in its fused pre-forward hook, which runs after our container pre-hook?

    A method replaced from outside (e.g. by a no-op lambda, to take the fix out) does not count.
    """
    for name in _EXPOSING_METHODS:
        method = getattr(cls, name, None)
        if callable(method) and getattr(method, "__qualname__", "").endswith(f".{name}"):
            return True
    return False


def _grad_tensor(output: Any) -> torch.Tensor | None:
    """The first output tensor that will receive a gradient (modules may return tuples, e.g. (out, bias))."""
    if isinstance(output, _Tensor):
        return output if output.requires_grad else None
    if isinstance(output, (tuple, list)):
        for item in output:
            if isinstance(item, _Tensor) and item.requires_grad:
                return item
    elif isinstance(output, dict):
        for item in output.values():
            if isinstance(item, _Tensor) and item.requires_grad:
                return item
    return None


def _remedy(problem: str, param: Any) -> str:
    if problem in (MISSING, NONE, GET_FAILED):
        if callable(getattr(param, "get_main_grad", None)):
            return (
                "expose main_grad before the fused forward: call maingrad.hooks.install(model) (mode 'fix') "
                "after wrapping the model with Megatron-FSDP, or maingrad.hooks.expose_main_grad(module) in a "
                "pre-forward hook; megatron-core >= 0.19 does this itself for TEGroupedMLP"
            )
        return (
            "the parameter has no main_grad and no get_main_grad(): wrap the model with Megatron "
            "DistributedDataParallel or Megatron-FSDP before the first forward, or build this module without "
            "fused wgrad accumulation (gradient_accumulation_fusion / accumulate_into_main_grad = False)"
        )
    if problem == NOT_TENSOR:
        return "assign a tensor to main_grad (or leave it to get_main_grad()); never a placeholder value"
    return "main_grad must be this parameter's gradient-buffer view with the same number of elements"


class Runtime:
    """State shared by all sites of one handle: mode, step counter, ring buffer, error counters."""

    def __init__(self, mode: str, overwrite_policy: str, sample_every: int, ring: RecordRing) -> None:
        self.mode = mode
        self.fix = mode == "fix"
        self.check = mode == "check"
        self.observe = mode == "observe"
        self.force_true = self.fix and overwrite_policy == "force_true"
        self.fast_fix = self.fix and not self.force_true
        self.sample_every = sample_every
        self.needs_backward = sample_every > 0 or self.check
        self.step = 0
        self.ring = ring
        self.live = True
        self.internal_errors = 0
        self.last_error: str | None = None

    def hook_error(self, site: Site, phase: int, mb: int, slot: int, exc: BaseException) -> None:
        """Count and record an internal failure; must itself never raise (keeps no traceback: it holds frames)."""
        try:
            self.internal_errors += 1
            self.last_error = f"{site.path} {PHASES[phase]}: {type(exc).__name__}: {exc}"[:500]
            site.errors += 1
            site.anomalies[HOOK_ERROR] = site.anomalies.get(HOOK_ERROR, 0) + 1
            ring = self.ring
            ring.append(
                (ring.next_seq(), time_ns(), self.step, mb, phase, site.index, slot)
                + (False, None, None, None, None, None, None, None, False, A_ERROR, HOOK_ERROR)
            )
        except Exception:  # noqa: BLE001 - the error path of an error path: swallow, training goes on
            pass


class Site:
    """Hooks of one instrumented module and the per-module counters the summary reports."""

    __slots__ = (
        "rt",
        "index",
        "path",
        "kind",
        "strict",
        "groups",
        "fast",
        "takers",
        "wgrads",
        "slot_ids",
        "meta_cache",
        "nslots",
        "relnames",
        "fwd_calls",
        "bwd_calls",
        "records",
        "exposed",
        "raised",
        "errors",
        "anomalies",
        "mb",
        "last_bwd_ptr",
        "pending",
        "order_checked",
        "checked_ptr",
        "buffer_meta",
        "late_handle",
        "late_ref",
        "pre_ptrs",
        "relax_once",
        "__weakref__",
    )

    def __init__(self, rt: Runtime, index: int, spec: TargetSpec) -> None:
        self.rt = rt
        self.index = index
        self.path = spec.path
        self.kind = spec.kind
        self.strict = spec.strict_forward
        # Group slots by owner module, keeping discovery order (records' param order).
        owners: list[torch.nn.Module] = []
        names: dict[int, list[str]] = {}
        wgrads: dict[int, list[bool]] = {}
        self.relnames: list[str] = []
        for slot in spec.slots:
            key = id(slot.owner)
            if key not in names:
                owners.append(slot.owner)
                names[key], wgrads[key] = [], []
            names[key].append(slot.name)
            wgrads[key].append(slot.wgrad)
        for owner in owners:
            key = id(owner)
            # relnames in the same (grouped) order the hooks walk the slots
            prefix = {s.name: s.relname for s in spec.slots if s.owner is owner}
            self.relnames.extend(prefix[name] for name in names[key])
        groups = []
        base = 0
        for o in owners:
            n = len(names[id(o)])
            group = (o, itemgetter(*names[id(o)]), n == 1, tuple(names[id(o)]), tuple(wgrads[id(o)]))
            groups.append((*group, tuple(range(base, base + n))))
            base += n
        self.groups = tuple(groups)
        # fix mode's fast path walks an owner's parameter dict directly when every entry is covered (a TE
        # GroupedLinear's weights): no per-name lookups. `whole` is that entry count (0: look names up).
        self.fast = tuple(
            (o, getter, single, len(names_) if set(names_) == set(o._parameters) else 0)
            for o, getter, single, names_, *_ in self.groups
        )
        # The vectorised path's view of the same slots: (owner, getter, single) per group, flat wgrad flags.
        self.takers = tuple((o, getter, single) for o, getter, single, *_ in self.groups)
        self.wgrads = tuple(w for *_, wgrads_, _ in self.groups for w in wgrads_)
        self.nslots = len(self.relnames)
        self.slot_ids = tuple(range(self.nslots))
        # (data_ptrs, dtypes, shapes, devices) of the buffers last recorded by the vectorised path: a call
        # that finds the same buffers reuses the shape and device objects (see buffer_meta).
        self.meta_cache: tuple | None = None
        self.checked_ptr = [0] * self.nslots  # data_ptr whose element count was last found right, per slot
        # Per slot (data_ptr, dtype, shape, device) of the buffer last recorded: a record of the same buffer
        # (same address and dtype) reuses them instead of building a torch.Size and a torch.device per row
        # (time, and GC-tracked objects the ring would keep alive: one shape per slot is shared instead). A view
        # of the same address with another shape but the same dtype would be recorded with the first shape;
        # buffers that TE writes are shaped like their parameter, which the element-count check validates.
        self.buffer_meta: list[tuple] = [_NO_META] * self.nslots
        self.fwd_calls = 0
        self.bwd_calls = 0
        self.records = 0
        self.exposed = 0
        self.raised = 0
        self.errors = 0
        self.anomalies: dict[str, int] = {}
        self.mb = 0
        self.last_bwd_ptr = [0] * self.nslots
        self.pending: tuple | None = None
        self.order_checked = False
        self.late_handle: Any = None  # our pre-hook on a container's fused object (see container_pre_forward)
        self.late_ref: weakref.ref | None = None
        self.pre_ptrs: list[int] | None = None  # main_grad data_ptrs seen at the container's pre-forward
        self.relax_once = False

    @property
    def is_container(self) -> bool:
        return self.kind == CONTAINER

    # -- hooks -----------------------------------------------------------------------------------------
    def container_pre_forward(self, module: torch.nn.Module, args: Any = None) -> None:
        """Pre-hook of a container keeping its fused object in `_fused_ops` or `_fused_impl` (megatron-core
        TEGroupedMLP, TEFusedMLP*).

        Once the fused object exists (built lazily in the first forward), the work moves to a pre-hook on it,
        appended after the container's own pre-hook there, which replays the children's (Megatron-FSDP
        unshard) hooks and, from megatron-core 0.19 on, exposes main_grad itself: the point right before the
        fused kernels, so what is recorded at forward is what the fused op sees. Here we then only note which
        main_grad buffers the call starts with (for the overwrite heuristic, when the call is recorded).
        Before the fused object exists (the first call) the work is done here.
        """
        rt = self.rt
        if not rt.live:
            return None
        try:
            target = fused_object(module)
            if target is not None:
                late = self.late_ref() if self.late_ref is not None else None
                if late is not target:
                    if self.late_handle is not None:
                        self.late_handle.remove()
                    self.late_handle = target.register_forward_pre_hook(self.pre_forward)
                    self.late_ref = weakref.ref(target)
                    self.order_checked = False
                every = rt.sample_every
                if (every > 0 and self.fwd_calls % every == 0) or rt.check:
                    self.pre_ptrs = self._current_ptrs()
                return None
            # First call: the container's own exposure (0.19+) has not run yet; do not flag what it will fix.
            self.relax_once = _self_exposing(type(module))
        except Exception as exc:  # noqa: BLE001
            rt.hook_error(self, FORWARD, self.mb, -1, exc)
        try:
            return self.pre_forward(module, args)
        finally:
            self.relax_once = False

    def _current_ptrs(self) -> list[int]:
        ptrs = []
        for owner, _, _, names, *_ in self.groups:
            params = owner._parameters
            for name in names:
                mg = getattr(params.get(name), "main_grad", None)
                ptrs.append(mg.data_ptr() if isinstance(mg, _Tensor) else 0)
        return ptrs

    def detach(self) -> None:
        """Remove the hook this site added outside the handle's list (the fused object's pre-hook)."""
        if self.late_handle is not None:
            self.late_handle.remove()
            self.late_handle = None
        self.late_ref = None

    def pre_forward(self, module: torch.nn.Module, args: Any = None) -> None:
        """Forward pre-hook. Also accepts Megatron's replay `hook(module, None)`; always returns None."""
        rt = self.rt
        if not rt.live:
            return None
        mb = self.mb
        try:
            n = self.fwd_calls = self.fwd_calls + 1
            self.mb = mb + 1
            every = rt.sample_every
            record = every == 1 or (every > 1 and (n - 1) % every == 0)
            if not record:
                if rt.observe:
                    self.pending = None
                    return None
                if rt.fast_fix and self.order_checked and self._all_present():
                    self.pending = None
                    return None
            if not self.order_checked:
                self._check_order(module)
            ptrs = self._inspect(FORWARD, mb, record, None)
            if self.pre_ptrs is not None:  # a container: the state before its own pre-hook ran
                ptrs, self.pre_ptrs = self.pre_ptrs, None
            self.pending = (mb, record, ptrs) if (record or rt.check) else None
        except MainGradContractError:
            self.pending = None
            raise
        except Exception as exc:  # noqa: BLE001 - observe/fix must never break training
            self.pending = None
            rt.hook_error(self, FORWARD, mb, -1, exc)
        return None

    def post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """Forward hook: attach the backward recorder to the output's gradient (no sync, no output change)."""
        rt = self.rt
        pending = self.pending
        if pending is None or not rt.live:
            return None
        self.pending = None
        try:
            if torch.is_grad_enabled():
                tensor = _grad_tensor(output)
                if tensor is not None:
                    tensor.register_hook(partial(self.on_backward, pending))
        except Exception as exc:  # noqa: BLE001
            rt.hook_error(self, FORWARD, pending[0], -1, exc)
        return None

    def on_backward(self, pending: tuple, grad: Any) -> None:
        """Gradient hook on the module's output: runs right before the module's backward (the fused wgrad)."""
        rt = self.rt
        if not rt.live:
            return None
        mb, record, ptrs = pending
        try:
            self.bwd_calls += 1
            self._inspect(BACKWARD, mb, record, ptrs)
        except MainGradContractError:
            raise
        except Exception as exc:  # noqa: BLE001
            rt.hook_error(self, BACKWARD, mb, -1, exc)
        return None

    # -- internals ---------------------------------------------------------------------------------------
    def _all_present(self) -> bool:
        """Fast path of fix mode: nothing to expose. Strict kinds need a main_grad on every parameter; the
        others only where nothing refreshes it in backward (no `__fsdp_param__`)."""
        strict = self.strict
        try:
            for owner, getter, single, whole in self.fast:
                params = owner._parameters
                # Same count as when installed: every entry is a covered parameter or its replacement.
                if whole and len(params) == whole:
                    found = params.values()
                else:
                    found = (getter(params),) if single else getter(params)
                for param in found:
                    if getattr(param, "main_grad", None) is None and (
                        strict or param is None or not hasattr(param, "__fsdp_param__")
                    ):
                        return False
        except KeyError:
            return False
        return True

    def _check_order(self, module: torch.nn.Module) -> None:
        """Warn once if an unshard-like pre-forward hook runs after ours on the same module."""
        self.order_checked = True
        hooks = list(module._forward_pre_hooks.values())
        mine = self.pre_forward
        position = next((i for i, h in enumerate(hooks) if h == mine), None)
        if position is None:
            return
        for hook in hooks[position + 1 :]:
            name = getattr(hook, "__qualname__", None) or getattr(
                getattr(hook, "func", None), "__qualname__", ""
            )
            if "unshard" in name or "all_gather" in name:
                warnings.warn(
                    f"maingrad hooks on {self.path or '(root)'} run before {name}; install the hooks after "
                    "wrapping the model so they see the unsharded parameters",
                    MainGradHooksWarning,
                    stacklevel=2,
                )
                return

    def _inspect(self, phase: int, mb: int, record: bool, fwd_ptrs: list[int] | None) -> list[int] | None:
        """Read (and in fix mode repair) every covered parameter; append rows; raise in check mode.

        The steady state (every main_grad a validated tensor, flags bool, nothing to expose, force or flag)
        takes the vectorised path; anything else, or any surprise in it, the per-parameter one.
        """
        if self.nslots >= VECTORISED_MIN_PARAMS:
            try:
                result = self._inspect_vectorised(phase, mb, record, fwd_ptrs)
            except Exception:  # noqa: BLE001 - e.g. a property raising: the per-parameter path records it
                result = _SLOW
            if result is not _SLOW:
                return result
        return self._inspect_each(phase, mb, record, fwd_ptrs)

    def _inspect_vectorised(self, phase: int, mb: int, record: bool, fwd_ptrs: list[int] | None) -> Any:
        """The steady state in C-level passes (map/zip over the parameter list, one `deque.extend` of rows).

        Returns what `_inspect` returns, or `_SLOW` (having changed nothing but `checked_ptr` entries it
        validated) when a parameter needs the per-parameter path: something to expose, force or flag.
        """
        rt = self.rt
        forward = phase == FORWARD
        if forward and rt.force_true:
            return _SLOW
        takers = self.takers
        if len(takers) == 1:
            owner, getter, single = takers[0]
            ps = (getter(owner._parameters),) if single else getter(owner._parameters)
        else:
            ps = []
            for owner, getter, single in takers:
                found = getter(owner._parameters)
                if single:
                    ps.append(found)
                else:
                    ps.extend(found)
        mgs = list(map(getattr, ps, _R_MAIN_GRAD, _R_MISSING))
        if not _TENSOR_ONLY.issuperset(map(type, mgs)):
            return _SLOW
        ows = list(map(getattr, ps, _R_OW, _R_NONE))
        gams = list(map(getattr, ps, _R_GAM, _R_NONE))
        if not (_FLAG_TYPES.issuperset(map(type, ows)) and _FLAG_TYPES.issuperset(map(type, gams))):
            return _SLOW
        ptrs = list(map(_data_ptr, mgs))
        checked = self.checked_ptr
        if ptrs != checked:  # buffers not validated yet: compare element counts once per buffer
            wgrads = self.wgrads
            for i, ptr in enumerate(ptrs):
                if ptr != checked[i]:
                    if wgrads[i] and mgs[i].numel() != ps[i].numel() and not _is_distributed(ps[i]):
                        return _SLOW
                    checked[i] = ptr
        if not forward and mb > 0 and True in ows:  # ows hold bools and None only: `in` is safe
            distributed = list(map(getattr, map(getattr, ps, _R_GBUF, _R_NONE), _R_DISTRIBUTED, _R_NONE))
            if not all(map(is_, distributed, _R_TRUE)):
                last = self.last_bwd_ptr
                wgrads = self.wgrads
                for i, ow in enumerate(ows):
                    if (
                        ow is True
                        and wgrads[i]
                        and _overwrites_accumulation(ps[i], fwd_ptrs[i] if fwd_ptrs else 0, last[i])
                    ):
                        return _SLOW
        if record:
            n = self.nslots
            dtypes = list(map(_dtype_of, mgs))
            cache = self.meta_cache
            if cache is not None and cache[0] == ptrs and cache[1] == dtypes:
                shapes, devices = cache[2], cache[3]
            else:
                shapes = list(map(_shape_of, mgs))
                devices = list(map(_device_of, mgs))
                self.meta_cache = (ptrs[:], dtypes, shapes, devices)
            fsdps = list(map(hasattr, ps, _R_FSDP))
            ring = rt.ring
            seq = ring.reserve(n)
            ring.extend(
                zip(
                    range(seq, seq + n), repeat(time_ns()), repeat(rt.step), repeat(mb), repeat(phase),
                    repeat(self.index), self.slot_ids, _R_TRUE, _R_FALSE, dtypes, shapes, devices, ptrs, ows,
                    gams, fsdps, repeat(A_NONE), _R_NONE,
                )
            )  # fmt: skip
            self.records += n
        if not forward:
            self.last_bwd_ptr = ptrs
            return None
        return ptrs if (record or rt.check) else None

    def _inspect_each(
        self, phase: int, mb: int, record: bool, fwd_ptrs: list[int] | None
    ) -> list[int] | None:
        """The per-parameter path: exposes, forces, flags and records anomalies; raises in check mode."""
        rt = self.rt
        forward = phase == FORWARD
        fix = rt.fix and forward
        force = rt.force_true and forward
        check = rt.check
        strict = self.strict and forward and not self.relax_once
        ptrs = [0] * self.nslots if (forward and (record or check)) else None
        last = None if forward else self.last_bwd_ptr
        anomalies = self.anomalies
        problems: list[tuple[str, str, Any]] | None = None
        if record:
            t = time_ns()
            step = rt.step
            append = rt.ring.append
            next_seq = rt.ring.next_seq
            site = self.index
        checked = self.checked_ptr
        metas = self.buffer_meta
        strict_kind = self.strict
        for owner, getter, single, names, wgrads, indices in self.groups:
            params = owner._parameters
            try:
                found = (getter(params),) if single else getter(params)
            except KeyError:  # a parameter was deleted: look the others up one by one
                found = tuple(params.get(name) for name in names)
            for i, p, wgrad in zip(indices, found, wgrads, strict=True):
                try:
                    mg = getattr(p, "main_grad", _MISSING)
                    ow = getattr(p, "overwrite_main_grad", None)
                    gam = getattr(p, "grad_added_to_main_grad", None)
                    # Fast path: a tensor buffer already validated, bool flags, nothing to change or flag.
                    if (
                        mg.__class__ is _Tensor
                        and (ow is None or ow.__class__ is bool)
                        and (gam is None or gam.__class__ is bool)
                        and not force
                    ):
                        ptr = mg.data_ptr()
                        if (ptr == checked[i] or not wgrad) and (
                            last is None
                            or not (
                                ow is True
                                and mb > 0
                                and wgrad
                                and _overwrites_accumulation(p, fwd_ptrs[i] if fwd_ptrs else 0, last[i])
                            )
                        ):
                            if last is None:
                                if ptrs is not None:
                                    ptrs[i] = ptr
                            else:
                                last[i] = ptr
                            if record:
                                meta = metas[i]
                                dtype = mg.dtype
                                if meta[0] != ptr or meta[1] is not dtype:
                                    meta = metas[i] = (ptr, dtype, mg.shape, mg.device)
                                append(
                                    (
                                        next_seq(), t, step, mb, phase, site, i, True, False, dtype, meta[2],
                                        meta[3], ptr, ow, gam, hasattr(p, "__fsdp_param__"), A_NONE, None,
                                    )
                                )  # fmt: skip
                            continue
                    # Slow path: anything missing, odd, to expose, to force, or to flag.
                    if p is None:
                        anomalies[PARAM_MISSING] = anomalies.get(PARAM_MISSING, 0) + 1
                        if record:
                            append(
                                (next_seq(), t, step, mb, phase, site, i, False, None, None, None, None, None)
                                + (None, None, False, A_NONE, PARAM_MISSING)
                            )
                        continue
                    action = A_NONE
                    anomaly = None
                    if mg.__class__ is _Tensor:
                        is_tensor = True
                    else:
                        if fix and (mg is None or mg is _MISSING) and (strict_kind or not _refreshable(p)):
                            mg, action, anomaly = self._expose(p, mg)
                        is_tensor = isinstance(mg, _Tensor)
                    if force and hasattr(p, "overwrite_main_grad"):  # opt-in policy "force_true"
                        p.overwrite_main_grad = ow = True  # maingrad: ignore[MG006]
                    if (ow is not None and ow.__class__ is not bool) or (
                        gam is not None and gam.__class__ is not bool
                    ):
                        if ow.__class__ is not bool:
                            ow = None
                        if gam.__class__ is not bool:
                            gam = None
                        if wgrad and anomaly is None:
                            anomaly = FLAG
                    if is_tensor:
                        ptr = mg.data_ptr()
                        if ptrs is not None and action == A_NONE:
                            ptrs[i] = ptr
                        if last is not None:
                            if (
                                ow is True
                                and mb > 0
                                and wgrad
                                and _overwrites_accumulation(p, fwd_ptrs[i] if fwd_ptrs else 0, last[i])
                            ):
                                anomaly = OVERWRITE
                            last[i] = ptr
                        if ptr != checked[i] and wgrad:  # a buffer not validated yet: compare sizes once
                            if mg.numel() != p.numel() and not _is_distributed(p):
                                anomaly = SHAPE
                            else:
                                checked[i] = ptr
                    else:
                        ptr = None
                        if last is not None:
                            last[i] = 0
                        if wgrad and anomaly in (None, FLAG) and (strict or not _refreshable(p)):
                            anomaly = MISSING if mg is _MISSING else NONE if mg is None else NOT_TENSOR
                    if anomaly is not None:
                        anomalies[anomaly] = anomalies.get(anomaly, 0) + 1
                        if check and wgrad and anomaly in FATAL_ANOMALIES:
                            action = A_RAISED
                            if problems is None:
                                problems = []
                            problems.append((self.relnames[i], anomaly, p))
                    if record:
                        if is_tensor:
                            append(
                                (
                                    next_seq(), t, step, mb, phase, site, i, True, False, mg.dtype, mg.shape,
                                    mg.device, ptr, ow, gam, hasattr(p, "__fsdp_param__"), action, anomaly,
                                )
                            )  # fmt: skip
                        else:
                            has = mg is not _MISSING
                            append(
                                (
                                    next_seq(), t, step, mb, phase, site, i, has, (mg is None) if has else None,
                                    None, None, None, None, ow, gam, hasattr(p, "__fsdp_param__"), action, anomaly,
                                )
                            )  # fmt: skip
                except Exception as exc:  # noqa: BLE001 - one bad parameter must not hide the others
                    rt.hook_error(self, phase, mb, i, exc)
        if record:
            self.records += self.nslots
        if problems:
            self.raised += 1
            relname, problem, param = problems[0]
            raise MainGradContractError(
                self.path,
                relname,
                problem,
                _remedy(problem, param),
                phase=PHASES[phase],
                others=len(problems) - 1,
            )
        return ptrs

    def _expose(self, p: Any, mg: Any) -> tuple[Any, int, str | None]:
        """fix mode: main_grad from get_main_grad() -> (main_grad, action, anomaly)."""
        get_main_grad = getattr(p, "get_main_grad", None)
        if get_main_grad is None:
            return mg, A_NONE, None
        try:
            new = get_main_grad()
        except Exception:  # noqa: BLE001 - recorded as an anomaly; TE raises its own error
            return mg, A_NONE, GET_FAILED
        if not isinstance(new, _Tensor):
            return mg, A_NONE, GET_FAILED
        p.main_grad = new
        self.exposed += 1
        return new, A_EXPOSED, None

    def reset_step(self) -> None:
        self.mb = 0
        self.last_bwd_ptr = [0] * self.nslots

    def counts(self) -> dict[str, Any]:
        return {
            "module": self.path,
            "kind": self.kind,
            "params": self.nslots,
            "forward_calls": self.fwd_calls,
            "backward_calls": self.bwd_calls,
            "records": self.records,
            "exposed": self.exposed,
            "raised": self.raised,
            "errors": self.errors,
            "anomalies": dict(self.anomalies),
        }


__all__ = ["Runtime", "Site", "A_ERROR", "A_RAISED"]
