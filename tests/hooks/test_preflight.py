"""maingrad.hooks.preflight on the CPU emulators: each accumulation bug classified, passing paths pass, and the
model's state afterwards equals its state before."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from emulators import (
    FFN,
    SPLITS,
    DenseBlock,
    E,
    H,
    MegatronDDP,
    MegatronFSDP,
    MoELayer,
    batches,
    dense_batches,
    moe_loss,
    moe_microbatch,
    mse_loss,
    mse_microbatch,
)
from preflight_zoo import overwrite

import maingrad.hooks
from maingrad.contracts.records import validate
from maingrad.hooks.preflight import run as preflight_module
from maingrad.hooks.preflight.result import PreflightResult, result_from_dict
from maingrad.hooks.preflight.run import PreflightFailed, preflight, preflight_from_env


def fsdp(middle: str, strategy: str, *, dp: int = 1, semantics: str = "main", **kw) -> MegatronFSDP:
    torch.manual_seed(0)
    return MegatronFSDP(
        DenseBlock(middle, **kw), strategy, unit_types=(), data_parallel_size=dp, semantics=semantics
    )


def check(model: torch.nn.Module, n: int = 3, **kw) -> PreflightResult:
    return preflight(model, mse_microbatch, dense_batches(n), loss_fn=mse_loss, **kw)


def verdicts(result) -> dict[str, list[str]]:
    """parameter name -> anomaly codes, failing parameters only."""
    return {p.name: p.anomalies for p in result.params if p.anomalies}


# -- 1. an accumulating fused path passes ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        lambda: fsdp("te", "no_shard"),
        lambda: fsdp("te", "optim", semantics="main"),  # Megatron-LM main (#6357): optim keeps the flag False
        lambda: fsdp("te", "optim_grads_params", semantics="6773"),  # one-rank groups: flag False
        lambda: fsdp("basic", "no_shard"),
        lambda: fsdp("megatron", "optim_grads_params", dp=2),  # out= into a temporary bucket, then reduced
        lambda: fsdp(
            "te", "optim_grads_params", dp=2
        ),  # real sharding: overwriting the temporary bucket is right
        lambda: fsdp("basic", "optim_grads_params", dp=2),  # sharded copy_ of the returned main_grad: 1x
        lambda: MegatronDDP(DenseBlock("megatron")),  # the DDP branch: apex kernel accumulates
        lambda: MegatronDDP(DenseBlock("basic")),
        lambda: DenseBlock("plain"),
    ],
    ids=[
        "te-no_shard",
        "te-optim-main",
        "te-ogp-6773",
        "basic-no_shard",
        "megatron-ogp-dp2",
        "te-ogp-dp2",
        "basic-ogp-dp2",
        "ddp-megatron",
        "ddp-basic",
        "plain",
    ],
)
def test_accumulating_paths_pass(make) -> None:
    model = make()
    result = check(model)
    assert result.status == "pass", result.table()
    assert all(p.rel_sum is not None and p.rel_sum <= p.tolerance for p in result.params if p.norm_a > 0)
    scaled = [g.scale for g in result.groups if g.scale is not None]
    assert scaled and all(abs(s - 1) < 0.05 for s in scaled), result.table()


def test_megatron_linear_no_shard_dp2_is_a_real_overwrite_only_at_dp1() -> None:
    # megatron-core's Megatron-FSDP branch overwrites whatever the flag says; with a real (dp 2) sharded
    # buffer nothing persistent is overwritten under optim_grads_params, but no_shard is never sharded.
    assert verdicts(check(fsdp("megatron", "no_shard", dp=2))) == {"mid.weight": ["grad_overwritten"]}


# -- 2. overwrites: flag-driven and flag-ignoring -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("strategy", "semantics"),
    [
        ("optim_grads_params", "main"),
        ("optim_grads", "main"),
        ("optim", "0.19.2"),
        ("optim_grads_params", "0.19.2"),
    ],
)
def test_flag_driven_overwrite(strategy: str, semantics: str) -> None:
    result = check(fsdp("te", strategy, semantics=semantics))
    assert result.status == "fail"
    assert verdicts(result) == {"mid.weight": ["grad_overwritten"]}
    mid = next(p for p in result.params if p.name == "mid.weight")
    assert mid.overwrite_main_grad is True and mid.mechanism_kind == "te_module"
    assert mid.fit is not None and len(mid.fit) == 3  # coefficients by position in the sequence
    assert all(abs(c) < 0.01 for c in mid.fit[:2]) and abs(mid.fit[2] - 1) < 0.01  # the last one alone
    assert 0.3 < mid.rel_sum < 1.0
    assert "persistent (unsharded) buffer" in mid.notes[0]
    assert mid.fd_scale == pytest.approx(1.0, abs=0.05)  # one micro-batch is right: no scale error


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads_params"])
def test_flag_ignoring_overwrite(strategy: str) -> None:
    """megatron-core tensor_parallel/layers.py: out=main_grad under Megatron-FSDP, whatever the flag."""
    result = check(fsdp("megatron", strategy, semantics="6773"))  # the flag is never True here
    assert verdicts(result) == {"mid.weight": ["grad_overwritten"]}
    mid = next(p for p in result.params if p.name == "mid.weight")
    assert mid.overwrite_main_grad is not True and mid.mechanism_kind == "megatron_linear"
    assert "whatever overwrite_main_grad says" in mid.notes[0]


def test_moe_experts_overwritten_by_019_exposure() -> None:
    """megatron-core 0.19.2 TEGroupedMLP (op-fuser, forces overwrite_main_grad=True) at data-parallel size 1."""
    torch.manual_seed(0)
    layer = MoELayer(E, H, FFN, version="0.19.2")
    model = MegatronFSDP(layer, "optim_grads_params", semantics="0.19.2", data_parallel_size=1)
    data = batches(1, 2)[0]
    result = preflight(model, moe_microbatch, data, loss_fn=moe_loss)
    bad = verdicts(result)
    experts = {f"experts.linear_fc{i}.weight{j}" for i in (1, 2) for j in range(E) if SPLITS[j]}
    assert set(bad) == experts and all(v == ["grad_overwritten"] for v in bad.values()), result.table()
    unused = [p for p in result.params if p.name.endswith("weight1") and "experts" in p.name]
    assert unused and all(p.ok and p.norm_a == 0 for p in unused)  # expert 1 gets no token: ok, not "lost"
    assert any(g.zero_gradient and g.verdict == "unused" for g in result.groups)
    no_shard = MegatronFSDP(
        MoELayer(E, H, FFN, version="0.19.2"), "no_shard", semantics="0.19.2", data_parallel_size=1
    )
    assert preflight(no_shard, moe_microbatch, data, loss_fn=moe_loss).ok


# -- 3. a path returning main_grad as the autograd gradient: 2x ---------------------------------------------------
def test_basic_linear_overwrite_doubles_the_gradient() -> None:
    result = check(fsdp("basic", "optim_grads_params"))
    bad = verdicts(result)
    assert bad == {"mid.weight": ["grad_overwritten", "grad_scaled"]}, result.table()
    mid = next(p for p in result.params if p.name == "mid.weight")
    assert mid.fd_scale == pytest.approx(2.0, rel=0.02)
    assert mid.fit[-1] == pytest.approx(1.0, abs=0.01)  # G(seq) = G(last) = 2 g(last)
    assert any("returned main_grad as the autograd gradient" in n for n in mid.notes)


def test_scaled_with_one_microbatch_only() -> None:
    """One batch: the 'A twice' law instead of A,B; the x2 still comes from the finite differences."""
    result = check(fsdp("basic", "optim_grads_params"), n=1)
    mid = next(p for p in result.params if p.name == "mid.weight")
    assert mid.anomalies == ["grad_overwritten", "grad_scaled"] and mid.rel_twice is not None
    assert check(fsdp("te", "no_shard"), n=1).ok


# -- 4. lost wgrad and never-written buckets ------------------------------------------------------------------------
def test_lost_wgrad() -> None:
    result = check(fsdp("guarded", "no_shard"))
    assert verdicts(result) == {"mid.weight": ["grad_lost"]}, result.table()
    group = next(g for g in result.groups if "mid.weight" in g.names)
    assert group.zero_gradient and group.verdict == "lost"
    # the same module under Megatron DDP (main_grad always a buffer) is fine
    assert check(MegatronDDP(DenseBlock("guarded"))).ok


def test_unwritten_sharded_bucket_is_not_finite() -> None:
    result = check(
        fsdp("guarded", "optim_grads_params", dp=2)
    )  # the NaN-filled temporary bucket reaches the buffer
    assert verdicts(result) == {"mid.weight": ["grad_not_finite"]}


# -- 5. nondeterminism is named, not blamed on accumulation ---------------------------------------------------------
def test_nondeterministic_module() -> None:
    result = check(DenseBlock("noisy"))
    assert result.status == "fail"
    codes = {code for p in result.params for code in p.anomalies}
    assert codes == {"grad_nondeterministic"}, result.table()
    assert next(p for p in result.params if p.name == "mid.weight").rel_repeat > 0.01


def _noisy_gradient(param: torch.Tensor, relative: float, scalar: bool, seed: int) -> None:
    """Run-to-run noise preflight cannot reset (a private generator advancing every backward): added to the
    gradient with `relative` x its norm, spread over the elements, or (scalar) the gradient x (1 + U(-r, r))."""
    gen = torch.Generator().manual_seed(seed)

    def hook(g: torch.Tensor) -> torch.Tensor:
        if scalar:
            return g * (1 + relative * (2 * torch.rand((), generator=gen) - 1))
        noise = torch.randn(g.shape, generator=gen)
        return g + relative * g.norm() * noise / noise.norm()

    param.register_hook(hook)


@pytest.mark.parametrize("hidden", [8, 16, 32])
def test_run_to_run_noise_is_never_named_an_accumulation_bug(hidden: int) -> None:
    """A population of nondeterministic gradients (spread noise from 4 to 256 x the tolerance, and a random scale
    per backward of 30% and 60%), 5 seeds each: the verdict is always nondeterminism, from the repeat; the fit
    residual that lets an overwritten gradient skip the repeat never lets noise skip it."""
    tol = 4.8e-6  # the fp32 linearity tolerance's floor
    kinds = [(f * tol, False) for f in (4, 16, 64, 256)] + [(0.3, True), (0.6, True)]
    for relative, scalar in kinds:
        for seed in range(5):
            torch.manual_seed(seed)
            block = DenseBlock("plain", hidden)
            _noisy_gradient(block.mid.weight, relative, scalar, seed)
            result = preflight(block, mse_microbatch, dense_batches(3, hidden), loss_fn=mse_loss)
            mid = next(p for p in result.params if p.name == "mid.weight")
            assert mid.anomalies == ["grad_nondeterministic"], (relative, scalar, seed, result.table())
            assert mid.rel_repeat is not None and mid.rel_repeat > mid.tolerance / 2


@pytest.mark.parametrize("hidden", [8, 16, 32])
def test_an_exact_overwrite_skips_the_repeat(hidden: int) -> None:
    """The same population's overwritten gradient (each backward replaces .grad): the fit (0, 0, 1) leaves a
    residual far below tolerance / 8, so the first micro-batch is not run again; with run-to-run noise on top,
    the residual shows it and the repeat names the noise."""
    for seed in range(5):
        torch.manual_seed(seed)
        block = DenseBlock("plain", hidden)
        overwrite(block, "mid.weight")
        result = preflight(block, mse_microbatch, dense_batches(3, hidden), loss_fn=mse_loss)
        mid = next(p for p in result.params if p.name == "mid.weight")
        assert mid.anomalies == ["grad_overwritten"], result.table()
        assert mid.fit_residual is not None and mid.fit_residual <= mid.tolerance / 8
        assert mid.rel_repeat is None and result.cost["microbatch_passes"] == 6
        torch.manual_seed(seed)
        block = DenseBlock("plain", hidden)
        _noisy_gradient(block.mid.weight, 64 * 4.8e-6, False, seed)
        overwrite(block, "mid.weight")
        result = preflight(block, mse_microbatch, dense_batches(3, hidden), loss_fn=mse_loss)
        mid = next(p for p in result.params if p.name == "mid.weight")
        assert mid.anomalies == ["grad_nondeterministic"], result.table()
        assert result.cost["microbatch_passes"] == 7


def test_dropout_and_batchnorm_are_repeatable() -> None:
    """Dropout draws from the global RNG, which preflight sets back before every micro-batch."""
    result = check(fsdp("te", "no_shard", dropout=0.5, norm=True))
    assert result.ok, result.table()
    # the same masks in every run: the sum of the singles equals the sequence up to the order of the additions
    assert all(p.rel_sum is not None and p.rel_sum <= 1e-6 for p in result.params if p.norm_a > 0)
    assert all(p.rel_repeat is None for p in result.params)  # the repeat runs only where something failed


def test_extra_rng_states_make_a_private_generator_repeatable() -> None:
    torch.manual_seed(0)
    block = DenseBlock("noisy")
    gen = block.mid.gen
    result = check(block, rng_states=[(gen.get_state, gen.set_state)])
    assert result.ok, result.table()


# -- 6. the model's state afterwards equals its state before ---------------------------------------------------------
def _params(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The parameters to compare: a Megatron-FSDP module holds its raw or its distributed Parameter objects
    depending on where in the step it is (it swaps them every step), so for the emulator both sets, by name."""
    if isinstance(model, MegatronFSDP):
        return [*model.raw.items(), *((f"{n}#dist", p) for n, p in model.dist.items())]
    return list(model.named_parameters())


