"""Pieces the GPU drivers share (tests/gpu/preflight_gpu.py, tests/gpu/preflight_zoo.py,
benchmarks/gpu/preflight_cost.py). Importing it has no side effect: each driver sets the process environment
(attention backends, rendezvous port) before it imports torch, then this."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

FSDP_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def wrap(cfg, net: torch.nn.Module, wrapper: str) -> torch.nn.Module:
    """`net` under a Megatron-FSDP strategy (FSDP_STRATEGIES), Megatron DDP (`ddp`) or Megatron DDP with the
    distributed optimizer (`ddp-distopt`)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    if wrapper in FSDP_STRATEGIES:
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        ddp = DistributedDataParallelConfig(
            use_megatron_fsdp=True,
            data_parallel_sharding_strategy=wrapper,
            # Megatron-LM main rejects the sharded-gradient strategies without overlapped reduction
            overlap_grad_reduce=wrapper in ("optim_grads", "optim_grads_params"),
            overlap_param_gather=False,
            use_distributed_optimizer=True,
        )
        return FullyShardedDataParallel(config=cfg, ddp_config=ddp, module=net)
    from megatron.core.distributed import DistributedDataParallel

    ddp = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=(wrapper == "ddp-distopt"),
    )
    return DistributedDataParallel(config=cfg, ddp_config=ddp, module=net)


def gpt_model(cfg, spec, *, vocab: int, seq: int, tied: bool) -> torch.nn.Module:
    """megatron-core's GPTModel on the GPU: embedding, the decoder of `spec`, output layer."""
    from megatron.core.models.gpt import GPTModel

    # GPTModel(config, transformer_layer_spec, vocab_size, max_sequence_length, ...)
    return GPTModel(
        cfg, spec, vocab, seq, pre_process=True, post_process=True, share_embeddings_and_output_weights=tied
    ).cuda()


def timed(model: torch.nn.Module, call: Callable[[], Any]) -> tuple[float, int]:
    """Wall time and peak memory above the base of call(), from zeroed gradient buffers (the base holds no
    gradient the optimizer reads, as before preflight)."""
    model.zero_grad_buffer()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    call()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, torch.cuda.max_memory_allocated() - base
