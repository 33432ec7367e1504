"""preflight's copy of the gradients, rounded to the precision the linearity tolerance uses.

With bf16 parameters and an fp32 main_grad the tolerance is 8 units of bf16 round-off, and the copy of G(A)
(then G(A) + G(B)) is kept in bf16: half the bytes. Rounding G(A), then the sum, adds at most
(sqrt(5) + rel_sum) units of bf16 round-off to |G(A,B) - G(A) - G(B)| / |(G(A), G(B))| (the proof is in
docs/hooks.md); these tests run every verdict with the rounded copy and with a full-precision
one (the old behaviour) and check that nothing but the bytes changes beyond that bound, including a bug
confined to one expert's slice of a 64-expert grouped weight."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch
from emulators import (
    DenseBlock,
    MainWeightsFSDP,
    MegatronFSDP,
    dense_batches,
    fp32_mse_loss,
    fp32_mse_microbatch,
)

from maingrad.hooks.preflight import check as check_module
from maingrad.hooks.preflight.measure import copy_dtype, unit_roundoff
from maingrad.hooks.preflight.run import preflight

U = unit_roundoff(torch.bfloat16)


def _bf16_batches(n: int = 2, tokens: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x.bfloat16(), t.bfloat16()) for x, t in dense_batches(n, tokens=tokens)]


def _run(make, rounded: bool, monkeypatch: pytest.MonkeyPatch, n: int = 2, tokens: int = 16):
    with monkeypatch.context() as m:
        if not rounded:  # the copy in the gradient's own dtype, as before the rounding
            m.setattr(check_module, "copy_dtype", lambda grad_dtype, tolerance: grad_dtype)
        torch.manual_seed(0)
        model = make()
        return preflight(model, fp32_mse_microbatch, _bf16_batches(n, tokens), loss_fn=fp32_mse_loss)


def _verdicts(result) -> dict[str, list[str]]:
    return {p.name: p.anomalies for p in result.params if p.anomalies}


def _fsdp_bf16(middle: str, strategy: str, semantics: str = "main") -> MegatronFSDP:
    return MainWeightsFSDP(DenseBlock(middle).to(torch.bfloat16), strategy, semantics=semantics)


def test_copy_dtype_follows_the_tolerance() -> None:
    bf16_tol = 8 * U  # fp32 main_grad, bf16 parameters: the default tolerance
    assert copy_dtype(torch.float32, bf16_tol) == torch.bfloat16
    fp16_tol = 8 * unit_roundoff(torch.float16)  # fp16 parameters: bf16 is too coarse
    assert copy_dtype(torch.float32, fp16_tol) == torch.float32
    assert copy_dtype(torch.float32, 4e-6) == torch.float32  # fp32 parameters
    assert copy_dtype(torch.float64, 4e-6) == torch.float32
    assert copy_dtype(torch.bfloat16, bf16_tol) == torch.bfloat16  # never wider than the gradient
    assert copy_dtype(torch.float16, 1.0) == torch.float16  # never narrowed below the gradient's own
    assert copy_dtype(torch.float32, 1e-3) == torch.float32  # a caller's rtol below 8 bf16 units


CASES = {
    "accumulates": (lambda: _fsdp_bf16("te", "no_shard"), {}),
    "overwritten": (
        lambda: _fsdp_bf16("te", "optim_grads_params"),
        {"mid.weight": ["grad_overwritten"]},
    ),
    "overwritten+scaled": (
        lambda: _fsdp_bf16("basic", "optim_grads_params"),
        {"mid.weight": ["grad_overwritten", "grad_scaled"]},
    ),
    "lost": (lambda: _fsdp_bf16("guarded", "no_shard"), {"mid.weight": ["grad_lost"]}),
    "megatron-linear": (
        lambda: _fsdp_bf16("megatron", "no_shard", semantics="6773"),
        {"mid.weight": ["grad_overwritten"]},
    ),
}


@pytest.mark.parametrize("n", [2, 1], ids=["A,B", "A twice"])
@pytest.mark.parametrize("case", list(CASES))
def test_rounded_copy_keeps_every_verdict(case: str, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    make, expected = CASES[case]
    full = _run(make, False, monkeypatch, n=n)
    rounded = _run(make, True, monkeypatch, n=n)
    assert _verdicts(full) == expected, full.table()
    assert _verdicts(rounded) == expected, rounded.table()
    assert rounded.cost["copy_bytes"] * 2 == full.cost["copy_bytes"]  # fp32 main_grad kept in bf16
    assert rounded.tolerances["copy_dtypes"] == ["torch.bfloat16"]
    for p, q in zip(rounded.params, full.params, strict=True):
        assert p.tolerance == q.tolerance == pytest.approx(8 * U)
        if q.rel_sum is not None:  # the bound of the docstring
            assert abs(p.rel_sum - q.rel_sum) <= U * (math.sqrt(5) + q.rel_sum) + 1e-7, p.name
        if q.rel_twice is not None:
            assert abs(p.rel_twice - q.rel_twice) <= U * (1 + q.rel_twice) + 1e-7, p.name
        assert p.fit == q.fit and p.rel_repeat == q.rel_repeat  # from the subsets: untouched
        if q.fd_scale is not None:  # the directions are the copy: within a bf16 unit or two of the same
            assert p.fd_scale == pytest.approx(q.fd_scale, rel=0.02), p.name


# -- a bug in one slice of one fused parameter ---------------------------------------------------------------------
class _SliceWgrad(torch.autograd.Function):
    """y = x_e W[e]^T per expert e (equal token splits); the fused wgrad writes every expert's slice of the ONE
    grouped weight's main_grad by adding, except expert `bad`, whose slice it overwrites."""

    @staticmethod
    def forward(ctx, x, weight, bad):  # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.weight = weight
        ctx.bad = bad
        xs = x.chunk(weight.shape[0])
        return torch.cat([xi @ w.t() for xi, w in zip(xs, weight, strict=True)])

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        weight = ctx.weight
        xs, dys = x.chunk(weight.shape[0]), dy.chunk(weight.shape[0])
        dw = torch.stack([dyi.t().float() @ xi.float() for xi, dyi in zip(xs, dys, strict=True)])
        weight.main_grad = weight.get_main_grad()  # Megatron-FSDP: a view of the persistent fp32 buffer
        for e in range(weight.shape[0]):
            if e == ctx.bad:
                weight.main_grad[e].copy_(dw[e])
            else:
                weight.main_grad[e].add_(dw[e])
        weight.grad_added_to_main_grad = True
        dx = torch.cat([dyi @ w for dyi, w in zip(dys, weight, strict=True)])
        return dx, torch.zeros_like(weight), None