def _hooks(model: torch.nn.Module) -> list:
    out = []
    for module in model.modules():
        for attr in (
            "_forward_pre_hooks",
            "_forward_hooks",
            "_backward_hooks",
            "_backward_pre_hooks",
            "_forward_pre_hooks_with_kwargs",
            "_forward_hooks_with_kwargs",
        ):
            out.append(dict(getattr(module, attr)))
        out.append(len(module._state_dict_hooks))
    for _, param in _params(model):
        out.append(len(getattr(param, "_post_accumulate_grad_hooks", None) or {}))
        out.append(len(getattr(param, "_backward_hooks", None) or {}))
    return out


def _snapshot(model: torch.nn.Module) -> dict:
    return {
        "params": [(n, p, p.detach().clone()) for n, p in _params(model)],
        "buffers": [(n, b.detach().clone()) for n, b in model.named_buffers()],
        "training": [m.training for m in model.modules()],
        "hooks": _hooks(model),
        "rng": torch.get_rng_state().clone(),
        "py_rng": random.getstate(),
    }


def _assert_same(before: dict, model: torch.nn.Module) -> None:
    after = _snapshot(model)
    assert [(n, id(p)) for n, p, _ in before["params"]] == [(n, id(p)) for n, p, _ in after["params"]]
    for (name, _, value), (_, _, now) in zip(before["params"], after["params"], strict=True):
        assert torch.equal(value, now), name  # bit for bit
    for (name, value), (_, now) in zip(before["buffers"], after["buffers"], strict=True):
        assert torch.equal(value, now), name
    assert before["training"] == after["training"]
    assert before["hooks"] == after["hooks"]
    assert torch.equal(before["rng"], after["rng"]) and before["py_rng"] == after["py_rng"]


