"""Containers that keep their fused Sequential in `_fused_impl` (megatron-core 0.19.x TEFusedMLPWithGroupedLinear,
rule MG001's remaining finding in 0.19.2): the shipped path fails under Megatron-FSDP, `install(model)` fixes
it, and the container's own hooks replayed by its fused object are not counted twice."""

from __future__ import annotations

import pytest
import torch
from emulators import (
    STRATEGIES,
    MegatronFSDP,
    batches,
    fsdp_run,
    hooked_run_matches,
    make_layer,
    reference_run,
)

from maingrad.hooks import MainGradContractError, install

DENSE = "0.19.2-dense"
STEPS = 2


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dense_fused_path_fails_without_hooks(strategy: str) -> None:
    model = MegatronFSDP(make_layer(version=DENSE), strategy)
    with pytest.raises(RuntimeError, match="MAIN GRAD NOT FOUND"):
        fsdp_run(model, batches(1, 1))


@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_install_trains_the_dense_fused_path(strategy: str, microbatches: int) -> None:
    data = batches(STEPS, microbatches)
    ref_grads, ref_losses = reference_run(data, version=DENSE)
    model = MegatronFSDP(make_layer(version=DENSE), strategy)
    handle = install(model)
    mlp = hooked_run_matches(model, handle, data, ref_grads, ref_losses)
    assert (mlp.module, mlp.kind, mlp.params) == ("module.experts", "fused_container", 2)
    # the fused object replays the container's own pre-forward hooks (ours among them): one call each
    assert mlp.forward_calls == STEPS * microbatches
    assert mlp.backward_calls == STEPS * microbatches
    records = handle.records()
    assert len(records) == STEPS * microbatches * 2 * 2  # calls x phases x parameters
    assert {r["param"] for r in records} == {"linear_fc1.weight0", "linear_fc2.weight0"}
    handle.remove()


def test_check_mode_names_the_parameter_before_te() -> None:
    model = MegatronFSDP(make_layer(version=DENSE), "optim_grads_params")
    handle = install(model, "check")
    with pytest.raises(MainGradContractError, match=r"linear_fc1\.weight0"):
        fsdp_run(model, batches(1, 1))
    handle.remove()


def test_observe_records_the_missing_buffer_and_remove_cleans_the_fused_object() -> None:
    layer = make_layer(version=DENSE)
    model = MegatronFSDP(layer, "optim")
    with install(model) as handle:  # fix: the fused object exists after this run
        fsdp_run(model, batches(1, 1), on_step=handle.step)
    (fused,) = layer.experts._fused_impl
    assert not any("maingrad" in repr(h) for h in fused._forward_pre_hooks.values())
    assert len(fused._forward_pre_hooks) == 1  # the container's own replay hook only
    assert not layer.experts._forward_pre_hooks and not layer.experts._forward_hooks

    fresh = MegatronFSDP(make_layer(version=DENSE), "optim")
    observed = install(fresh, "observe")
    with pytest.raises(RuntimeError, match="MAIN GRAD NOT FOUND"):
        fsdp_run(fresh, batches(1, 1))
    assert observed.summary().anomalies.get("main_grad_missing", 0) >= 1
    observed.remove()


def test_a_basic_linear_dense_container_is_lenient() -> None:
    """TEFusedMLP's BasicLinear ops read main_grad only in backward: check mode must not raise at forward."""
    from maingrad.hooks.discovery import discover

    class TEFusedMLP(torch.nn.Module):  # the class name says no GroupedLinear; _fused_impl not built yet
        def __init__(self) -> None:
            super().__init__()
            self.linear_fc1 = torch.nn.Linear(4, 4)
            self.linear_fc1.fuse_wgrad_accumulation = True
            self._fused_impl = None

    class TEFusedMLPWithGroupedLinear(TEFusedMLP):
        pass

    (basic,) = discover(TEFusedMLP())
    (grouped,) = discover(TEFusedMLPWithGroupedLinear())
    assert basic.kind == grouped.kind == "fused_container"
    assert not basic.strict_forward
    assert grouped.strict_forward
