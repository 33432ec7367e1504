"""A forward that writes a parameter in place (an Embedding with max_norm renormalises the rows it looks up)
makes the loss a function of something other than the weight its gradient is for: the finite differences
read a factor that is the projection, not the gradient path (on the untuned population's batch F, x1.03 by the
loss and x98 on the module's output, a false alarm). preflight leaves such a parameter out of them and says why,
and judges the rest as before."""

from __future__ import annotations

import torch
from preflight_zoo import microbatch, scale
from torch import nn

from maingrad.hooks.preflight import loss_fd
from maingrad.hooks.preflight.run import preflight


class MaxNorm(nn.Module):
    def __init__(self, max_norm: float | None) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16, max_norm=max_norm)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(x))))


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x).reshape(-1, 40), y.reshape(-1))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [
        (torch.randint(0, 40, (3, 8), generator=gen), torch.randint(0, 40, (3, 8), generator=gen))
        for _ in range(3)
    ]


def _run(model: nn.Module, **kwargs: object):  # noqa: ANN202 - the result type
    return preflight(model, microbatch(_loss), _batches(), loss_fn=_loss, **kwargs)


def test_a_parameter_the_forward_writes_is_inconclusive_with_the_reason() -> None:
    torch.manual_seed(60)
    result = _run(MaxNorm(1.0))
    by_name = {p.name: p for p in result.params}
    emb = by_name["emb.weight"]
    assert emb.inconclusive and not emb.anomalies
    assert emb.notes == [loss_fd.WRITTEN_NOTE]
    assert emb.fd_probe is None  # never moved by a probe
    assert result.status == "inconclusive"
    others = [p for n, p in by_name.items() if n != "emb.weight"]
    assert all(not p.inconclusive and not p.anomalies and p.fd_probe for p in others)


def test_without_max_norm_nothing_is_written() -> None:
    torch.manual_seed(60)
    result = _run(MaxNorm(None))
    assert result.status == "pass"
    assert not any(p.inconclusive for p in result.params)


def test_a_bug_beside_the_written_parameter_is_still_named() -> None:
    torch.manual_seed(60)
    model = MaxNorm(1.0)
    scale(2.0)(model, "mix.weight")
    result = _run(model)
    named = {p.name: p.anomalies for p in result.params if p.anomalies}
    assert named == {"mix.weight": ["grad_scaled"]}


def test_without_finite_differences_the_written_parameter_is_not_flagged() -> None:
    """Nothing is judged by finite differences then: the written weight is no exception to report."""
    torch.manual_seed(60)
    result = _run(MaxNorm(1.0), finite_differences=False)
    assert result.status == "pass"
    assert not any(p.inconclusive for p in result.params)