@pytest.mark.parametrize("middle", ["plain", "noisy"])
def test_plain_model_state_is_restored(middle: str) -> None:
    torch.manual_seed(0)
    model = DenseBlock(middle, dropout=0.3, norm=True)
    x, t = dense_batches(1)[0]
    mse_loss(model, (x, t)).backward()  # the user has pending gradients
    user_grads = {n: p.grad for n, p in model.named_parameters()}
    user_values = {n: g.clone() for n, g in user_grads.items()}
    torch.manual_seed(42)
    random.seed(7)
    before = _snapshot(model)
    result = check(model)
    _assert_same(before, model)
    for name, param in model.named_parameters():
        assert param.grad is user_grads[name] and torch.equal(param.grad, user_values[name])
    # three singles and the sequence of three; the repeat only where something failed
    assert result.cost["microbatch_passes"] == (6 if not result.failing else 7)
    # the noise (2) and two central steps per group at least
    assert result.cost["forward_passes"] >= 2 + 4 * result.cost["fd_groups"]


@pytest.mark.parametrize("middle", ["te", "basic", "megatron"])
def test_wrapped_model_state_is_restored(middle: str) -> None:
    model = fsdp(middle, "optim_grads_params", norm=True, dropout=0.2)
    torch.manual_seed(3)
    before = _snapshot(model)
    check(model)
    _assert_same(before, model)
    assert torch.count_nonzero(model.grad_data) == 0  # zeroed through the wrapper's own zero_grad_buffer()
    assert all(p.grad is None for _, p in model.param_and_grad_buffer.optimizer_named_parameters)
    assert (
        model.installs > 0
    )  # perturbed weights went in (and back) through install_optimized_model_weights()


