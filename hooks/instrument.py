"""The hooks themselves: one `Site` per instrumented module, sharing one `Runtime` per handle.

Hot path: a call in the steady state (every main_grad a tensor already validated, flags bool or absent:
nothing to expose, force or flag beyond an overwrite; on small sites also a main_grad that is None where the
module refreshes it itself, as TE modules under Megatron-FSDP's sharded gradients do) takes a fast path,
vectorised for large sites (`_inspect_vectorised`) and a lean per-parameter loop for small ones
(`_fast_forward` / `_fast_backward`). Either pushes one compact entry per call to the ring (records.py), reusing
the last call's rows or columns where they are equal, so a steady call keeps one new object alive; sequence
numbers and the expansion into rows wait for the flush. Anything else, or any surprise, goes to the general per-parameter path
(`_inspect_each`), which exposes, forces, flags and raises; the fast paths change nothing but caches before
they hand over, so both give the same records (tests/hooks/test_hooks_paths.py).

Hot-path rules (the record contract, contracts/records.py): metadata only. Hooks read attributes, `dtype`, `shape`, `device` and
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
from collections.abc import Callable, Sequence
from functools import partial
from itertools import repeat
from operator import and_, attrgetter, is_, itemgetter
from time import time_ns
from typing import Any, cast

import torch

from maingrad.contracts.anomalies import FATAL_ANOMALIES, remedy
from maingrad.hooks.discovery import CONTAINER, TargetSpec, fused_object
from maingrad.hooks.errors import MainGradContractError, MainGradHooksWarning
from maingrad.hooks.records import (
    A_ERROR,
    A_EXPOSED,
    A_NONE,
    A_RAISED,
    BACKWARD,
    FORWARD,
    PHASES,
    CallEntry,
    ColumnsEntry,
    ErrorEntry,
    ErrorRow,
    FlaggedRow,
    PlainRow,
    RecordRing,
    TensorRow,
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
_R_NONE = repeat(None)
_R_TRUE = repeat(True)
_R_FALSE = repeat(False)
_TENSOR_ONLY = frozenset({_Tensor})
_FLAG_TYPES = frozenset({bool, type(None)})
_data_ptr: Callable[[Any], int] = _Tensor.data_ptr  # raises TypeError on anything but a tensor
_main_grad_of = attrgetter("main_grad")  # raises AttributeError where there is none
_ow_of = attrgetter("overwrite_main_grad")
_gam_of = attrgetter("grad_added_to_main_grad")
_gbuf_distributed_of = attrgetter("_gbuf.is_data_distributed")  # Megatron-FSDP's parameter gradient buffer
_dtype_of = attrgetter("dtype")
_shape_of = attrgetter("shape")
_device_of = attrgetter("device")
# Sites with at least this many parameters take the vectorised path first. Against the per-parameter fast
# path (fix + records, CPU): 1.2x slower at 8 parameters, even at 16, 5-15% faster from 24 to 128.
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
_OVERWRITE_IF = (None, OVERWRITE)  # indexed by a bool: the anomaly column of the vectorised path


def _refreshable(param: Any) -> bool:
    """TE and Megatron refresh main_grad from get_main_grad() in backward when the param has __fsdp_param__."""
    return hasattr(param, "__fsdp_param__") and callable(getattr(param, "get_main_grad", None))


def _is_distributed(param: Any) -> bool:
    return hasattr(param, "_local_tensor") or hasattr(param, "to_local")


def _flags_or_none(found: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """overwrite_main_grad and grad_added_to_main_grad of each parameter, None where absent."""
    return list(map(getattr, found, _R_OW, _R_NONE)), list(map(getattr, found, _R_GAM, _R_NONE))


def _meta(ptr: int, mg: Any) -> tuple:
    """A tensor buffer's (data_ptr, dtype, shape, device), laid out as BufferMeta."""
    return (ptr, mg.dtype, mg.shape, mg.device)


def _fwd_ptr(fwd: Sequence[Any] | None, slot: int) -> int:
    """main_grad's data_ptr at the forward, from what the forward handed its backward: data_ptrs, or the
    compact rows of `_fast_forward` (whose meta starts with the data_ptr); 0 when unknown or None."""
    if not fwd:
        return 0
    value = fwd[slot]
    if value.__class__ is int:
        return value
    meta = value[2]  # a TensorRow's meta (a tuple), or a PlainRow's `has` where main_grad was None
    return meta[0] if meta.__class__ is tuple else 0


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
    return _heuristic_overwrite(forward_ptr, previous_backward_ptr)


def _heuristic_overwrite(forward_ptr: int, previous_backward_ptr: int) -> bool:
    """Without Megatron-FSDP's answer: the forward found main_grad still holding the buffer the previous
    backward wrote (nothing consumed or reset it)."""
    return forward_ptr != 0 and forward_ptr == previous_backward_ptr


# Methods through which a fused container exposes main_grad itself, in its fused object's pre-forward hook:
# megatron-core >= 0.19 TEGroupedMLP's, and the one `maingrad fix` (rule MG001) adds to older sources.
_EXPOSING_METHODS = ("_ensure_main_grad", "_expose_main_grad_for_fused_ops")


_NO_META: tuple = (0, None, None, None)  # laid out as BufferMeta
_NO_ROWS: tuple = ((TensorRow, -1, None, None, None, None),)  # matches no row (a row's meta is never None)
_NO_COLUMNS: tuple = (None,) * 7  # equals no column (a list)


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
    return remedy(problem, has_get_main_grad=callable(getattr(param, "get_main_grad", None)))


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

    def hook_error(
        self, site: Site, phase: int, mb: int, slot: int, exc: BaseException, rows: list | None = None
    ) -> None:
        """Count and record an internal failure; must itself never raise (keeps no traceback: it holds frames).

        `rows`: the list of the call being recorded, so the error row keeps its place among that call's rows.
        """
        try:
            self.internal_errors += 1
            self.last_error = f"{site.path} {PHASES[phase]}: {type(exc).__name__}: {exc}"[:500]
            site.counters.errors += 1
            site.counters.flag(HOOK_ERROR)
            row = (
                ErrorRow, time_ns(), self.step, mb, phase, site.index, slot,
                False, None, None, None, None, None, None, None, False, A_ERROR, HOOK_ERROR,
            )  # fmt: skip
            if rows is not None:
                rows.append(row)
            else:
                self.ring.push((ErrorEntry, 1, [row]))
        except Exception:  # noqa: BLE001 - the error path of an error path: swallow, training goes on
            pass


