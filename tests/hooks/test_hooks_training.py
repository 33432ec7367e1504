"""The emulated megatron-core 0.18.2 fused path fails under Megatron-FSDP without hooks and
trains with `install(model)`, gradients equal to plain autograd, for every sharding strategy and 1/2/4
micro-batches; plus what the overwrite policies do in the emulator (the GPU answers it for real)."""

from __future__ import annotations

import warnings

import pytest
import torch
from emulators import (
    SPLITS,
    STRATEGIES,
    MegatronFSDP,
    assert_grads_equal,
    batches,
    fsdp_run,
    hooked_run_matches,
    make_layer,
    max_rel_diff,
    reference_run,
)

from maingrad.hooks import MainGradContractError, MainGradHooksWarning, install

STEPS = 2


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fused_path_fails_without_hooks(strategy: str) -> None:
    model = MegatronFSDP(make_layer(), strategy)
    with pytest.raises(RuntimeError, match="MAIN GRAD NOT FOUND"):
        fsdp_run(model, batches(1, 1))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_main_grad_is_none_after_the_first_step_without_hooks(strategy: str) -> None:
    """Exposing for step 0 only: after zero_grad_buffer main_grad is None and the next forward fails."""
    model = MegatronFSDP(make_layer(), strategy)
    handle = install(model)
    data = batches(2, 1)
    fsdp_run(model, data[:1], on_step=handle.step)
    handle.remove()
    with pytest.raises(RuntimeError, match="MAIN GRAD IS NONE"):
        fsdp_run(model, data[1:])


