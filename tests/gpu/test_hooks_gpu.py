"""maingrad.hooks against real Transformer Engine (and megatron-core) on a GPU; skipped elsewhere.

On the GPU machine (recipe: docs/gpu-evidence.md ("Setting up the GPU machine")), with maingrad installed to /tmp/mg:
    PYTHONPATH=/tmp/mg:/tmp/site:/tmp/mc18 python3 -m pytest tests/gpu/test_hooks_gpu.py -v
    PYTHONPATH=/tmp/mg:/tmp/site:/tmp/mc19 python3 -m pytest tests/gpu/test_hooks_gpu.py -v
The megatron tests run tests/gpu/mcore_hooks.py in a subprocess (it initialises torch.distributed) and check
its JSON results; the TE tests drive `te.ops.Sequential(te.ops.GroupedLinear(...))` in-process.
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

HAVE_CUDA = torch.cuda.is_available()
HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
HAVE_MCORE = (
    importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
)
needs_te = pytest.mark.skipif(not (HAVE_CUDA and HAVE_TE), reason="needs CUDA and Transformer Engine")
needs_mcore = pytest.mark.skipif(
    not (HAVE_CUDA and HAVE_TE and HAVE_MCORE), reason="needs CUDA, Transformer Engine and megatron-core"
)
SCRIPT = Path(__file__).with_name("mcore_hooks.py")
G, IN, OUT = 4, 256, 384
SPLITS = [64, 0, 128, 320]  # group 1 gets no token


def _fsdp_like_op(seed: int = 0):
    """te.ops.Sequential(GroupedLinear(accumulate_into_main_grad=True)) with Megatron-FSDP-like weights."""
    import transformer_engine.pytorch as te

    torch.manual_seed(seed)
    op = te.ops.GroupedLinear(
        G, IN, OUT, bias=False, device="cuda", dtype=torch.bfloat16, accumulate_into_main_grad=True
    )
    seq = te.ops.Sequential(op)
    buffers = []
    for i in range(G):
        weight = getattr(op, f"weight{i}")
        buf = torch.zeros(OUT, IN, device="cuda", dtype=torch.float32)
        weight.__fsdp_param__ = True
        weight.grad_added_to_main_grad = False
        weight.overwrite_main_grad = False
        weight.get_main_grad = lambda b=buf: b
        buffers.append(buf)
    return seq, op, buffers


def _inputs(seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(sum(SPLITS), IN, device="cuda", dtype=torch.bfloat16, generator=g)
    dy = torch.randn(sum(SPLITS), OUT, device="cuda", dtype=torch.bfloat16, generator=g)
    return x, dy


def _ref_wgrads(x, dy):
    out, off = [], 0
    for n in SPLITS:
        out.append(dy[off : off + n].float().t() @ x[off : off + n].float())
        off += n
    return out


def _installed_op(mode: str):
    """The Megatron-FSDP-like op with maingrad's hooks installed in `mode`, and the first inputs for it."""
    from maingrad.hooks import install

    seq, _, _ = _fsdp_like_op()
    return seq, install(seq, mode), _inputs(1)


def _run(seq, x, dy):
    splits = torch.tensor(SPLITS, dtype=torch.int64, device="cuda")
    y = seq(x.clone().requires_grad_(True), splits)
    y.backward(dy)
    torch.cuda.synchronize()


@needs_te
def test_te_op_fuser_fails_without_hooks_and_accumulates_with_them() -> None:
    from maingrad.hooks import install

    seq, op, buffers = _fsdp_like_op()
    x1, dy1 = _inputs(1)
    with pytest.raises(RuntimeError, match="MAIN GRAD NOT FOUND"):
        _run(seq, x1, dy1)
    handle = install(seq, sinks=["memory"])
    assert handle.targets == [("", "op_fuser", G)]
    x2, dy2 = _inputs(2)
    _run(seq, x1, dy1)
    _run(seq, x2, dy2)
    ref = [a + b for a, b in zip(_ref_wgrads(x1, dy1), _ref_wgrads(x2, dy2), strict=True)]
    for i in range(G):
        assert getattr(op, f"weight{i}").main_grad is buffers[i]
        rel = ((buffers[i] - ref[i]).norm() / (ref[i].norm() + 1e-12)).item()
        assert rel < 1e-3, (i, rel)
    summary = handle.summary()
    assert summary.ok and summary.modules[0].exposed == G  # exposed once, then present
    records = [r for r in handle.records() if r["param"] == "0.weight0"]  # op 0 of the Sequential
    # TE sets grad_added_to_main_grad after its fused wgrad; without Megatron-FSDP nothing resets it
    assert [(r["phase"], r["grad_added_to_main_grad"]) for r in records] == [
        ("forward", False),
        ("backward", False),
        ("forward", True),
        ("backward", True),
    ]
    assert all(r["device"] == "cuda:0" and r["dtype"] == "torch.float32" for r in handle.records())
    handle.remove()


