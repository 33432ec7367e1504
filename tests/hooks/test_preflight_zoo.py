"""maingrad.hooks.preflight on a population (`preflight_zoo.py`): every correct model passes (0 false alarms),
every injected bug is named on the right parameter with the right verdict and nothing else is blamed; plus the
CPU reproductions of the misses reported against the earlier design (a x3 weight diluted by its group, a
gradient dropped by an autograd.Function, a hook halving every second backward, 4 micro-batches cut to 2).

The held-out models and bugs (`HELD_OUT_MODELS`, `HELD_OUT_BUGS`) run here too; they were not looked at while
the steps and thresholds were chosen."""

from __future__ import annotations

import pytest
import torch
from preflight_zoo import (
    BUGS,
    MLP,
    MODELS,
    applicable,
    inject_bug,
    microbatch,
    mse,
    param_of,
    regression_batches,
    scale,
    wrap,
)

from maingrad.hooks.preflight.result import VERDICTS, PreflightResult
from maingrad.hooks.preflight.run import preflight

# bf16 forwards: without the module-local finite differences (module_fd=False), a small factor on one weight of
# the GPT can stay within its group's loss-level error bar (a few percent in bf16), so the group is not
# bisected. For these cases that test asserts that nothing else is blamed and that a miss is visible: the target
# is inconclusive, or its `fd_resolution` (the factor its probe could have passed) is at least the injected
# factor. With the module-local ones (the default) every case must be named exactly.
_BF16_LIMITS = {("gpt-bf16", "x1.3"): 1.3, ("gpt-bf16", "x0.5"): 0.5, ("gpt-bf16", "x2-bias"): 2.0}


def _run(
    model_name: str, bug_name: str | None, n: int = 3, *, module_fd: bool = True
) -> tuple[PreflightResult, torch.nn.Module]:
    case = MODELS[model_name]
    model = case.make()
    wrapped = wrap(case, model)
    if bug_name is not None:
        inject_bug(BUGS[bug_name], case, model)
    result = preflight(
        wrapped, microbatch(case.loss), case.batches(n), loss_fn=case.loss, module_fd=module_fd
    )
    return result, model


def _anomalies(result: PreflightResult) -> dict[str, list[str]]:
    return {p.name: p.anomalies for p in result.params if p.anomalies}


@pytest.mark.parametrize("model_name", list(MODELS))
def test_correct_models_pass(model_name: str) -> None:
    result, _ = _run(model_name, None)
    assert result.status == "pass", result.table()
    assert all(p.verdict in ("ok", "unused") for p in result.params)
    assert all(p.verdict in VERDICTS for p in result.params)
    if model_name.startswith("moe"):  # experts that get no token: probed, the loss does not move
        unused = {p.name for p in result.params if p.verdict == "unused"}
        assert {f"experts.3.w{k}.{leaf}" for k in (1, 2) for leaf in ("weight", "bias")} <= unused
        assert all(name.startswith("experts.") for name in unused), result.table()
        assert all(p.norm_a == 0 for p in result.params if p.name in unused)


CASES = [(m, b) for m in MODELS for b in BUGS if applicable(MODELS[m], BUGS[b])]


@pytest.mark.parametrize(("model_name", "bug_name"), CASES, ids=[f"{m}-{b}" for m, b in CASES])
def test_injected_bug_is_named_on_its_parameter(model_name: str, bug_name: str) -> None:
    result, model = _run(model_name, bug_name)
    expected = BUGS[bug_name].expect(MODELS[model_name], model)
    assert _anomalies(result) == expected, result.table()
    assert result.status == "fail"


@pytest.mark.parametrize(("model_name", "bug_name"), sorted(_BF16_LIMITS))
def test_a_loss_level_miss_is_visible(model_name: str, bug_name: str) -> None:
    """module_fd=False: the loss-level probe alone may miss a small factor in bf16, never silently."""
    result, model = _run(model_name, bug_name, module_fd=False)
    expected = BUGS[bug_name].expect(MODELS[model_name], model)
    assert set(_anomalies(result)) <= set(expected), result.table()  # never a neighbour
    factor = _BF16_LIMITS[(model_name, bug_name)]
    for name in set(expected) - set(_anomalies(result)):  # missed: the result must say it could be
        target = next(p for p in result.params if p.name == name)
        assert target.could_hide(factor), result.table()
        assert target.inconclusive or target in result.weakly_checked(factor), result.table()


