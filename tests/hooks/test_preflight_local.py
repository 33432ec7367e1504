"""Module-local finite differences (`maingrad.hooks.preflight.local`): each weight of a probed module judged on
its own module's output, inside the backwards preflight runs anyway.

What must hold: a scaled weight is named however small its share of the loss (bf16 included); a zero gradient
the module's output depends on is `grad_lost`, one it does not is `unused`; a weight used outside its module's
call is not judged there (no false alarm from a tie by hand); a module whose forward is not the library's is
not probed; nothing is left behind (weights bit for bit, no hook, its class back)."""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch
from preflight_zoo import cross_entropy, microbatch, mse, regression_batches, token_batches
from torch import nn

from maingrad.hooks.preflight.local import (
    LocalProbe,
    Move,
    column_moves,
    prediction,
    probed_kind,
    product_role,
    zero_probed,
)
from maingrad.hooks.preflight.local_fd import BYPASSED, UNSURE
from maingrad.hooks.preflight.run import preflight


class Tiny(nn.Module):
    """Embedding, LayerNorm and two Linears, bf16 or fp32; `tie`: the output reuses the embedding through
    F.linear in this module's own forward (a use outside any probed call)."""

    def __init__(self, vocab: int = 32, dim: int = 16, tie: bool = False) -> None:
        super().__init__()
        self.tie = tie
        self.emb = nn.Embedding(vocab, dim)
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.head = None if tie else nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        h = h + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(h))))
        if self.head is None:
            return torch.nn.functional.linear(h, self.emb.weight)
        return self.head(h)


def _tiny(dtype: torch.dtype = torch.bfloat16, **kwargs: bool) -> Tiny:
    torch.manual_seed(0)
    return Tiny(**kwargs).to(dtype)


def _anomalies(result: object) -> dict[str, list[str]]:
    return {p.name: p.anomalies for p in result.params if p.anomalies}  # type: ignore[attr-defined]


def _check(model: nn.Module) -> object:
    return preflight(model, microbatch(cross_entropy), token_batches(3), loss_fn=cross_entropy)


def test_every_weight_of_a_correct_bf16_model_is_bounded_and_the_loose_ones_by_their_module() -> None:
    """The loss-level probe alone leaves the small-share weights loosely bounded; those are judged on their
    module, and then every weight rules out a x(1 + UNSURE) (the LayerNorm bias included: its screening set
    bounds it, or it is judged again alone)."""
    alone = preflight(
        _tiny(), microbatch(cross_entropy), token_batches(3), loss_fn=cross_entropy, module_fd=False
    )
    loose = {p.name for p in alone.params if p.fd_resolution is None or p.fd_resolution >= 1.5}
    assert alone.ok and "ln.bias" in loose and alone.local == {"on": False}, alone.table()
    result = _check(_tiny())
    assert result.ok, result.table()
    judged = {p.name for p in result.params if p.fd_local is not None}
    assert result.local["on"] and loose <= judged and result.local["verdicts"] == {"ok": len(judged)}
    for p in result.params:
        assert p.fd_local is None or abs(p.fd_local - 1) <= 0.05, p
        assert p.fd_resolution is not None and p.fd_resolution < 1 + UNSURE, p
    assert not result.weakly_checked(1 + UNSURE)
    assert f"module-local finite differences: {len(judged)} weights judged" in result.table()


def test_a_scaled_small_share_weight_is_named_alone() -> None:
    for name, factor in [("ln.bias", 2.0), ("fc2.bias", 0.5), ("fc1.weight", 1.3)]:
        model = _tiny()
        dict(model.named_parameters())[name].register_hook(lambda g, f=factor: g * f)
        result = _check(model)
        assert _anomalies(result) == {name: ["grad_scaled"]}, result.table()
        target = next(p for p in result.params if p.name == name)
        assert target.fd_probe is not None and target.fd_probe.startswith("module ")
        assert abs(target.fd_scale - factor) <= 0.05 * factor, result.table()


def test_a_zero_gradient_the_output_depends_on_is_lost_and_one_it_does_not_is_unused() -> None:
    model = _tiny()
    model.fc2.bias.register_hook(torch.zeros_like)  # every micro-batch's gradient dropped
    result = _check(model)
    assert _anomalies(result) == {"fc2.bias": ["grad_lost"]}, result.table()
    assert next(p for p in result.params if p.name == "fc2.bias").fd_probe == "module fc2"

    class Idle(nn.Module):  # a branch no micro-batch takes: its weights are truly unused
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(12, 12)
            self.idle = nn.Linear(12, 12)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x) + 0.0 * self.idle(x)

    torch.manual_seed(0)
    result = preflight(Idle(), microbatch(mse), regression_batches(3), loss_fn=mse)
    idle = {p.name: p for p in result.params if p.name.startswith("idle.")}
    assert result.ok and all(p.unused and p.fd_probe == "module idle" for p in idle.values()), result.table()