def _make_lookup(takers: tuple) -> Callable[[], Sequence[Any]]:
    """A function giving every slot's current Parameter in slot order (KeyError when a name is gone).

    Looked up afresh at every call (Megatron-FSDP swaps the Parameter objects); specialised at install for
    the common one-owner site. It holds the owners: `Site.release()` drops it.
    """
    if len(takers) == 1:
        ((owner, getter, single),) = takers
        if single:
            return lambda: (getter(owner._parameters),)
        return lambda: getter(owner._parameters)

    def lookup() -> list[Any]:
        found: list[Any] = []
        for owner, getter, single in takers:
            if single:
                found.append(getter(owner._parameters))
            else:
                found.extend(getter(owner._parameters))
        return found

    return lookup


def _released() -> Sequence[Any]:
    raise ReferenceError("maingrad hooks removed")


class Slots:
    """What a site covers, fixed at install: the covered parameters grouped by owner module in discovery order
    (the records' slot order), with the getters that look them up afresh at every call (Megatron-FSDP swaps
    the Parameter objects). The only piece that holds the model: `release()` drops it."""

    __slots__ = ("groups", "fast", "takers", "lookup", "owner1", "getter1", "wgrads", "relnames", "n")

    def __init__(self, spec: TargetSpec) -> None:
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
        # (owner, getter, single, names, wgrads, slot indices) per owner: the general path's view
        self.groups: tuple = tuple(groups)
        # fix mode's fast path walks an owner's parameter dict directly when every entry is covered (a TE
        # GroupedLinear's weights): no per-name lookups. `whole` is that entry count (0: look names up).
        self.fast: tuple = tuple(
            (o, getter, single, len(names_) if set(names_) == set(o._parameters) else 0)
            for o, getter, single, names_, *_ in self.groups
        )
        # The fast paths' view of the same slots: (owner, getter, single) per group, flat wgrad flags.
        self.takers: tuple = tuple((o, getter, single) for o, getter, single, *_ in self.groups)
        self.lookup: Callable[[], Sequence[Any]] = _make_lookup(self.takers)
        # The usual small site, one owner with several covered names, is looked up inline (no call).
        one = len(self.takers) == 1 and not self.takers[0][2]
        self.owner1: Any = self.takers[0][0] if one else None
        self.getter1: Any = self.takers[0][1] if one else None
        self.wgrads: tuple[bool, ...] = tuple(w for *_, wgrads_, _ in self.groups for w in wgrads_)
        self.n = len(self.relnames)

    def current_ptrs(self) -> list[int]:
        """main_grad's data_ptr per slot (0 where it is not a tensor or the parameter is gone)."""
        try:
            return list(map(_data_ptr, map(_main_grad_of, self.lookup())))
        except Exception:  # noqa: BLE001 - one absent, None or not a tensor: look closer
            pass
        try:
            mgs = list(map(getattr, self.lookup(), _R_MAIN_GRAD, _R_NONE))
        except KeyError:
            mgs = [
                getattr(params.get(name), "main_grad", None)
                for owner, _, _, names, *_ in self.groups
                for params in (owner._parameters,)
                for name in names
            ]
        if _TENSOR_ONLY.issuperset(map(type, mgs)):
            return list(map(_data_ptr, mgs))
        return [mg.data_ptr() if isinstance(mg, _Tensor) else 0 for mg in mgs]

    def all_present(self, strict: bool) -> bool:
        """Fast path of fix mode: nothing to expose. Strict kinds need a main_grad on every parameter; the
        others only where nothing refreshes it in backward (no `__fsdp_param__`).

        Plain attribute reads (faster than getattr with a default); an absent main_grad (or parameter)
        raises AttributeError, and `_all_present_slow` answers with getattr, as before.
        """
        found: Any
        try:
            for owner, getter, single, whole in self.fast:
                params = owner._parameters
                # Same count as when installed: every entry is a covered parameter or its replacement.
                if whole and len(params) == whole:
                    found = params.values()
                else:
                    found = (getter(params),) if single else getter(params)
                for param in found:
                    if param.main_grad is None and (strict or not hasattr(param, "__fsdp_param__")):
                        return False
        except AttributeError:
            return self._all_present_slow(strict)
        except KeyError:
            return False
        return True

    def _all_present_slow(self, strict: bool) -> bool:
        found: Any
        try:
            for owner, getter, single, whole in self.fast:
                params = owner._parameters
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

    def release(self) -> None:
        """Drop every reference to the model (the owner modules)."""
        self.groups = ()
        self.fast = ()
        self.takers = ()
        self.lookup = _released
        self.owner1 = self.getter1 = None


class Counters:
    """What the summary reports per module (`Site.counts()`)."""

    __slots__ = ("fwd_calls", "bwd_calls", "records", "exposed", "raised", "errors", "anomalies")

    def __init__(self) -> None:
        self.fwd_calls = self.bwd_calls = self.records = 0
        self.exposed = self.raised = self.errors = 0
        self.anomalies: dict[str, int] = {}

    def flag(self, anomaly: str, times: int = 1) -> None:
        self.anomalies[anomaly] = self.anomalies.get(anomaly, 0) + times


