"""preflight calls the wrapper's between-steps API only where it changes something.

Megatron-FSDP's `start_param_sync()` (the parameter all-gather after an optimizer step) is needed after the
weights changed (the finite differences install perturbed, then restored weights) and redundant between runs
with unchanged weights; zeroing gradient buffers that nothing wrote since they were zeroed is redundant too.
`GatheredFSDP` makes a missing sync visible: its forward computes with a gathered copy of the weights that only
`start_param_sync()` refreshes, as the unsharded buffers of a sharded strategy do. Every verdict must be the one
of the emulator that needs no sync, with one sync per change of the weights and no more."""

from __future__ import annotations

import pytest
import torch
from emulators import DenseBlock, MainWeightsFSDP, dense_batches, fp32_mse_loss, fp32_mse_microbatch

from maingrad.hooks.preflight.run import preflight


class GatheredFSDP(MainWeightsFSDP):
    """Installed weights reach the forward only through start_param_sync() (the all-gather into the buffers the
    forward computes with): without it the forward keeps computing with the weights of the last sync."""

    def __init__(self, module: torch.nn.Module, strategy: str, **kwargs) -> None:
        super().__init__(module, strategy, **kwargs)
        self.staged = {n: self.raw[n].detach().clone() for n in self.names}

    def install_optimized_model_weights(self) -> None:
        self.installs += 1
        self.calls.append("install")
        with torch.no_grad():
            for name in self.names:
                self.staged[name].copy_(self.dist[name])

    def start_param_sync(self) -> None:
        self.calls.append("sync")
        with torch.no_grad():
            for name in self.names:
                self.raw[name].copy_(self.staged[name])


def _bf16(make, middle: str, strategy: str, semantics: str = "main") -> MainWeightsFSDP:
    torch.manual_seed(0)
    return make(DenseBlock(middle).to(torch.bfloat16), strategy, semantics=semantics)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x.bfloat16(), t.bfloat16()) for x, t in dense_batches(n, tokens=16)]


CASES = {
    "accumulates": ("te", "no_shard", "main", {}),
    "overwritten": ("te", "optim_grads_params", "main", {"mid.weight": ["grad_overwritten"]}),
    "overwritten+scaled": (
        "basic",
        "optim_grads_params",
        "main",
        {"mid.weight": ["grad_overwritten", "grad_scaled"]},
    ),
    "lost": ("guarded", "no_shard", "main", {"mid.weight": ["grad_lost"]}),
    "megatron-linear": ("megatron", "no_shard", "6773", {"mid.weight": ["grad_overwritten"]}),
}


def _verdicts(result) -> dict[str, list[str]]:
    return {p.name: p.anomalies for p in result.params if p.anomalies}


def _check_call_order(calls: list[str], syncs: bool = True) -> None:
    """Every forward after an install sees a sync first; no sync without an install since the last one (but
    the first); every run's first backward starts from zeroed buffers; no zero without a backward since the
    last one (but the final clean-up, which preflight always makes)."""
    synced, installed = False, False
    clean, in_run = False, False
    zeros_since_backward = 0
    for i, call in enumerate(calls):
        if call == "install":
            installed, synced = True, False
        elif call == "sync":
            assert not synced or i == 0, f"redundant sync at {i}: {calls}"
            synced, installed = True, False
        elif call == "forward":
            assert not (syncs and installed), (
                f"forward at {i} computes with weights installed but not synced: {calls}"
            )
        elif call == "zero":
            zeros_since_backward += 1
            assert zeros_since_backward == 1 or i == len(calls) - 1, f"redundant zero at {i}: {calls}"
            clean = True
        elif call == "backward":
            if not in_run:
                assert clean, f"a run's first backward at {i} adds to unzeroed buffers: {calls}"
            in_run, clean, zeros_since_backward = True, False, 0
        elif call == "finish":
            in_run = False