class Scaled(nn.Module):
    """An attention branch scaled by `scale` into a residual stream (CaiT's layer scale): at 1e-4 in bf16 its
    whole output rounds away in the sum, while the gradient through it does not."""

    def __init__(self, scale: float, dropout: float = 0.0) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, dropout=dropout, batch_first=True)
        self.head = nn.Linear(16, 16)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = 4.0 + x  # a residual stream far larger than the branch
        h = h + self.scale * self.attn(x, x, x, need_weights=False)[0]
        return self.head(h)


def _scaled(scale: float, dtype: torch.dtype, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return Scaled(scale, dropout).to(dtype)


def _attention_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(3, 5, 16, generator=gen), torch.randn(3, 5, 16, generator=gen)) for _ in range(n)]


def _attention_check(model: nn.Module) -> object:
    return preflight(model, microbatch(mse), _attention_batches(3), loss_fn=mse)


@pytest.mark.parametrize("name", ["attn.in_proj_weight", "attn.in_proj_bias"])
def test_a_lost_attention_gradient_is_found_on_its_output_where_the_loss_rounds_it_away(name: str) -> None:
    """The loss does not move bit for bit when the attention's weights move (the branch rounds away), so the
    loss-level probe alone reads a dropped gradient there as `unused`; MultiheadAttention's output moves, and
    its reported gradient is zero: `grad_lost` on the module, and nothing else named."""
    model = _scaled(1e-4, torch.bfloat16)
    dict(model.named_parameters())[name].register_hook(torch.zeros_like)
    result = _attention_check(model)
    assert _anomalies(result) == {name: ["grad_lost"]}, result.table()  # type: ignore[attr-defined]
    p = next(p for p in result.params if p.name == name)  # type: ignore[attr-defined]
    assert p.fd_probe == "module attn" and "its module's output moves" in " ".join(p.notes), p
    alone = preflight(
        _scaled(1e-4, torch.bfloat16), microbatch(mse), _attention_batches(3), loss_fn=mse, module_fd=False
    )
    assert alone.ok, alone.table()  # the correct model passes without the module reruns too
    model = _scaled(1e-4, torch.bfloat16)
    dict(model.named_parameters())[name].register_hook(torch.zeros_like)
    blind = preflight(model, microbatch(mse), _attention_batches(3), loss_fn=mse, module_fd=False)
    assert next(p for p in blind.params if p.name == name).unused, blind.table()  # what the reruns add


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_attention_gradient_is_never_judged_on_its_output_unless_it_is_zero(dtype: torch.dtype) -> None:
    """Attention is not affine in its weights (a finite difference there has a truncation error): a correct
    model passes, its attention weights judged by the loss alone; one truly unused (the branch multiplied by
    zero: no gradient reaches the output either) is `unused`."""
    result = _attention_check(_scaled(0.5, dtype))
    assert result.ok, result.table()  # type: ignore[attr-defined]
    for p in result.params:  # type: ignore[attr-defined]
        assert not (p.name.startswith("attn.") and p.fd_local is not None), p
    idle = _attention_check(_scaled(0.0, dtype))
    attn = [p for p in idle.params if p.name.startswith("attn.")]  # type: ignore[attr-defined]
    assert idle.ok and all(p.unused for p in attn), idle.table()  # type: ignore[attr-defined]


def test_only_torch_attention_is_rerun_and_its_dropout_draws_the_forwards_numbers_again() -> None:
    """A subclass's own forward is not torch's: not rerun. Torch's own with dropout while training is: each rerun
    starts from the random state its forward started from, so it draws the same mask (its rerun reproduces the
    forward, checked), and the state is set back after, so the runs after it draw what they would have (the
    correct model passes: the sequence's micro-batches draw as their singles did)."""

    class Own(nn.MultiheadAttention):
        def forward(self, *args: object, **kwargs: object) -> object:  # type: ignore[override]
            return super().forward(*args, **kwargs)  # type: ignore[arg-type]

    plain = nn.MultiheadAttention(8, 2)
    assert zero_probed(plain) == "MultiheadAttention" and probed_kind(plain) is None
    assert zero_probed(nn.MultiheadAttention(8, 2, dropout=0.1)) == "MultiheadAttention"
    assert zero_probed(Own(8, 2)) is None and zero_probed(nn.Linear(4, 4)) is None
    model = _scaled(1e-4, torch.bfloat16, dropout=0.1)
    before = torch.random.get_rng_state()
    correct = _attention_check(model)
    assert correct.ok, correct.table()  # type: ignore[attr-defined]
    assert torch.equal(torch.random.get_rng_state(), before)
    model = _scaled(1e-4, torch.bfloat16, dropout=0.1)
    model.attn.in_proj_weight.register_hook(torch.zeros_like)
    result = _attention_check(model)
    assert _anomalies(result) == {"attn.in_proj_weight": ["grad_lost"]}, result.table()  # type: ignore[attr-defined]
    own = _scaled(1e-4, torch.bfloat16)
    own.attn.__class__ = Own
    own.attn.in_proj_weight.register_hook(torch.zeros_like)
    result = _attention_check(own)
    p = next(p for p in result.params if p.name == "attn.in_proj_weight")  # type: ignore[attr-defined]
    assert p.fd_probe != "module attn" and not p.anomalies, result.table()  # type: ignore[attr-defined]


