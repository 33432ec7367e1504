"""Observe mode never raises whatever it meets and records what it saw; remove() leaves no hook,
attribute or reference behind. Also: hooks never read tensor values (trap tensors), env overrides."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from emulators import MegatronFSDP, batches, fsdp_run, make_layer

from maingrad.contracts.records import validate
from maingrad.hooks import MainGradContractError, MainGradHooksWarning, install, watch
from maingrad.hooks.api import Handle

_ALLOWED = {"dtype", "shape", "device", "data_ptr", "numel"}


class Trap(torch.Tensor):
    """A tensor whose every use but metadata (dtype/shape/device/data_ptr/numel) fails the test."""

    misuses: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name == "__get__":
            name = func.__self__.__name__
        if name not in _ALLOWED:
            cls.misuses.append(name)
            raise AssertionError(f"hook read a tensor value via {name}")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def trap(*shape: int) -> Trap:
    return torch.zeros(*shape).as_subclass(Trap)


class Fused(torch.nn.Module):
    """A module with fused-wgrad weights whose forward never fails, so faults reach only the hooks."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.n = n
        for i in range(n):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.ones(2, 2)))
        self.fuse_wgrad_accumulation = True  # a TE module by duck typing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x
        for i in range(self.n):
            out = out @ getattr(self, f"weight{i}")
        return out


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fused = Fused()
        self.plain = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.plain(self.fused(x))


def fsdp_like(param: torch.nn.Parameter, buffer: torch.Tensor | None = None) -> None:
    param.__fsdp_param__ = True
    param.grad_added_to_main_grad = False
    param.overwrite_main_grad = False
    buf = torch.zeros_like(param) if buffer is None else buffer
    param.get_main_grad = lambda: buf


def run(model: torch.nn.Module, calls: int = 1) -> None:
    for _ in range(calls):
        model(torch.ones(1, 2, requires_grad=True)).sum().backward()


@pytest.fixture(autouse=True)
def _reset_traps():
    Trap.misuses.clear()
    yield
    assert Trap.misuses == [], f"hooks read tensor values: {Trap.misuses}"


@pytest.mark.parametrize("mode", ["observe", "fix", "check"])
def test_trap_tensors_show_hooks_read_metadata_only(mode: str) -> None:
    net = Net()
    for i in range(3):
        param = net.fused._parameters[f"weight{i}"]
        fsdp_like(param)
        param.main_grad = trap(2, 2)
        param.overwrite_main_grad = trap(1)  # a tensor flag: must be reported, never truth-tested
        param.grad_added_to_main_grad = trap(1)
    handle = install(net, mode)
    run(net, 2)
    summary = handle.summary()
    assert summary.internal_errors == 0, summary.last_error
    assert summary.anomalies == {"flag_not_bool": 12}
    records = handle.records()
    assert len(records) == 12 and all(validate(r) == [] for r in records)
    assert all(r["overwrite_main_grad"] is None and r["grad_added_to_main_grad"] is None for r in records)
    assert all(r["dtype"] == "torch.float32" and r["shape"] == [2, 2] for r in records)
    handle.remove()


def test_observe_never_raises_under_injected_faults() -> None:
    net = Net()
    w0, w1, w2 = (net.fused._parameters[f"weight{i}"] for i in range(3))
    fsdp_like(w0)

    def broken():
        raise RuntimeError("get_main_grad exploded")

    w0.get_main_grad = broken  # get_main_grad raising
    w1.main_grad = "not a tensor"  # attributes of wrong types
    w1.get_main_grad = 5
    w1.overwrite_main_grad = [True]
    w2.main_grad = None  # None and no get_main_grad
    handle = install(net, "observe", sample_every=1)
    run(net)
    # parameters replaced mid-run: a fresh Parameter, then None, then the key gone
    net.fused._parameters["weight1"] = torch.nn.Parameter(torch.ones(2, 2))
    run(net)
    net.fused._parameters["weight2"] = None
    with pytest.raises(TypeError):
        run(net)  # the *model* fails (matmul with None); the hooks did not raise before it
    del net.fused._parameters["weight2"]
    net.fused.n = 2
    run(net)
    # Megatron's fused path replays children's pre-hooks as hook(module, None)
    for hook in list(net.fused._forward_pre_hooks.values()):
        assert hook(net.fused, None) is None
    records = handle.records()
    handle.remove()
    assert all(validate(r) == [] for r in records)
    by = {}
    for r in records:
        by.setdefault((r["phase"], r["param"]), []).append(r["anomaly"])
    # w0: no main_grad; observe never calls get_main_grad, so nothing raised; it is refreshable (fsdp) -> ok
    assert by[("forward", "weight0")][0] is None
    # w1: a string main_grad -> not a tensor; after replacement: a plain param without main_grad
    assert by[("forward", "weight1")][0] == "main_grad_not_tensor"
    assert by[("forward", "weight1")][1] == "main_grad_missing"
    assert by[("forward", "weight2")][:3] == ["main_grad_none", "main_grad_none", "param_missing"]
    assert by[("forward", "weight2")][3:] == ["param_missing", "param_missing"]  # key deleted, then replay
    assert handle.summary().internal_errors == 0


