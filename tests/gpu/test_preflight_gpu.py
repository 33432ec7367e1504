"""maingrad.hooks.preflight against real Transformer Engine and megatron-core on a GPU; skipped elsewhere.

On the GPU machine (recipe: docs/gpu-evidence.md ("Setting up the GPU machine")), with maingrad installed to /tmp/mg:
    PYTHONPATH=/tmp/mg:/tmp/site:/tmp/mc19:tests/gpu/stub python3 -m pytest tests/gpu/test_preflight_gpu.py -v
Megatron-LM main: put its source tree of megatron/core on PYTHONPATH instead of /tmp/mc19. Each test runs
tests/gpu/preflight_gpu.py in a subprocess (it initialises torch.distributed) and checks what preflight named.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu]

HAVE = (
    torch.cuda.is_available()
    and importlib.util.find_spec("transformer_engine") is not None
    and importlib.util.find_spec("megatron") is not None
    and importlib.util.find_spec("megatron.core") is not None
)
needs_mcore = pytest.mark.skipif(not HAVE, reason="needs CUDA, Transformer Engine and megatron-core")
SCRIPT = Path(__file__).with_name("preflight_gpu.py")
STUB = Path(__file__).with_name("stub")


def _run(tmp_path: Path, *cases: str) -> dict[str, dict]:
    out = tmp_path / "pf.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(STUB), os.environ.get("PYTHONPATH", "")]))
    if any(case.startswith("gpt-local") for case in cases):  # LanguageModule rejects these
        env.pop("NVTE_FLASH_ATTN", None)
        env.pop("NVTE_FUSED_ATTN", None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(out), "--tag", "pytest", *cases],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {r["case"]: r for r in json.loads(out.read_text())}


def _short(names: list[str]) -> set[str]:
    return {n.split(".", 1)[-1] if n.startswith(("self_attention", "mlp")) else n for n in names}


@needs_mcore
def test_moe_and_tefusedmlp(tmp_path: Path) -> None:
    results = _run(
        tmp_path,
        "moe/optim_grads_params/fusion",
        "moe/no_shard/fusion",
        "moe/optim_grads_params/nofusion",
        "dense-fused/optim_grads_params/fusion",
        "dense-fused/no_shard/fusion",
    )
    ogp = results["moe/optim_grads_params/fusion"]
    assert ogp["status"] == "fail" and set(ogp["named"]) == {"grad_overwritten"}
    named = set(ogp["named"]["grad_overwritten"])
    assert {"self_attention.linear_qkv.weight", "self_attention.linear_proj.weight"} <= named
    assert {f"mlp.experts.linear_fc{i}.weight{j}" for i in (1, 2) for j in range(4)} <= named
    assert not any("router" in n or "norm" in n for n in named)
    for case in ("moe/no_shard/fusion", "moe/optim_grads_params/nofusion", "dense-fused/no_shard/fusion"):
        assert results[case]["status"] == "pass", results[case]
    fused = results["dense-fused/optim_grads_params/fusion"]
    assert set(fused["named"]["grad_scaled"]) == {"mlp.linear_fc1.weight", "mlp.linear_fc2.weight"}
    scales = {p["name"]: p["fd_scale"] for p in fused["result"]["params"] if "grad_scaled" in p["anomalies"]}
    assert all(abs(s - 2.0) < 0.2 for s in scales.values()), scales


@needs_mcore
def test_megatron_own_linears(tmp_path: Path) -> None:
    results = _run(
        tmp_path,
        "gpt-local/no_shard/fusion",
        "gpt-local/optim_grads_params/fusion",
        "gpt-local/no_shard/nofusion",
    )
    expected = {
        "self_attention.linear_qkv.weight",
        "self_attention.linear_proj.weight",
        "mlp.linear_fc1.weight",
        "mlp.linear_fc2.weight",
        "output_layer.weight",
    }
    for case in ("gpt-local/no_shard/fusion", "gpt-local/optim_grads_params/fusion"):
        named = results[case]["named"]
        assert set(named) == {"grad_overwritten"} and set(named["grad_overwritten"]) == expected, named
    assert results["gpt-local/no_shard/nofusion"]["status"] == "pass"