def test_state_is_restored_when_the_microbatch_raises() -> None:
    model = fsdp("te", "optim_grads_params")
    before = _snapshot(model)
    calls = {"n": 0}

    def failing(model, batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("MAIN GRAD IS NONE")
        return mse_microbatch(model, batch)

    result = preflight(model, failing, dense_batches(2), loss_fn=mse_loss)
    assert result.status == "error" and result.error == "RuntimeError: MAIN GRAD IS NONE"
    assert "preflight_error" in result.table()
    _assert_same(before, model)
    records = result.records(run="r")
    assert [r["anomaly"] for r in records] == ["preflight_error"] and not validate(records[0])


def test_a_perturbation_the_forward_never_sees_is_an_error() -> None:
    class Detached(preflight_module.Adapter):
        def target(self, entry):  # a copy: what a wrapper computing with cached weights amounts to
            return entry.opt_param.detach().clone()

    model = DenseBlock("plain")
    result = check(model, wrapper=Detached(model))
    assert result.status == "error" and "never changed the loss" in result.error
    assert result.params and not any(p.anomalies for p in result.params)  # linearity itself was fine


# -- cost and device discipline ---------------------------------------------------------------------------------------
def test_host_syncs_and_cost() -> None:
    passing = check(fsdp("basic", "no_shard"))
    # the steps' sizes, the noise and the rounded predicted changes (they set the first steps), one round of
    # estimates (both groups agree at the first two steps), the comparison
    assert passing.ok and passing.cost["host_syncs"] == 5, passing.table()
    assert passing.cost["microbatch_passes"] == 6  # three singles, the sequence of three; no repeat
    # the noise, then both groups in one combined probe at two steps (each group at its own multiple)
    assert passing.cost["fd_groups"] == 2 and passing.cost["forward_passes"] == 2 + 4
    assert [g.verdict for g in passing.groups] == ["ok"]
    assert sorted(passing.groups[0].names) == sorted(p.name for p in passing.params)
    assert passing.cost["fd_rounds"] == 2 and passing.cost["bisection_depth"] == 0
    failing = check(fsdp("basic", "optim_grads_params"))
    # + the repeat of the first micro-batch (one pass, one sync); the x2 is a group of its own: the combined
    # probe deviates and splits into the two groups (one evaluated, one inferred as the rest): one more round;
    # the blame is confirmed at two smaller steps, down to where the noise would reach E_MAX / 4: two rounds
    assert failing.cost["host_syncs"] == 9 and failing.cost["microbatch_passes"] == 7
    assert failing.cost["forward_passes"] == 2 + 4 + 4 + 4 and failing.cost["bisection_depth"] == 1
    blamed = next(g for g in failing.groups if g.verdict == "scaled")
    assert len(blamed.levels) == 4 and blamed.step == min(s for s, _, _ in blamed.levels)
    assert set(failing.cost["seconds_by_part"]) == {"runs", "finite_differences", "comparison"}
    # on the CPU no loss forward is replayed from a CUDA graph, and the cost says why
    # (tests/gpu/test_preflight_graphs_gpu.py: the replays on a GPU)
    assert (
        passing.cost["loss_replays"] == 0
        and passing.cost["loss_graph"] == "loss forwards eager: no CUDA device"
    )
    assert "replayed" not in passing.table()


def test_weights_that_cannot_be_flattened_move_in_their_own_shape() -> None:
    """The finite differences move a group's weights with a few multi-tensor launches on scratch viewed in each
    weight's shape; a weight that is a strided view (not contiguous) moves the same way, to the same estimate."""

    def block(strided: bool) -> DenseBlock:
        torch.manual_seed(0)
        model = DenseBlock("plain")
        if strided:
            weight = model.mid.weight.detach()
            holder = torch.zeros(weight.shape[0], 2 * weight.shape[1])
            holder[:, ::2] = weight
            model.mid.weight = torch.nn.Parameter(holder[:, ::2])
            assert not model.mid.weight.is_contiguous()
        return model

    flat, strided = check(block(False)), check(block(True))
    assert flat.ok and strided.ok, strided.table()
    assert [g.scale for g in strided.groups] == pytest.approx([g.scale for g in flat.groups], rel=1e-3)
    model = block(True)
    before = model.mid.weight.detach().clone()
    check(model)
    assert torch.equal(model.mid.weight, before)  # restored bit for bit through the strided view


def test_without_loss_fn_the_microbatch_gives_the_loss() -> None:
    result = preflight(fsdp("basic", "optim_grads_params"), mse_microbatch, dense_batches(3))
    assert verdicts(result) == {"mid.weight": ["grad_overwritten", "grad_scaled"]}
    # every loss evaluation is a run_microbatch call (a backward more each); as in test_host_syncs_and_cost
    assert result.cost["forward_passes"] == 0 and result.cost["loss_evaluations"] == 14
    assert result.cost["microbatch_passes"] == 7 + 14


def test_fd_groups_param_and_params_filter() -> None:
    result = check(fsdp("basic", "optim_grads_params"), fd_groups="param", params=["mid.*", "out.weight"])
    assert [p.name for p in result.params] == ["mid.weight", "out.weight"]
    assert result.cost["fd_groups"] == 2
    assert verdicts(result) == {"mid.weight": ["grad_overwritten", "grad_scaled"]}


# -- forms: table, JSON, records, sinks ------------------------------------------------------------------------------
def test_table_json_and_records(tmp_path) -> None:
    result = check(fsdp("basic", "optim_grads_params"), label="dense/ogp")
    table = result.table()
    lines = table.splitlines()
    assert lines[0].startswith("maingrad preflight [dense/ogp]: FAIL - Megatron-FSDP (optim_grads_params)")
    assert "grad_overwritten+grad_scaled" in table and "x2" in table and "fix:" in table
    data = json.loads(json.dumps(result.to_dict()))
    assert data["status"] == "fail" and data["summary"][0]["verdict"] == "grad_overwritten+grad_scaled"
    shown = result_from_dict(data)
    assert shown.table().splitlines()[0] == lines[0]
    records = result.records(run="run-1", rank=0, commit="abc")
    assert all(not validate(r) for r in records)
    assert [(r["param"], r["anomaly"]) for r in records] == [
        ("*", None),
        ("weight", "grad_overwritten"),
        ("weight", "grad_scaled"),
    ]
    assert records[1]["module"] == "mid" and records[1]["phase"] == "preflight"
    assert records[1]["overwrite_main_grad"] is True and records[1]["is_fsdp_param"] is True
    assert len({r["id"] for r in records}) == len(records)
    path = tmp_path / "pf.jsonl"
    result2 = check(fsdp("basic", "optim_grads_params"), sinks=[f"jsonl:{path}"], run="run-2", commit="def")
    written = [json.loads(line) for line in (tmp_path / "pf.rank0.jsonl").read_text().splitlines()]
    assert [r["anomaly"] for r in written] == [
        None,
        "grad_overwritten",
        "grad_scaled",
    ] and result2.status == "fail"
    assert {r["run"] for r in written} == {"run-2"} and {r["commit"] for r in written} == {"def"}


def test_package_exports_the_functions() -> None:
    # maingrad.hooks.preflight is the package, callable as the function it is named after
    assert callable(maingrad.hooks.preflight) and maingrad.hooks.preflight_from_env is preflight_from_env
    assert maingrad.hooks.PreflightResult is PreflightResult
    result = maingrad.hooks.preflight(
        fsdp("te", "no_shard"), mse_microbatch, dense_batches(3), loss_fn=mse_loss
    )
    assert result.ok and isinstance(result, PreflightResult)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fd_groups": "layers"}, "fd_groups must be one of"),
        ({"fd_step": 0.0}, "fd_step must be in"),
        ({"fd_rtol": -1.0}, "fd_rtol must be > 0"),
        ({"wrapper": "deepspeed"}, "wrapper must be 'auto'"),
        ({"wrapper": "megatron-fsdp"}, "needs model.param_and_grad_buffer"),
        ({"loss_fn": 3}, "loss_fn must be callable"),
    ],
)
def test_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        preflight(DenseBlock("plain"), mse_microbatch, dense_batches(2), **kwargs)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        preflight(DenseBlock("plain"), mse_microbatch, [])
    with pytest.raises(TypeError, match="torch.nn.Module"):
        preflight(object(), mse_microbatch, dense_batches(1))  # type: ignore[arg-type]


