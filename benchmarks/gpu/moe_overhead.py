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
env: EXPERTS (64), HIDDEN (1024), FFN (1024), TOKENS (4096), MB (2), ROUNDS (12), STEPS (8 per round),
VARIANTS, IN_PLACE_STEPS (40), GC_FREEZE (1: gc.freeze() after the warm-up, for every variant alike)
"""

from __future__ import annotations

import gc
import os
import statistics
import time
import timeit
import traceback

from moe_layer import FFN, TOKENS, E, H, prepare

prepare(master_port=29561)

import torch  # noqa: E402

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


class GcClock:
    """Time the garbage collector spends inside timed steps, per variant (gc.callbacks): full collections in a
    large training process take milliseconds, land in whichever step allocates at the time, and are one source
    of the steps' spread; objects the hooks keep alive (records) can make them come sooner."""

    def __init__(self) -> None:
        self.current: str | None = None
        self.ns: dict[str, int] = {}
        self.full: dict[str, int] = {}
        self._t0 = 0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter_ns()
        elif self.current is not None:
            self.ns[self.current] = self.ns.get(self.current, 0) + time.perf_counter_ns() - self._t0
            if info.get("generation") == 2:
                self.full[self.current] = self.full.get(self.current, 0) + 1


GC = GcClock()


