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
    from maingrad.hooks.preflight import run as run_module

    monkeypatch.setattr(run_module, "fp8_state_pairs", lambda model: [])
    model = _model()
    batches = [torch.randn(5, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    for b in batches:
        _run(model, b)
    model.zero_grad()
    result = maingrad.hooks.preflight(model, _run, batches, loss_fn=_loss)
    assert result.status != "pass"