def test_fix_mode_records_get_main_grad_failures_without_raising() -> None:
    net = Net()
    w0, w1, w2 = (net.fused._parameters[f"weight{i}"] for i in range(3))
    # no __fsdp_param__: nothing would refresh main_grad in backward, so fix mode exposes at forward
    w0.get_main_grad = lambda: (_ for _ in ()).throw(RuntimeError("boom"))
    w1.get_main_grad = lambda: None  # returns a non-tensor
    w2.get_main_grad = lambda: torch.zeros(2, 2)
    handle = install(net, "fix")
    run(net)
    forward = {r["param"]: r for r in handle.records() if r["phase"] == "forward"}
    assert forward["weight0"]["anomaly"] == forward["weight1"]["anomaly"] == "get_main_grad_failed"
    assert forward["weight0"]["action"] == "none" and not hasattr(w0, "main_grad")
    assert forward["weight2"]["action"] == "exposed" and forward["weight2"]["anomaly"] is None
    handle.remove()


def test_fix_mode_leaves_refreshing_te_modules_alone() -> None:
    """TE modules and Megatron linears refresh main_grad from get_main_grad() in backward when the
    parameter has __fsdp_param__: exposing it at forward would only allocate Megatron-FSDP's buckets early."""
    net = Net()
    for param in net.fused.parameters():
        fsdp_like(param)
    handle = install(net, "fix")
    run(net)
    assert handle.summary().modules[0].exposed == 0 and handle.summary().ok
    assert not any(hasattr(p, "main_grad") for p in net.fused.parameters())
    handle.remove()


def test_internal_errors_become_records_not_exceptions() -> None:
    class Exploding(torch.nn.Parameter):
        @property
        def main_grad(self):  # a property that raises something other than AttributeError
            raise ValueError("property exploded")

    net = Net()
    net.fused._parameters["weight1"] = Exploding(torch.ones(2, 2))
    for mode in ("observe", "fix"):
        handle = install(net, mode)
        run(net)
        summary = handle.summary()
        assert summary.internal_errors == 2, summary.last_error  # forward + backward, weight1 only
        errors = [r for r in handle.records() if r["anomaly"] == "hook_error"]
        assert {(r["param"], r["action"]) for r in errors} == {("weight1", "error")}
        others = {r["param"] for r in handle.records() if r["anomaly"] != "hook_error"}
        assert others == {"weight0", "weight2"}  # the other parameters were still recorded
        handle.remove()


def test_check_mode_raises_at_backward_when_nothing_will_refresh() -> None:
    class Megatron(torch.nn.Linear):
        gradient_accumulation_fusion = True  # Megatron's own fused-wgrad linear by duck typing

    model = Megatron(2, 2)
    model.weight.main_grad = torch.zeros(2, 2)
    handle = install(model, "check")
    out = model(torch.ones(1, 2))
    del model.weight.main_grad  # gone before backward, and no __fsdp_param__/get_main_grad to refresh it
    with pytest.raises(MainGradContractError) as info:
        out.sum().backward()
    assert info.value.phase == "backward" and info.value.param == "weight"
    assert "wrap the model" in info.value.remedy
    handle.remove()


def _hook_state(model: torch.nn.Module) -> dict:
    state = {}
    for name, module in model.named_modules():
        state[name] = (
            list(module._forward_pre_hooks),
            list(module._forward_hooks),
            list(module._forward_pre_hooks_with_kwargs),
            list(module._forward_hooks_with_kwargs),
            list(module._backward_hooks),
            list(module._backward_pre_hooks),
            sorted(vars(module)),
        )
    return state


def _fused_object(model: MegatronFSDP) -> torch.nn.Module:
    (ops,) = model.module.experts._fused_ops
    return ops


@pytest.mark.parametrize("mode", ["fix", "check", "observe"])
def test_remove_leaves_nothing_behind(mode: str) -> None:
    model = MegatronFSDP(make_layer(version="0.19.2"), "optim_grads")
    fsdp_run(model, batches(1, 1))  # builds the fused object before we look
    before = _hook_state(model)
    ops_before = _hook_state(_fused_object(model))
    params_before = {n: sorted(vars(p)) for n, p in model.raw.items()}
    handle = install(model, mode, sinks=["memory"])
    fsdp_run(model, batches(2, 2), on_step=handle.step)
    assert _hook_state(_fused_object(model)) != ops_before  # we did hook the fused object
    runtime = weakref.ref(handle._rt)
    sites = [weakref.ref(s) for s in handle._sites]
    handle.remove()
    handle.remove()  # idempotent
    assert _hook_state(model) == before
    assert _hook_state(_fused_object(model)) == ops_before
    assert {n: sorted(vars(p)) for n, p in model.raw.items()} == params_before
    assert handle.summary().modules[0].forward_calls == 4  # the summary survives removal
    fsdp_run(model, batches(1, 1))  # still trains (0.19.2 exposes by itself), nothing recorded any more
    assert handle.summary().modules[0].forward_calls == 4
    assert not any(_reaches(handle, module) for module in model.modules())
    del handle
    gc.collect()
    assert runtime() is None and all(s() is None for s in sites)


