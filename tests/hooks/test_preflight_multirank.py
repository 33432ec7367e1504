"""preflight at data-parallel size 2 (two CPU processes, gloo): torch DDP and torch FSDP2 with a real shard per
rank and each rank its own micro-batches. Both ranks reach the same verdicts without a hang (every collective
of the check is taken by both: a rank-dependent branch would deadlock), a correct model passes, a bug on one
weight is named on it, and a bug on one rank only (its loss doubled) shows on both ranks' results."""

from __future__ import annotations

import os
import socket
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
HIDDEN = 16
# (wrapper, bug): the bug is none, "mid-x2" (mid.weight's gradient doubled on every rank, at the tensor the
# forward computes with) or "rank1-double" (rank 1 back-propagates twice its loss)
CASES = [
    ("ddp", "none"),
    ("ddp", "mid-x2"),
    ("ddp", "rank1-double"),
    ("fsdp2", "none"),
    ("fsdp2", "mid-x2"),
    ("fsdp2", "rank1-double"),
]


class _DoubleMidGradient:
    """Forward pre-hook: doubles the gradient of the weight this forward computes with (under FSDP2 the
    unsharded parameter it registers for the forward), with one persistent hook per such tensor."""

    def __init__(self) -> None:
        self.hooked: set[int] = set()

    def __call__(self, module: torch.nn.Module, args: Any) -> None:  # noqa: ANN401
        weight = module.weight
        if id(weight) not in self.hooked:
            self.hooked.add(id(weight))
            weight.register_hook(lambda g: 2 * g)


def _case(
    rank: int, wrapper: str, bug: str, seed: int
) -> tuple[str, dict[str, list[str]], list[str], str | None]:
    from emulators import DenseBlock, dense_batches, mse_loss, mse_microbatch

    from maingrad.hooks.preflight.run import preflight

    torch.manual_seed(seed)
    block = DenseBlock("plain", HIDDEN)
    if bug == "mid-x2":
        block.mid.register_forward_pre_hook(_DoubleMidGradient())
    model: torch.nn.Module = block
    if wrapper == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(block.mid)
        fully_shard(block)
    else:
        model = torch.nn.parallel.DistributedDataParallel(block)
    run = mse_microbatch
    if bug == "rank1-double" and rank == 1:

        def run(m: torch.nn.Module, batch: tuple) -> torch.Tensor:
            loss = mse_loss(m, batch)
            (2 * loss).backward()
            return loss.detach()

    batches = dense_batches(3, HIDDEN, seed=10 * seed + rank)  # each rank its own data
    result = preflight(model, run, batches, loss_fn=mse_loss)
    named = {p.name.removeprefix("module."): p.anomalies for p in result.params if p.anomalies}
    unsure = [p.name for p in result.params if p.inconclusive]
    return result.status, named, unsure, result.error


def _worker(rank: int, port: int, seeds: list[int], queue: Any) -> None:  # noqa: ANN401
    try:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        out = {(w, b, s): _case(rank, w, b, s) for s in seeds for w, b in CASES}
        dist.destroy_process_group()
        queue.put((rank, out))
    except Exception:  # noqa: BLE001 - reported to the test
        queue.put((rank, traceback.format_exc()[-3000:]))


@pytest.fixture(scope="module")
def results() -> dict[int, dict[tuple[str, str, int], Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, [0, 1, 2], queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        for _ in range(WORLD):
            rank, value = queue.get(
                timeout=180
            )  # a hang at a collective ends here (a normal run takes ~10 s)
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():  # hung: killed, not left behind
                p.kill()
    for rank, value in out.items():
        assert isinstance(value, dict), f"rank {rank} failed:\n{value}"
    return out


@pytest.mark.parametrize("case", CASES, ids=[f"{w}-{b}" for w, b in CASES])
def test_both_ranks_agree_and_name_the_bug(results: dict[int, Any], case: tuple[str, str]) -> None:
    wrapper, bug = case
    for seed in (0, 1, 2):
        per_rank = [results[r][(wrapper, bug, seed)] for r in range(WORLD)]
        assert per_rank[0][:3] == per_rank[1][:3], per_rank  # status, anomalies, inconclusive: one verdict
        status, named, unsure, error = per_rank[0]
        assert error is None and not unsure, per_rank
        if bug == "none":
            assert status == "pass", per_rank
        elif bug == "mid-x2":
            assert named == {"mid.weight": ["grad_scaled"]}, per_rank
        else:  # rank 1's doubled loss: every gradient the optimizer reads is x1.5 of the true mean
            assert status == "fail" and set(named) == {"inp.weight", "inp.bias", "mid.weight", "out.weight",
                                                       "out.bias"}, per_rank  # fmt: skip
            assert all(codes == ["grad_scaled"] for codes in named.values()), per_rank