# -- the reported misses, reproduced on the CPU ---------------------------------------------------------------------
class Wide(torch.nn.Module):
    """Seven equal linears in one plain-autograd group: one x3 weight moves the group's factor to about 1.3."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(12, 12) for _ in range(7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + 0.3 * torch.tanh(layer(x))
        return x


def test_a_x3_weight_diluted_by_its_group_is_bisected_out() -> None:
    torch.manual_seed(0)
    model = Wide()
    scale(3.0)(model, "layers.3.weight")
    result = preflight(model, microbatch(mse), regression_batches(3), loss_fn=mse)
    group = result.groups[0]
    assert group.depth == 0 and group.verdict == "split" and group.scale is not None
    assert 1.05 < group.scale < 2.0  # diluted by the 13 correct parameters of the group
    assert _anomalies(result) == {"layers.3.weight": ["grad_scaled"]}, result.table()
    bad = next(p for p in result.params if p.name == "layers.3.weight")
    assert bad.fd_scale == pytest.approx(3.0, rel=0.02) and result.cost["bisection_depth"] >= 3


def test_a_gradient_dropped_by_an_autograd_function_is_lost_not_unused() -> None:
    result, _ = _run("mlp", "dropped")
    p = next(p for p in result.params if p.name == "layers.1.weight")
    assert p.anomalies == ["grad_lost"] and p.fd_scale == 0.0 and p.norm_a == 0.0
    assert any(g.zero_gradient and g.verdict == "lost" for g in result.groups)


@pytest.mark.parametrize("n", [3, 4, 5])
def test_a_hook_halving_every_second_backward_is_caught_for_any_count(n: int) -> None:
    result, _ = _run("mlp", "every-second-halved", n=n)
    p = next(p for p in result.params if p.name == "layers.1.weight")
    assert p.anomalies == ["grad_inconsistent"], result.table()
    assert p.fit is not None and any(abs(c - 0.5) < 0.05 for c in p.fit)  # the halved positions


def test_four_microbatches_are_all_run() -> None:
    """A bug that only hits the third micro-batch of a step: all 4 given are run, so it shows."""
    result, _ = _run("mlp", "third-lost", n=4)
    assert result.microbatches == 4 and result.sequence == [1, 2, 3, 0]
    assert result.cost["microbatch_passes"] == 2 * 4 + 1  # singles, the sequence, the repeat
    assert _anomalies(result) == {"layers.1.weight": ["grad_inconsistent"]}, result.table()
    assert not result.warnings


def test_fewer_than_three_microbatches_are_named() -> None:
    torch.manual_seed(0)
    result = preflight(MLP(), microbatch(mse), regression_batches(2), loss_fn=mse)
    assert result.ok and result.microbatches == 2
    assert any("only 2 distinct micro-batches" in w for w in result.warnings)
    assert "warning: only 2 distinct" in result.table()
    with pytest.raises(ValueError, match="more than max_microbatches=3"):
        preflight(MLP(), microbatch(mse), regression_batches(4), loss_fn=mse, max_microbatches=3)
    taken = preflight(MLP(), microbatch(mse), iter(regression_batches(5)), loss_fn=mse, max_microbatches=4)
    assert taken.microbatches == 4 and any(
        "first 4 micro-batches of an iterator" in w for w in taken.warnings
    )


def test_x2_next_to_an_overwritten_weight_is_named_x2() -> None:
    result, model = _run("mlp", "x2+overwritten-neighbour")
    scaled = next(p for p in result.params if p.name == "layers.1.weight")
    assert scaled.anomalies == ["grad_scaled"] and scaled.fd_scale == pytest.approx(2.0, rel=0.02)
    overwritten = next(p for p in result.params if p.name == "layers.0.weight")
    assert overwritten.anomalies == ["grad_overwritten"]
    assert param_of(model, "layers.0.weight").grad is None  # nothing left behind


def test_wrapper_specific_lines() -> None:
    """The likely/fix lines are the found wrapper's: Megatron-FSDP's never appear under Megatron DDP."""
    ddp, _ = _run("mlp-ddp", "stale")
    plain, _ = _run("mlp", "overwrite")
    for result in (ddp, plain):
        assert "Megatron-FSDP" not in result.table() and "overwrite_main_grad is True" not in result.table()
    assert ddp.wrapper_kind == "megatron-ddp" and "zero_grad_buffer()" in ddp.fix("grad_stale")
    assert "replaces .grad" in plain.table()


class _LateExpert(torch.nn.Module):
    """A shared layer and an expert that only rows with a positive first feature reach: in the batches below the
    first micro-batch routes no row to it, the later ones do."""

    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Linear(8, 8)
        self.expert = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.base(x))
        routed = x[:, 0] > 0
        out = h.clone()
        if routed.any():
            out[routed] = out[routed] + self.expert(h[routed])
        return out


def _late_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    out = []
    for k in range(3):
        x = torch.randn(16, 8, generator=gen)
        x[:, 0] = -x[:, 0].abs() if k == 0 else x[:, 0].abs()  # no row of micro-batch 0 reaches the expert
        out.append((x, torch.randn(16, 8, generator=gen)))
    return out


@pytest.mark.parametrize("bug", [None, "dropped"])
def test_an_expert_idle_in_the_first_microbatch_is_probed_on_all_of_them(bug: str | None) -> None:
    """A weight with no gradient on the first micro-batch is not "unused": it is probed on the loss summed over
    every micro-batch, along the sum of its singles (correct: ok) or along a random direction where that sum
    is zero too (its gradient dropped: lost)."""
    from preflight_zoo import _drop_linear

    torch.manual_seed(0)
    model = _LateExpert()
    if bug:
        _drop_linear(model.expert)
    result = preflight(model, microbatch(mse), _late_batches(), loss_fn=mse)
    weight = next(p for p in result.params if p.name == "expert.weight")
    probe = next(g for g in result.groups if "expert.weight" in g.names and g.verdict != "split")
    assert "all micro-batches" in probe.key and probe.zero_gradient == bool(bug), result.table()
    assert not weight.unused
    if bug:
        assert _anomalies(result) == {"expert.weight": ["grad_lost"]}, result.table()
    else:
        assert result.ok and weight.fd_scale == pytest.approx(1.0, rel=1e-3), result.table()
