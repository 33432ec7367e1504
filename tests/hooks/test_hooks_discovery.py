"""targets="auto" and explicit targets: which module is instrumented and which parameters it covers."""

from __future__ import annotations

import pytest
import torch
from emulators import GroupedLinear, MegatronFSDP, OpGroupedLinear, OpSiLU, Sequential, make_layer

from maingrad.hooks.discovery import CONTAINER, EXPLICIT, MEGATRON_LINEAR, OP_FUSER, TE_MODULE, discover


def _summary(specs):
    return [(s.path, s.kind, [slot.relname for slot in s.slots if slot.wgrad]) for s in specs]


def test_container_covers_its_fused_children_once() -> None:
    specs = discover(MegatronFSDP(make_layer(), "optim"))
    weights = [f"linear_fc{i}.weight{j}" for i in (1, 2) for j in range(4)]
    assert _summary(specs) == [("module.experts", CONTAINER, weights)]
    (spec,) = specs
    assert {slot.owner for slot in spec.slots} == {spec.module.linear_fc1, spec.module.linear_fc2}


def test_non_fused_container_leaves_its_te_children_as_targets() -> None:
    specs = discover(make_layer(fused=False))
    assert [(s.path, s.kind) for s in specs] == [
        ("experts.linear_fc1", TE_MODULE),
        ("experts.linear_fc2", TE_MODULE),
    ]


def test_container_without_fused_wgrad_children_is_no_target() -> None:
    assert discover(make_layer(fuse=False)) == []


def test_op_fuser_ops_are_covered_by_the_sequential_that_is_called() -> None:
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ops = Sequential(
                OpGroupedLinear(2, 4, 4, accumulate_into_main_grad=True),
                OpSiLU(),
                OpGroupedLinear(2, 4, 4, accumulate_into_main_grad=False),
            )
            self.lone = OpGroupedLinear(2, 4, 4, accumulate_into_main_grad=True)

    specs = discover(Model())
    assert _summary(specs) == [
        ("ops", OP_FUSER, ["0.weight0", "0.weight1"]),  # op 2 does not accumulate into main_grad
        ("lone", OP_FUSER, ["weight0", "weight1"]),  # called directly: its own hooks run
    ]


def test_nested_sequentials_use_the_outermost() -> None:
    inner = Sequential(OpGroupedLinear(2, 4, 4, accumulate_into_main_grad=True))
    outer = Sequential(inner)
    assert _summary(discover(outer)) == [("", OP_FUSER, ["0.0.weight0", "0.0.weight1"])]


def test_te_modules_and_megatron_linears_by_duck_typing() -> None:
    class TELinear(torch.nn.Linear):
        fuse_wgrad_accumulation = True

    class LayerNormMLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fuse_wgrad_accumulation = True
            self.layer_norm_weight = torch.nn.Parameter(torch.ones(4))
            self.fc1_weight = torch.nn.Parameter(torch.ones(4, 4))
            self.fc2_weight = torch.nn.Parameter(torch.ones(4, 4))

    class ColumnParallelLinear(torch.nn.Linear):
        def __init__(self, fusion: bool) -> None:
            super().__init__(4, 4)
            self.gradient_accumulation_fusion = fusion

    model = torch.nn.ModuleDict(
        {
            "te": TELinear(4, 4),
            "ln_mlp": LayerNormMLP(),
            "col": ColumnParallelLinear(True),
            "col_off": ColumnParallelLinear(False),
            "plain": torch.nn.Linear(4, 4),
        }
    )
    specs = discover(model)
    assert _summary(specs) == [
        ("te", TE_MODULE, ["weight"]),
        ("ln_mlp", TE_MODULE, ["fc1_weight", "fc2_weight"]),
        ("col", MEGATRON_LINEAR, ["weight"]),
    ]
    # non-wgrad parameters (biases, norm weights) are covered (exposed like upstream) but never flagged
    assert [s.relname for s in specs[0].slots] == ["weight", "bias"]


def test_explicit_targets_modules_and_patterns() -> None:
    model = MegatronFSDP(make_layer(), "optim")
    specs = discover(model, ["*.experts", model.module.proj])
    assert [(s.path, s.kind) for s in specs] == [("module.experts", CONTAINER), ("module.proj", EXPLICIT)]
    assert [(s.relname, s.wgrad) for s in specs[1].slots] == [("weight", True), ("bias", True)]
    assert _summary(discover(model, "module.experts.linear_fc1")) == [
        ("module.experts.linear_fc1", TE_MODULE, [f"weight{j}" for j in range(4)])
    ]
    with pytest.raises(ValueError, match="matches no module"):
        discover(model, "*.nothing")
    with pytest.raises(TypeError):
        discover(model, [3])


def test_explicit_child_target_is_called_by_megatron_replay_as_hook_module_none() -> None:
    """A hook on linear_fc1 is replayed by the fused path as hook(module, None) and must return None."""
    from emulators import batches, fsdp_run

    from maingrad.hooks import install

    model = MegatronFSDP(make_layer(), "optim_grads")
    handle = install(model, targets=["*.linear_fc1", "*.linear_fc2"])
    fsdp_run(model, batches(1, 2), on_step=handle.step)  # trains: the replay exposes through our hooks
    summary = handle.summary()
    assert [m.forward_calls for m in summary.modules] == [2, 2]
    assert summary.ok
    # backward records need the module's own output, which the fused path never produces
    assert [m.backward_calls for m in summary.modules] == [0, 0]
    handle.remove()


def test_discovery_ignores_meta_placeholders_left_as_none() -> None:
    op = OpGroupedLinear(2, 4, 4, accumulate_into_main_grad=True)
    op.register_parameter("weight1", None)
    assert _summary(discover(op)) == [("", OP_FUSER, ["weight0"])]


def test_grouped_linear_module_in_isolation() -> None:
    assert _summary(discover(GroupedLinear(2, 4, 4))) == [("", TE_MODULE, ["weight0", "weight1"])]