def timed_step(model, x, tgt, handle=None, variant: str | None = None) -> float:
    """One step in CUDA-event milliseconds; with a handle, its step-boundary flush is inside the timed span
    (training pays for it at every step)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    GC.current = variant
    start.record()
    step(model, x, tgt)
    if handle is not None:
        handle.step()
    end.record()
    torch.cuda.synchronize()
    GC.current = None
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
                tick[variant] = timed_step(model, x, tgt, handles.get(variant), variant)
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
# Inner parts, timed on their own as well (nested in the entries): where an entry's time goes.
_INNER = ("_inspect_vectorised", "_inspect_each")
_SLOTS_INNER = ("current_ptrs",)  # methods of Site.slots (instrument.Slots)


def _timed_entries(cls, names, spent: dict, outer: list | None) -> dict:
    """Wrap `cls`'s methods `names` with timers adding ns to spent[name]; with `outer` (a one-item list used
    as a flag), only the outermost of nested calls counts (a container's pre-hook calls the plain one on its
    first call). Returns the originals."""
    originals = {name: getattr(cls, name) for name in names}

    def timed(name, original):
        def wrapper(self, *args):
            if outer is not None:
                if outer[0]:
                    return original(self, *args)
                outer[0] = True
            c0 = time.thread_time_ns()
            t0 = time.perf_counter_ns()
            try:
                return original(self, *args)
            finally:
                spent[name] = spent.get(name, 0) + time.perf_counter_ns() - t0
                if outer is not None:  # an entry: its thread CPU time too (cpu < wall: the thread waited)
                    spent[f"{name} cpu"] = spent.get(f"{name} cpu", 0) + time.thread_time_ns() - c0
                    outer[0] = False

        return wrapper

    for name, original in originals.items():
        setattr(cls, name, timed(name, original))
    return originals


def in_place_cost(model, x, tgt, variant: str, steps: int) -> tuple[float, float, float, dict]:
    """The hooks' CPU time inside real steps: every hook entry point (the registered pre-hooks, forward hook
    and gradient hook) timed where it runs, cold caches included; the outermost call only. Returns (hook ms
    per step, flush ms per step, median step ms of these steps, {entry or inner part: us per step}).

    Variant "null": the same entry points with bodies that do nothing (pre-hooks on the container and its
    fused object, a forward hook hanging a pre-hook on the output's autograd node): what any Python hook at
    those points costs in place, the floor under the hooks' own figure.
    """
    from maingrad.hooks import instrument

    spent: dict[str, int] = {}
    outer = [False]
    originals = _timed_entries(instrument.Site, _HOOK_ENTRIES, spent, outer)
    inner = _timed_entries(instrument.Site, _INNER, spent, None)
    slots_inner = _timed_entries(instrument.Slots, _SLOTS_INNER, spent, None)
    try:
        # after patching: the registered bound methods are the timed ones
        handle = NullHooks(model, spent) if variant == "null" else install_variant(model, variant)
        step(model, x, tgt)
        handle.step()
        spent.clear()
        flush_ns = 0
        times = []
        for _ in range(steps):
            times.append(timed_step(model, x, tgt))
            t0 = time.perf_counter_ns()
            handle.step()
            flush_ns += time.perf_counter_ns() - t0
        parts = {name: ns / steps / 1e3 for name, ns in spent.items()}
        hook_ns = sum(
            ns
            for name, ns in spent.items()
            if name not in _INNER + _SLOTS_INNER and not name.endswith(" cpu")
        )
        handle.remove()
    finally:
        for name, original in {**originals, **inner}.items():
            setattr(instrument.Site, name, original)
        for name, original in slots_inner.items():
            setattr(instrument.Slots, name, original)
    return hook_ns / steps / 1e6, flush_ns / steps / 1e6, statistics.median(times), parts


class NullHooks:
    """No-op hooks where maingrad's container site puts its own, each timed like them (see in_place_cost)."""

    def __init__(self, model, spent: dict) -> None:
        from maingrad.hooks.discovery import discover, fused_object

        self.spent = spent
        self.handles = []
        self.fused_object = fused_object
        self.late: dict[int, object] = {}
        for spec in discover(model, "auto"):
            module = spec.module
            self.handles.append(
                module.register_forward_pre_hook(self._timed("null_container_pre", self._pre))
            )
            self.handles.append(module.register_forward_hook(self._timed("null_post_forward", self._post)))

    def _timed(self, name, fn):
        spent = self.spent

        def wrapper(*args):
            c0 = time.thread_time_ns()
            t0 = time.perf_counter_ns()
            try:
                return fn(*args)
            finally:
                spent[name] = spent.get(name, 0) + time.perf_counter_ns() - t0
                spent[f"{name} cpu"] = spent.get(f"{name} cpu", 0) + time.thread_time_ns() - c0

        return wrapper

    def _pre(self, module, args):
        target = self.fused_object(module)
        if target is not None and id(target) not in self.late:
            self.late[id(target)] = target.register_forward_pre_hook(
                self._timed("null_pre_forward", _noop_pre)
            )
            self.handles.append(self.late[id(target)])

    def _post(self, module, args, output):
        tensor = output[0] if isinstance(output, tuple) else output
        if isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None:
            tensor.grad_fn.register_prehook(self._timed("null_on_backward", _noop_grad))

    def step(self) -> None:
        pass

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _noop_pre(module, args):
    return None


def _noop_grad(grad):
    return None


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
    if os.environ.get("GC_FREEZE") == "1":  # what long-running trainers often do after setup
        gc.collect()
        gc.freeze()
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
    steps_each = len(samples["none"])
    print(
        f"garbage collector inside timed steps (GC_FREEZE={os.environ.get('GC_FREEZE', '0')}), ms per step / full "
        "collections: "
        + ", ".join(f"{v} {GC.ns.get(v, 0) / steps_each / 1e6:.3f} / {GC.full.get(v, 0)}" for v in VARIANTS)
    )
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
    for variant in (*VARIANTS[1:], "null"):
        try:
            hook_ms, flush_ms, med, parts = in_place_cost(models[0], x, tgt, variant, in_place_steps)
            print(
                f"in place, {variant}: hooks {hook_ms * 1e3:.1f} us per step = {hook_ms / base * 100:.3f}% of the "
                f"median no-hook step (flush at handle.step(): {flush_ms * 1e3:.1f} us; these {in_place_steps} "
                f"steps' median {med:.3f} ms)"
            )
            print("   us per step:", ", ".join(f"{k} {v:.1f}" for k, v in sorted(parts.items())))
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