class GroupedExperts(torch.nn.Module):
    def __init__(self, experts: int, hidden: int, bad: int | None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, hidden, hidden) / math.sqrt(hidden))
        self.bad = bad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SliceWgrad.apply(x, self.weight, self.bad)


class SliceBlock(torch.nn.Module):
    def __init__(self, bad: int | None, experts: int = 64, hidden: int = 8) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(hidden, hidden)
        self.experts = GroupedExperts(experts, hidden, bad)
        self.out = torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.experts(self.inp(x))))


@pytest.mark.parametrize("bad", [None, 0, 37])
def test_one_overwritten_expert_of_64_in_one_grouped_weight(bad, monkeypatch: pytest.MonkeyPatch) -> None:
    def make() -> MegatronFSDP:
        return MainWeightsFSDP(SliceBlock(bad).to(torch.bfloat16), "no_shard")

    full = _run(make, False, monkeypatch, tokens=128)  # 2 tokens per expert and micro-batch
    rounded = _run(make, True, monkeypatch, tokens=128)
    assert rounded.tolerances["copy_dtypes"] == ["torch.bfloat16"]
    assert _verdicts(rounded) == _verdicts(full), rounded.table()
    if bad is None:
        assert rounded.ok, rounded.table()
        return
    assert set(_verdicts(rounded)) == {"experts.weight"}, rounded.table()
    for result in (full, rounded):
        p = next(p for p in result.params if p.name == "experts.weight")
        # 1/64 of the weight is out: past the tolerance by more than the rounding could move it
        assert p.rel_sum - U * (math.sqrt(5) + p.rel_sum) > p.tolerance, p.rel_sum


def test_rounded_copy_leaves_no_trace() -> None:
    torch.manual_seed(0)
    model = _fsdp_bf16("basic", "optim_grads_params")
    torch.manual_seed(5)
    random.seed(3)
    before = {n: p.detach().clone() for n, p in [*model.raw.items(), *model.dist.items()]}
    rng, py_rng = torch.get_rng_state().clone(), random.getstate()
    result = preflight(model, fp32_mse_microbatch, _bf16_batches(), loss_fn=fp32_mse_loss)
    assert result.status == "fail" and result.cost["copy_bytes"] > 0
    assert all(torch.equal(before[n], p) for n, p in [*model.raw.items(), *model.dist.items()])
    assert torch.equal(rng, torch.get_rng_state()) and py_rng == random.getstate()
    assert torch.count_nonzero(model.grad_data) == 0


