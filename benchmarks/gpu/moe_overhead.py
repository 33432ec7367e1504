"""Hooks' share of a training step of a realistic MoE layer on one GPU (evidence issue, run 4).

megatron-core 0.19.2's fused TEGroupedMLP (op-fuser path, which exposes main_grad itself) under
Megatron-FSDP, built as tests/gpu/mcore_hooks.py builds it. Identical models, one per variant, take turns step by step
(A B C D A B C D ...); each round gives every model another variant (no hooks, `fix`, `observe`, `fix`
without records), so a model's
own placement or a slow moment hits every variant alike. Each step (zero_grad_buffer -> MB forward/backward
-> finish_grad_sync, then the handle's step-boundary flush) is timed with CUDA events after one untimed step
per install. Reported per variant:
the median step, and the median of the ratios of steps taken side by side in the same tick (paired, the
robust number on a CPU-bound, jittery step) with its 95% bootstrap interval.

A second, direct estimate: the hooks' own CPU time per step = their calls per step x the cost of one call of
each installed hook body (timed on the real sites, mid-step), over the median step without hooks. A third,
in place: every hook entry point timed where it runs inside real steps (IN_PLACE_STEPS of them), over the
median step without hooks; the step is CPU-bound, so the hooks' CPU time is what they add to it. Last, the
sync checks of tests/gpu/mcore_hooks.py in fix mode.

usage (GPU machine): NVTE_CUTEDSL_FUSED_GROUPED_MLP=1 PYTHONPATH=/tmp/site:/tmp/mc19:/tmp/mg \
    python3 benchmarks/gpu/moe_overhead.py
env: EXPERTS (64), HIDDEN (1024), FFN (1024), TOKENS (4096), MB (2), ROUNDS (12), STEPS (8 per round)
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import timeit
import traceback
from pathlib import Path

os.environ.setdefault("NVTE_FLASH_ATTN", "0")
os.environ.setdefault("NVTE_FUSED_ATTN", "0")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29561")
os.environ.setdefault("NVTE_CUTEDSL_FUSED_GROUPED_MLP", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "gpu"))

E = int(os.environ.get("EXPERTS", "64"))
H = int(os.environ.get("HIDDEN", "1024"))
FFN = int(os.environ.get("FFN", "1024"))
TOKENS = int(os.environ.get("TOKENS", "4096"))
MB = int(os.environ.get("MB", "2"))
ROUNDS = int(os.environ.get("ROUNDS", "12"))
STEPS = int(os.environ.get("STEPS", "8"))
SEQ, BATCH = TOKENS // 4, 4
# "mode" or "mode:N" (sample_every=N; "fix:0" = fix without records); the first must be "none".
VARIANTS = tuple(os.environ.get("VARIANTS", "none,fix,observe,fix:0").split(","))


def install_variant(model, variant: str):
    from maingrad.hooks import install

    mode, _, every = variant.partition(":")
    return install(model, mode=mode, sample_every=int(every or 1))


def build(seed: int):
    """The MoE block of tests/gpu/mcore_hooks.py (the setup proven on the H200), at a realistic size."""
    import mcore_hooks

    strategy = os.environ.get("STRATEGY", "optim_grads_params")
    args = mcore_hooks.parse_args(
        ["--experts", str(E), "--hidden", str(H), "--ffn", str(FFN), "--strategy", strategy]
    )
    return mcore_hooks.build(args, fused=True, seed=seed)


def step(model, x, tgt) -> None:
    model.zero_grad_buffer()
    for mb in range(MB):
        out = model(torch.roll(x, shifts=mb, dims=0) if mb else x)
        ((out.float() - tgt.float()) ** 2).mean().backward()
    model.finish_grad_sync()


def timed_step(model, x, tgt, handle=None) -> float:
    """One step in CUDA-event milliseconds; with a handle, its step-boundary flush is inside the timed span
    (training pays for it at every step)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step(model, x, tgt)
    if handle is not None:
        handle.step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def compare(models, x, tgt) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, float]]:
    """Step times per variant, paired ratios (variant / none of the same tick), hook calls per step."""
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    paired: dict[str, list[float]] = {v: [] for v in VARIANTS[1:]}
    calls = {v: 0 for v in VARIANTS[1:]}
    for r in range(ROUNDS):
        n = len(VARIANTS)
        variant_of = [VARIANTS[(i + r) % n] for i in range(n)]  # model i runs variant_of[i] this round
        handles = {}
        for model, variant in zip(models, variant_of, strict=True):
            if variant != "none":
                handles[variant] = install_variant(model, variant)
            step(model, x, tgt)  # untimed: the first call after install moves container hooks in place
            if variant in handles:
                handles[variant].step()
        for _ in range(STEPS):
            tick = {}
            for model, variant in zip(models, variant_of, strict=True):
                tick[variant] = timed_step(model, x, tgt, handles.get(variant))
            for variant in VARIANTS:
                samples[variant].append(tick[variant])
            for variant in paired:
                paired[variant].append(tick[variant] / tick["none"])
        for variant, handle in handles.items():
            calls[variant] += sum(m.forward_calls + m.backward_calls for m in handle.summary().modules)
            handle.remove()
    return samples, paired, {v: calls[v] / (ROUNDS * (STEPS + 1)) for v in calls}


