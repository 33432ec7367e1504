"""Cost of maingrad.hooks.preflight on CPU, in training steps and in the gradients' bytes.

    python3 benchmarks/preflight_cost.py [--rounds 5] [--json FILE]

For models of the CPU population (tests/hooks/preflight_zoo.py: an MLP, the tied-embedding GPT, the MoE with
an expert that gets no token) with 3 and 4 micro-batches, on the passing path (the correct model) and two
failing paths (one weight x2 inside its group, found by the finite differences; one weight's gradient
overwritten by each backward, named by the fit, without the repeat): the counts preflight reports (forward+
backward passes, loss forwards, bisection depth, host transfers) and, measured interleaved in this one run,
preflight's wall time over one training step (zero, the forward+backward of every micro-batch, an SGD step),
median of the rounds. Memory: preflight's copy of the gradients over the gradients' bytes (its other buffers,
subsets of 4096 elements per parameter and run and one parameter's scratch, are reported separately).
No target is asserted here; the GPU numbers are the lead's (benchmarks/gpu/preflight_cost.py).

A second table compares, on a wider GPT (3.3M parameters: weights above the 65,536 elements under which a
weight always stays in the loss-level probe), the loss-level probe that waits for the module-local screening
(`check.AFTER_SCREENING` on) with the one that runs first and moves every weight (the default), interleaved
in one run: the elements the probe on the first micro-batch's loss moved, the loss forwards, the module reruns
and the wall time over one training step. On the CPU the forwards' arithmetic, not their launching, is most of a
call, so the ratio says less about the GPU than the elements moved do.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "hooks"))

from preflight_zoo import MODELS, TinyGPT, cross_entropy, microbatch, overwrite, scale, token_batches  # noqa: E402

from maingrad.hooks.preflight import check as check_module  # noqa: E402
from maingrad.hooks.preflight import run as run_module  # noqa: E402
from maingrad.hooks.preflight.measure import SUBSET  # noqa: E402
from maingrad.hooks.preflight.run import preflight  # noqa: E402


def _step(model: torch.nn.Module, run, batches, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad(set_to_none=True)
    for batch in batches:
        run(model, batch)
    opt.step()


PATHS = ("pass", "x2", "overwrite")


def measure(name: str, n: int, path: str, rounds: int) -> dict:
    case = MODELS[name]
    model = case.make()
    if path == "x2":
        scale(2.0)(model, case.targets["one"])
    elif path == "overwrite":
        overwrite(model, case.targets["one"])
    run = microbatch(case.loss)
    batches = case.batches(n)
    # the step's optimizer works on a copy, so preflight always sees the same weights
    twin = case.make()
    opt = torch.optim.SGD(twin.parameters(), lr=0.0)
    ratios = []
    result = None
    for _ in range(rounds):
        t0 = time.perf_counter()
        _step(twin, run, batches, opt)
        t1 = time.perf_counter()
        result = preflight(model, run, batches, loss_fn=case.loss)
        t2 = time.perf_counter()
        ratios.append((t2 - t1) / (t1 - t0))
    assert result is not None
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    params = len(list(model.parameters()))
    return {
        "model": name,
        "microbatches": n,
        "path": path,
        "status": result.status,
        "steps_wall_median": round(statistics.median(ratios), 2),
        "passes": result.cost["microbatch_passes"],
        "passes_in_steps": round(result.cost["microbatch_passes"] / n, 2),
        "loss_forwards": result.cost["forward_passes"],
        "fd_probes": result.cost["fd_probes"],
        "bisection_depth": result.cost["bisection_depth"],
        "host_syncs": result.cost["host_syncs"],
        "copy_over_grads": round(result.cost["copy_bytes"] / grad_bytes, 3),
        "subset_bytes_over_grads": round((n + 2) * params * SUBSET * 4 / grad_bytes, 3),
    }


def late_against_first(rounds: int) -> list[dict]:
    """The wider GPT, correct: the probe after the screening (default) and the probe first, interleaved."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=512, dim=256, heads=4, layers=4, seq=64)
    torch.manual_seed(0)
    twin = TinyGPT(vocab=512, dim=256, heads=4, layers=4, seq=64)
    run = microbatch(cross_entropy)
    batches = token_batches(3, vocab=512, seq=64)
    opt = torch.optim.SGD(twin.parameters(), lr=0.0)
    default = check_module.AFTER_SCREENING
    modes = {"after screening": True, "first": False}
    ratios: dict[str, list[float]] = {m: [] for m in modes}
    last: dict[str, dict] = {}
    elements = sum(p.numel() for p in model.parameters())
    try:
        for _ in range(rounds):
            for mode, after in modes.items():
                check_module.AFTER_SCREENING = after
                t0 = time.perf_counter()
                _step(twin, run, batches, opt)
                t1 = time.perf_counter()
                result = preflight(model, run, batches, loss_fn=cross_entropy)
                t2 = time.perf_counter()
                ratios[mode].append((t2 - t1) / (t1 - t0))
                last[mode] = {"status": result.status, **result.cost}
    finally:
        check_module.AFTER_SCREENING = default
    return [
        {
            "loss-level probe": mode,
            "status": last[mode]["status"],
            "moved_share": round(last[mode]["fd_first_elements"] / elements, 4),
            "moved_params": f"{last[mode]['fd_first_params']}/{last[mode]['params']}",
            "loss_forwards": last[mode]["forward_passes"],
            "module_reruns": last[mode]["module_reruns"],
            "steps_wall_median": round(statistics.median(ratios[mode]), 2),
        }
        for mode in modes
    ]