@pytest.mark.parametrize("loss_fn", [fp32_mse_loss, None], ids=["loss_fn", "run_microbatch"])
@pytest.mark.parametrize("n", [2, 1], ids=["A,B", "A twice"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_forward_after_changed_weights_always_follows_a_sync(case: str, n: int, loss_fn) -> None:
    middle, strategy, semantics, expected = CASES[case]
    plain = _bf16(MainWeightsFSDP, middle, strategy, semantics)
    gathered = _bf16(GatheredFSDP, middle, strategy, semantics)
    before = {k: v.detach().clone() for k, v in gathered.raw.items()}
    reference = preflight(plain, fp32_mse_microbatch, _batches(n), loss_fn=loss_fn)
    result = preflight(gathered, fp32_mse_microbatch, _batches(n), loss_fn=loss_fn)

    assert result.error is None, result.error
    assert _verdicts(result) == _verdicts(reference) == expected, result.table()
    for p, q in zip(result.params, reference.params, strict=True):
        assert (p.rel_sum, p.rel_twice, p.fit, p.fd_scale) == (q.rel_sum, q.rel_twice, q.fit, q.fd_scale)
    assert all(torch.equal(before[k], gathered.raw[k]) for k in before)  # the forward's weights are back too
    assert all(torch.equal(gathered.staged[k], gathered.raw[k]) for k in before)

    _check_call_order(gathered.calls)
    _check_call_order(plain.calls, syncs=False)  # no start_param_sync: installs reach the forward at once
    installs = gathered.calls.count("install")
    # one install per perturbed evaluation, one per round of estimates (the restored weights)
    assert installs == result.cost["loss_evaluations"] + result.cost["fd_rounds"]
    assert gathered.calls.count("sync") == 1 + installs  # before the first run and after every install


@pytest.mark.parametrize(
    ("middle", "repeated"),
    [("te", False), ("basic", True)],
    ids=["overwritten-no-repeat", "overwritten+scaled-repeat"],
)
def test_sync_counts_on_a_failing_model(middle: str, repeated: bool) -> None:
    """A failing model with loss_fn and three micro-batches: A alone, the finite differences, B and C alone,
    the sequence (B, C, A), and the repeat of A only where a failing verdict could be noise: not for the plain
    overwrite (its fit by position (0, 0, 1) leaves no residual that run-to-run noise would), but for the
    doubling one (its x2 is a finite-difference verdict). The sync comes before A and after each install only
    (not before every run), the zero only where a backward ran since the last one, plus the final clean-up."""
    model = _bf16(GatheredFSDP, middle, "optim_grads_params")
    result = preflight(model, fp32_mse_microbatch, _batches(3), loss_fn=fp32_mse_loss)
    assert result.status == "fail"
    failing = [p for p in result.params if p.anomalies]
    assert failing and all((p.rel_repeat is not None) == repeated for p in failing)
    if repeated:  # a finite-difference verdict beside the fit: the residual is not what decides
        assert all(p.fit_residual is None for p in failing)
    else:
        assert all(p.fit_residual is not None and p.fit_residual <= p.tolerance / 8 for p in failing)
    assert result.cost["microbatch_passes"] == 6 + repeated
    installs = result.cost["loss_evaluations"] + result.cost["fd_rounds"]
    assert model.calls.count("install") == installs
    assert model.calls.count("sync") == 1 + installs
    # zero: before A, release after A, before C, before the sequence, (before the repeat,) the final clean-up
    # (none before B: nothing ran backward after the release)
    assert model.calls.count("zero") == 5 + repeated
    assert model.calls.count("finish") == 4 + repeated  # A, B, C, the sequence(, the repeat)


@pytest.mark.parametrize("fail_at", [2, 3])
def test_an_error_during_the_finite_differences_leaves_the_forward_weights_restored(fail_at: int) -> None:
    """loss_fn raises while a group's weights are perturbed (installed and synced): preflight returns the error
    as its result, and the forward computes with the original weights again, not the perturbed ones that the
    caller's next steps would otherwise train on until an optimizer step reinstalled the main weights."""
    model = _bf16(GatheredFSDP, "te", "no_shard")
    before = {k: v.detach().clone() for k, v in model.raw.items()}
    main_before = {k: v.detach().clone() for k, v in model.dist.items()}
    calls = {"n": 0}

    def flaky_loss(m, batch):
        calls["n"] += 1
        if calls["n"] == fail_at:  # 1, 2: the noise's perturbed forwards; 3: a group's
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return fp32_mse_loss(m, batch)

    result = preflight(model, fp32_mse_microbatch, _batches(2), loss_fn=flaky_loss)
    assert result.status == "error" and "illegal memory access" in (result.error or "")
    assert all(torch.equal(before[k], model.raw[k]) for k in before)  # what the forward computes with
    assert all(torch.equal(main_before[k], model.dist[k]) for k in main_before)
    assert model.calls[-3:] == ["install", "sync", "zero"]  # reinstalled and synced, then the buffers zeroed
    _check_call_order(model.calls)