def bootstrap_ci(ratios: list[float], resamples: int = 2000, seed: int = 3) -> tuple[float, float]:
    """95% bootstrap interval of the paired median's overhead in percent: is a difference of this size real?"""
    import random

    rng = random.Random(seed)
    n = len(ratios)
    medians = sorted(statistics.median(rng.choices(ratios, k=n)) for _ in range(resamples))
    return (medians[int(0.025 * resamples)] - 1) * 100, (medians[int(0.975 * resamples) - 1] - 1) * 100


def direct_cost(model, x, tgt, mode: str) -> tuple[float, int]:
    """CPU seconds of the installed hook bodies per step: each site's forward and backward body timed mid-step
    (parameters unsharded, main_grad exposed: the state they run in), times its calls in one real step."""
    handle = install_variant(model, mode)
    step(model, x, tgt)
    handle.step()
    before = {m.module: (m.forward_calls, m.backward_calls) for m in handle.summary().modules}
    step(model, x, tgt)
    handle.step()
    per_step = {
        m.module: (m.forward_calls - before[m.module][0], m.backward_calls - before[m.module][1])
        for m in handle.summary().modules
    }
    model.zero_grad_buffer()
    loss = ((model(x).float() - tgt.float()) ** 2).mean()
    total = 0.0
    for site in handle._sites:
        fwd_calls, bwd_calls = per_step.get(site.path, (0, 0))
        fwd = min(timeit.repeat(lambda s=site: s._inspect(0, 0, True, None), number=20, repeat=5)) / 20
        bwd = min(timeit.repeat(lambda s=site: s._inspect(1, 0, True, None), number=20, repeat=5)) / 20
        total += fwd_calls * fwd + bwd_calls * bwd
    loss.backward()
    model.finish_grad_sync()
    torch.cuda.synchronize()
    handle.remove()
    return total, sum(f + b for f, b in per_step.values())


_HOOK_ENTRIES = ("container_pre_forward", "pre_forward", "post_forward", "on_backward")


def in_place_cost(model, x, tgt, variant: str, steps: int) -> tuple[float, float, float]:
    """The hooks' CPU time inside real steps: every hook entry point (the registered pre-hooks, forward hook
    and gradient hook) timed where it runs, cold caches included; the outermost call only (a container's
    pre-hook calls the plain one on its first call). Returns (hook ms per step, flush ms per step, median
    step ms of these steps)."""
    from maingrad.hooks import instrument

    spent = [0, False]  # ns inside hooks, "inside a timed hook"
    originals = {name: getattr(instrument.Site, name) for name in _HOOK_ENTRIES}

    def timed(original):
        def wrapper(self, *args):
            if spent[1]:
                return original(self, *args)
            spent[1] = True
            t0 = time.perf_counter_ns()
            try:
                return original(self, *args)
            finally:
                spent[0] += time.perf_counter_ns() - t0
                spent[1] = False

        return wrapper

    for name, original in originals.items():
        setattr(instrument.Site, name, timed(original))
    try:
        handle = install_variant(model, variant)  # after patching: the registered bound methods are timed
        step(model, x, tgt)
        handle.step()
        spent[0] = 0
        flush_ns = 0
        times = []
        for _ in range(steps):
            times.append(timed_step(model, x, tgt))
            t0 = time.perf_counter_ns()
            handle.step()
            flush_ns += time.perf_counter_ns() - t0
        hook_ns = spent[0]
        handle.remove()
    finally:
        for name, original in originals.items():
            setattr(instrument.Site, name, original)
    return hook_ns / steps / 1e6, flush_ns / steps / 1e6, statistics.median(times)


