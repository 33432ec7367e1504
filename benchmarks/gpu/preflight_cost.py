"""What `maingrad.hooks.preflight` costs on the 64-expert MoE layer, in training steps of the same model.

megatron-core's fused TEGroupedMLP layer of benchmarks/gpu/moe_overhead.py (64 experts, hidden 1024, ffn 1024,
4096 tokens per micro-batch, 2 micro-batches, bf16, Megatron-FSDP, one GPU), built by tests/gpu/mcore_hooks.py.
Per strategy (STRATEGIES, default no_shard and optim_grads_params):
- one step without the optimizer (zero_grad_buffer -> 2 x forward/backward -> finish_grad_sync, the stricter
  yardstick of earlier runs): the median wall time of the steps measured (each ended by a device sync; WARMUP
  steps before), and its peak memory above the memory held after zero_grad_buffer() (Megatron-FSDP's
  optimizer-side fp32 gradients are freed there and made again by finish_grad_sync, in a step as in preflight);
- preflight (default settings, loss_fn given): the median wall time of REPEATS calls after one warm-up call, and
  its peak memory above the same base;
- one training step as Megatron's training loop runs it (OPTIMIZER=1, default): the step above plus
  `optimizer.step()` of megatron-core's own optimizer for the model (`get_megatron_optimizer`, Adam, bf16,
  distributed optimizer, gradient clipping at 1.0: the Adam update of the fp32 main weights, their install into
  the model weights and `start_param_sync()`); where megatron-core cannot build it, torch's AdamW over the
  optimizer's parameters followed by the same install and sync (the line OPTIMIZER says which);
- steps and calls interleaved: REPEATS rounds of STEPS steps of each kind then one preflight call, so that a
  drift of the machine's speed (seen between sessions: the same step 54-93 ms) hits both alike; each round's
  own ratio is printed too;
- reported: preflight time / step time for both steps (target <= 4; the step without the optimizer is the
  stricter yardstick), (preflight peak - step peak) / the bytes of the gradients the optimizer reads (target
  <= 1), the passes preflight ran, and whether the model's weights and the loss of a forward are bit-identical
  before and after every preflight call (it must leave no trace; the optimizer moves them between calls), also
  after a call whose loss_fn raises in the middle of the finite differences (TRACE-ERROR).

With BASELINE=1 every round also times one call with the wrapper's between-steps calls made before every run
(`start_param_sync()` and `zero_grad_buffer()`, as preflight made them before it skipped the redundant ones),
first or second in alternate rounds: what skipping them saves, paired round by round.

With PHASES=1 (default) one more, untimed call per strategy runs with every part of preflight wrapped in
device syncs: a PHASE line per part (calls, milliseconds including the syncs, peak memory above the base while
it ran, memory held when it ended); PROFILE=1 adds one more untimed call under cProfile (the 25 functions with
the most time of their own).

usage (GPU machine): PYTHONPATH=/tmp/mg:/tmp/site:/tmp/mc19 python3 benchmarks/gpu/preflight_cost.py
env: EXPERTS (64), HIDDEN (1024), FFN (1024), TOKENS (4096), STRATEGIES, STEPS (4 per round), WARMUP (3),
REPEATS (5 rounds), OPTIMIZER (1), BASELINE (0), PHASES (1), PROFILE (0)
"""

from __future__ import annotations

import gc
import os
import statistics
import time

from moe_layer import FFN, TOKENS, E, H, prepare

prepare(master_port=29563)

import torch  # noqa: E402

STEPS = int(os.environ.get("STEPS", "4"))
WARMUP = int(os.environ.get("WARMUP", "3"))
REPEATS = int(os.environ.get("REPEATS", "5"))
STRATEGIES = os.environ.get("STRATEGIES", "no_shard,optim_grads_params").split(",")
OPTIMIZER = os.environ.get("OPTIMIZER", "1") == "1"
BASELINE = os.environ.get("BASELINE", "0") == "1"
PHASES = os.environ.get("PHASES", "1") == "1"
PROFILE = os.environ.get("PROFILE", "0") == "1"


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


class TorchAdam:
    """torch's AdamW over Megatron-FSDP's optimizer parameters, then what megatron-core's DistributedOptimizer
    does after its update for Megatron-FSDP: install the main weights into the model weights, start the sync."""

    def __init__(self, model) -> None:
        self.model = model
        params = [p for _, p in model.param_and_grad_buffer.optimizer_named_parameters]
        self.opt = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0, foreach=True)

    def zero_grad(self) -> None:
        pass  # the gradients are Megatron-FSDP's buffer, zeroed by zero_grad_buffer()

    def step(self) -> None:
        self.opt.step()
        self.model.module.install_optimized_model_weights()
        self.model.start_param_sync()


