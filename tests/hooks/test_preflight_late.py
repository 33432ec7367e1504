"""The probe on the first micro-batch's loss after the module-local screening (`Check.plan_loss_level`, on with
`check.AFTER_SCREENING`, off by default): where the weights the screening cannot judge and the small ones fit in a quarter of the copy, the loss-level probe
moves only those, along copies kept from before the second single; the weights judged on their own module are
not moved. Models here have weights above `END_TO_END_MAX` elements, so that path runs on the CPU."""

from __future__ import annotations

from typing import Any

import pytest
import test_preflight_local as local_tests
import test_preflight_wild as wild_tests
import test_preflight_zoo as zoo_tests
import torch
import torch.nn.functional as F
from emulators import MegatronDDP, MegatronFSDP
from preflight_zoo import microbatch, mse, scale
from torch import nn

from maingrad.hooks.preflight import check as check_module
from maingrad.hooks.preflight.result import PreflightResult
from maingrad.hooks.preflight.run import preflight

DIM = 272  # 272 x 272 = 73,984 elements: above END_TO_END_MAX


@pytest.fixture(autouse=True)
def after_screening(monkeypatch: pytest.MonkeyPatch) -> None:
    """The path is off by default (`check.AFTER_SCREENING`); every test here turns it on."""
    monkeypatch.setattr(check_module, "AFTER_SCREENING", True)


class Doubled(torch.autograd.Function):
    """The identity whose backward doubles the gradient: a wrong backward between two modules."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN401
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # noqa: ANN401
        return 2 * g


class Deep(nn.Module):
    """Pre-norm residual blocks of LayerNorm + Linear with a small head; `faulty`: the block whose output's
    gradient is doubled on its way back (its weights get x2, those below it a mix)."""

    def __init__(self, depth: int = 3, faulty: int | None = None, tied_by_hand: bool = False) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(depth))
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(depth))
        self.head = nn.Linear(DIM, 8)
        self.faulty = faulty
        self.tied_by_hand = tied_by_hand

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, (norm, layer) in enumerate(zip(self.norms, self.layers, strict=True)):
            h = layer(norm(x))
            if k == self.faulty:
                h = Doubled.apply(h)
            x = x + 0.5 * torch.tanh(h)
        if self.tied_by_hand:  # the first layer's weight used again outside its module
            x = x + 0.1 * torch.tanh(F.linear(x, self.layers[0].weight))
        return self.head(x)


def _batches(n: int = 3, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [
        (torch.randn(24, DIM, generator=g).to(dtype), torch.randn(24, 8, generator=g).to(dtype))
        for _ in range(n)
    ]


def _run(model: nn.Module, dtype: torch.dtype = torch.float32, wrapper: str = "plain") -> PreflightResult:
    torch.manual_seed(0)
    model = model.to(dtype)
    wrapped = {
        "plain": lambda: model,
        "ddp": lambda: MegatronDDP(model),
        "fsdp": lambda: MegatronFSDP(model, "no_shard", unit_types=(), data_parallel_size=1),
    }[wrapper]()
    return preflight(wrapped, microbatch(mse), _batches(dtype=dtype), loss_fn=mse)


def _named(result: PreflightResult) -> dict[str, list[str]]:
    return {p.name: p.anomalies for p in result.params if p.anomalies}


def _model(**kwargs: Any) -> Deep:  # noqa: ANN401
    torch.manual_seed(1)
    return Deep(**kwargs)


WRAPPERS = ["plain", "ddp", "fsdp"]
# (the Megatron-FSDP emulator keeps an fp32 gradient buffer that a bf16 parameter's .grad cannot take)
DTYPES_WRAPPERS = [(torch.float32, w) for w in WRAPPERS] + [
    (torch.bfloat16, "plain"),
    (torch.bfloat16, "ddp"),
]


@pytest.mark.parametrize(("dtype", "wrapper"), DTYPES_WRAPPERS)
def test_a_correct_model_passes_with_the_big_weights_judged_on_their_module_only(
    dtype: torch.dtype, wrapper: str
) -> None:
    result = _run(_model(), dtype, wrapper)
    assert result.status == "pass", result.table()
    big = {p.name for p in result.params if p.numel > check_module.END_TO_END_MAX}
    assert big == {f"layers.{k}.weight" for k in range(3)}
    # the loss-level probe moved every other parameter and none of those
    assert result.cost["fd_first_params"] == len(result.params) - len(big)
    moved = {name for g in result.groups if g.depth == 0 for name in g.names}
    assert moved == {p.name for p in result.params} - big
    for p in result.params:
        assert p.verdict == "ok" and not p.inconclusive, result.table()
        if p.name in big:
            assert p.fd_probe is not None and p.fd_probe.startswith("module "), p
            assert p.fd_resolution is not None and p.fd_resolution < 1.5, p


@pytest.mark.parametrize(("target", "factor"), [("layers.1.weight", 2.0), ("layers.2.bias", 2.0),
                                                ("norms.0.weight", 3.0), ("layers.0.weight", 0.5)])  # fmt: skip
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_a_scaled_weight_is_named_alone(target: str, factor: float, wrapper: str) -> None:
    model = _model()
    scale(factor)(model, target)
    result = _run(model, wrapper=wrapper)
    assert _named(result) == {target: ["grad_scaled"]}, result.table()
    p = next(p for p in result.params if p.name == target)
    assert p.fd_scale == pytest.approx(factor, rel=0.05) or p.fd_local == pytest.approx(factor, rel=0.05)


def test_a_wrong_gradient_upstream_of_a_module_is_named_on_its_weights() -> None:
    """A backward that doubles the gradient reaching layer 1's output: its module-local check agrees with the
    doubled gradient, the loss-level probe blames the small weights below it, and the big weights the
    screening passed are probed on the loss after all (all micro-batches), where layer 1's weight is x2."""
    result = _run(_model(faulty=1))
    named = _named(result)
    assert result.status == "fail"
    assert named.get("layers.1.weight") == ["grad_scaled"], result.table()
    assert named.get("layers.1.bias") == ["grad_scaled"], result.table()
    assert not {n for n in named if n.startswith(("layers.2.", "norms.2.", "head."))}, result.table()
    w = next(p for p in result.params if p.name == "layers.1.weight")
    assert w.fd_scale == pytest.approx(2.0, rel=0.05) and w.fd_local == pytest.approx(1.0, abs=0.05)
    assert any("(all micro-batches)" in g.key and "layers.1.weight" in g.names for g in result.groups)


