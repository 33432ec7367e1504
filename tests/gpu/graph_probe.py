"""Whether a zoo case's loss forward can be captured once as a CUDA graph and replayed with moved weights
(diagnostic, not a test): the eager and replayed loss forward's times, and whether a replay gives the eager
loss bit for bit at the start and after an in-place move of every weight.

    PYTHONPATH=/tmp/mg:/tmp/site:/tmp/mc19:$PWD/tests/gpu/stub python3 tests/gpu/graph_probe.py CASE...
"""

from __future__ import annotations

import sys
import traceback

import preflight_zoo as zoo
import torch


def probe(name: str) -> None:
    case = zoo.CASES[name]
    model, _cfg = zoo.build(case)
    data = zoo.make_batches(case)
    run = zoo.run_microbatch
    run(model, data[0])  # one training pass first, as preflight's first run
    with torch.no_grad():
        eager_ms = zoo.clock(lambda: zoo.loss_fn(model, data[0]), 7) * 1e3
        ref = zoo.loss_fn(model, data[0]).clone()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(3):
                zoo.loss_fn(model, data[0])
        torch.cuda.current_stream().wait_stream(side)
        with torch.no_grad(), torch.cuda.graph(graph):
            out = zoo.loss_fn(model, data[0])
    except Exception as exc:  # noqa: BLE001 - a diagnostic: say why and go on
        print(f"GRAPH {name} capture failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        traceback.print_exc()
        return
    graph.replay()
    torch.cuda.synchronize()
    same_start = bool(torch.equal(out, ref))
    replay_ms = zoo.clock(graph.replay, 7) * 1e3
    weights = [p for p in model.parameters() if p.requires_grad]
    starts = [p.detach().clone() for p in weights]
    with torch.no_grad():
        for p in weights:
            p.add_(torch.randn_like(p), alpha=1e-3 * float(p.float().norm()) / max(p.numel(), 1) ** 0.5)
        moved_ref = zoo.loss_fn(model, data[0]).clone()
    graph.replay()
    torch.cuda.synchronize()
    same_moved = bool(torch.equal(out, moved_ref))
    with torch.no_grad():
        for p, s in zip(weights, starts, strict=True):
            p.copy_(s)
    print(
        f"GRAPH {name}: eager {eager_ms:.2f} ms, replay {replay_ms:.2f} ms; bit for bit at the start {same_start}, "
        f"after a move {same_moved} (loss {float(ref):.6f} -> {float(moved_ref):.6f}, replay {float(out):.6f})",
        flush=True,
    )


def main() -> None:
    zoo.setup_distributed()
    for name in sys.argv[1:]:
        try:
            probe(name)
        except Exception as exc:  # noqa: BLE001
            print(f"GRAPH {name} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
