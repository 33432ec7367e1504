"""What the GPU benchmarks share: the process environment they set before torch is imported, and the size of
the MoE layer they measure (tests/gpu/mcore_hooks.py's fused TEGroupedMLP; env EXPERTS, HIDDEN, FFN, TOKENS)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

E = int(os.environ.get("EXPERTS", "64"))
H = int(os.environ.get("HIDDEN", "1024"))
FFN = int(os.environ.get("FFN", "1024"))
TOKENS = int(os.environ.get("TOKENS", "4096"))


def prepare(master_port: int) -> None:
    """Before torch is imported: plain PyTorch attention, one CUDA connection, megatron-core 0.19's fused grouped
    MLP, a one-process rendezvous at `master_port` (unless the environment says otherwise), and tests/gpu
    (mcore_hooks) importable."""
    defaults = {
        "NVTE_FLASH_ATTN": "0",
        "NVTE_FUSED_ATTN": "0",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        "NVTE_CUTEDSL_FUSED_GROUPED_MLP": "1",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "gpu"))
