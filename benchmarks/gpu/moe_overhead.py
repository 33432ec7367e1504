"""Hooks' share of a training step of a realistic MoE layer on one GPU (evidence issue, run 4).

megatron-core 0.19.2's fused TEGroupedMLP (op-fuser path, which exposes main_grad itself) under
Megatron-FSDP, built as tests/gpu/mcore_hooks.py builds it; the same model is timed without hooks, with
`maingrad.hooks` in `fix` mode and in `observe` mode, interleaved round by round so clock drift hits every variant alike. Each step
(zero_grad_buffer -> MB forward/backward -> finish_grad_sync) is timed with CUDA events; the median per
variant is compared against the no-hook median of the same run.

usage (GPU machine): NVTE_CUTEDSL_FUSED_GROUPED_MLP=1 PYTHONPATH=/tmp/site:/tmp/mc19:/tmp/mg \
    python3 benchmarks/gpu/moe_overhead.py
env: EXPERTS (64), HIDDEN (1024), FFN (1024), TOKENS (4096), MB (2), ROUNDS (6), STEPS (5 per round)
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
os.environ.setdefault("MASTER_PORT", "29561")
os.environ.setdefault("NVTE_CUTEDSL_FUSED_GROUPED_MLP", "1")

import torch  # noqa: E402

E = int(os.environ.get("EXPERTS", "64"))
H = int(os.environ.get("HIDDEN", "1024"))
FFN = int(os.environ.get("FFN", "1024"))
TOKENS = int(os.environ.get("TOKENS", "4096"))
MB = int(os.environ.get("MB", "2"))
ROUNDS = int(os.environ.get("ROUNDS", "6"))
STEPS = int(os.environ.get("STEPS", "5"))
SEQ, BATCH = TOKENS // 4, 4


sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "gpu"))


def build():
    """The MoE block of tests/gpu/mcore_hooks.py (the setup proven on the H200), at a realistic size."""
    import mcore_hooks

    args = mcore_hooks.parse_args(
        [
            "--experts",
            str(E),
            "--hidden",
            str(H),
            "--ffn",
            str(FFN),
            "--strategy",
            os.environ.get("STRATEGY", "optim_grads_params"),
        ]
    )
    return mcore_hooks.build(args, fused=True, seed=0)


def timed_steps(model, x, tgt, steps, handle=None) -> list[float]:
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model.zero_grad_buffer()
        for mb in range(MB):
            out = model(torch.roll(x, shifts=mb, dims=0) if mb else x)
            ((out.float() - tgt.float()) ** 2).mean().backward()
        model.finish_grad_sync()
        end.record()
        if handle is not None:
            handle.step()  # flush at the step boundary, as a training loop would (outside the timed hooks)
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def main() -> None:
    from maingrad.hooks import install

    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    model = build()
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(SEQ, BATCH, H, device="cuda", dtype=torch.bfloat16, generator=g)
    tgt = torch.randn(SEQ, BATCH, H, device="cuda", dtype=torch.bfloat16, generator=g)
    timed_steps(model, x, tgt, 3)  # warm-up: kernels, allocator, main_grad buffers
    variants = ("none", "fix", "observe")
    samples: dict[str, list[float]] = {v: [] for v in variants}
    records = {v: 0 for v in variants}
    t0 = time.time()
    for _ in range(ROUNDS):
        for variant in variants:
            handle = None if variant == "none" else install(model, mode=variant)
            samples[variant] += timed_steps(model, x, tgt, STEPS, handle)
            if handle is not None:
                records[variant] += sum(module.records for module in handle.summary().modules)
                handle.remove()
    base = statistics.median(samples["none"])
    print(
        f"\nMoE layer: {E} experts, hidden {H}, ffn {FFN}, {TOKENS} tokens x {MB} micro-batches, bf16, "
        f"Megatron-FSDP; {ROUNDS}x{STEPS} steps per variant ({time.time() - t0:.1f} s)"
    )
    print(f"{'variant':<10}{'median ms':>12}{'p10 ms':>10}{'p90 ms':>10}{'share vs none':>16}")
    for variant in variants:
        s = sorted(samples[variant])
        med = statistics.median(s)
        share = (med - base) / base * 100
        print(
            f"{variant:<10}{med:>12.3f}{s[len(s) // 10]:>10.3f}{s[(9 * len(s)) // 10]:>10.3f}{share:>15.2f}%"
        )
    spread = (max(samples["none"]) - min(samples["none"])) / base * 100
    print(f"no-hook spread (max-min)/median: {spread:.2f}%  records kept: {records}")
    # No device sync from the hooks at this size either: mcore_hooks' checks (a step under "warn" with every
    # sync's stack attributed, each hook body under "error"), in fix mode.
    import mcore_hooks

    handle = install(model, mode="fix")
    report = mcore_hooks.sync_checks(None, model, handle, [x, torch.roll(x, shifts=1, dims=0)], tgt)
    handle.remove()
    print("sync checks (fix mode):", report)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