class _Ops(TorchDispatchMode):
    """Counts the operators dispatched (views and metadata excluded: they launch nothing on a GPU)."""

    VIEWS = frozenset(
        [
            "view",
            "_unsafe_view",
            "t",
            "transpose",
            "permute",
            "expand",
            "slice",
            "select",
            "reshape",
            "alias",
            "detach",
            "as_strided",
            "unsqueeze",
            "squeeze",
            "split",
            "unbind",
            "_reshape_alias",
            "split_with_sizes",
            "narrow",
            "flatten",
            "lift_fresh",
        ]
    )

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func.overloadpacket.__name__ not in self.VIEWS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def dispatched_ops() -> list[dict]:
    """Operators dispatched by one call and by one training step of an 8-layer GPT (3 micro-batches), for both
    orders of the loss-level probe, split as preflight's `seconds_by_part` splits its time (its clock read
    as the operator count). On a GPU most of preflight's own operators are small (norms, dots, moves of
    biases), so their count, not their arithmetic, is what they cost: this is the CPU's view of that."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=512, dim=256, heads=4, layers=8, seq=64)
    run = microbatch(cross_entropy)
    batches = token_batches(3, vocab=512, seq=64)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with _Ops() as ops:
        _step(model, run, batches, opt)
    step = ops.count
    default = check_module.AFTER_SCREENING
    rows = []
    try:
        for mode, after in {"after screening": True, "first": False}.items():
            check_module.AFTER_SCREENING = after
            ops = _Ops()
            clock = run_module.time
            run_module.time = SimpleNamespace(perf_counter=lambda ops=ops: float(ops.count))
            try:
                with ops:
                    result = preflight(model, run, batches, loss_fn=cross_entropy)
            finally:
                run_module.time = clock
            parts = result.cost["seconds_by_part"]
            rows.append(
                {
                    "loss-level probe": mode,
                    "status": result.status,
                    "ops_call/step": round(ops.count / step, 2),
                    "runs": int(parts.get("runs", 0)),
                    "finite_diffs": int(parts.get("finite_differences", 0)),
                    "step_ops": step,
                }
            )
    finally:
        check_module.AFTER_SCREENING = default
    return rows


def _print(rows: list[dict]) -> None:
    keys = list(rows[0])
    print(" ".join(f"{k:>16}" for k in keys))
    for row in rows:
        print(" ".join(f"{row[k]!s:>16}" for k in keys))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [
        measure(name, n, path, args.rounds)
        for name in ("mlp", "gpt-tied", "moe")
        for n in (3, 4)
        for path in PATHS
    ]
    _print(rows)
    late = late_against_first(args.rounds)
    print()
    _print(late)
    ops = dispatched_ops()
    print()
    _print(ops)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"population": rows, "late_against_first": late, "dispatched_ops": ops}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