def test_a_big_weight_used_outside_its_module_is_judged_on_the_loss() -> None:
    result = _run(_model(tied_by_hand=True))
    assert result.status == "pass", result.table()
    assert result.local["not_judged"].get("used outside its module's call") == 1
    moved = {name for g in result.groups if g.depth == 0 for name in g.names}
    assert "layers.0.weight" in moved and "layers.1.weight" not in moved
    model = _model(tied_by_hand=True)
    scale(2.0)(model, "layers.0.weight")
    assert _named(_run(model)) == {"layers.0.weight": ["grad_scaled"]}


def test_copies_over_the_share_go_to_the_probe_on_all_microbatches(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight the screening could not judge whose copy would pass LATE_SHARE of the copy is probed after the
    singles, on every micro-batch's loss along their sum, instead of being copied."""
    monkeypatch.setattr(check_module, "LATE_SHARE", 0.05)
    model = _model(tied_by_hand=True)
    scale(2.0)(model, "layers.0.weight")
    result = _run(model)
    assert _named(result) == {"layers.0.weight": ["grad_scaled"]}, result.table()
    assert "layers.0.weight" not in {n for g in result.groups if g.depth == 0 and "all micro" not in g.key
                                     for n in g.names}  # fmt: skip
    assert any("(all micro-batches)" in g.key and "layers.0.weight" in g.names for g in result.groups)


def test_without_small_weights_every_weight_is_probed_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """No weight small enough to carry the check of the gradients modules receive: the probe runs right after
    the first micro-batch and moves every weight, as with module_fd=False."""
    monkeypatch.setattr(check_module, "END_TO_END_MAX", 0)
    result = _run(_model())
    assert result.status == "pass", result.table()
    assert result.cost["fd_first_params"] == len(result.params)


# -- the CPU populations on this path ---------------------------------------------------------------------------
# Their models are small: with END_TO_END_MAX lowered to 64 elements, 786 of their 1,015 cases take this path
# (the biases and norms of a few dozen elements stay in the loss-level probe, the weight matrices do not).
LATE_MAX = 64


@pytest.fixture
def late(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(check_module, "END_TO_END_MAX", LATE_MAX)


@pytest.mark.parametrize("model_name", list(zoo_tests.MODELS))
def test_the_zoo_passes_on_this_path(late: None, model_name: str) -> None:
    zoo_tests.test_correct_models_pass(model_name)


@pytest.mark.parametrize(
    ("model_name", "bug_name"), zoo_tests.CASES, ids=[f"{m}-{b}" for m, b in zoo_tests.CASES]
)
def test_the_zoo_bugs_are_named_on_this_path(late: None, model_name: str, bug_name: str) -> None:
    zoo_tests.test_injected_bug_is_named_on_its_parameter(model_name, bug_name)


@pytest.mark.parametrize(("name", "seed"), wild_tests.correct_params())
def test_the_wild_population_passes_on_this_path(late: None, name: str, seed: int) -> None:
    wild_tests.test_a_correct_model_passes(name, seed)


@pytest.mark.parametrize(("name", "seed", "bug"), wild_tests.buggy_params(late=True))
def test_the_wild_bugs_are_named_or_visibly_missed_on_this_path(
    late: None, name: str, seed: int, bug: str
) -> None:
    wild_tests.test_a_bug_is_named_on_its_parameter_or_visibly_missed(name, seed, bug)


def test_most_population_cases_take_this_path(late: None) -> None:
    """(The populations above run here, not the early path: a GPT of the zoo moves only its small weights.)"""
    result, _ = zoo_tests._run("gpt-tied", None)
    assert 0 < result.cost["fd_first_params"] < len(result.params), result.table()


@pytest.mark.parametrize("style", list(local_tests.BY_HAND))
def test_weights_the_loss_cannot_judge_alone_are_probed_with_anchors(late: None, style: str) -> None:
    """bf16, a fused implementation computing with its modules' weights: the two biases left to the loss (the
    module-local check judges nothing else there) move the bf16 loss too little for two steps to agree; they are
    probed again with a weight their module judged `ok` as an anchor, which bounds them as the probe of every
    weight does, instead of leaving them inconclusive."""
    torch.manual_seed(0)
    result = local_tests._check(local_tests._FusedImpl(style).to(torch.bfloat16))
    assert result.ok and not any(p.inconclusive for p in result.params), result.table()
    anchored = [g for g in result.groups if g.key.endswith("(anchored)")]
    assert anchored and anchored[0].verdict == "ok", result.table()


@pytest.mark.parametrize(("local_verdict", "reliable", "expected"), [
    (None, False, "scaled"),  # no module-local verdict: consistently off at every step is a blame
    ("ok", False, "inconclusive"),  # its module judged it ok: only two agreeing steps may overrule that
    ("ok", True, "scaled"),
    ("scaled", False, "scaled"),
])  # fmt: skip
def test_a_weight_its_module_judged_ok_is_blamed_only_on_a_self_checking_estimate(
    local_verdict: str | None, reliable: bool, expected: str
) -> None:
    """`LossFD._finish` on one parameter whose loss changes 0.57 x as much as predicted at every step: with
    steps agreeing (reliable) or only consistently off (`off`)."""
    from maingrad.hooks.preflight.check import Check
    from maingrad.hooks.preflight.local import LocalVerdict
    from maingrad.hooks.preflight.measure import Estimate
    from maingrad.hooks.preflight.wrappers import choose

    model = _model()
    check = Check(model, microbatch(mse), _batches(), loss_fn=mse, adapter=choose(model, "plain"), params=None,
                  finite_differences=True, fd_groups="mechanism", fd_step=None, fd_rtol=None, rtol=None,
                  rng_states=())  # fmt: skip
    i = next(k for k, e in enumerate(check.entries) if e.name == "layers.2.bias")
    if local_verdict is not None:
        check.local_fd.verdicts[i] = LocalVerdict((i,), 1.0, 1.0, 0.0, 1.0, 0.01, local_verdict)
    node = check.loss_fd._node("layers.2.bias", [i], False, 0)
    steps = [2.0**-8, 2.0**-9, 2.0**-10]
    node.levels = {s: (0.57 * s, s) for s in steps}  # C = 0.57 P at every step, far above the noise
    node.probe.noise = 1e-9
    check.loss_fd.loss_level = 1.0
    est = Estimate(ratio=0.57, error=0.01 if reliable else 0.15, step=steps[-1], pair=(steps[-2], steps[-1]),
                   reliable=reliable, off=not reliable)  # fmt: skip
    assert check.loss_fd._finish(node, est, confirmed=True) == []
    assert node.probe.verdict == expected, node.probe.reason


class Spread(Deep):
    """The loss evaluations (`loss_fn`) see every small weight's effect damped by `damp` around its value at
    the start, the training runs the plain model: each small weight's loss-level estimate reads reported /
    estimated = 1 / damp while its gradient is right (what the H200 showed on a correct bf16 GPT: its biases'
    and norms' loss-level estimates 2-10% off together, their module-local verdicts ok). Each op's change from
    the start is damped in fp32 before the one rounding of its output: a damped bf16 weight would round back."""

    def __init__(self, damp: float) -> None:
        super().__init__()
        self.damp = damp
        self.damping = False
        self.start: dict[str, torch.Tensor] = {}

    def snapshot(self) -> None:
        self.start = {n: p.detach().clone() for n, p in self.named_parameters()}

    def _damped(self, op: Any, x: torch.Tensor, *names: str) -> torch.Tensor:  # noqa: ANN401
        params = dict(self.named_parameters())
        now = op(x, *(params[n] for n in names)).float()
        then = op(x, *(self.start[n] for n in names)).float()
        return (then + self.damp * (now - then)).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.damping:
            return super().forward(x)
        for k in range(len(self.layers)):
            h = self._damped(
                lambda t, w, b: F.layer_norm(t, (DIM,), w, b), x, f"norms.{k}.weight", f"norms.{k}.bias"
            )
            h = F.linear(h, self.layers[k].weight) + self._damped(
                lambda t, b: b.expand_as(t), h, f"layers.{k}.bias"
            )
            x = x + 0.5 * torch.tanh(h)
        return self._damped(F.linear, x, "head.weight", "head.bias")


def _spread_run(model: Spread) -> PreflightResult:
    torch.manual_seed(0)
    model = model.to(torch.bfloat16)
    model.snapshot()

    def damped_loss(m: nn.Module, batch: Any) -> torch.Tensor:  # noqa: ANN401
        m.damping = True
        try:
            return mse(m, batch)
        finally:
            m.damping = False

    return preflight(model, microbatch(mse), _batches(dtype=torch.bfloat16), loss_fn=damped_loss)


def test_a_deviation_spread_over_the_small_weights_is_not_bisected_to_single_weights() -> None:
    """A group's halves that deviate no more than the group did hold no weight that made the deviation: the
    probe stops there, each weight bounded by its share (an 8% deviation, within what a bf16 weight alone may show)."""
    torch.manual_seed(1)
    result = _spread_run(Spread(1 / 1.08))
    assert result.ok and _named(result) == {}, result.table()
    assert result.cost["bisection_depth"] <= 1, result.table()


def test_a_weight_off_among_a_spread_deviation_is_still_named() -> None:
    """The same spread, and one small weight's gradient x3: its half deviates more than the group, and is
    bisected down to it."""
    for target in ("norms.1.weight", "layers.2.bias"):
        torch.manual_seed(1)
        model = Spread(1 / 1.08)
        dict(model.named_parameters())[target].register_hook(lambda g: 3 * g)
        result = _spread_run(model)
        assert _named(result) == {target: ["grad_scaled"]}, result.table()