class BufferCache:
    """What the hooks remember about each slot's main_grad buffers, so that a steady call validates nothing
    and keeps one new object alive in the ring. Only a cache: the general path rebuilds what it needs."""

    __slots__ = ("checked_ptr", "buffer_meta", "fwd_rows", "bwd_rows", "columns", "last_bwd_ptr")

    def __init__(self, n: int) -> None:
        self.checked_ptr = [0] * n  # data_ptr whose element count was last found right, per slot
        # Per slot (data_ptr, dtype, shape, device) of the buffer last recorded: a record of the same buffer
        # (same address and dtype) reuses them instead of building a torch.Size and a torch.device per row
        # (time, and GC-tracked objects the ring would keep alive: one shape per slot is shared instead). A view
        # of the same address with another shape but the same dtype would be recorded with the first shape;
        # buffers that TE writes are shaped like their parameter, which the element-count check validates.
        self.buffer_meta: list[tuple] = [_NO_META] * n
        # The rows (a tuple, one 5-row per slot) of the last recorded steady-state forward / backward of a small
        # site. A call whose rows are all the same objects (same meta, flags) pushes that tuple again instead of
        # building new ones: in the steady state a recorded call then allocates one entry, not a list and a
        # tuple per slot that the ring would keep alive (allocation, and garbage-collector work).
        self.fwd_rows: tuple = _NO_ROWS * n
        self.bwd_rows: tuple = _NO_ROWS * n
        # The columns (data_ptrs, dtypes, shapes, devices, ows, gams, fsdps) the vectorised path last pushed. A
        # call that finds the same buffers reuses their shape and device lists (see buffer_meta); each column
        # equal to the last call's is pushed as that same list, so a steady call keeps one entry alive in the
        # ring instead of five new lists and 128 ints (memory the next calls would touch cold).
        self.columns: tuple = _NO_COLUMNS
        # data_ptrs the previous backward found, per slot (the overwrite heuristic's memory). Replaced, never
        # changed in place: a ring entry may hold the same list.
        self.last_bwd_ptr: list[int] = [0] * n

    def validate(self, slot: int, param: Any, mg: _Tensor, ptr: int) -> bool:
        """A fused-wgrad slot's first sight of buffer `ptr`: is its element count right? (once per buffer)"""
        if mg.numel() != param.numel() and not _is_distributed(param):
            return False
        self.set_checked(slot, ptr)
        return True

    def set_checked(self, slot: int, ptr: int) -> None:
        """Note `ptr` as the slot's validated buffer. Keeps the invariant the per-parameter fast paths rely
        on: `buffer_meta[slot]` names no data_ptr but the validated one, so a hit there needs no check."""
        self.checked_ptr[slot] = ptr
        if self.buffer_meta[slot][0] != ptr:
            self.buffer_meta[slot] = _NO_META


class Route:
    """Which way the site's hooks go: fixed at install (`every`, `vectorised`, `plain_fwd`), then narrowed
    by what the first calls find (`order_checked`, `lean`, `flag_reads`). Only the speed depends on it."""

    __slots__ = ("every", "vectorised", "plain_fwd", "lean", "flag_reads", "order_checked")

    def __init__(self, rt: Runtime, n: int) -> None:
        self.every = rt.sample_every
        self.vectorised = n >= VECTORISED_MIN_PARAMS
        # small sites' hooks call the per-parameter fast path directly (forward: unless forcing the flag)
        self.plain_fwd = not self.vectorised and not rt.force_true
        # The hook's shortest way (see pre_forward): set once the first call has checked the hook order.
        self.lean = False
        # Per-parameter fast paths read overwrite_main_grad / grad_added_to_main_grad / __fsdp_param__ as plain
        # attributes (faster than getattr with a default, hasattr) until a parameter with a main_grad turns out
        # to lack one (DDP has neither the overwrite flag nor __fsdp_param__): then getattr/hasattr for good.
        # Only the speed differs: an absent flag reads as None, an absent __fsdp_param__ as False, either way.
        self.flag_reads = True
        self.order_checked = False


class ContainerState:
    """A fused container's hook on its fused object, and what the overwrite heuristic of its backward needs
    from before the container's own pre-hook ran (see `Site.container_pre_forward`)."""

    __slots__ = ("late_handle", "late_ref", "pre_ptrs", "exact_overwrite", "relax_once")

    def __init__(self) -> None:
        self.late_handle: Any = None  # our pre-hook on the fused object
        self.late_ref: weakref.ref | None = None
        self.pre_ptrs: Sequence[int] | None = None  # main_grad data_ptrs seen at the container's pre-forward
        # The last backward that asked whether an overwrite discards micro-batches got Megatron-FSDP's exact
        # answer (`_gbuf.is_data_distributed` a bool) for every slot it asked about: the heuristic, and the
        # snapshot of starting buffers it needs, are not needed. Set by every backward path.
        self.exact_overwrite = False
        # The first call, made before the fused object exists: its own exposure has not run yet
        self.relax_once = False

    def detach(self) -> None:
        """Remove the hook on the fused object (outside the handle's list of hooks)."""
        if self.late_handle is not None:
            self.late_handle.remove()
            self.late_handle = None
        self.late_ref = None


