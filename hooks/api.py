"""`install()` / `watch()` and the `Handle` that undoes them (modelled on torch's RemovableHandle).

    model = FullyShardedDataParallel(config=cfg, ddp_config=ddp_cfg, module=net)  # wrap first
    handle = maingrad.hooks.install(model)            # mode="fix": expose main_grad, record
    for step in ...:
        ...forward/backward per micro-batch...; optimizer.step()
        handle.step()                                 # step boundary: flush records to the sinks
    print(handle.summary())
    handle.remove()

Install after the model is wrapped: Megatron-FSDP registers its unshard pre-forward hooks with
`prepend=True`, so ours (appended) run after them either way, but `get_main_grad` and the Parameter objects
only exist once the wrapper has been built; `install` warns when it sees neither a wrapper nor any
main_grad/get_main_grad on the covered parameters.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from maingrad.hooks.discovery import TargetSpec, discover
from maingrad.hooks.errors import MainGradHooksWarning
from maingrad.hooks.expose import check_policy
from maingrad.hooks.instrument import Runtime, Site
from maingrad.hooks.records import RecordRing, Row, RunMeta, to_dicts
from maingrad.hooks.settings import resolve_commit, resolve_mode, resolve_rank, resolve_run
from maingrad.hooks.sinks import Sink, make_sink
from maingrad.hooks.summary import ModuleSummary, Summary

# module -> number of live handles instrumenting it (weak: never keeps a model alive)
_ACTIVE: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()

_WRAPPER_NAMES = frozenset({"DistributedDataParallel", "FullyShardedDataParallel", "MegatronFSDP"})


def _looks_wrapped(model: torch.nn.Module, specs: Sequence[TargetSpec]) -> bool:
    for module in model.modules():
        if type(module).__name__ in _WRAPPER_NAMES or hasattr(module, "param_and_grad_buffer"):
            return True
    for spec in specs:
        for slot in spec.slots:
            param = slot.owner._parameters.get(slot.name)
            try:
                if param is not None and (hasattr(param, "main_grad") or hasattr(param, "get_main_grad")):
                    return True
            except Exception:  # noqa: BLE001 - a raising attribute: the hooks will record it, not install()
                return True
    return False


class Handle:
    """What `install()` returns: step boundaries, records, summary, and `remove()` to undo everything."""

    def __init__(
        self,
        *,
        meta: RunMeta,
        runtime: Runtime | None,
        sites: list[Site],
        torch_handles: list[Any],
        sinks: list[Sink],
    ) -> None:
        self.meta = meta
        self._rt = runtime
        self._sites = sites
        self._torch_handles = torch_handles
        self._sinks = sinks
        self._modules = [s.path for s in sites]
        self._params = [list(s.slots.relnames) for s in sites]
        self._kinds = [s.kind for s in sites]
        self._instrumented: list[weakref.ref] = []
        self._final: Summary | None = None
        self.sink_errors = 0

    # -- properties ---------------------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self.meta.mode

    @property
    def run(self) -> str:
        return self.meta.run

    @property
    def rank(self) -> int:
        return self.meta.rank

    @property
    def removed(self) -> bool:
        return self._final is not None

    @property
    def targets(self) -> list[tuple[str, str, int]]:
        """(module path, kind, number of covered parameters) of every instrumented module."""
        return [(m, k, len(p)) for m, k, p in zip(self._modules, self._kinds, self._params, strict=True)]

    @property
    def sinks(self) -> list[Sink]:
        return list(self._sinks)

    # -- records --------------------------------------------------------------------------------------------
    def _dicts(self, rows: Iterable[Row]) -> list[dict]:
        return to_dicts(rows, self.meta, self._modules, self._params)

    def records(self) -> list[dict]:
        """The records still in the ring buffer, oldest first (does not consume them)."""
        if self._rt is None:
            return []
        return self._dicts(self._rt.ring.snapshot())

    def flush(self) -> int:
        """Hand the records made since the last flush to every sink; returns how many. Never raises."""
        rt = self._rt
        if rt is None:
            return 0
        if not self._sinks:  # nobody to hand them to: count them, build nothing
            return rt.ring.skip_new()
        rows = rt.ring.take_new()
        if not rows:
            return 0
        try:
            records = self._dicts(rows)
        except Exception:  # noqa: BLE001
            self.sink_errors += 1
            return 0
        for sink in self._sinks:
            try:
                sink.emit(records)
            except Exception:  # noqa: BLE001 - a sink must never break training
                self.sink_errors += 1
        return len(records)

    def step(self) -> None:
        """Mark an optimizer step: micro-batch counters restart at 0 and new records go to the sinks."""
        rt = self._rt
        if rt is None or not rt.live:
            return
        rt.step += 1
        for site in self._sites:
            site.reset_step()
        self.flush()

    # -- summary --------------------------------------------------------------------------------------------
    def summary(self) -> Summary:
        """Per-module call counts, exposures, raises and anomalies (exact, from counters); print() it."""
        if self._final is not None:
            return self._final
        rt = self._rt
        modules = [ModuleSummary(**{k: v for k, v in s.counts().items()}) for s in self._sites]
        return Summary(
            mode=self.meta.mode,
            run=self.meta.run,
            rank=self.meta.rank,
            step=rt.step if rt else 0,
            modules=modules,
            internal_errors=rt.internal_errors if rt else 0,
            ring_overflow=rt.ring.overflow if rt else 0,
            sinks=[self._sink_stats(s) for s in self._sinks],
            last_error=rt.last_error if rt else None,
        )

    @staticmethod
    def _sink_stats(sink: Sink) -> dict[str, Any]:
        try:
            return dict(sink.stats())
        except Exception as exc:  # noqa: BLE001
            return {"sink": type(sink).__name__, "error": repr(exc)}

    # -- removal --------------------------------------------------------------------------------------------
    def remove(self) -> None:
        """Remove every hook, flush and close the sinks, and drop every reference to the model. Idempotent.

        main_grad buffers exposed in fix mode stay: they are Megatron-FSDP's own buffer views, which it
        resets at its next gradient reduction, exactly as after megatron-core 0.19's exposure.
        """
        if self._final is not None:
            return
        rt = self._rt
        for handle in self._torch_handles:
            handle.remove()
        self._torch_handles = []
        for site in self._sites:
            site.detach()
        self.flush()
        if rt is not None:
            rt.live = False
        for sink in self._sinks:
            try:
                sink.close()
            except Exception:  # noqa: BLE001
                self.sink_errors += 1
        for ref in self._instrumented:
            module = ref()
            if module is not None and module in _ACTIVE:
                left = _ACTIVE[module] - 1
                if left > 0:
                    _ACTIVE[module] = left
                else:
                    del _ACTIVE[module]
        self._instrumented = []
        final = self.summary()
        self._final = final
        for site in self._sites:  # sites hold the owner modules: release them
            site.release()
        self._sites = []

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self.removed else "active"
        return f"<maingrad.hooks.Handle mode={self.mode} run={self.run} rank={self.rank} targets={len(self._modules)} {state}>"


def install(
    model: torch.nn.Module,
    mode: str = "fix",
    *,
    targets: str | torch.nn.Module | Iterable[torch.nn.Module | str] = "auto",
    sinks: Sequence[Sink | str] = (),
    sample_every: int = 1,
    overwrite_policy: str = "keep",
    run: str | None = None,
    rank: int | None = None,
    commit: str | None = None,
    capacity: int = 65_536,
) -> Handle:
    """Instrument the fused-wgrad modules of `model` (call after wrapping it with DDP / Megatron-FSDP).

    mode: "fix" exposes main_grad from get_main_grad() before each fused forward and records; "check"
    raises MainGradContractError before TE would fail; "observe" only records and never raises; "off"
    installs nothing. MAINGRAD_HOOKS in the environment overrides it.
    targets: "auto" (see discovery.py), or modules / fnmatch patterns over qualified module names.
    sinks: Sink objects or "memory", "jsonl:PATH", an http(s) URL; fed at handle.step()/flush()/remove().
    sample_every: record every Nth call of each module (1: all; 0: none, fix/check still act every call).
    overwrite_policy: "keep" leaves overwrite_main_grad as Megatron-FSDP set it; "force_true" sets it True
    where it exists, as megatron-core 0.19 does.
    capacity: size of the record ring buffer (rows beyond it before a flush are counted as overflow).
    """
    check_policy(overwrite_policy)
    if not isinstance(sample_every, int) or isinstance(sample_every, bool) or sample_every < 0:
        raise ValueError("sample_every must be an int >= 0")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"install() needs a torch.nn.Module, got {type(model).__name__}")
    mode = resolve_mode(mode)
    meta = RunMeta(run=resolve_run(run), rank=resolve_rank(rank), mode=mode, commit=resolve_commit(commit))
    if mode == "off":  # installs nothing; the handle's methods are no-ops
        return Handle(meta=meta, runtime=None, sites=[], torch_handles=[], sinks=[])
    sink_objects = [make_sink(s) for s in sinks]
    specs = discover(model, targets)
    if not specs:
        warnings.warn(
            "maingrad.hooks.install found no fused-wgrad module (fuse_wgrad_accumulation / "
            "accumulate_into_main_grad / gradient_accumulation_fusion); nothing is instrumented",
            MainGradHooksWarning,
            stacklevel=2,
        )
    elif not _looks_wrapped(model, specs):
        warnings.warn(
            "maingrad.hooks.install sees no DDP/Megatron-FSDP wrapper and no main_grad/get_main_grad on any "
            "fused-wgrad parameter: call install() after wrapping the model, or the hooks cannot fix anything",
            MainGradHooksWarning,
            stacklevel=2,
        )
    runtime = Runtime(mode, overwrite_policy, sample_every, RecordRing(capacity))
    sites: list[Site] = []
    torch_handles: list[Any] = []
    instrumented: list[weakref.ref] = []
    for spec in specs:
        if _ACTIVE.get(spec.module, 0):
            warnings.warn(
                f"{spec.path or '(root)'} is already instrumented by another maingrad handle",
                MainGradHooksWarning,
                stacklevel=2,
            )
        site = Site(runtime, len(sites), spec)
        sites.append(site)
        pre_hook = site.container_pre_forward if site.is_container else site.pre_forward
        torch_handles.append(spec.module.register_forward_pre_hook(pre_hook))
        if runtime.needs_backward:
            torch_handles.append(spec.module.register_forward_hook(site.post_forward))
        _ACTIVE[spec.module] = _ACTIVE.get(spec.module, 0) + 1
        instrumented.append(weakref.ref(spec.module))
    handle = Handle(meta=meta, runtime=runtime, sites=sites, torch_handles=torch_handles, sinks=sink_objects)
    handle._instrumented = instrumented
    for sink in sink_objects:
        sink.open(meta)
    return handle


@contextlib.contextmanager
def watch(model: torch.nn.Module, mode: str = "fix", **kwargs: Any) -> Iterator[Handle]:
    """Context-manager form of install(): the hooks are removed (and sinks flushed) on exit."""
    handle = install(model, mode, **kwargs)
    try:
        yield handle
    finally:
        handle.remove()