def make_optimizer(model):
    """megatron-core's own optimizer for the model, as its training loop builds it; torch's AdamW otherwise."""
    try:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config = OptimizerConfig(
            optimizer="adam", lr=1e-6, min_lr=0.0, weight_decay=0.0, bf16=True, params_dtype=torch.bfloat16,
            use_distributed_optimizer=True, clip_grad=1.0,
        )  # fmt: skip
        return get_megatron_optimizer(config, [model]), "megatron-core get_megatron_optimizer (Adam)"
    except Exception as exc:  # noqa: BLE001 - reported, and the fallback measured instead
        why = f"{type(exc).__name__}: {exc}"[:200]
        return TorchAdam(model), f"torch AdamW + install + start_param_sync (megatron-core's: {why})"


def full_step(model, optimizer, data) -> None:
    """One iteration of Megatron's training loop: zero, the micro-batches, the grad sync, the optimizer step."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    for batch in data:
        run_microbatch(model, batch)
    model.finish_grad_sync()
    optimizer.step()


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


def state(model, data) -> tuple[list[torch.Tensor], float]:
    """What preflight must leave as it found it: the weights (main and compute) and the loss of micro-batch A
    computed with them."""
    with torch.no_grad():
        loss = loss_fn(model, data[0]).item()
    return weights(model), loss


def grad_bytes(model) -> int:
    total = 0
    for _, param in model.param_and_grad_buffer.optimizer_named_parameters:
        grad = param.grad
        if grad is not None:
            grad = grad.to_local() if hasattr(grad, "to_local") else grad
            total += grad.numel() * grad.element_size()
    return total


MISSING = object()


class Phases:
    """Wraps preflight's parts (methods of its check, adapter and state objects) in device syncs; per part
    name: calls, inclusive milliseconds, the peak memory above `base` while it ran (nested parts included) and
    the memory held when it last ended."""

    PARTS = {
        "maingrad.hooks.preflight.check.Check": (
            "__init__", "first", "loss", "single", "sequence", "repeat", "_run", "host",
        ),
        "maingrad.hooks.preflight.loss_fd.LossFD": ("probe_first", "_round", "evaluate"),
        "maingrad.hooks.preflight.run": ("classify", "_execute"),
        "maingrad.hooks.preflight.state.BufferState": ("__init__", "restore"),
        "maingrad.hooks.preflight.state.RngState": ("__init__", "apply"),
        "maingrad.hooks.preflight.wrappers.MegatronFsdpAdapter": ("zero", "finish", "prepare", "commit"),
        "maingrad.hooks.preflight.wrappers.Adapter": ("__init__",),
    }  # fmt: skip

    def __init__(self) -> None:
        self.stats: dict[str, list[float]] = {}
        self.stack: list[list[float]] = []
        self.saved: list[tuple[object, str, object]] = []
        self.base = 0

    def _wrap(self, owner: object, attr: str, label: str) -> None:
        original = getattr(owner, attr, None)
        if original is None or not callable(original):
            return
        phases = self

        def wrapped(*args, **kwargs):
            phases.enter()
            try:
                return original(*args, **kwargs)
            finally:
                phases.leave(label)

        self.saved.append((owner, attr, vars(owner).get(attr, MISSING)))
        setattr(owner, attr, wrapped)

    def install(self) -> None:
        import importlib

        for path, attrs in self.PARTS.items():
            module_path, _, cls = path.rpartition(".")
            try:
                module = importlib.import_module(path)
                owner, prefix = module, path.rsplit(".", 1)[-1] + "."
            except ImportError:
                owner, prefix = getattr(importlib.import_module(module_path), cls), cls + "."
            for attr in attrs:
                self._wrap(owner, attr, prefix + attr)

    def uninstall(self) -> None:
        for owner, attr, original in reversed(self.saved):
            if original is MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
        self.saved.clear()

    def enter(self) -> None:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        for frame in self.stack:
            frame[1] = max(frame[1], peak)
        torch.cuda.reset_peak_memory_stats()
        self.stack.append([time.perf_counter(), torch.cuda.memory_allocated()])

    def leave(self, label: str) -> None:
        torch.cuda.synchronize()
        start, peak = self.stack.pop()
        peak = max(peak, torch.cuda.max_memory_allocated())
        if self.stack:
            self.stack[-1][1] = max(self.stack[-1][1], peak)
        torch.cuda.reset_peak_memory_stats()
        row = self.stats.setdefault(label, [0, 0.0, 0.0, 0.0])
        row[0] += 1
        row[1] += (time.perf_counter() - start) * 1e3
        row[2] = max(row[2], (peak - self.base) / 2**20)
        row[3] = (torch.cuda.memory_allocated() - self.base) / 2**20

    def report(self, strategy: str) -> None:
        for label, (calls, ms, peak, held) in self.stats.items():
            say(f"PHASE {strategy}: {label:<28} x{int(calls):<3} {ms:8.2f} ms  peak +{peak:7.1f} MiB  "
                f"held after +{held:7.1f} MiB")  # fmt: skip


def measure(strategy: str) -> None:
    import mcore_hooks
    import mcore_parts

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
    model.zero_grad_buffer()
    torch.cuda.synchronize()
    before = state(model, data)

    def timed(call) -> tuple[float, int]:
        return mcore_parts.timed(model, call)

    results = []

    def call() -> None:
        results.append(
            preflight(model, run_microbatch, data, loss_fn=loss_fn, label=f"64 experts {strategy}")
        )

    def every_run_call() -> None:
        """BASELINE: the wrapper's between-steps calls before every run, as preflight made them before it
        skipped the redundant ones (start_param_sync() before each run, zero_grad_buffer() also where nothing
        ran backward since the last zeroing); everything else identical."""
        from maingrad.hooks.preflight.check import Check

        saved = Check._prepare, Check._zero
        Check._prepare = lambda self: self.adapter.prepare()  # type: ignore[method-assign]
        Check._zero = lambda self: self.adapter.zero()  # type: ignore[method-assign]
        try:
            preflight(model, run_microbatch, data, loss_fn=loss_fn)
        finally:
            Check._prepare, Check._zero = saved

    timed(call)  # warm-up
    if BASELINE:
        timed(every_run_call)
    same = [_same(before, state(model, data))]
    optimizer, optimizer_kind = make_optimizer(model) if OPTIMIZER else (None, "off")
    if optimizer is not None:
        try:
            timed(lambda: full_step(model, optimizer, data))
        except Exception as exc:  # noqa: BLE001 - megatron-core's optimizer built but cannot step here
            why = f"{type(exc).__name__}: {exc}"[:200]
            optimizer, optimizer_kind = TorchAdam(model), f"torch AdamW + install + start_param_sync ({why})"
        say(f"OPTIMIZER {strategy}: {optimizer_kind}")
        for _ in range(WARMUP):
            timed(lambda: full_step(model, optimizer, data))
    times, peaks, full_times, full_peaks, pf_times, pf_peaks, rounds, full_rounds = ([] for _ in range(8))
    baseline_times: list[float] = []
    for r in range(REPEATS):
        round_times, round_full = [], []
        for _ in range(STEPS):
            t, peak = timed(lambda: train_step(model, data))
            round_times.append(t)
            peaks.append(peak)
        if optimizer is not None:
            for _ in range(STEPS):
                t, peak = timed(lambda: full_step(model, optimizer, data))
                round_full.append(t)
                full_peaks.append(peak)
        if BASELINE and r % 2 == 1:  # after the steps, before or after the call in alternate rounds
            baseline_times.append(timed(every_run_call)[0])
        before = state(model, data)
        t, peak = timed(call)
        same.append(_same(before, state(model, data)))
        del before
        if BASELINE and r % 2 == 0:
            baseline_times.append(timed(every_run_call)[0])
        times += round_times
        full_times += round_full
        pf_times.append(t)
        pf_peaks.append(peak)
        rounds.append(t / statistics.median(round_times))
        if round_full:
            full_rounds.append(t / statistics.median(round_full))
    say(f"TRACE-ERROR {strategy}: {error_trace(model, data)}")
    diagnose(strategy, model, data)
    say(results[-1].table())
    report(
        strategy, results[-1], gbytes, same,
        times=times, peaks=peaks, full_times=full_times, full_peaks=full_peaks, pf_times=pf_times,
        pf_peaks=pf_peaks, rounds=rounds, full_rounds=full_rounds, baseline_times=baseline_times,
    )  # fmt: skip


def error_trace(model, data) -> str:
    """A loss_fn that raises in the middle of the finite differences (its second call: the first group's
    perturbed forward, after the perturbed weights were installed): preflight must return the error as its
    result and leave the weights, and the loss a forward computes with them, bit-identical."""
    from maingrad.hooks import preflight

    model.zero_grad_buffer()
    before = state(model, data)
    calls = {"n": 0}

    def flaky(m, batch):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure in the second loss evaluation")
        return loss_fn(m, batch)

    result = preflight(model, run_microbatch, data, loss_fn=flaky)
    after = state(model, data)
    return (
        f"status {result.status} ({result.error}); weights and the loss of A bit-identical afterwards: "
        f"{_same(before, after)} (loss {before[1]!r} -> {after[1]!r})"
    )


def diagnose(strategy: str, model, data) -> None:
    """PHASES and PROFILE: untimed calls that say where the time goes."""
    from maingrad.hooks import preflight

    if PHASES:
        phases = Phases()
        phases.install()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        phases.base = torch.cuda.memory_allocated()
        phases.stack = [[time.perf_counter(), phases.base]]
        try:
            preflight(model, run_microbatch, data, loss_fn=loss_fn)
        finally:
            phases.uninstall()
        phases.leave("preflight (all)")
        phases.report(strategy)
    if PROFILE:
        import cProfile
        import io
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        preflight(model, run_microbatch, data, loss_fn=loss_fn)
        torch.cuda.synchronize()
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        for line in text.getvalue().splitlines():
            if line.strip():
                say(f"PROFILE {strategy}: {line}")


def report(strategy: str, result, gbytes: int, same: list[bool], **m: list) -> None:
    """The RESULT, BASELINE, RESULT-FULL, MEMORY and TRACE lines of one strategy."""
    times, pf_times = m["times"], m["pf_times"]
    step, step_peak = statistics.median(times), max(m["peaks"])
    pf, pf_peak = statistics.median(pf_times), max(m["pf_peaks"])
    say(
        f"RESULT {strategy}: step {step * 1e3:.1f} ms (median of {len(times)}, min {min(times) * 1e3:.1f}, max "
        f"{max(times) * 1e3:.1f}); preflight {pf * 1e3:.1f} ms (median of {len(pf_times)}: "
        f"{', '.join(f'{t * 1e3:.1f}' for t in pf_times)}) = {pf / step:.2f} steps (per round: "
        f"{', '.join(f'{r:.2f}' for r in m['rounds'])}); "
        f"{result.cost['microbatch_passes']} passes + {result.cost['forward_passes']} forwards "
        f"({result.cost['fd_groups']} groups); status {result.status}; seconds by part "
        f"{result.cost['seconds_by_part']}"
    )
    baseline_times = m["baseline_times"]
    if baseline_times:
        base_pf = statistics.median(baseline_times)
        paired = [b - t for b, t in zip(baseline_times, pf_times, strict=True)]
        say(
            f"BASELINE {strategy}: the calls before every run (the scheduling before) {base_pf * 1e3:.1f} ms "
            f"(median of {len(baseline_times)}) = {base_pf / step:.2f} steps, against {pf * 1e3:.1f} ms now; "
            f"per round, before minus now: median {statistics.median(paired) * 1e3:.1f} ms, "
            f"{sum(d > 0 for d in paired)} of {len(paired)} rounds slower before "
            f"({', '.join(f'{d * 1e3:.0f}' for d in paired)})"
        )
    full_times = m["full_times"]
    if full_times:
        full = statistics.median(full_times)
        say(
            f"RESULT-FULL {strategy}: full training step (with optimizer.step) {full * 1e3:.1f} ms (median of "
            f"{len(full_times)}, min {min(full_times) * 1e3:.1f}, max {max(full_times) * 1e3:.1f}); preflight "
            f"{pf * 1e3:.1f} ms = {pf / full:.2f} full steps (per round: "
            f"{', '.join(f'{r:.2f}' for r in m['full_rounds'])}); full step peak "
            f"+{max(m['full_peaks']) / 2**20:.1f} MiB"
        )
    say(
        f"MEMORY {strategy}: gradients {gbytes / 2**20:.1f} MiB; step peak +{step_peak / 2**20:.1f} MiB; "
        f"preflight peak +{pf_peak / 2**20:.1f} MiB; extra over a step {(pf_peak - step_peak) / 2**20:.1f} MiB "
        f"= {(pf_peak - step_peak) / gbytes:.2f} x the gradients"
    )
    say(
        f"TRACE {strategy}: weights and the loss of A bit-identical before and after each of {len(same)} "
        f"preflight calls: {all(same)} ({sum(same)} of {len(same)})"
    )


def _same(before: tuple[list[torch.Tensor], float], after: tuple[list[torch.Tensor], float]) -> bool:
    """Bit-identical weights and the same loss of A."""
    (w0, loss0), (w1, loss1) = before, after
    return (
        loss0 == loss1 and len(w0) == len(w1) and all(torch.equal(a, b) for a, b in zip(w0, w1, strict=True))
    )


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
        gc.collect()
        torch.cuda.empty_cache()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