@needs_te
def test_te_check_mode_raises_before_te() -> None:
    from maingrad.hooks import MainGradContractError

    seq, handle, (x, dy) = _installed_op("check")
    with pytest.raises(MainGradContractError, match="weight0"):
        _run(seq, x, dy)
    handle.remove()


@needs_te
def test_te_hook_bodies_never_sync() -> None:
    seq, handle, (x, dy) = _installed_op("fix")
    _run(seq, x, dy)  # exposes and records once outside the check
    (site,) = handle._sites
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            site._inspect(0, 0, True, None)
            site._inspect(1, 0, True, None)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    summary = handle.summary()
    assert summary.internal_errors == 0, summary.last_error
    assert summary.ok
    handle.remove()


def _script(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "result.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(out), "--records", str(tmp_path / "records"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    print(proc.stdout[-6000:])
    print(proc.stderr[-3000:], file=sys.stderr)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@needs_mcore
@pytest.mark.parametrize(
    ("experts", "microbatches"),
    # 32 experts: a container of 64 parameters, which the hooks inspect on their vectorised path
    [("4", "1"), ("4", "2"), ("32", "2")],
)
def test_mcore_fused_grouped_mlp_fixed_by_hooks(tmp_path: Path, experts: str, microbatches: str) -> None:
    result = _script(tmp_path, "--strategy", "optim_grads_params", "--mb", microbatches, "--experts", experts)
    cases = result["cases"]
    assert not cases["fused"]["ok"] and "MAIN GRAD" in cases["fused"]["error"]
    hooks = cases["hooks"]
    assert hooks["ok"], hooks["error"]
    assert hooks["compare"]["max_rel"] < 2e-2 and hooks["compare"]["loss_rel"] < 1e-3, hooks["compare"]
    assert hooks["hooks"]["exposed"] > 0 and hooks["hooks"]["internal_errors"] == 0
    assert cases["plain"]["ok"], cases["plain"]["error"]
    # At data-parallel size 1 Megatron-FSDP does not shard the gradient buffer even for optim_grads_params,
    # yet sets overwrite_main_grad=True: with 2 micro-batches both TE paths (fused and nonfused) drop the
    # first one. The records must say so exactly when it happens.
    diverged = hooks["compare_plain"]["max_rel"] > 5e-2
    assert diverged == ("overwrite_discards_microbatch" in hooks["hooks"]["anomalies"]), hooks[
        "compare_plain"
    ]
    assert diverged == (microbatches != "1" and result["world"] == 1)
    assert not cases["check"]["ok"] and cases["check"]["error_type"] == "MainGradContractError"
    sync = hooks["sync"]
    assert sync["warn_step_sync_events_in_hooks"] == 0, sync
    assert sync["error_mode_hook_calls"] > 0 and sync["error_mode_new_internal_errors"] == 0, sync
    assert "inside hooks" not in sync["error_step"], sync
    if "shipped" in cases:  # megatron-core >= 0.19: its own exposure works too
        assert cases["shipped"]["ok"] and cases["shipped"]["compare"]["max_rel"] < 2e-2


@needs_mcore
def test_mcore_unsharded_gradients_heuristic_matches_reality(tmp_path: Path) -> None:
    """`optim` with 2 micro-batches: whether Megatron-FSDP's flags make the fused backward overwrite an
    earlier micro-batch was an open question (docs/gpu-evidence.md §2 has the answer). Whatever the answer,
    the records must agree with the gradients against the plain-autograd reference (the nonfused TE path reads
    the same flag, so it cannot be the reference here): the overwrite anomaly is flagged exactly when the
    fused path diverges."""
    result = _script(tmp_path, "--strategy", "optim", "--mb", "2", "--no-sync", "--cases", "hooks", "plain")
    hooks = result["cases"]["hooks"]
    assert hooks["ok"], hooks["error"]
    diverged = hooks["compare_plain"]["max_rel"] > 5e-2
    flagged = "overwrite_discards_microbatch" in hooks["hooks"]["anomalies"]
    assert diverged == flagged, (
        hooks["compare_plain"],
        hooks["hooks"]["anomalies"],
        hooks["hooks"]["overwrite_seen"],
    )
