"""Where a preflight call's time goes on one GPU (diagnostic, not a test): the wrapper's own calls timed alone,
then one preflight call under torch.profiler, its ops sorted by CPU and by CUDA time.

    PYTHONPATH=/tmp/mg:/tmp/site:/tmp/mc19:tests/gpu/stub python3 tests/gpu/preflight_profile.py gpt541m-untied-ddp-bf16
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import preflight_zoo as zoo
import torch


def clock(call: Callable[[], Any], n: int = 5) -> float:
    """Median milliseconds of n synchronized calls."""
    return zoo.clock(call, n) * 1e3


def main() -> None:
    import maingrad.hooks
    from maingrad.hooks.preflight.wrappers import choose

    zoo.setup_distributed()
    case = zoo.CASES[sys.argv[1] if len(sys.argv) > 1 else "gpt541m-untied-ddp-bf16"]
    model, _cfg = zoo.build(case)
    data = zoo.make_batches(case)
    adapter = choose(model, "auto")
    zoo.run_microbatch(model, data[0])
    print(f"PROFILE zero {clock(adapter.zero):.2f} ms, finish {clock(adapter.finish):.2f} ms, "
          f"prepare {clock(adapter.prepare):.2f} ms, commit {clock(adapter.commit):.2f} ms", flush=True)  # fmt: skip
    with torch.no_grad():
        print(f"PROFILE forward {clock(lambda: zoo.loss_fn(model, data[0])):.2f} ms", flush=True)
    print(f"PROFILE forward+backward {clock(lambda: zoo.run_microbatch(model, data[0])):.2f} ms", flush=True)

    def call(module_fd: bool = True) -> Any:
        return maingrad.hooks.preflight(
            model, zoo.run_microbatch, data, loss_fn=zoo.loss_fn, module_fd=module_fd
        )

    call()
    for _ in range(3):  # interleaved: with and without the module-local finite differences
        for on in (True, False):
            print(f"PROFILE preflight module_fd={on} {clock(lambda on=on: call(on), 3):.1f} ms", flush=True)
    print(
        f"PROFILE parts {call().cost['seconds_by_part']} / {call(False).cost['seconds_by_part']}", flush=True
    )
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        result = call()
        torch.cuda.synchronize()
    print(result.cost, flush=True)
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=30), flush=True)
    print(table.table(sort_by="self_cuda_time_total", row_limit=30), flush=True)


if __name__ == "__main__":
    main()