@pytest.mark.parametrize("small_move", [None, 100])
@pytest.mark.parametrize("case", ["mlp", "gpt-tied"])
def test_every_loss_evaluation_moves_from_the_callers_weights(
    case: str, small_move: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe's weights are copied once for all its evaluations in a round (`loss_fd._Moving`); a large
    weight's move is written from that copy and the weights are restored once per probe. Every loss forward of an
    evaluation must see exactly the caller's weights moved once, as restoring them and adding the move in place
    would give, and every weight the evaluation does not move untouched, whatever the evaluations before it
    moved (a x2 on one weight: the probe is split, several rounds and probes; the noise's draws are reused for
    its second sign). These models' weights are all small; with `small_move` most of them are large."""
    from preflight_zoo import MODELS, microbatch, scale

    from maingrad.hooks.preflight import check as check_module
    from maingrad.hooks.preflight import loss_fd
    from maingrad.hooks.preflight.moves import Along

    if small_move is not None:
        monkeypatch.setattr(loss_fd, "SMALL_MOVE", small_move)

    model_case = MODELS[case]
    model = model_case.make()
    scale(2.0)(model, model_case.targets["one"])
    params = list(model.parameters())
    start = [p.detach().clone() for p in params]
    slot = {p.data_ptr(): k for k, p in enumerate(params)}
    current: list[Any] = []
    found: list[bool] = []
    evaluate, loss = loss_fd.LossFD.evaluate, check_module.Check.loss

    def spy_evaluate(self, moving, delta, sign):  # noqa: ANN001, ANN202
        current[:] = [moving, delta, sign]
        try:
            return evaluate(self, moving, delta, sign)
        finally:
            current.clear()

    def spy_loss(self, batch):  # noqa: ANN001, ANN202
        if current:
            moving, delta, sign = current
            expected = [s.clone() for s in start]
            for j, (i, t) in enumerate(zip(moving.indexes, moving.targets, strict=True)):
                e = expected[slot[t.data_ptr()]]
                g = moving.grads[j]
                with torch.no_grad():
                    if isinstance(delta, Along) and j in moving.small_along_set:  # one multi-tensor launch
                        e.addcmul_(g, torch.ones_like(g), value=sign * delta.factor(i, e))
                    elif isinstance(delta, Along) and g is not None:
                        e.add_(g, alpha=sign * delta.factor(i, e))
                    else:
                        e.add_(delta(i, e.clone()), alpha=sign)
            found.append(all(torch.equal(p.detach(), e) for p, e in zip(params, expected, strict=True)))
        return loss(self, batch)

    monkeypatch.setattr(loss_fd.LossFD, "evaluate", spy_evaluate)
    monkeypatch.setattr(check_module.Check, "loss", spy_loss)
    result = preflight(model, microbatch(model_case.loss), model_case.batches(3), loss_fn=model_case.loss)
    assert result.status == "fail" and result.cost["bisection_depth"] >= 1
    assert len(found) == result.cost["loss_evaluations"] > 6 and all(found)
    assert all(torch.equal(p.detach(), s) for p, s in zip(params, start, strict=True))


@pytest.mark.parametrize("in_place", [None, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_a_loss_level_prediction_is_the_sum_of_the_concatenated_products(
    dtype: torch.dtype, in_place: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`LossFD._predictions`: <G, move> of a group of weights, big ones (their products written in place into one
    buffer, from `PREDICT_IN_PLACE` elements: 1000 here) and smaller ones (one multi-tensor launch) mixed, or all
    concatenated (below it), is the sum of the concatenated products bit for bit, in every weight dtype against
    an fp32 gradient (and an fp64 one for fp64 weights); a product written to the wrong place or left out
    changes it."""
    from maingrad.hooks.preflight import loss_fd

    if in_place is not None:
        monkeypatch.setattr(loss_fd, "PREDICT_IN_PLACE", in_place)
    # fresh buffers full of NaN: a product never written shows (not a reused block's values)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(math.nan))
    gen = torch.Generator().manual_seed(5)
    gdtype = torch.float64 if dtype == torch.float64 else torch.float32
    sizes = [(3, 7), (1005,), (11,), (2, 600), (1000,)]
    items = []
    for shape in sizes:
        old = torch.randn(shape, generator=gen).to(dtype)
        moved = (old.float() + 0.01 * torch.randn(shape, generator=gen)).to(dtype)
        items.append((moved, old, torch.randn(shape, generator=gen, dtype=gdtype)))
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    (got,) = loss_fd.LossFD._predictions(items, dtype)
    expected = torch.cat([((t - o) * g).reshape(-1) for t, o, g in items]).sum(dtype=acc)
    assert torch.equal(got, expected)
    assert got.dtype == acc and got != 0