@pytest.mark.parametrize("use", ["dropped", "used"])
def test_attention_returning_its_weights_is_measured_on_each_output_that_gets_a_gradient(use: str) -> None:
    """need_weights=True (torch's default) gives a second output that needs a gradient. Each output that gets one
    is measured at it, and the judge sums them (the derivative through the call): where the caller drops the
    weights, the first output alone; where it uses them, both. The attention's out_proj is never called: its
    weights are the attention call's, measured on its output. What the sum cannot do: where the weights do not
    depend on the moved weight (out_proj's) and their gradient is large, their rounding bar hides the first
    output's change, and a zeroed out_proj gradient reads `unused` (not asserted here: a limit, documented)."""

    class Weights(Scaled):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a, w = self.attn(x, x, x)
            h = 4.0 + x + self.scale * a
            if use == "used":
                h = h + 0.5 * w[..., :1]  # each query's weight on the first key
            return self.head(h)

    names = ("attn.in_proj_weight", "attn.out_proj.weight") if use == "dropped" else ("attn.in_proj_weight",)
    for name in names:
        torch.manual_seed(0)
        model = Weights(1e-4).to(torch.bfloat16)
        dict(model.named_parameters())[name].register_hook(torch.zeros_like)
        result = _attention_check(model)
        p = next(p for p in result.params if p.name == name)  # type: ignore[attr-defined]
        assert _anomalies(result) == {name: ["grad_lost"]} and p.fd_probe == "module attn", result.table()  # type: ignore[attr-defined]


def test_a_weight_used_outside_its_module_call_is_not_judged_there() -> None:
    """The tied output `F.linear(h, self.emb.weight)` runs in the model's own forward: the embedding weight is
    seen there, left unmoved by the reruns, and not compared (its module's output carries only part of its
    gradient); every other weight is measured."""
    model = _tiny(tie=True)
    names = [n for n, _ in model.named_parameters()]
    params = dict(enumerate(model.parameters()))
    plan = {i: Move(h=0.01, direction=torch.ones(p.numel())) for i, p in params.items()}
    probe = LocalProbe(model, params, plan)
    with probe.watching():
        cross_entropy(model, token_batches(1)[0]).backward()
    assert {names[i]: how for i, how in probe.escaped.items()} == {"emb.weight": "linear"}
    measured = {names[i] for key in probe.sums for i in key}
    assert measured == set(names) - {"emb.weight"} and not probe.failed
    assert all(type(p) is nn.Parameter for p in model.parameters())
    result = _check(_tiny(tie=True))
    assert result.ok, result.table()


# how fused implementations call a submodule's hooks themselves: pre-forward, post-forward (None: not called)
BY_HAND = {
    # megatron-core 0.19's fused GroupedMLP (`experts.py`): hook(submodule, None), whatever the hook's kind
    "megatron-experts": ((None,), None),
    # megatron-core's TE fused residual RMSNorm, for a hook registered with kwargs and for one without
    "te-kwargs": (((), {}), ((), {}, None)),
    "te-plain": (((),), ((), None)),
    # its fused shared experts (with kwargs; no post-forward hook) and its CUDA graphs (the module alone)
    "shared-experts": (((), {}), None),
    "cuda-graphs": ((), None),
}