class Site:
    """Hooks of one instrumented module: the call in flight (`mb`, `pending`) and five named pieces of state,
    `slots` (what it covers), `route` (which path its hooks take), `cache` (what they remember about the
    buffers), `container` (a fused container's extra hook) and `counters` (what the summary reports)."""

    __slots__ = (
        "rt",
        "index",
        "path",
        "kind",
        "strict",
        "slots",
        "route",
        "cache",
        "container",
        "counters",
        "mb",
        "pending",
        "__weakref__",
    )

    def __init__(self, rt: Runtime, index: int, spec: TargetSpec) -> None:
        self.rt = rt
        self.index = index
        self.path = spec.path
        self.kind = spec.kind
        self.strict = spec.strict_forward
        self.slots = Slots(spec)
        self.route = Route(rt, self.slots.n)
        self.cache = BufferCache(self.slots.n)
        self.container = ContainerState()
        self.counters = Counters()
        self.mb = 0  # micro-batch index within the optimizer step
        self.pending: tuple | None = None  # (mb, record, fwd) from the pre-forward to the forward hook

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
        main_grad buffers the call starts with, for the overwrite heuristic of its backward: only when the
        call is recorded (or checked) and is not a step's first micro-batch, the only calls whose backward
        reads them, and only until a backward finds Megatron-FSDP's exact answer (`exact_overwrite`). Before the
        fused object exists (the first call) the work is done here.
        """
        rt = self.rt
        if not rt.live:
            return None
        state = self.container
        try:
            target = fused_object(module)
            if target is not None:
                late = state.late_ref() if state.late_ref is not None else None
                if late is not target:
                    state.detach()
                    state.late_handle = target.register_forward_pre_hook(self.pre_forward)
                    state.late_ref = weakref.ref(target)
                    self.route.order_checked = self.route.lean = False
                every = self.route.every
                if self.mb > 0 and ((every > 0 and self.counters.fwd_calls % every == 0) or rt.check):
                    # () where Megatron-FSDP answered exactly last time: no pass over the parameters; should a
                    # slot need the heuristic after all, () reads as "unknown", which flags nothing
                    state.pre_ptrs = () if state.exact_overwrite else self.slots.current_ptrs()
                return None
            # First call: the container's own exposure (0.19+) has not run yet; do not flag what it will fix.
            state.relax_once = _self_exposing(type(module))
        except Exception as exc:  # noqa: BLE001
            rt.hook_error(self, FORWARD, self.mb, -1, exc)
        try:
            return self.pre_forward(module, args)
        finally:
            state.relax_once = False

    def detach(self) -> None:
        """Remove the hook this site added outside the handle's list (the fused object's pre-hook)."""
        self.container.detach()

    def release(self) -> None:
        """Drop every reference to the model (the owner modules); the site only answers counts() after."""
        self.slots.release()
        self.route.lean = False
        self.pending = None

    def pre_forward(self, module: torch.nn.Module, args: Any = None) -> None:  # noqa: C901 - hot path inlined on purpose
        """Forward pre-hook. Also accepts Megatron's replay `hook(module, None)`; always returns None.

        `lean` (a small site that records every call, not a container, forward not forcing the flag, hook
        order checked): none of the sampling, order and container branches can apply, so they are skipped.
        """
        if self.route.lean:  # implies live: release() clears it
            mb = self.mb
            counters = self.counters
            try:
                counters.fwd_calls += 1
                self.mb = mb + 1
                fwd = _SLOW
                try:  # _fast_rows inlined (keep the two alike): the call alone is a fair share of a small site
                    slots = self.slots
                    cache = self.cache
                    getter = slots.getter1
                    found = getter(slots.owner1._parameters) if getter is not None else slots.lookup()
                    plain = self.route.flag_reads
                    metas = cache.buffer_meta
                    last = cache.fwd_rows
                    rows: Any = None  # stays None while every row is the last call's
                    for i, p in enumerate(found):
                        mg = p.main_grad
                        if plain:
                            ow = p.overwrite_main_grad
                            gam = p.grad_added_to_main_grad
                            fsdp = p.__fsdp_param__ is not _MISSING  # read for its presence: always True
                        else:
                            ow = getattr(p, "overwrite_main_grad", None)
                            gam = getattr(p, "grad_added_to_main_grad", None)
                            fsdp = hasattr(p, "__fsdp_param__")
                        if (ow is not True and ow is not False and ow is not None) or (
                            gam is not True and gam is not False and gam is not None
                        ):
                            break
                        if mg is None:  # refreshed by the module's own backward (see _fast_rows)
                            if self.strict or not (fsdp and callable(getattr(p, "get_main_grad", None))):
                                break
                            if rows is None:
                                row = last[i]
                                if row[2] is True and row[4] is ow and row[5] is gam and row[6] is fsdp:
                                    continue
                                rows = list(last[:i])
                            rows.append((PlainRow, i, True, True, ow, gam, fsdp, A_NONE, None))
                            continue
                        ptr = _data_ptr(mg)  # TypeError unless a tensor
                        dtype = mg.dtype
                        meta = metas[i]
                        if (
                            meta[0] != ptr or meta[1] is not dtype
                        ):  # a buffer new to this slot: validated first
                            if (
                                ptr != cache.checked_ptr[i]
                                and slots.wgrads[i]
                                and not cache.validate(i, p, mg, ptr)
                            ):
                                break
                            meta = metas[i] = (ptr, dtype, mg.shape, mg.device)
                        if rows is None:
                            row = last[i]
                            if row[2] is meta and row[3] is ow and row[4] is gam and row[5] is fsdp:
                                continue
                            rows = list(last[:i])
                        rows.append((TensorRow, i, meta, ow, gam, fsdp))
                    else:
                        if rows is None:
                            rows = last
                        else:
                            rows = cache.fwd_rows = tuple(rows)
                        rt = self.rt
                        n = slots.n
                        rt.ring.push((CallEntry, n, rows, time_ns(), rt.step, mb, FORWARD, self.index))
                        counters.records += n
                        fwd = rows
                except AttributeError:  # main_grad absent (the general path sees to it), or a flag
                    self._flag_absent()
                except Exception:  # noqa: BLE001 - e.g. a property raising: the general path records it
                    fwd = _SLOW
                if fwd is _SLOW:
                    fwd = self._inspect_each(FORWARD, mb, True, None)
                self.pending = (mb, True, fwd)
            except MainGradContractError:
                self.pending = None
                raise
            except Exception as exc:  # noqa: BLE001 - observe/fix must never break training
                self.pending = None
                self.rt.hook_error(self, FORWARD, mb, -1, exc)
            return None
        rt = self.rt
        if not rt.live:
            return None
        mb = self.mb
        route = self.route
        try:
            n = self.counters.fwd_calls = self.counters.fwd_calls + 1
            self.mb = mb + 1
            every = route.every
            record = every == 1 or (every > 1 and (n - 1) % every == 0)
            if not record:
                if rt.observe:
                    self.pending = None
                    return None
                if rt.fast_fix and route.order_checked and self.slots.all_present(self.strict):
                    self.pending = None
                    return None
            if not route.order_checked:
                self._check_order(module)
            if route.plain_fwd:
                try:
                    fwd = self._fast_forward(mb, record)
                except AttributeError:  # main_grad absent (the general path sees to it), or a flag
                    self._flag_absent()
                    fwd = _SLOW
                except Exception:  # noqa: BLE001 - e.g. a property raising: the general path records it
                    fwd = _SLOW
                if fwd is _SLOW:
                    fwd = self._inspect_each(FORWARD, mb, record, None)
            else:
                fwd = self._inspect(FORWARD, mb, record, None)
            container = self.container
            if container.pre_ptrs is not None:  # a container: the state before its own pre-hook ran
                fwd, container.pre_ptrs = container.pre_ptrs, None
            self.pending = (mb, record, fwd) if (record or rt.check) else None
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
                    hook = partial(self.on_backward, pending)
                    node = tensor.grad_fn
                    if node is not None:
                        # A pre-hook on the node that made the output runs where a hook on the output would
                        # (right before that node, even when this output gets no gradient), registered in C++
                        # at about half the cost of Tensor.register_hook's Python handle machinery.
                        node.register_prehook(hook)
                    else:
                        tensor.register_hook(hook)
        except Exception as exc:  # noqa: BLE001
            rt.hook_error(self, FORWARD, pending[0], -1, exc)
        return None

    def on_backward(self, pending: tuple, grad: Any) -> None:
        """Pre-hook of the output's autograd node (or gradient hook on the output): runs right before the
        module's backward (the fused wgrad). `grad` (the node's incoming gradients) is not read."""
        rt = self.rt
        if not rt.live:
            return None
        mb, record, fwd = pending
        try:
            self.counters.bwd_calls += 1
            if self.route.vectorised:
                self._inspect(BACKWARD, mb, record, fwd)
            else:
                try:
                    done = self._fast_backward(mb, record, fwd)
                except AttributeError:
                    self._flag_absent()
                    done = _SLOW
                except Exception:  # noqa: BLE001 - the general path sees to it
                    done = _SLOW
                if done is _SLOW:
                    self._inspect_each(BACKWARD, mb, record, fwd)
        except MainGradContractError:
            raise
        except Exception as exc:  # noqa: BLE001
            rt.hook_error(self, BACKWARD, mb, -1, exc)
        return None

    # -- internals ---------------------------------------------------------------------------------------
    def _check_order(self, module: torch.nn.Module) -> None:
        """Warn once if an unshard-like pre-forward hook runs after ours on the same module."""
        route = self.route
        route.order_checked = True
        route.lean = route.plain_fwd and route.every == 1 and not self.is_container
        hooks = list(module._forward_pre_hooks.values())
        mine = self.pre_forward
        position = next((i for i, h in enumerate(hooks) if h == mine), None)
        if position is None:
            return
        for hook in hooks[position + 1 :]:
            name: str = getattr(hook, "__qualname__", "") or getattr(
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

    def _inspect(self, phase: int, mb: int, record: bool, fwd: Sequence[Any] | None = None) -> Any:
        """Read (and in fix mode repair) every covered parameter; record the call; raise in check mode.

        Forward returns what its backward needs for the overwrite heuristic (`fwd`, see `_fwd_ptr`) when the
        call is recorded or checked, else None; backward returns None. The steady state takes a fast path;
        anything else, or any surprise in it, the general per-parameter one.
        """
        try:
            if self.route.vectorised:
                result = self._inspect_vectorised(phase, mb, record, fwd)
            elif phase == FORWARD:
                result = _SLOW if self.rt.force_true else self._fast_forward(mb, record)
            else:
                result = self._fast_backward(mb, record, fwd)
        except AttributeError:
            if not self.route.vectorised:
                self._flag_absent()
            result = _SLOW
        except Exception:  # noqa: BLE001 - e.g. a property raising: the general path records it
            result = _SLOW
        if result is not _SLOW:
            return result
        return self._inspect_each(phase, mb, record, fwd)

    def _flag_absent(self) -> None:
        """After an AttributeError in a plain-read fast path: read the flags (and `__fsdp_param__`) with
        getattr/hasattr from now on if a parameter that has a main_grad lacks one (not when main_grad itself is
        what was absent)."""
        if not self.route.flag_reads:
            return
        try:
            for p in self.slots.lookup():
                if hasattr(p, "main_grad") and not (
                    hasattr(p, "overwrite_main_grad")
                    and hasattr(p, "grad_added_to_main_grad")
                    and hasattr(p, "__fsdp_param__")
                ):
                    self.route.flag_reads = False
                    return
        except Exception:  # noqa: BLE001 - a parameter gone: the general path reports it
            pass

    def _fast_forward(self, mb: int, record: bool) -> Any:
        """The forward steady state of a small site, one parameter at a time, in as few steps as possible.

        Every main_grad a tensor whose buffer is validated, flags bool or absent, no force: nothing to expose
        or flag. Returns `_SLOW` at the first parameter that needs more, having changed only caches.
        Recording, it returns its rows for the backward (each meta starts with the data_ptr, so no separate
        list is built); else the data_ptrs (check mode wants them).
        """
        return self._fast_rows(mb) if record else self._fast_ptrs()

    def _fast_rows(self, mb: int) -> Any:
        """`_fast_forward` recording: rows (slot, meta, ow, gam, fsdp), one ring entry; the last call's rows
        tuple again when nothing changed (see `fwd_rows`). pre_forward's lean branch runs the same loop inline;
        tests/hooks/test_hooks_paths.py holds both to the general path."""
        slots = self.slots
        cache = self.cache
        getter = slots.getter1
        found = getter(slots.owner1._parameters) if getter is not None else slots.lookup()
        plain = self.route.flag_reads
        metas = cache.buffer_meta
        last = cache.fwd_rows
        rows: Any = None  # stays None while every row is the last call's
        for i, p in enumerate(found):
            mg = p.main_grad
            if plain:
                ow = p.overwrite_main_grad
                gam = p.grad_added_to_main_grad
                fsdp = p.__fsdp_param__ is not _MISSING  # read for its presence: always True
            else:
                ow = getattr(p, "overwrite_main_grad", None)
                gam = getattr(p, "grad_added_to_main_grad", None)
                fsdp = hasattr(p, "__fsdp_param__")
            if (ow is not True and ow is not False and ow is not None) or (
                gam is not True and gam is not False and gam is not None
            ):
                return _SLOW
            if mg is None:  # refreshed by the module's own backward (Megatron-FSDP, sharded grads)
                if self.strict or not (fsdp and callable(getattr(p, "get_main_grad", None))):
                    return _SLOW
                if rows is None:
                    row = last[i]
                    if row[2] is True and row[4] is ow and row[5] is gam and row[6] is fsdp:
                        continue
                    rows = list(last[:i])
                rows.append((PlainRow, i, True, True, ow, gam, fsdp, A_NONE, None))
                continue
            ptr = _data_ptr(mg)  # TypeError unless a tensor
            dtype = mg.dtype
            meta = metas[i]
            if meta[0] != ptr or meta[1] is not dtype:  # a buffer new to this slot: validated first
                if ptr != cache.checked_ptr[i] and slots.wgrads[i] and not cache.validate(i, p, mg, ptr):
                    return _SLOW
                meta = metas[i] = (ptr, dtype, mg.shape, mg.device)
            if rows is None:
                row = last[i]
                if row[2] is meta and row[3] is ow and row[4] is gam and row[5] is fsdp:
                    continue
                rows = list(last[:i])
            rows.append((TensorRow, i, meta, ow, gam, fsdp))
        if rows is None:
            rows = last
        else:
            rows = cache.fwd_rows = tuple(rows)
        rt = self.rt
        n = slots.n
        rt.ring.push((CallEntry, n, rows, time_ns(), rt.step, mb, FORWARD, self.index))
        self.counters.records += n
        return rows

    def _fast_ptrs(self) -> Any:
        """`_fast_forward` not recording: the data_ptrs only."""
        slots = self.slots
        cache = self.cache
        getter = slots.getter1
        found = getter(slots.owner1._parameters) if getter is not None else slots.lookup()
        checked = cache.checked_ptr
        wgrads = slots.wgrads
        plain = self.route.flag_reads
        ptrs: list[int] = []
        keep = ptrs.append
        for i, p in enumerate(found):
            mg = p.main_grad
            if plain:
                ow = p.overwrite_main_grad
                gam = p.grad_added_to_main_grad
            else:
                ow = getattr(p, "overwrite_main_grad", None)
                gam = getattr(p, "grad_added_to_main_grad", None)
            if (ow is not True and ow is not False and ow is not None) or (
                gam is not True and gam is not False and gam is not None
            ):
                return _SLOW
            if mg is None:  # refreshed by the module's own backward (see _fast_rows)
                if self.strict or not (
                    hasattr(p, "__fsdp_param__") and callable(getattr(p, "get_main_grad", None))
                ):
                    return _SLOW
                keep(0)
                continue
            ptr = _data_ptr(mg)
            if ptr != checked[i] and wgrads[i] and not cache.validate(i, p, mg, ptr):
                return _SLOW
            keep(ptr)
        return ptrs

    def _fast_backward(self, mb: int, record: bool, fwd: Sequence[Any] | None) -> Any:  # noqa: C901 - hot path inlined on purpose
        """The backward steady state of a small site (see `_fast_forward`), overwrite detection included.

        The one anomaly it records itself is `overwrite_discards_microbatch` (not fatal: check mode does not
        raise for it), computed exactly as the general path does.
        """
        slots = self.slots
        cache = self.cache
        getter = slots.getter1
        found = getter(slots.owner1._parameters) if getter is not None else slots.lookup()
        checked = cache.checked_ptr
        wgrads = slots.wgrads
        plain = self.route.flag_reads
        last = cache.last_bwd_ptr
        detect = mb > 0
        flagged = 0
        exact = None  # None: no slot asked (see ContainerState.exact_overwrite)
        ptrs: list[int] = []
        keep = ptrs.append
        metas = cache.buffer_meta  # read and written only when recording
        last_rows = cache.bwd_rows
        rows: Any = None  # stays None while every row is the last call's (see fwd_rows)
        meta: Any = None
        for i, p in enumerate(found):
            mg = p.main_grad
            if plain:
                ow = p.overwrite_main_grad
                gam = p.grad_added_to_main_grad
                fsdp = p.__fsdp_param__ is not _MISSING  # read for its presence: always True
            else:
                ow = getattr(p, "overwrite_main_grad", None)
                gam = getattr(p, "grad_added_to_main_grad", None)
                fsdp = hasattr(p, "__fsdp_param__")
            if (ow is not True and ow is not False and ow is not None) or (
                gam is not True and gam is not False and gam is not None
            ):
                return _SLOW
            if mg is None:  # refreshed inside the module's backward, which runs next: nothing to flag
                if not (fsdp and callable(getattr(p, "get_main_grad", None))):
                    return _SLOW
                keep(0)
                if record:
                    if rows is None:
                        row = last_rows[i]
                        if row[2] is True and row[4] is ow and row[5] is gam and row[6] is fsdp:
                            continue
                        rows = list(last_rows[:i])
                    rows.append((PlainRow, i, True, True, ow, gam, fsdp, A_NONE, None))
                continue
            ptr = _data_ptr(mg)
            if record:
                dtype = mg.dtype
                meta = metas[i]
                if meta[0] != ptr or meta[1] is not dtype:  # a buffer new to this slot: validated first
                    if ptr != checked[i] and wgrads[i] and not cache.validate(i, p, mg, ptr):
                        return _SLOW
                    meta = metas[i] = (ptr, dtype, mg.shape, mg.device)
            elif ptr != checked[i] and wgrads[i] and not cache.validate(i, p, mg, ptr):
                return _SLOW
            keep(ptr)
            anomaly = None
            if detect and ow is True and wgrads[i]:
                distributed = getattr(getattr(p, "_gbuf", None), "is_data_distributed", None)
                if distributed.__class__ is bool:
                    exact = exact is not False
                    if not distributed:
                        anomaly = OVERWRITE
                        flagged += 1
                else:
                    exact = False
                    if _heuristic_overwrite(_fwd_ptr(fwd, i), last[i]):
                        anomaly = OVERWRITE
                        flagged += 1
            if record:
                if anomaly is None:
                    if rows is None:
                        row = last_rows[i]
                        if row[2] is meta and row[3] is ow and row[4] is gam and row[5] is fsdp:
                            continue
                        rows = list(last_rows[:i])
                    rows.append((TensorRow, i, meta, ow, gam, fsdp))
                else:
                    if rows is None:
                        rows = list(last_rows[:i])
                    rows.append((FlaggedRow, i, meta, ow, gam, fsdp, A_NONE, anomaly))
        cache.last_bwd_ptr = ptrs
        if exact is not None:
            self.container.exact_overwrite = exact
        if flagged:
            self.counters.flag(OVERWRITE, flagged)
        if record:
            if rows is None:
                rows = last_rows
            elif flagged:
                rows = tuple(rows)  # holds anomaly rows: never reused (bwd_rows holds TensorRows only)
            else:
                rows = cache.bwd_rows = tuple(rows)
            rt = self.rt
            n = len(rows)
            rt.ring.push((CallEntry, n, rows, time_ns(), rt.step, mb, BACKWARD, self.index))
            self.counters.records += n
        return None

    def _inspect_vectorised(self, phase: int, mb: int, record: bool, fwd: Sequence[Any] | None) -> Any:  # noqa: C901 - hot path inlined on purpose
        """The steady state in C-level passes (map over the parameter list), recorded as one columnar entry.

        Returns what `_inspect` returns, or `_SLOW` (having changed nothing but `checked_ptr` entries it
        validated) when a parameter needs the per-parameter path: something to expose, force or flag (but an
        overwrite, which it flags itself). A main_grad that is absent or not a tensor raises in the first two
        passes, which `_inspect` turns into `_SLOW`.
        """
        rt = self.rt
        forward = phase == FORWARD
        if forward and rt.force_true:
            return _SLOW
        slots = self.slots
        cache = self.cache
        found = slots.lookup()
        mgs = list(map(_main_grad_of, found))
        ptrs = list(map(_data_ptr, mgs))
        if self.route.flag_reads:
            try:
                ows = list(map(_ow_of, found))
                gams = list(map(_gam_of, found))
            except AttributeError:  # every main_grad is there (the passes above): a flag is absent
                self.route.flag_reads = False
                ows, gams = _flags_or_none(found)
        else:
            ows, gams = _flags_or_none(found)
        if not (_FLAG_TYPES.issuperset(map(type, ows)) and _FLAG_TYPES.issuperset(map(type, gams))):
            return _SLOW
        checked = cache.checked_ptr
        if ptrs != checked:  # buffers not validated yet: compare element counts once per buffer
            wgrads = slots.wgrads
            for i, ptr in enumerate(ptrs):
                if ptr != checked[i]:
                    if wgrads[i] and mgs[i].numel() != found[i].numel() and not _is_distributed(found[i]):
                        return _SLOW
                    cache.set_checked(i, ptr)
        anomalies: list[str | None] | None = None
        if not forward and mb > 0 and True in ows:  # ows hold bools and None only: `in` is safe
            try:
                distributed = list(map(_gbuf_distributed_of, found))
            except AttributeError:
                distributed = list(
                    map(getattr, map(getattr, found, _R_GBUF, _R_NONE), _R_DISTRIBUTED, _R_NONE)
                )
            if all(map(is_, distributed, _R_FALSE)):
                # Megatron-FSDP with unsharded gradients, every parameter: each fused-wgrad slot whose flag is
                # True discards the earlier micro-batches (what _overwrites_accumulation says), in C.
                self.container.exact_overwrite = True
                flags = list(map(and_, map(is_, ows, _R_TRUE), slots.wgrads))
                flagged = flags.count(True)
                if flagged:
                    anomalies = list(map(_OVERWRITE_IF.__getitem__, flags))
            elif all(map(is_, distributed, _R_TRUE)):
                self.container.exact_overwrite = True
                flagged = 0
            else:
                self.container.exact_overwrite = all(d.__class__ is bool for d in distributed)
                last = cache.last_bwd_ptr
                wgrads = slots.wgrads
                flagged = 0
                for i, ow in enumerate(ows):
                    if ow is True and wgrads[i]:
                        d = distributed[i]
                        if not d if d.__class__ is bool else _heuristic_overwrite(_fwd_ptr(fwd, i), last[i]):
                            if anomalies is None:
                                anomalies = list[str | None]([None] * len(ows))
                            anomalies[i] = OVERWRITE
                            flagged += 1
            if flagged:
                self.counters.flag(OVERWRITE, flagged)
        if record:
            n = len(ptrs)
            dtypes = list(map(_dtype_of, mgs))
            fsdps = list(map(hasattr, found, _R_FSDP))
            prev = cache.columns  # lists of ints, dtypes, bools and None only: `==` compares no tensor
            if prev[0] == ptrs and prev[1] == dtypes:
                ptrs, dtypes, shapes, devices = prev[0], prev[1], prev[2], prev[3]
            else:
                shapes = list(map(_shape_of, mgs))
                devices = list(map(_device_of, mgs))
            if prev[4] == ows:
                ows = prev[4]
            if prev[5] == gams:
                gams = prev[5]
            if prev[6] == fsdps:
                fsdps = prev[6]
            cache.columns = (ptrs, dtypes, shapes, devices, ows, gams, fsdps)
            rt.ring.push(
                (ColumnsEntry, n, ptrs, dtypes, shapes, devices, ows, gams, fsdps, anomalies, time_ns(), rt.step, mb, phase, self.index)
            )  # fmt: skip
            self.counters.records += n
        if not forward:
            cache.last_bwd_ptr = ptrs
            return None
        return ptrs if (record or rt.check) else None

    # noqa below: every case of one parameter in one loop, the reference the fast paths are tested against.
    def _inspect_each(  # noqa: C901
        self, phase: int, mb: int, record: bool, fwd: Sequence[Any] | None
    ) -> list[int] | None:
        """The general per-parameter path: exposes, forces, flags and records anomalies; raises in check mode."""
        rt = self.rt
        forward = phase == FORWARD
        fix = rt.fix and forward
        force = rt.force_true and forward
        check = rt.check
        strict = self.strict and forward and not self.container.relax_once
        ptrs = [0] * self.slots.n if (forward and (record or check)) else None
        # a fresh list for this backward's buffers: the previous one may be held by a ring entry
        cache = self.cache
        last = None if forward else list(cache.last_bwd_ptr)
        if last is not None:
            cache.last_bwd_ptr = last
        counters = self.counters
        problems: list[tuple[str, str, Any]] | None = None
        found: Any
        mg: Any
        ptr: Any  # an int where main_grad is a tensor, else None
        # This call's rows (appended to only when recording, then pushed as one entry whatever happens)
        rows: list[Any] = []
        append = rows.append
        t, step = (time_ns(), rt.step) if record else (0, 0)
        checked = cache.checked_ptr
        metas = cache.buffer_meta
        strict_kind = self.strict
        try:
            for owner, getter, single, names, wgrads, indices in self.slots.groups:
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
                                    and _overwrites_accumulation(p, _fwd_ptr(fwd, i), last[i])
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
                                    append((TensorRow, i, meta, ow, gam, hasattr(p, "__fsdp_param__")))
                                continue
                        # Slow path: anything missing, odd, to expose, to force, or to flag.
                        if p is None:
                            counters.flag(PARAM_MISSING)
                            if record:
                                append((PlainRow, i, False, None, None, None, False, A_NONE, PARAM_MISSING))
                            continue
                        action = A_NONE
                        anomaly = None
                        if mg.__class__ is _Tensor:
                            is_tensor = True
                        else:
                            if (
                                fix
                                and (mg is None or mg is _MISSING)
                                and (strict_kind or not _refreshable(p))
                            ):
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
                            mg = cast(_Tensor, mg)  # (the checker cannot tie is_tensor to mg)
                            ptr = mg.data_ptr()
                            if ptrs is not None and action == A_NONE:
                                ptrs[i] = ptr
                            if last is not None:
                                if (
                                    ow is True
                                    and mb > 0
                                    and wgrad
                                    and _overwrites_accumulation(p, _fwd_ptr(fwd, i), last[i])
                                ):
                                    anomaly = OVERWRITE
                                last[i] = ptr
                            if ptr != checked[i] and wgrad:  # a buffer not validated yet: compare sizes once
                                if mg.numel() != p.numel() and not _is_distributed(p):
                                    anomaly = SHAPE
                                else:
                                    cache.set_checked(i, ptr)
                        else:
                            ptr = None
                            if last is not None:
                                last[i] = 0
                            if wgrad and anomaly in (None, FLAG) and (strict or not _refreshable(p)):
                                anomaly = MISSING if mg is _MISSING else NONE if mg is None else NOT_TENSOR
                        if anomaly is not None:
                            counters.flag(anomaly)
                            if check and wgrad and anomaly in FATAL_ANOMALIES:
                                action = A_RAISED
                                if problems is None:
                                    problems = []
                                problems.append((self.slots.relnames[i], anomaly, p))
                        if record:
                            if is_tensor:
                                append(
                                    (
                                        FlaggedRow, i, _meta(ptr, mg), ow, gam,
                                        hasattr(p, "__fsdp_param__"), action, anomaly,
                                    )
                                )  # fmt: skip
                            else:
                                has = mg is not _MISSING
                                append(
                                    (
                                        PlainRow, i, has, (mg is None) if has else None, ow, gam,
                                        hasattr(p, "__fsdp_param__"), action, anomaly,
                                    )
                                )  # fmt: skip
                    except Exception as exc:  # noqa: BLE001 - one bad parameter must not hide the others
                        rt.hook_error(self, phase, mb, i, exc, rows if record else None)
        finally:
            if rows:  # whatever was recorded, even if something above escaped
                rt.ring.push((CallEntry, len(rows), rows, t, step, mb, phase, self.index))
        if record:
            counters.records += self.slots.n
        if problems:
            counters.raised += 1
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
        self.counters.exposed += 1
        return new, A_EXPOSED, None

    def reset_step(self) -> None:
        """An optimizer step: micro-batches count from 0 again, and no earlier backward's buffers count."""
        self.mb = 0
        self.cache.last_bwd_ptr = [0] * self.slots.n

    def counts(self) -> dict[str, Any]:
        """The summary's row for this module (`ModuleSummary`'s fields)."""
        return {
            "module": self.path,
            "kind": self.kind,
            "params": self.slots.n,
            "forward_calls": self.counters.fwd_calls,
            "backward_calls": self.counters.bwd_calls,
            "records": self.counters.records,
            "exposed": self.counters.exposed,
            "raised": self.counters.raised,
            "errors": self.counters.errors,
            "anomalies": dict(self.counters.anomalies),
        }


__all__ = [
    "Runtime",
    "Site",
    "Slots",
    "Route",
    "BufferCache",
    "ContainerState",
    "Counters",
    "A_ERROR",
    "A_RAISED",
]
