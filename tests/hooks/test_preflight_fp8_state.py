"""preflight and Transformer Engine's FP8 scaling state (`fp8_meta`), with a CPU stand-in of delayed scaling.

Delayed scaling updates each TE module's amax history and scales at every forward, so the same micro-batch
quantizes differently the second time. preflight must run every micro-batch from the state the caller had (else
the recipe's drift reads as a nondeterministic or inconsistent gradient: a false alarm on every FP8 model, seen
on the H200 with a 336M GPT) and leave the state as it found it.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

import maingrad.hooks


class DelayedScalingLinear(torch.nn.Module):
    """A linear layer whose output scale depends on an amax history that every forward rolls, as TE's delayed
    scaling does with its `fp8_meta["scaling_fwd"]` recipe state."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n_out, n_in) / n_in**0.5)
        state = SimpleNamespace(amax_history=torch.zeros(4), scale=torch.ones(1))
        self.fp8_meta = {"recipe": "delayed", "scaling_fwd": state}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = self.fp8_meta["scaling_fwd"]
        y = (x @ self.weight.t()) * (1.0 + 0.25 * state.scale)
        with torch.no_grad():
            state.amax_history.copy_(torch.roll(state.amax_history, 1))
            state.amax_history[0] = y.detach().abs().max()
            state.scale.copy_(state.amax_history.max() / 10.0)
        return y


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(DelayedScalingLinear(8, 16), torch.nn.Tanh(), DelayedScalingLinear(16, 4))


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().mean()