def _reaches(start: object, target: object, limit: int = 100_000) -> bool:
    """Whether `target` is reachable from `start` through our own objects and plain containers."""
    from collections import deque as _deque

    from maingrad.hooks import instrument
    from maingrad.hooks.api import Handle
    from maingrad.hooks.records import RecordRing

    pieces = (instrument.Slots, instrument.Route, instrument.BufferCache, instrument.ContainerState)
    follow = (Handle, instrument.Runtime, instrument.Site, *pieces, instrument.Counters, RecordRing)
    follow += (dict, list, tuple, set, _deque)
    seen, todo = set(), [start]
    while todo and len(seen) < limit:
        obj = todo.pop()
        if obj is target:
            return True
        if id(obj) in seen or not isinstance(obj, follow):
            continue
        seen.add(id(obj))
        todo.extend(gc.get_referents(obj))
    return False


def _hooked_fsdp_like_layer() -> tuple[torch.nn.Module, Handle]:
    """A fused MoE layer whose parameters look like Megatron-FSDP's, with the hooks installed."""
    layer = make_layer()
    for param in layer.parameters():
        fsdp_like(param)
    return layer, install(layer)


def test_removed_handle_keeps_no_reference_to_the_model() -> None:
    layer, handle = _hooked_fsdp_like_layer()
    x, target = batches(1, 1)[0][0]
    for _ in range(2):
        ((layer(x, (5, 0, 3, 8)) - target) ** 2).mean().backward()
        handle.step()
    assert _reaches(handle, layer.experts.linear_fc1)  # the control: sites hold the parameters' owners
    handle.remove()
    assert not any(_reaches(handle, module) for module in layer.modules())
    layer_ref = weakref.ref(layer)
    del layer
    gc.collect()
    assert layer_ref() is None


def test_remove_releases_model_with_a_pending_backward() -> None:
    layer, handle = _hooked_fsdp_like_layer()
    x, _ = batches(1, 1)[0][0]
    out = layer(x, (5, 0, 3, 8))  # forward only: our gradient hook sits on `out`'s graph
    handle.remove()
    out.sum().backward()  # the leftover hook fires after removal and does nothing
    assert handle.summary().modules[0].backward_calls == 0
    layer_ref = weakref.ref(layer)
    del layer, out
    gc.collect()
    assert layer_ref() is None


def test_watch_context_manager_removes() -> None:
    net = Net()
    for param in net.fused.parameters():
        fsdp_like(param)
    with watch(net, "observe") as handle:
        run(net)
        assert net.fused._forward_pre_hooks
    assert handle.removed and not net.fused._forward_pre_hooks and not net.fused._forward_hooks


@pytest.mark.parametrize(("env", "expected"), [("off", "off"), ("observe", "observe"), ("CHECK", "check")])
def test_environment_overrides_mode(env: str, expected: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAINGRAD_HOOKS", env)
    net = Net()
    for param in net.fused.parameters():
        fsdp_like(param)
    handle = install(net, "fix")
    assert handle.mode == expected
    assert bool(net.fused._forward_pre_hooks) == (expected != "off")
    run(net)
    handle.step()
    assert handle.summary().modules == [] or handle.summary().modules[0].exposed == 0
    handle.remove()


@pytest.mark.filterwarnings("ignore:maingrad.hooks.install sees no")
def test_invalid_environment_mode_warns_and_keeps_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAINGRAD_HOOKS", "loud")
    with pytest.warns(MainGradHooksWarning, match="MAINGRAD_HOOKS"):
        handle = install(Net(), "observe")
    assert handle.mode == "observe"
    handle.remove()


@pytest.mark.filterwarnings("ignore:maingrad.hooks.install sees no")
def test_sampling_and_sink_failures_never_raise() -> None:
    class BadSink:
        def open(self, meta):
            pass

        def emit(self, records):
            raise OSError("disk full")

        def close(self):
            raise OSError("still full")

        def stats(self):
            raise RuntimeError("no stats")

    net = Net()
    handle = install(net, "observe", sample_every=3, sinks=[BadSink()])
    run(net, 7)
    handle.step()
    assert handle.sink_errors == 1
    calls = sorted({r["t_ns"] for r in handle.records() if r["phase"] == "forward"})
    assert len(calls) == 3  # calls 1, 4 and 7 of 7
    summary = handle.summary()
    assert summary.modules[0].forward_calls == 7 and summary.modules[0].records == 3 * 3 * 2
    assert "error" in summary.sinks[0]
    handle.remove()
    assert handle.sink_errors == 2
