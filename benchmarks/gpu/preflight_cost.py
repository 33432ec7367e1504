"""What `maingrad.hooks.preflight` costs on the 64-expert MoE layer, in training steps of the same model.

megatron-core's fused TEGroupedMLP layer of benchmarks/gpu/moe_overhead.py (64 experts, hidden 1024, ffn 1024,
4096 tokens per micro-batch, 2 micro-batches, bf16, Megatron-FSDP, one GPU), built by tests/gpu/mcore_hooks.py.
Per strategy (STRATEGIES, default no_shard and optim_grads_params):
- one training step (zero_grad_buffer -> 2 x forward/backward -> finish_grad_sync): the median wall time of STEPS
  steps after WARMUP, each ended by a device sync, and its peak memory above the memory held after
  zero_grad_buffer() (Megatron-FSDP's optimizer-side fp32 gradients are freed there and made again by
  finish_grad_sync, in a step as in preflight);
- preflight (default settings, loss_fn given): the wall time of REPEATS calls after one warm-up call, and its
  peak memory above the same base;
- reported: preflight time / step time (target <= 4), (preflight peak - step peak) / the bytes of the gradients
  the optimizer reads (target <= 1), the passes preflight ran, and whether the model's weights and the loss of a
  forward are bit-identical before and after preflight (it must leave no trace).

usage (GPU machine): PYTHONPATH=/tmp/mg:/tmp/site:/tmp/mc19 python3 benchmarks/gpu/preflight_cost.py
env: EXPERTS (64), HIDDEN (1024), FFN (1024), TOKENS (4096), STRATEGIES, STEPS (10), WARMUP (3), REPEATS (3)
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("NVTE_FLASH_ATTN", "0")
os.environ.setdefault("NVTE_FUSED_ATTN", "0")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29563")
os.environ.setdefault("NVTE_CUTEDSL_FUSED_GROUPED_MLP", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "gpu"))

E = int(os.environ.get("EXPERTS", "64"))
H = int(os.environ.get("HIDDEN", "1024"))
FFN = int(os.environ.get("FFN", "1024"))
TOKENS = int(os.environ.get("TOKENS", "4096"))
STEPS = int(os.environ.get("STEPS", "10"))
WARMUP = int(os.environ.get("WARMUP", "3"))
REPEATS = int(os.environ.get("REPEATS", "3"))
STRATEGIES = os.environ.get("STRATEGIES", "no_shard,optim_grads_params").split(",")


def say(*args: object) -> None:
    print(*args, flush=True)


def loss_fn(model, batch):
    x, target = batch
    return ((model(x).float() - target.float()) ** 2).mean()


def run_microbatch(model, batch):
    loss = loss_fn(model, batch)
    loss.backward()
    return loss.detach()


def train_step(model, data) -> None:
    model.zero_grad_buffer()
    for batch in data:
        run_microbatch(model, batch)
    model.finish_grad_sync()


def weights(model) -> list[torch.Tensor]:
    out = []
    for _, param in model.param_and_grad_buffer.optimizer_named_parameters:
        local = param.to_local() if hasattr(param, "to_local") else param
        out.append(local.detach().clone())
    for param in model.module.parameters():  # the compute weights the forward reads
        local = param.to_local() if hasattr(param, "to_local") else param
        if local.numel():
            out.append(local.detach().clone())
    return out


def grad_bytes(model) -> int:
    total = 0
    for _, param in model.param_and_grad_buffer.optimizer_named_parameters:
        grad = param.grad
        if grad is not None:
            grad = grad.to_local() if hasattr(grad, "to_local") else grad
            total += grad.numel() * grad.element_size()
    return total


def measure(strategy: str) -> None:
    import mcore_hooks

    from maingrad.hooks import preflight

    args = mcore_hooks.parse_args(
        ["--experts", str(E), "--hidden", str(H), "--ffn", str(FFN), "--strategy", strategy,
         "--seq", str(TOKENS // 4), "--batch", "4"]
    )  # fmt: skip
    model = mcore_hooks.build(args, fused=True)
    inputs, target = mcore_hooks.make_data(args)
    data = [(x, target) for x in inputs]
    for _ in range(WARMUP):
        train_step(model, data)
    torch.cuda.synchronize()
    gbytes = grad_bytes(model)
    times, peaks = [], []
    for _ in range(STEPS):
        model.zero_grad_buffer()  # the base holds no gradient the optimizer reads (as before preflight)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        train_step(model, data)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        peaks.append(torch.cuda.max_memory_allocated() - base)
    step = statistics.median(times)
    step_peak = max(peaks)
    model.zero_grad_buffer()
    torch.cuda.synchronize()
    with torch.no_grad():
        loss_before = loss_fn(model, data[0]).item()
    before = weights(model)
    results = []
    pf_times, pf_peaks = [], []
    for i in range(REPEATS + 1):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        result = preflight(model, run_microbatch, data, loss_fn=loss_fn, label=f"64 experts {strategy}")
        torch.cuda.synchronize()
        if i:  # the first call is a warm-up
            pf_times.append(time.perf_counter() - t0)
            pf_peaks.append(torch.cuda.max_memory_allocated() - base)
        results.append(result)
    after = weights(model)
    with torch.no_grad():
        loss_after = loss_fn(model, data[0]).item()
    same = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    pf = statistics.median(pf_times)
    pf_peak = max(pf_peaks)
    result = results[-1]
    say(result.table())
    say(
        f"RESULT {strategy}: step {step * 1e3:.1f} ms (median of {STEPS}, min {min(times) * 1e3:.1f}, max "
        f"{max(times) * 1e3:.1f}); preflight {pf * 1e3:.1f} ms (median of {REPEATS}: "
        f"{', '.join(f'{t * 1e3:.1f}' for t in pf_times)}) = {pf / step:.2f} steps; "
        f"{result.cost['microbatch_passes']} passes + {result.cost['forward_passes']} forwards "
        f"({result.cost['fd_groups']} groups); status {result.status}; seconds by part "
        f"{result.cost['seconds_by_part']}"
    )
    say(
        f"MEMORY {strategy}: gradients {gbytes / 2**20:.1f} MiB; step peak +{step_peak / 2**20:.1f} MiB; "
        f"preflight peak +{pf_peak / 2**20:.1f} MiB; extra over a step {(pf_peak - step_peak) / 2**20:.1f} MiB "
        f"= {(pf_peak - step_peak) / gbytes:.2f} x the gradients"
    )
    say(
        f"TRACE {strategy}: weights bit-identical after {REPEATS + 1} preflights: {same}; loss of A before "
        f"{loss_before!r} after {loss_after!r} equal: {loss_before == loss_after}"
    )
    del model


def main() -> None:
    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    import megatron.core
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    say(f"megatron-core {megatron.core.__version__}; {torch.cuda.get_device_name(0)}; experts {E}, hidden {H}, "
        f"ffn {FFN}, {TOKENS} tokens x 2 micro-batches")  # fmt: skip
    for strategy in STRATEGIES:
        measure(strategy)
        torch.cuda.empty_cache()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
