"""Where a preflight call's time goes on one GPU (diagnostic, not a test).

    PYTHONPATH=/tmp/mg:/tmp/site:/tmp/mc19:$PWD/tests/gpu/stub python3 tests/gpu/preflight_profile.py [case]

Prints (lines starting PROFILE): a loss forward, a forward+backward and a training step of the case, timed
alone; then one call with and one without the module-local check, each phase of the call timed with the
device synchronized around it (phases nest: `Check._run` and the `Subsets.*` lines are inside the others,
and the sum is a little more than an unprofiled call), with the
module-local screening's and refinement's rerun counts and the weights the screening left loosely bounded;
then the call under cProfile (the call is CPU-bound: the Python and launch time is the cost), sorted by
cumulative time over maingrad's functions and by own time over everything.
"""

from __future__ import annotations

import cProfile
import importlib
import io
import pstats
import sys
import time
from collections.abc import Callable
from typing import Any

import preflight_zoo as zoo
import torch

# the phases timed, by the module and class that hold them (a method of one call's Check or of its parts)
PHASES = {
    ("check", "Check"): [
        "first", "single", "sequence", "repeat", "needs_repeat", "__init__", "_run", "_zero", "_prepare",
        "commit", "loss", "adopt_fp8_state", "plan_loss_level", "loss_level",
    ],
    ("loss_fd", "LossFD"): [
        "measure", "keep", "probe_first", "probe_rest", "probe_left", "_first_steps", "evaluate",
    ],
    ("local_fd", "LocalFD"): ["screening", "plan_refinement", "refinement", "judge", "find_tensors"],
}  # fmt: skip
SUBSETS = ["take", "positions", "gram"]  # measure.Subsets' methods (inside the phases above)
FUNCTIONS = ["_execute", "classify", "choose"]  # functions run.py calls by its own names, timed the same way


def clock(call: Callable[[], Any], n: int = 5) -> float:
    """Median milliseconds of n synchronized calls."""
    return zoo.clock(call, n) * 1e3


def timed_function(name: str, fn: Callable[..., Any], timed: Callable[..., Any]) -> Callable[..., Any]:
    """`timed` (made for methods) around a module-level function."""
    method = timed(name, lambda _unused, *args, **kwargs: fn(*args, **kwargs))
    return lambda *args, **kwargs: method(None, *args, **kwargs)


def main() -> None:
    import maingrad.hooks
    from maingrad.hooks.preflight import measure
    from maingrad.hooks.preflight import run as pr

    zoo.setup_distributed()
    case = zoo.CASES[sys.argv[1] if len(sys.argv) > 1 else "gpt541m-untied-ddp-bf16"]
    model, _cfg = zoo.build(case)
    data = zoo.make_batches(case)
    run = zoo.run_microbatch if not case.bug else zoo.Injector(model, case).wrap(zoo.run_microbatch)
    step = zoo.training_step(model, zoo.make_optimizer(model, case.model), run, data)

    with torch.no_grad():
        print(f"PROFILE forward {clock(lambda: zoo.loss_fn(model, data[0])):.1f} ms", flush=True)
    print(f"PROFILE forward+backward {clock(lambda: run(model, data[0])):.1f} ms", flush=True)
    print(f"PROFILE training step {clock(step):.1f} ms", flush=True)

    spent: dict[str, float] = {}

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                torch.cuda.synchronize()
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0

        return wrapper

    for (module_name, class_name), names in PHASES.items():
        owner = getattr(importlib.import_module(f"maingrad.hooks.preflight.{module_name}"), class_name)
        for name in names:
            setattr(owner, name, timed(f"{class_name}.{name}", getattr(owner, name)))
    for name in SUBSETS:
        setattr(measure.Subsets, name, timed(f"Subsets.{name}", getattr(measure.Subsets, name)))
    for name in FUNCTIONS:
        setattr(pr, name, timed_function(name, getattr(pr, name), timed))
    from maingrad.hooks.preflight.local_fd import LocalFD

    judge_local = LocalFD.judge

    def counted(self: Any, probe: Any, reported: Any, screening: bool, predicted: Any = None) -> None:  # noqa: ANN401
        judge_local(self, probe, reported, screening, predicted)
        loose = [self.check.entries[i].name for i in self.unsure] if screening else []
        print(f"PROFILE {'screening' if screening else 'refinement'}: {probe.reruns} reruns, {len(probe.plan)} "
              f"weights planned, {len(probe.escaped)} used outside their call; loosely bounded: {loose}", flush=True)  # fmt: skip

    LocalFD.judge = counted  # type: ignore[method-assign]

    def call(module_fd: bool = True) -> Any:  # noqa: ANN401
        return maingrad.hooks.preflight(model, run, data, loss_fn=zoo.loss_fn, module_fd=module_fd)

    call()
    call(False)
    for on in (True, False):
        spent.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = call(on)
        torch.cuda.synchronize()
        total = (time.perf_counter() - t0) * 1e3
        phases = " ".join(f"{k}={v * 1e3:.1f}" for k, v in spent.items())
        print(f"PROFILE module_fd={on} {total:.1f} ms ({result.status}): {phases}", flush=True)
        print(f"PROFILE cost {result.cost}", flush=True)
        print(f"PROFILE local {result.local}", flush=True)
    profiler = cProfile.Profile()
    profiler.enable()
    call()
    torch.cuda.synchronize()
    profiler.disable()
    for sort, restrict in (("cumulative", ("maingrad", 60)), ("tottime", (50,))):
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats(sort).print_stats(*restrict)
        print(out.getvalue(), flush=True)


if __name__ == "__main__":
    main()