@pytest.mark.parametrize("sample_every", [1, 0], ids=["records", "fix-alone"])
@pytest.mark.parametrize("microbatches", [1, 2, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_install_trains_and_matches_reference(strategy: str, microbatches: int, sample_every: int) -> None:
    """sample_every=0 takes fix mode's fast path (no records: the parameter dicts are walked directly, while
    the Megatron-FSDP stand-in swaps its Parameter objects every step)."""
    data = batches(STEPS, microbatches)
    ref_grads, ref_losses = reference_run(data)
    model = MegatronFSDP(make_layer(), strategy)
    handle = install(model, sample_every=sample_every)  # overwrite_policy="keep" (default)
    experts = hooked_run_matches(model, handle, data, ref_grads, ref_losses)
    assert (experts.module, experts.kind, experts.params) == ("module.experts", "fused_container", 8)
    assert experts.forward_calls == STEPS * microbatches
    # without records nothing is left to inspect in backward: no gradient hook is attached
    assert experts.backward_calls == (STEPS * microbatches if sample_every else 0)
    # main_grad is exposed again whenever Megatron-FSDP reset it: once per step for unsharded gradients,
    # every micro-batch for sharded ones (the bucket is reduced and main_grad reset after each backward).
    per_step = microbatches if strategy in ("optim_grads", "optim_grads_params") else 1
    assert experts.exposed == 8 * per_step * STEPS
    # the fused op leaves no .grad behind (TE's dummy wgrad is dropped by Megatron-FSDP's grad hook)
    assert all(p.grad is None for p in model.raw.values())
    handle.remove()


def test_records_capture_the_flag_at_forward_and_backward() -> None:
    model = MegatronFSDP(make_layer(), "optim_grads")
    handle = install(model)
    fsdp_run(model, batches(2, 2), on_step=handle.step)
    records = handle.records()
    handle.remove()
    weight = [r for r in records if r["param"] == "linear_fc1.weight0"]
    assert [(r["step"], r["microbatch"], r["phase"]) for r in weight] == [
        (s, m, p) for s in range(2) for m in range(2) for p in ("forward", "backward")
    ]
    first_forward, first_backward = weight[0], weight[1]
    # the very first call runs before the container's fused object (and the replayed unshard) exists
    assert first_forward["overwrite_main_grad"] is None
    assert first_backward["overwrite_main_grad"] is True
    # later forwards run after the replayed Megatron-FSDP unshard hook set the flag
    assert all(r["overwrite_main_grad"] is True for r in weight[2:])
    assert {r["action"] for r in weight if r["phase"] == "forward"} == {"exposed"}
    assert all(r["has_main_grad"] and r["main_grad_is_none"] is False for r in weight)
    assert all(r["dtype"] == "torch.float32" and r["shape"] == [12, 8] for r in weight)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_megatron_core_019_shipped_needs_no_hooks(strategy: str) -> None:
    """Emulator sanity: the 0.19 exposure in the fused pre-forward hook is what makes the path work."""
    data = batches(STEPS, 2)
    ref_grads, _ = reference_run(data)
    model = MegatronFSDP(make_layer(version="0.19.2"), strategy)
    grads, _ = fsdp_run(model, data)
    if strategy in ("optim_grads", "optim_grads_params"):
        assert_grads_equal(grads, ref_grads)
    else:
        # its forced overwrite_main_grad=True under Megatron-FSDP-main flags (False for no_shard/optim)
        # makes the second micro-batch overwrite the first in the emulator: see test_force_true_*.
        assert max_rel_diff(grads[0], ref_grads[0]) > 0.1


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_hooks_fix_019_with_its_own_exposure_disabled(strategy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import emulators

    monkeypatch.setattr(
        emulators.GroupedMLP019, "_ensure_main_grad", staticmethod(lambda linear_module: None)
    )
    model = MegatronFSDP(make_layer(version="0.19.2"), strategy)
    with pytest.raises(RuntimeError, match="MAIN GRAD NOT FOUND"):
        fsdp_run(model, batches(1, 1))
    data = batches(STEPS, 2)
    ref_grads, _ = reference_run(data)
    model = MegatronFSDP(make_layer(version="0.19.2"), strategy)
    handle = install(model)
    grads, _ = fsdp_run(model, data, on_step=handle.step)
    assert_grads_equal(grads, ref_grads)
    handle.remove()


def _last_microbatch_reference(data: list) -> list[dict]:
    """Reference grads of each step's last micro-batch alone (what an overwriting backward leaves)."""
    last_only = [[step_data[-1]] for step_data in data]
    grads, _ = reference_run(last_only)
    return grads


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("microbatches", [1, 2, 4])
def test_force_true_in_the_emulator(strategy: str, microbatches: int) -> None:
    """Documents the emulator (Megatron-FSDP main flags), not the hardware: force_true, like megatron-core
    0.19, sets overwrite_main_grad=True after the replayed unshard hooks. With unsharded gradients
    (no_shard, optim) nothing resets main_grad between micro-batches and the op-fuser reads the flag at
    backward, so each micro-batch's expert wgrad overwrites the previous one; sharded gradients are
    reduced and main_grad reset after every backward, so overwriting is right there."""
    data = batches(1, microbatches)
    ref_grads, _ = reference_run(data)
    model = MegatronFSDP(make_layer(), strategy)
    handle = install(model, overwrite_policy="force_true")
    grads, _ = fsdp_run(model, data, on_step=handle.step)
    anomalies = handle.summary().anomalies
    handle.remove()
    loses = microbatches > 1 and strategy in ("no_shard", "optim")
    if not loses:
        assert_grads_equal(grads, ref_grads)
        assert "overwrite_discards_microbatch" not in anomalies
        return
    last = _last_microbatch_reference(data)[0]
    for name, grad in grads[0].items():
        if ".linear_fc" in name:  # fused expert weights: only the last micro-batch survives
            torch.testing.assert_close(grad, last[name], rtol=1e-5, atol=1e-6)
        else:  # ordinary parameters accumulate through .grad as usual
            torch.testing.assert_close(grad, ref_grads[0][name], rtol=1e-5, atol=1e-6)
    # the heuristic flags exactly the overwriting backward passes: 8 weights x (microbatches - 1)
    assert anomalies == {"overwrite_discards_microbatch": 8 * (microbatches - 1)}


def test_flags_from_megatron_fsdp_0192_semantics_lose_microbatches_even_with_keep() -> None:
    """Megatron-FSDP 0.19.2's unshard sets overwrite_main_grad=True for `optim` (unsharded gradients) too; in
    the emulator that alone discards earlier micro-batches, whatever our policy, as the H200 showed for the
    real 0.19.2 stack under `optim` with 2 micro-batches (docs/gpu-evidence.md §2)."""
    data = batches(1, 2)
    ref_grads, _ = reference_run(data)
    model = MegatronFSDP(make_layer(), "optim", semantics="0.19.2")
    handle = install(model)
    grads, _ = fsdp_run(model, data, on_step=handle.step)
    assert max_rel_diff(grads[0], ref_grads[0]) > 0.1
    assert handle.summary().anomalies == {"overwrite_discards_microbatch": 8}
    handle.remove()


def test_install_before_wrapping_warns_and_still_fixes() -> None:
    layer = make_layer()
    with pytest.warns(MainGradHooksWarning, match="after wrapping"):
        handle = install(layer)
    model = MegatronFSDP(layer, "optim_grads_params")  # swaps Parameter objects: our lookups follow them
    data = batches(STEPS, 2)
    ref_grads, _ = reference_run(data)
    grads, _ = fsdp_run(model, data, on_step=handle.step)
    assert_grads_equal(grads, ref_grads)
    handle.remove()


def test_no_warning_when_installed_after_wrapping() -> None:
    model = MegatronFSDP(make_layer(), "optim")
    with warnings.catch_warnings():
        warnings.simplefilter("error", MainGradHooksWarning)
        install(model).remove()


def test_check_mode_raises_before_te_with_path_param_and_remedy() -> None:
    model = MegatronFSDP(make_layer(), "optim_grads_params")
    handle = install(model, "check")
    x, target = batches(1, 1)[0][0]
    with pytest.raises(MainGradContractError) as info:
        model(x, SPLITS)
    error = info.value
    assert (error.module, error.param, error.problem) == (
        "module.experts",
        "linear_fc1.weight0",
        "main_grad_missing",
    )
    assert "install(model)" in error.remedy and "MAIN GRAD NOT FOUND" in str(error)
    assert error.others == 7
    raised = [r for r in handle.records() if r["action"] == "raised"]
    assert len(raised) == 8 and {r["anomaly"] for r in raised} == {"main_grad_missing"}
    handle.remove()


def test_check_mode_passes_megatron_core_019_shipped() -> None:
    """0.19 exposes main_grad itself after our first-call hook ran: check mode must not raise there."""
    model = MegatronFSDP(make_layer(version="0.19.2"), "optim_grads")
    handle = install(model, "check")
    fsdp_run(model, batches(STEPS, 2), on_step=handle.step)
    assert handle.summary().ok
    handle.remove()


def test_check_mode_raises_on_019_with_its_exposure_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    import emulators

    monkeypatch.setattr(
        emulators.GroupedMLP019, "_ensure_main_grad", staticmethod(lambda linear_module: None)
    )
    model = MegatronFSDP(make_layer(version="0.19.2"), "optim_grads")
    handle = install(model, "check")
    with pytest.raises(MainGradContractError, match="linear_fc1.weight0"):
        fsdp_run(model, batches(1, 1))
    handle.remove()


def test_observe_records_the_failure_it_does_not_prevent() -> None:
    model = MegatronFSDP(make_layer(), "optim_grads_params")
    handle = install(model, "observe")
    with pytest.raises(RuntimeError, match="MAIN GRAD NOT FOUND"):  # TE's error, not ours
        fsdp_run(model, batches(1, 1))
    assert handle.summary().anomalies == {"main_grad_missing": 8}
    assert {r["action"] for r in handle.records()} == {"none"}
    handle.remove()


@pytest.mark.parametrize("version", ["0.19.2", "0.18.2+maingrad-fix"])
def test_observe_does_not_flag_what_the_containers_own_exposure_fixes(version: str) -> None:
    """0.19's `_ensure_main_grad` and the method `maingrad fix` adds both expose main_grad in the fused
    object's pre-forward hook, after the container's: the first forward must not be reported as failing
    (seen on the H200 with `maingrad fix`ed 0.18.2 before the fixer's method was recognised)."""
    data = batches(STEPS, 2)
    ref_grads, _ = reference_run(data)
    model = MegatronFSDP(make_layer(version=version), "optim_grads_params")
    handle = install(model, "observe")
    grads, _ = fsdp_run(model, data, on_step=handle.step)
    anomalies = handle.summary().anomalies
    assert "main_grad_missing" not in anomalies and "main_grad_none" not in anomalies, anomalies
    assert {r["action"] for r in handle.records()} == {"none"}
    assert_grads_equal(grads, ref_grads)
    handle.remove()


def test_observe_flags_the_fixers_method_when_it_is_taken_out(monkeypatch: pytest.MonkeyPatch) -> None:
    import emulators

    monkeypatch.setattr(
        emulators.GroupedMLPMaingradFixed, "_expose_main_grad_for_fused_ops", lambda self: None
    )
    monkeypatch.setattr(
        emulators.GroupedMLPMaingradFixed, "_ensure_main_grad_for_fused_impl", lambda self: None
    )
    model = MegatronFSDP(make_layer(version="0.18.2+maingrad-fix"), "optim_grads_params")
    handle = install(model, "observe")
    with pytest.raises(RuntimeError, match="MAIN GRAD NOT FOUND"):
        fsdp_run(model, batches(1, 1))
    assert handle.summary().anomalies == {"main_grad_missing": 8}
    handle.remove()