def _run(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    loss = _loss(model, batch)
    loss.backward()
    return loss.detach()


def _state(model: torch.nn.Module) -> list[torch.Tensor]:
    out = []
    for m in model.modules():
        if isinstance(m, DelayedScalingLinear):
            s = m.fp8_meta["scaling_fwd"]
            out += [s.amax_history.clone(), s.scale.clone()]
    return out


def test_fp8_scaling_state_is_fixed_per_run_and_restored() -> None:
    model = _model()
    batches = [torch.randn(5, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    for b in batches:  # a few steps of "training" so the history is not all zeros
        _run(model, b)
    model.zero_grad()
    before = _state(model)
    result = maingrad.hooks.preflight(model, _run, batches, loss_fn=_loss)
    assert result.status == "pass", result.table()
    after = _state(model)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_without_the_state_pairs_the_drift_reads_as_a_gradient_anomaly(monkeypatch) -> None:
    """The stand-in is strong enough to matter: with the FP8 state left to drift, preflight does not pass."""
    from maingrad.hooks.preflight import check as check_module

    monkeypatch.setattr(check_module, "fp8_state_pairs", lambda model, tensors=None: [])
    model = _model()
    batches = [torch.randn(5, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    for b in batches:
        _run(model, b)
    model.zero_grad()
    result = maingrad.hooks.preflight(model, _run, batches, loss_fn=_loss)
    assert result.status != "pass"


class CachedCastLinear(torch.nn.Module):
    """megatron-core's TE wrapper with FP8 weight caching: while `is_first_microbatch` is True the forward casts
    the weight again (rounded, as an FP8 cast would) and caches it; every forward sets the flag False."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n_out, n_in) / n_in**0.5)
        self.is_first_microbatch = True
        self.cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first_microbatch or self.cache is None:
            self.cache = self.weight.detach().clone()
        self.is_first_microbatch = False
        # the forward computes with the cached cast; the gradient flows to the weight (straight through)
        w = self.weight + (self.cache - self.weight).detach()
        return x @ w.t()


class CachedCastModel(torch.nn.Module):
    """A model with megatron-core's `set_is_first_microbatch()`: a no-op unless FP8 is on."""

    def __init__(self, fp8: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fp8 = fp8
        self.net = torch.nn.Sequential(CachedCastLinear(8, 16), torch.nn.Tanh(), CachedCastLinear(16, 4))

    def set_is_first_microbatch(self) -> None:
        if self.fp8:
            for m in self.modules():
                if hasattr(m, "is_first_microbatch"):
                    m.is_first_microbatch = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_every_run_and_probe_starts_a_step_like_the_training_schedule() -> None:
    """With the FP8 cache, a forward after the weights moved computes with the old cast unless the step's
    switch is set: preflight sets it the way the schedule does (through the model's own method), so the
    finite differences see their moves and the flags are as they were afterwards."""
    model = CachedCastModel(fp8=True)
    batches = [torch.randn(5, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    _run(model, batches[0])  # a forward left every flag False, as after the first micro-batch of a step
    model.zero_grad()
    flags = [m.is_first_microbatch for m in model.modules() if hasattr(m, "is_first_microbatch")]
    result = maingrad.hooks.preflight(model, _run, batches, loss_fn=_loss)
    assert result.status == "pass", result.table()
    assert [m.is_first_microbatch for m in model.modules() if hasattr(m, "is_first_microbatch")] == flags


def test_without_the_step_switch_the_probes_do_not_move_the_loss(monkeypatch) -> None:
    """The stand-in is strong enough to matter: never starting a step, the forward keeps the first cast."""
    from maingrad.hooks.preflight import state

    monkeypatch.setattr(state.StepStart, "begin", lambda self: None)
    model = CachedCastModel(fp8=True)
    batches = [torch.randn(5, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    _run(model, batches[0])
    model.zero_grad()
    result = maingrad.hooks.preflight(model, _run, batches, loss_fn=_loss)
    assert result.status != "pass"


def test_the_switch_is_the_models_own_a_bf16_model_keeps_accumulating() -> None:
    """Without FP8 the model's `set_is_first_microbatch()` does nothing, and preflight does not set the flags
    itself (in training they stay False after the first forward: TE keeps adding into main_grad)."""
    model = CachedCastModel(fp8=False)
    seen: list[bool] = []
    linear = model.net[0]
    original = CachedCastLinear.forward

    def spy(self: CachedCastLinear, x: torch.Tensor) -> torch.Tensor:
        if self is linear:
            seen.append(self.is_first_microbatch)
        return original(self, x)

    CachedCastLinear.forward = spy  # type: ignore[method-assign]
    try:
        batches = [torch.randn(5, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        _run(model, batches[0])
        model.zero_grad()
        seen.clear()
        maingrad.hooks.preflight(model, _run, batches, loss_fn=_loss, finite_differences=False)
    finally:
        CachedCastLinear.forward = original  # type: ignore[method-assign]
    assert seen and not any(seen)


class LazyDelayedScalingLinear(DelayedScalingLinear):
    """TE creates a module's FP8 scaling state at its first FP8 forward: before that `fp8_meta` has no tensors."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__(n_in, n_out)
        self.fp8_meta = {"recipe": "delayed"}
        self.fp8 = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "scaling_fwd" not in self.fp8_meta:
            self.fp8_meta["scaling_fwd"] = SimpleNamespace(amax_history=torch.zeros(4), scale=torch.ones(1))
        self.fp8 = True
        return super().forward(x)


def test_scaling_state_created_by_the_first_run_is_adopted_and_that_run_repeated() -> None:
    """A model that never ran an FP8 forward: its first run creates the state with fresh scales, every later run
    would start from other ones. preflight adopts the new state and runs the first micro-batch again; the
    weights that computed in FP8 are judged with FP8's tolerance."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        LazyDelayedScalingLinear(8, 16), torch.nn.Tanh(), LazyDelayedScalingLinear(16, 4)
    )
    batches = [torch.randn(5, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    result = maingrad.hooks.preflight(model, _run, batches, loss_fn=_loss)
    assert result.status == "pass", result.table()
    assert (
        result.cost["microbatch_passes"] == 7
    )  # the first micro-batch twice, then 2 singles and 3 in sequence
    assert {p.fd_tolerance for p in result.params} == {0.25}