def main() -> None:
    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    models = [build(seed=0) for _ in VARIANTS]
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(SEQ, BATCH, H, device="cuda", dtype=torch.bfloat16, generator=g)
    tgt = torch.randn(SEQ, BATCH, H, device="cuda", dtype=torch.bfloat16, generator=g)
    for model in models:  # warm-up: kernels, allocator, main_grad buffers
        for _ in range(3):
            step(model, x, tgt)
    torch.cuda.synchronize()
    t0 = time.time()
    samples, paired, calls = compare(models, x, tgt)
    base = statistics.median(samples["none"])
    print(
        f"\nMoE layer: {E} experts, hidden {H}, ffn {FFN}, {TOKENS} tokens x {MB} micro-batches, bf16, "
        f"Megatron-FSDP; {len(VARIANTS)} models in turn, {ROUNDS} rounds x {STEPS} timed steps ({time.time() - t0:.1f} s)"
    )
    print(
        f"{'variant':<10}{'median ms':>11}{'p10 ms':>9}{'p90 ms':>9}{'median vs none':>16}{'paired median':>15}"
        f"{'95% CI':>18}"
    )
    for variant in VARIANTS:
        s = sorted(samples[variant])
        med = statistics.median(s)
        if variant in paired:
            low, high = bootstrap_ci(paired[variant])
            pair = (
                f"{(statistics.median(paired[variant]) - 1) * 100:>14.2f}%{f'{low:+.2f}..{high:+.2f}%':>18}"
            )
        else:
            pair = f"{'ref':>15}"
        print(
            f"{variant:<10}{med:>11.3f}{s[len(s) // 10]:>9.3f}{s[(9 * len(s)) // 10]:>9.3f}"
            f"{(med - base) / base * 100:>15.2f}%{pair}"
        )
    spread = (max(samples["none"]) - min(samples["none"])) / base * 100
    print(f"no-hook spread (max-min)/median: {spread:.1f}%; hook calls per step: {calls}")
    for mode in ("fix", "observe"):
        try:
            seconds, ncalls = direct_cost(models[0], x, tgt, mode)
            print(
                f"direct estimate, {mode}: {ncalls} hook calls/step, {seconds * 1e6:.1f} us of hook CPU time per "
                f"step = {seconds * 1e3 / base * 100:.3f}% of the median step"
            )
        except Exception:  # noqa: BLE001 - report and go on to the sync checks
            traceback.print_exc()
    in_place_steps = int(os.environ.get("IN_PLACE_STEPS", "40"))
    for variant in VARIANTS[1:]:
        try:
            hook_ms, flush_ms, med = in_place_cost(models[0], x, tgt, variant, in_place_steps)
            print(
                f"in place, {variant}: hooks {hook_ms * 1e3:.1f} us per step = {hook_ms / base * 100:.3f}% of the "
                f"median no-hook step (flush at handle.step(): {flush_ms * 1e3:.1f} us; these {in_place_steps} "
                f"steps' median {med:.3f} ms)"
            )
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    import mcore_hooks

    handle = install_variant(models[0], "fix")
    report = mcore_hooks.sync_checks(None, models[0], handle, [x, torch.roll(x, shifts=1, dims=0)], tgt)
    handle.remove()
    print("sync checks (fix mode):", report)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