# -- the driver form ---------------------------------------------------------------------------------------------------
def test_preflight_from_env_modes(tmp_path, capsys) -> None:
    args = (mse_microbatch, dense_batches(3))
    assert preflight_from_env(fsdp("basic", "optim_grads_params"), *args, env={}, loss_fn=mse_loss) is None
    out = tmp_path / "r{rank}.json"
    env = {"MAINGRAD_PREFLIGHT": "warn", "MAINGRAD_PREFLIGHT_JSON": str(out), "RANK": "0"}
    result = preflight_from_env(fsdp("basic", "optim_grads_params"), *args, env=env, loss_fn=mse_loss)
    assert result is not None and result.status == "fail"
    assert json.loads((tmp_path / "r0.json").read_text())["status"] == "fail"
    assert "grad_scaled" in capsys.readouterr().err
    with pytest.raises(PreflightFailed, match="grad_overwritten"):
        preflight_from_env(
            fsdp("basic", "optim_grads_params"), *args, env={"MAINGRAD_PREFLIGHT": "on"}, loss_fn=mse_loss
        )
    with pytest.raises(SystemExit) as exc:
        preflight_from_env(
            fsdp("te", "no_shard"), *args, env={"MAINGRAD_PREFLIGHT": "only"}, loss_fn=mse_loss
        )
    assert exc.value.code == 0
    with pytest.raises(ValueError, match="MAINGRAD_PREFLIGHT='sometimes'"):
        preflight_from_env(fsdp("te", "no_shard"), *args, env={"MAINGRAD_PREFLIGHT": "sometimes"})


