"""Where a preflight call waits: the host or the device (diagnostic, not a test).

    PYTHONPATH=/tmp/mg:/tmp/site:/tmp/mc19:$PWD/tests/gpu/stub python3 tests/gpu/preflight_trace.py [case] [out]
    python3 tests/gpu/preflight_trace.py --summarize TRACE.json.gz    # the same lines from a saved trace

`preflight_profile.py` times each phase with the device synchronized around it, which says how long a phase
takes but not whether the host (Python, launches) or the device (kernels, copies) sets that time. This runs
one training step and one preflight call under torch.profiler with each phase marked (no added
synchronization) and prints, for the step, the call and each phase (lines starting TRACE): its host time, the
device time of the kernels it launched, and the device's busy time inside its host range. A phase whose
kernels take much less than its host time is paced by the host. The chrome trace is written to `out`
(default $OUT/preflight-trace.json.gz) for a closer look.
"""

from __future__ import annotations

import gzip
import importlib
import json
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import preflight_profile as prof
import preflight_zoo as zoo
import torch
from torch.profiler import ProfilerActivity, profile, record_function

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def marked(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        with record_function(f"MG {name}"):
            return fn(self, *args, **kwargs)

    return wrapper


def union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -1.0
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize(trace: dict[str, Any], label: str) -> None:
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    if label == "*":  # a saved trace: each top-level mark's own lines
        for top in ("step", "preflight"):
            marks = [e for e in events if e.get("cat") == "user_annotation" and e["name"] == f"MG {top}"]
            for m in marks:
                a, b = m["ts"], m["ts"] + m["dur"]
                summarize(
                    {"traceEvents": [e for e in events if a <= e["ts"] <= b or e.get("cat") in DEVICE_CATS]},
                    top,
                )
        return
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    launches = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    marks = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("MG ")]
    dev = [(e["ts"], e["ts"] + e["dur"], launches.get(e["args"].get("correlation"))) for e in device]
    for m in marks:
        a, b = m["ts"], m["ts"] + m["dur"]
        launched = sum(d1 - d0 for d0, d1, t in dev if t is not None and a <= t <= b)
        busy = union([(max(d0, a), min(d1, b)) for d0, d1, _ in dev if d1 > a and d0 < b])
        m["_row"] = (m["name"][3:], (b - a) / 1e3, launched / 1e3, busy / 1e3)
    rows: dict[str, list[float]] = {}
    for m in marks:
        name, host, launched, busy = m["_row"]
        r = rows.setdefault(name, [0, 0.0, 0.0, 0.0])
        r[0] += 1
        r[1] += host
        r[2] += launched
        r[3] += busy
    for name, (n, host, launched, busy) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        print(
            f"TRACE {label:9s} {name:28s} x{n:<3d} host {host:8.1f} ms  kernels launched {launched:8.1f} ms  "
            f"device busy {busy:8.1f} ms",
            flush=True,
        )


def main() -> None:
    if sys.argv[1:2] == ["--summarize"]:
        with gzip.open(sys.argv[2], "rt", encoding="utf-8") as handle:
            summarize(json.load(handle), "*")
        return
    import maingrad.hooks

    zoo.setup_distributed()
    case = zoo.CASES[sys.argv[1] if len(sys.argv) > 1 else "gpt541m-untied-ddp-bf16"]
    out = (
        sys.argv[2]
        if len(sys.argv) > 2
        else os.path.join(os.environ.get("OUT", "."), "preflight-trace.json.gz")
    )
    model, _cfg = zoo.build(case)
    data = zoo.make_batches(case)
    run = zoo.run_microbatch if not case.bug else zoo.Injector(model, case).wrap(zoo.run_microbatch)
    step = zoo.training_step(model, zoo.make_optimizer(model, case.model), run, data)
    for (module_name, class_name), names in prof.PHASES.items():
        owner = getattr(importlib.import_module(f"maingrad.hooks.preflight.{module_name}"), class_name)
        for name in names:
            setattr(owner, name, marked(f"{class_name}.{name}", getattr(owner, name)))

    def call() -> Any:  # noqa: ANN401
        return maingrad.hooks.preflight(model, run, data, loss_fn=zoo.loss_fn)

    for _ in range(3):
        step()
    call()
    torch.cuda.synchronize()
    merged: dict[str, Any] = {"traceEvents": []}
    for label, fn in (("step", step), ("preflight", call)):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            with record_function(f"MG {label}"):
                fn()
            torch.cuda.synchronize()
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            p.export_chrome_trace(tmp.name)
            with open(tmp.name, encoding="utf-8") as handle:
                trace = json.load(handle)
        summarize(trace, label)
        merged["traceEvents"] += trace["traceEvents"]
    with gzip.open(out, "wt", encoding="utf-8") as handle:
        json.dump(merged, handle)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