class _FusedImpl(nn.Module):
    """Two Linears run by a fused implementation that calls each submodule's hooks itself (`BY_HAND`) and
    computes with the submodules' weights outside their calls."""

    def __init__(self, style: str, dim: int = 16) -> None:
        super().__init__()
        self.pre, self.post = BY_HAND[style]
        self.emb = nn.Embedding(32, dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, 32, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for sub in (self.fc1, self.fc2):
            for hook in list(sub._forward_pre_hooks.values()):
                if hook(sub, *self.pre) is not None:
                    raise RuntimeError("a pre-forward hook modified the input")
        y = torch.nn.functional.linear(h, self.fc1.weight, self.fc1.bias)
        y = torch.nn.functional.linear(torch.nn.functional.gelu(y), self.fc2.weight, self.fc2.bias)
        if self.post is not None:
            for sub in (self.fc1, self.fc2):
                for hook in list(sub._forward_hooks.values()):
                    hook(sub, *self.post)
        return self.head(h + y)


@pytest.mark.parametrize("style", sorted(BY_HAND))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hooks_called_by_hand_are_not_module_calls(style: str, dtype: torch.dtype) -> None:
    """A fused implementation that calls its submodules' hooks itself, with or without the kwargs a hook was
    registered for, must not break the run nor be judged as the submodule's call: the weights it computes with
    are not judged on their module (its hooks were called by hand, or the call has no output to compare), and
    the loss-level probe judges them. The correct model passes; a x2 on one of those
    weights is named, by the loss."""
    torch.manual_seed(0)
    result = _check(_FusedImpl(style).to(dtype))
    assert result.ok and result.error is None, result.table()
    assert all(p.fd_local is None for p in result.params if p.name.startswith("fc")), result.table()
    kwargs = ("te-kwargs", "shared-experts")
    why = "its module could not be rerun" if style in kwargs else BYPASSED
    assert set(result.local["not_judged"]) <= {why, "bounded within x1.25 by the loss-level probe"}, (
        result.local
    )
    torch.manual_seed(0)
    model = _FusedImpl(style).to(dtype)
    model.fc2.weight.register_hook(lambda g: 2 * g)
    result = _check(model)
    assert _anomalies(result) == {"fc2.weight": ["grad_scaled"]}, result.table()
    target = next(p for p in result.params if p.name == "fc2.weight")
    assert target.fd_probe is not None and not target.fd_probe.startswith("module"), result.table()


def test_a_module_whose_forward_is_rewritten_is_not_probed() -> None:
    class Noisy(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * (1 + 0.1 * torch.rand(()))

    plain = nn.Linear(4, 4)
    patched = nn.Linear(4, 4)
    patched.forward = lambda x: x  # type: ignore[method-assign]
    assert probed_kind(plain) == "Linear" and probed_kind(nn.LayerNorm(4)) == "LayerNorm"
    assert probed_kind(Noisy(4, 4)) is None and probed_kind(patched) is None
    assert probed_kind(nn.Sequential(nn.Linear(4, 4))) is None


def test_nothing_is_left_behind() -> None:
    model = _tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    result = _check(model)
    assert result.ok and result.cost["module_reruns"] > 0
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    assert all(type(p) is nn.Parameter for p in model.parameters())
    x = token_batches(1)[0][0]
    assert model(x).dtype == torch.bfloat16  # the model still runs as before


@pytest.mark.parametrize("make", ["tiny", "layernorm-linear"])
def test_a_checked_model_is_freed_once_the_caller_drops_it(make: str) -> None:
    """No reference to the model outlives the call, not even in a cycle the garbage collector cannot see (a
    held output's backward hook holding the probe, through autograd's C++ nodes): a zoo of models checked in
    one process would otherwise keep every one of them on the device."""
    torch.manual_seed(0)
    if make == "tiny":
        model: nn.Module = _tiny()
        result = _check(model)
    else:
        model = _LNChain().bfloat16()
        result = preflight(model, microbatch(mse), regression_batches(3), loss_fn=mse)
    assert result.cost["module_outputs_held"] > 0
    alive = weakref.ref(model)
    del model, result
    gc.collect()
    assert alive() is None


def test_the_local_check_is_off_where_its_comparison_would_not_hold() -> None:
    """One micro-batch (no second backward to screen on) and finite_differences=False: not run, and the
    result says so."""
    model = _tiny()
    one = preflight(model, microbatch(cross_entropy), token_batches(1), loss_fn=cross_entropy)
    assert one.local == {"on": False} and "module-local" not in one.table()
    off = preflight(
        model, microbatch(cross_entropy), token_batches(3), loss_fn=cross_entropy, finite_differences=False
    )
    assert off.local == {"on": False} and off.cost["module_reruns"] == 0


def test_the_reruns_leave_the_backward_unchanged() -> None:
    """The gradients of a run with the module reruns in its backward are those of the same run without them, bit
    for bit (fp32: dy reaches the hooks as an fp32 tensor that the rerun's arithmetic must not touch)."""
    for dtype in (torch.float32, torch.bfloat16):
        model = _tiny(dtype)
        batch = token_batches(1)[0]
        cross_entropy(model, batch).backward()
        plain = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        params = dict(enumerate(model.parameters()))
        plan = {i: Move(h=0.5, direction=torch.randn(p.numel(), dtype=dtype)) for i, p in params.items()}
        probe = LocalProbe(model, params, plan)
        with probe.watching():
            cross_entropy(model, batch).backward()
        assert probe.reruns > 0 and not probe.failed
        for n, p in model.named_parameters():
            assert torch.equal(p.grad, plain[n]), (dtype, n)


def _backward(probe: LocalProbe, model: nn.Module, x: torch.Tensor) -> None:
    """One backward of `model` on `x` (the loss: the sum of its output's squares), watched by `probe` as the
    run's micro-batch 0."""
    with probe.watching():
        probe.current = 0
        model(x).pow(2).sum().backward()


class _Chain(nn.Module):
    """Bias-free Linears in a chain: each weight is its call's only weight (measured against the call's own
    output); `in_place`: the first output is then written in place (relu_), so it is no longer what the
    forward gave."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.in_place = in_place
        self.a = nn.Linear(12, 48, bias=False)
        self.b = nn.Linear(48, 48, bias=False)
        self.c = nn.Linear(48, 48, bias=False)
        self.d = nn.Linear(48, 12, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = torch.relu_(h) if self.in_place else torch.relu(h)
        return self.d(torch.tanh(self.c(torch.tanh(self.b(h)))))


def test_a_weight_alone_is_measured_against_its_own_output_unless_it_was_overwritten() -> None:
    """One rerun instead of two where a weight is its call's only moved weight and the call's output is still
    what the forward computed (a forward difference: the module is affine in that weight); two (a central
    difference) where the output was written in place since. Either way the measurement is the true
    directional derivative through the module, <autograd's gradient, the move>."""
    for in_place in (False, True):
        torch.manual_seed(0)
        model = _Chain(in_place).double()
        x = torch.randn(16, 12, dtype=torch.float64)
        weights = {0: model.a.weight, 1: model.c.weight}
        plan = {
            i: Move(h=0.01, direction=torch.randn(w.numel(), dtype=torch.float64)) for i, w in weights.items()
        }
        starts = {i: w.detach().clone() for i, w in weights.items()}
        probe = LocalProbe(model, weights, plan, one_sided=True)
        _backward(probe, model, x)
        assert probe.reruns == (3 if in_place else 2)
        for i, w in weights.items():
            sums = probe.sums[(i,)]
            sides = 2 if (in_place and i == 0) else 1
            assert sums.sides == {sides}
            predicted = prediction(starts[i], plan[i], w.grad, sides=sides)
            assert float(sums.measured[0]) == pytest.approx(float(predicted), rel=1e-5)  # an fp32 dot
            assert torch.equal(w.detach(), starts[i])  # restored bit for bit


class LayerNormLinear(nn.Module):
    """Transformer Engine's LayerNormLinear as its forward computes (norm, then linear), under its module and
    parameter names: a known class whose output multiplies two of its parameters."""

    def __init__(self, din: int, dout: int, bias: bool = True) -> None:
        super().__init__()
        self.layer_norm_weight = nn.Parameter(1 + 0.1 * torch.randn(din))
        self.layer_norm_bias = nn.Parameter(0.1 * torch.randn(din))
        self.weight = nn.Parameter(torch.randn(dout, din) / din**0.5)
        self.bias = nn.Parameter(0.1 * torch.randn(dout)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.layer_norm(x, x.shape[-1:], self.layer_norm_weight, self.layer_norm_bias)
        return torch.nn.functional.linear(h, self.weight, self.bias)


LayerNormLinear.__module__ = "transformer_engine.pytorch.module.layernorm_linear"


class _LNChain(nn.Module):
    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.a = LayerNormLinear(12, 24, bias)
        self.b = nn.Linear(24, 24)
        self.c = LayerNormLinear(24, 12, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


@pytest.mark.parametrize("masked", [True, False])
def test_a_set_affine_in_its_moves_is_measured_once_against_its_own_output(masked: bool) -> None:
    """A Linear's weight and bias moved together, and a LayerNormLinear's four with the norm's moves on even
    input columns and the linear weight's on odd ones (`column_moves`), change their output affinely: one
    rerun per call against the forward's own output, exact up to rounding. Without the columns the norm's and
    the linear's moves multiply: two reruns (a central difference, exact for a product of two moves); a
    forward difference there is off by the product term."""
    torch.manual_seed(0)
    model = _LNChain().double()
    x = torch.randn(16, 12, dtype=torch.float64)
    names = dict(model.named_parameters())
    weights = dict(enumerate(names.values()))
    index = {name: i for i, name in enumerate(names)}
    plan = {i: Move(h=0.3, direction=torch.randn(w.numel(), dtype=torch.float64)) for i, w in weights.items()}
    for prefix in ("a.", "c."):
        roles = {index[n]: (product_role(n[2:], w), w) for n, w in names.items() if n.startswith(prefix)}
        assert {role for role, _ in roles.values()} == {"norm", "gemm", "bias"}
        for i, columns in column_moves(roles).items():
            plan[i].columns = columns if masked else None
    starts = {i: w.detach().clone() for i, w in weights.items()}
    probe = LocalProbe(model, weights, plan, one_sided=True)
    _backward(probe, model, x)
    assert probe.reruns == (3 if masked else 5)
    for prefix in ("a.", "b.", "c."):
        key = tuple(sorted(i for n, i in index.items() if n.startswith(prefix)))
        sides = 1 if masked or prefix == "b." else 2
        assert probe.sums[key].sides == {sides}
        predicted = sum(float(prediction(starts[i], plan[i], weights[i].grad, sides=sides)) for i in key)
        assert float(probe.sums[key].measured[0]) == pytest.approx(predicted, rel=1e-6)  # fp32 dots
    assert all(torch.equal(w.detach(), starts[i]) for i, w in weights.items())
    # the forward difference of the unmasked moves is not the directional derivative: the columns are needed
    a = model.a
    xs = x.clone()
    with torch.no_grad():
        y0 = a(xs)
        keys = [index[n] for n in names if n.startswith("a.")]
        for i in keys:
            weights[i].add_(
                Move(h=0.3, direction=plan[i].direction).along(weights[i]).view_as(weights[i]), alpha=0.3
            )
        y1 = a(xs)
        for i in keys:
            weights[i].copy_(starts[i])
    h = torch.tanh(a(xs))
    dy = torch.autograd.grad(model.c(torch.tanh(model.b(h))).pow(2).sum(), h)[0] * (1 - h.detach() ** 2)
    exact = sum(
        float(prediction(starts[i], Move(h=0.3, direction=plan[i].direction), g, sides=1))
        for i, g in zip(keys, torch.autograd.grad(a(xs), [weights[i] for i in keys], dy), strict=True)
    )
    assert float((dy * (y1 - y0)).sum()) != pytest.approx(exact, rel=1e-3)


def test_layernorm_linear_weights_are_judged_on_their_module_once_per_call() -> None:
    """A bf16 model of LayerNormLinears: correct, it passes with every weight judged on its module (or bounded
    by the loss-level probe); a factor on one of a LayerNormLinear's weights is named on that weight, by its
    module."""

    def model() -> nn.Module:
        torch.manual_seed(0)
        return _LNChain().bfloat16()

    result = preflight(model(), microbatch(mse), regression_batches(3), loss_fn=mse)
    assert result.ok and result.local["verdicts"] == {"ok": result.local["judged"]}, result.table()
    bounded = result.local["not_judged"].get("bounded within x1.25 by the loss-level probe", 0)
    assert result.local["judged"] + bounded == 10, result.local
    for name in ("a.layer_norm_weight", "a.layer_norm_bias", "a.bias", "c.bias", "c.layer_norm_weight"):
        m = model()
        dict(m.named_parameters())[name].register_hook(lambda g: 2 * g)
        bad = preflight(m, microbatch(mse), regression_batches(3), loss_fn=mse)
        assert _anomalies(bad) == {name: ["grad_scaled"]}, (name, bad.table())
        target = next(p for p in bad.params if p.name == name)
        assert target.fd_probe == f"module {name[0]}" and abs(target.fd_scale - 2) <= 0.05, bad.table()


class _Bounded(LocalProbe):
    """A probe that notes the most bytes of forward outputs it held at once."""

    most = 0

    def _post(self, *args: object, **kwargs: object) -> None:
        super()._post(*args, **kwargs)  # type: ignore[arg-type]
        self.most = max(self.most, self.holding)


class _Twice(nn.Module):
    """One Linear called twice in a forward, and another after it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(48, 48, bias=False)
        self.b = nn.Linear(48, 12, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(torch.tanh(self.a(x)))))


@pytest.mark.parametrize("outputs", [None, 1, 0])
@pytest.mark.parametrize("twice", [False, True])
def test_held_outputs_stay_within_their_bound(outputs: int | None, twice: bool) -> None:
    """The forward outputs held for one-sided reruns never pass `hold_bytes` (None: no bound; here room for one
    output, or none) and are all released by the end of the run. A call past the bound is measured with a
    central difference (a held output larger per saved rerun gives its place to a smaller one), and so is
    every call of its weight (a weight called twice whose first call was held:
    one kind of difference per weight, which the judge needs); each measurement is still <autograd's
    gradient, the move>."""
    torch.manual_seed(0)
    model = _Twice().double() if twice else _Chain(False).double()
    x = torch.randn(16, 48 if twice else 12, dtype=torch.float64)
    weights = {0: model.a.weight, 1: model.b.weight} if twice else {0: model.a.weight, 1: model.c.weight}
    one = 16 * 48 * 8  # the bytes of one output of the first weight's module
    bound = None if outputs is None else outputs * one
    plan = {
        i: Move(h=0.01, direction=torch.randn(w.numel(), dtype=torch.float64)) for i, w in weights.items()
    }
    starts = {i: w.detach().clone() for i, w in weights.items()}
    probe = _Bounded(model, weights, plan, one_sided=True, hold_bytes=bound)
    _backward(probe, model, x)
    calls = 3 if twice else 2
    assert probe.held_calls + probe.unheld_calls == calls
    assert probe.holding == 0  # every held output released
    if bound is not None:
        assert probe.most <= bound
    # room for one output: the first call's is held; a later one as large does not fit, a smaller one (b's,
    # where a is called twice) takes its place: a's calls are then all central, b's one-sided
    assert probe.held_calls == {None: calls, 1: 1, 0: 0}[outputs]
    central = set() if outputs is None else {1} if outputs == 1 and not twice else {0} if outputs else {0, 1}
    assert {i for i in weights if probe.sums[(i,)].sides == {2}} == central
    assert all(len(probe.sums[(i,)].sides) == 1 for i in weights)
    for i, w in weights.items():
        sides = 2 if i in central else 1
        measured = sum(float(m) for m in probe.sums[(i,)].measured)
        predicted = float(prediction(starts[i], plan[i], w.grad, sides=sides))
        assert measured == pytest.approx(predicted, rel=1e-4)  # fp32 dots (a one-sided/central mix-up: x2)
        assert torch.equal(w.detach(), starts[i])


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_weights_are_judged_on_their_modules_under_megatron_fsdp(strategy: str) -> None:
    """Megatron-FSDP (the emulator, one rank) computes with the module's own parameter and the optimizer reads
    another tensor: the module-local check moves the former and compares with the latter's gradient. A x2 on a
    layer-norm bias the loss bounds loosely is named on its module, whatever the strategy."""
    from emulators import MegatronFSDP
    from preflight_zoo import MODELS

    case = MODELS["gpt-untied"]
    clean = preflight(
        MegatronFSDP(case.make(), strategy, unit_types=(), data_parallel_size=1),
        microbatch(case.loss),
        case.batches(3),
        loss_fn=case.loss,
    )
    judged = {p.name for p in clean.params if p.fd_local is not None}
    assert clean.ok and "blocks.1.ln1.bias" in judged and clean.local["verdicts"] == {"ok": len(judged)}
    model = case.make()
    model.blocks[1].ln1.bias.register_hook(lambda g: 2 * g)
    result = preflight(
        MegatronFSDP(model, strategy, unit_types=(), data_parallel_size=1),
        microbatch(case.loss),
        case.batches(3),
        loss_fn=case.loss,
    )
    assert _anomalies(result) == {"blocks.1.ln1.bias": ["grad_scaled"]}, result.table()
    target = next(p for p in result.params if p.name == "blocks.1.ln1.bias")
    assert target.fd_probe == "module blocks.1.ln1" and abs(target.fd_scale - 2) <= 0.02, result.table()


class ForkLNLinear(nn.Module):
    """A norm and a linear in one module, as a fork writes TE's LayerNormLinear (not a class preflight knows)."""

    def __init__(self, din: int, dout: int, noise: float = 0.0, inference_path: bool = False) -> None:
        super().__init__()
        self.noise, self.inference_path = noise, inference_path
        self.layer_norm_weight = nn.Parameter(torch.ones(din))
        self.layer_norm_bias = nn.Parameter(torch.zeros(din))
        self.weight = nn.Parameter(torch.randn(dout, din) / din**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.layer_norm(x, x.shape[-1:], self.layer_norm_weight, self.layer_norm_bias)
        h = torch.nn.functional.dropout(h, self.noise, self.training)  # randomness it was vouched not to have
        if self.inference_path and not torch.is_grad_enabled():  # another computation without autograd
            return torch.nn.functional.linear(h.bfloat16(), self.weight.bfloat16()).float()
        return torch.nn.functional.linear(h, self.weight)


class ForkNet(nn.Module):
    def __init__(self, **kwargs: float) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 16)
        self.fork = ForkLNLinear(16, 32, **kwargs)  # type: ignore[arg-type]
        self.out = nn.Linear(32, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.nn.functional.gelu(self.fork(self.inp(x))))


def _fork(declared: tuple[type, ...] = (ForkLNLinear,), bug: str | None = None, **kwargs: float) -> object:
    torch.manual_seed(0)
    model = ForkNet(**kwargs)
    if bug is not None:
        dict(model.named_parameters())[bug].register_hook(lambda g: 2 * g)
    return preflight(model, microbatch(mse), regression_batches(3), loss_fn=mse, module_fd_classes=declared)


def test_a_declared_class_is_probed_on_the_same_terms_as_a_known_one() -> None:
    class Inherits(ForkLNLinear):
        pass

    class Rewrites(ForkLNLinear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    patched = ForkLNLinear(4, 4)
    patched.forward = lambda x: x  # type: ignore[method-assign]
    declared = (ForkLNLinear,)
    assert probed_kind(ForkLNLinear(4, 4)) is None  # not declared: not probed
    assert probed_kind(ForkLNLinear(4, 4), declared) == "ForkLNLinear"
    assert probed_kind(Inherits(4, 4), declared) == "ForkLNLinear"
    assert probed_kind(Rewrites(4, 4), declared) is None and probed_kind(patched, declared) is None
    assert probed_kind(ForkNet(), (ForkNet,)) is None  # holds children with parameters
    assert probed_kind(nn.Linear(4, 4), declared) == "Linear"  # the known ones stay


def test_a_declared_class_weights_are_judged_on_their_module() -> None:
    correct = _fork()
    assert correct.ok, correct.table()
    fork = {p.name: p for p in correct.params if p.name.startswith("fork.")}
    assert all(p.fd_probe == "module fork" or p.fd_resolution for p in fork.values()), correct.table()
    result = _fork(bug="fork.layer_norm_bias")
    assert _anomalies(result) == {"fork.layer_norm_bias": ["grad_scaled"]}, result.table()
    target = next(p for p in result.params if p.name == "fork.layer_norm_bias")
    assert target.fd_probe == "module fork" and abs(target.fd_scale - 2) < 0.1, result.table()
    assert result.local["declared"] == ["ForkLNLinear"]  # type: ignore[attr-defined]
    assert "probed as declared (module_fd_classes): ForkLNLinear" in result.table()  # type: ignore[attr-defined]
    undeclared = _fork(declared=(), bug="fork.layer_norm_bias")  # the loss alone: a visible miss at best
    assert "declared" not in undeclared.local  # type: ignore[attr-defined]
    # the table points at the class as a candidate (its 3 weights judged by the loss alone); not once declared
    assert undeclared.local["own_classes"] == {"ForkLNLinear": 3}  # type: ignore[attr-defined]
    assert "modules of your own classes: ForkLNLinear (3)" in undeclared.table()  # type: ignore[attr-defined]
    assert "own_classes" not in result.local  # type: ignore[attr-defined]
    assert next(p for p in undeclared.params if p.name == "fork.layer_norm_bias").fd_probe != "module fork"


@pytest.mark.parametrize(
    "kwargs", [{"noise": 0.1}, {"inference_path": True}], ids=["dropout", "inference-path"]
)
def test_a_declared_class_that_does_not_reproduce_its_forward_is_not_judged_there(kwargs: dict) -> None:
    """A class declared wrongly (dropout inside; another computation where autograd is off, as the reruns run):
    its rerun with nothing moved differs from the forward's output, so its weights are not judged on it (no
    false alarm from the rerun's own difference), and the result says why."""
    result = _fork(**kwargs)
    assert not any(_anomalies(result).values()), result.table()
    reasons = result.local["not_judged"]  # type: ignore[attr-defined]
    assert any("does not reproduce its forward" in r for r in reasons), result.local  # type: ignore[attr-defined]
    assert "does not reproduce its forward" in result.table()  # type: ignore[attr-defined]


def test_module_fd_classes_must_be_module_classes() -> None:
    with pytest.raises(TypeError, match="module_fd_classes"):
        _fork(declared=(ForkLNLinear(4, 4),))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="module_fd_classes"):
        _fork(declared=(int,))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_the_module_local_sums_are_the_definition_in_every_output_dtype(dtype: torch.dtype) -> None:
    """`_compare` widens a half-precision output before combining it with fp32 (a GPU's mixed-dtype kernels are
    slow): the numbers must stay those of the definition, <dy, y+ - y-> with y+ - y- exact in fp32, the error
    bar's sum of (dy y)^2 over fp32 (fp64 for an fp64 output) products, and sum |dy (y+ - y-)|; chunked
    like the function (CHUNK lowered so that four chunks are summed, the last a short one)."""
    from maingrad.hooks.preflight import local

    gen = torch.Generator().manual_seed(5)
    n = 3 * 1000 + 17
    plus = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
    minus = (plus.double() + 1e-2 * torch.randn(n, generator=gen, dtype=torch.float64)).to(dtype)
    dy = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
    old = local.CHUNK
    local.CHUNK = 1000
    try:
        value, var, summing = local._compare(plus, minus, dy)
    finally:
        local.CHUNK = old
    parts = []
    for a in range(0, n, 1000):
        g, p, m = dy[a : a + 1000].float(), plus[a : a + 1000], minus[a : a + 1000]
        if dtype == torch.float64:  # fp64 products; fp32(y+) - y- computed in fp64, rounded to fp32
            diff = p.to(torch.float32, copy=True).sub_(m)
        else:
            diff = p.to(torch.float32) - m.to(torch.float32)
        gp, gm = g * p, g * m
        parts.append(
            (torch.dot(g, diff), torch.dot(gp, gp) + torch.dot(gm, gm), torch.dot(g.abs(), diff.abs()))
        )
    want_value, want_var, want_spread = parts[0]
    for v, w, x in parts[1:]:  # accumulated chunk by chunk, in order
        want_value, want_var, want_spread = want_value + v, want_var + w, want_spread + x
    u = float(torch.finfo(dtype).eps) / 2
    assert torch.equal(value, want_value.double())
    assert torch.equal(var, want_var.double() * (u * u / 3))
    assert torch.equal(summing, want_spread.double() * (local.SUM_ROUNDING * math.log2(n)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("sides", [1, 2])
def test_a_module_local_prediction_is_the_definition(dtype: torch.dtype, sides: int) -> None:
    """<reported gradient, w(+h) - w(-h)> (or w(+h) - w) with the moves rounded to the weight's dtype as the
    rerun rounds them, the difference exact (computed wider), summed in fp32 per chunk."""
    gen = torch.Generator().manual_seed(6)
    start = torch.randn(64, 32, generator=gen).to(dtype)
    direction = torch.randn(64 * 32, generator=gen)
    grad = torch.randn(64, 32, generator=gen)
    move = Move(h=0.01, direction=direction)
    got = prediction(start, move, grad, sides=sides)
    s = start.reshape(-1)
    high = torch.add(s, direction, alpha=0.01, out=torch.empty_like(s))
    low = s if sides == 1 else torch.add(s, direction, alpha=-0.01, out=torch.empty_like(s))
    diff = high.float() - low.float() if dtype != torch.float64 else high.float().sub_(low)
    assert torch.equal(got, torch.dot(diff, grad.reshape(-1)).double())