def test_every_lazy_export_is_typed_for_type_checkers() -> None:
    """`maingrad.hooks` loads its names lazily (`__getattr__`, typed Any); the same names are imported under
    TYPE_CHECKING so that a user's type checker sees install() / preflight() with their real signatures."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(maingrad.hooks.__file__).read_text())
    guarded = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    typed = {
        alias.asname or alias.name for n in guarded.body if isinstance(n, ast.ImportFrom) for alias in n.names
    }
    assert set(maingrad.hooks._EXPORTS) == typed


def test_a_passing_probe_says_what_factor_it_could_have_missed() -> None:
    """fd_resolution is the probe's pass band over the parameter's share of its predicted change: a weight
    whose share is large is bounded near 1, one whose share is tiny is not bounded by x2 and is listed as
    weakly checked (an ok that does not rule out a doubled gradient)."""
    from preflight_zoo import MODELS, microbatch, wrap

    case = MODELS["gpt-bf16"]
    model = case.make()
    result = preflight(  # the loss-level probe's own bounds (the module-local ones tighten the loose ones)
        wrap(case, model), microbatch(case.loss), case.batches(3), loss_fn=case.loss, module_fd=False
    )
    assert result.status == "pass", result.table()
    bounds = {p.name: p.fd_resolution for p in result.params}
    assert all(b is None or b >= 1.0 for b in bounds.values())
    tight = [n for n, b in bounds.items() if b is not None and b < 1.5]
    weak = {p.name for p in result.weakly_checked()}
    assert tight and weak and not (weak & set(tight))
    assert f"cannot rule out a x2 gradient on {len(weak)} of the passing" in result.table()
    assert all(p.could_hide(2.0) for p in result.weakly_checked())
    by_name = {p.name: p for p in result.params}
    assert all(not by_name[n].could_hide(2.0) and not by_name[n].could_hide(0.4) for n in tight)
    # the bound follows the share: the embedding carries more of the change than any layer-norm bias
    assert bounds["emb.weight"] is not None and all(
        bounds["emb.weight"] < (b if b is not None else math.inf)
        for n, b in bounds.items()
        if n.endswith("ln1.bias")
    )


def test_a_group_within_a_parameters_tolerance_bounds_the_parts_that_cannot_be_estimated() -> None:
    """A group whose reliable estimate deviates beyond the group band but within what one parameter would pass
    is split (a parameter hidden in it is looked for); a part whose own estimate then does not check itself is
    `ok` within the group's bound on each of its weights (fd_resolution, so a loose one stays listed as weakly
    checked), not `inconclusive`; a part that deviates reliably is still split and blamed. Without such a
    group above it, a part with no reliable estimate stays inconclusive."""
    from maingrad.hooks.preflight.check import Check
    from maingrad.hooks.preflight.measure import Estimate
    from maingrad.hooks.preflight.moves import CANDIDATE_STEPS
    from maingrad.hooks.preflight.wrappers import choose

    torch.manual_seed(0)
    model = DenseBlock("plain")
    check = Check(
        model, mse_microbatch, dense_batches(2), loss_fn=mse_loss, adapter=choose(model), params=None,
        finite_differences=True, fd_groups="mechanism", fd_step=None, fd_rtol=None, rtol=None, rng_states=[],
    )  # fmt: skip
    n = len(check.entries)
    fd = check.loss_fd
    step = CANDIDATE_STEPS[4]
    fd.step_mult = [1.0] * n
    fd.weight_gains = {i: [1.0] * len(CANDIDATE_STEPS) for i in range(n)}
    root = fd._node("all", list(range(n)), False, 0)
    ltol = math.log1p(root.tol)
    err = ltol / 100
    drift = math.exp((ltol / 4 + ltol) / 2)  # beyond the group band, within a parameter's tolerance
    requests = fd._finish(
        root, Estimate(ratio=drift, error=err, step=step, pair=(2 * step, step), reliable=True)
    )
    assert root.probe.verdict == "split" and requests
    left = requests[0][0]
    right = next(node for node, _ in requests if node is not left)
    assert left.bounded and right.bounded
    assert all(fd.resolution[i] == pytest.approx(1 + (ltol + 3 * err) * n) for i in range(n))
    fd._finish(left, Estimate(ratio=None, reason="no two steps agree"))
    assert left.probe.verdict == "ok" and "bounded by a group above it" in left.probe.reason
    fd._finish(right, Estimate(ratio=2.0, error=err, step=step, pair=(2 * step, step), reliable=True))
    assert right.probe.verdict in ("split", "scaled")  # a reliable deviation is still blamed

    lone = fd._node("alone", [0], False, 0)
    fd._finish(lone, Estimate(ratio=None, reason="no two steps agree"))
    assert lone.probe.verdict == "inconclusive"


def test_every_run_starts_from_the_callers_buffers_but_not_a_parameters_storage() -> None:
    """A buffer the forward writes and computes with (a running scale) starts every run where the caller left
    it, so the repeat of a micro-batch is not nondeterminism; a buffer that holds a parameter's storage (as
    megatron-core's MoE experts register their weights) is never put back mid-call, so the finite differences'
    moves reach the forward; after the call every buffer is as the caller left it."""

    class Stateful(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(6, 6)
            self.out = torch.nn.Linear(6, 6)
            self.register_buffer("scale", torch.ones(()))
            self.register_buffer("alias", self.out.weight.data.view(-1), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x) * self.scale.clone()
            with torch.no_grad():
                self.scale.mul_(1.05)  # written by every forward, as a power iteration's vector would be
            return self.out(torch.tanh(y))

    def loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return ((model(x) - y) ** 2).mean()

    def run(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        value = loss(model, batch)
        value.backward()
        return value.detach()

    torch.manual_seed(0)
    model = Stateful()
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=gen), torch.randn(8, 6, generator=gen)) for _ in range(3)]
    result = preflight(model, run, batches, loss_fn=loss, module_fd=False)  # the loss-level probes alone
    assert result.error is None and result.status in ("pass", "inconclusive"), result.table()
    aliased = next(p for p in result.params if p.name == "out.weight")
    assert aliased.fd_scale == pytest.approx(1.0, rel=0.01), result.table()  # its moves reached the loss
    assert not any("grad_nondeterministic" in p.anomalies for p in result.params), result.table()
    unsure = [p for p in result.params if p.inconclusive]
    assert all("writes buffers (scale)" in " ".join(p.notes) for p in unsure), result.table()
    assert float(model.scale) == 1.0 and torch.equal(model.alias, model.out.weight.detach().view(-1))
