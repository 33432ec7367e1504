"""Stand-in for apex's `fused_weight_gradient_mlp_cuda` (not installed on the GPU machine), for the GPU drivers.

megatron-core refuses `gradient_accumulation_fusion=True` when this module cannot be imported, although its
Megatron-FSDP branch never calls it. This one accumulates in torch (main_grad += dy^T x, as the apex kernels
do) and counts its calls, so a run shows whether the non-FSDP kernel path ran at all.
"""

import collections

IS_STUB = True
CALLS: collections.Counter = collections.Counter()


def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
    CALLS["fp32"] += 1
    dy = grad_output.reshape(-1, grad_output.shape[-1])
    x = total_input.reshape(-1, total_input.shape[-1])
    main_grad.add_(dy.t().float() @ x.float())


def wgrad_gemm_accum_fp16(total_input, grad_output, main_grad):
    CALLS["fp16"] += 1
    dy = grad_output.reshape(-1, grad_output.shape[-1])
    x = total_input.reshape(-1, total_input.shape[-1])
    main_grad.add_((dy.t() @ x).to(main_grad.dtype))
