"""A fused grouped MLP in the style of megatron-core 0.18.2's TEGroupedMLP: nothing exposes main_grad
before the op-fuser ops run, so under Megatron-FSDP the first forward fails (MG001)."""

import torch
import transformer_engine as te


class GroupedMLP(torch.nn.Module):
    def __init__(self, linear_fc1, linear_fc2):
        super().__init__()
        self.linear_fc1 = linear_fc1
        self.linear_fc2 = linear_fc2
        self._fused_ops = None

    def _make_fused_ops(self):
        ops = te.pytorch.ops.Sequential()
        op = te.pytorch.ops.GroupedLinear(
            self.linear_fc1.num_gemms,
            self.linear_fc1.in_features,
            self.linear_fc1.out_features,
            device="meta",
            accumulate_into_main_grad=self.linear_fc1.fuse_wgrad_accumulation,
        )
        ops.append(op)
        ops.register_forward_pre_hook(self._make_pre_forward_hook())
        return ops

    def _make_pre_forward_hook(self):
        def forward_pre_hook(module, *_):
            for submodule in self.linear_fc1.modules():
                for hook in submodule._forward_pre_hooks.values():
                    hook(submodule, None)

        return forward_pre_hook

    def forward(self, x, split_sizes):
        if self._fused_ops is None:
            self._fused_ops = (self._make_fused_ops(),)
        (ops,) = self._fused_ops
        if self.linear_fc1.weight0.main_grad:  # truth-tests a tensor (MG003)
            pass
        return ops(x, split_sizes)
