"""What Transformer Engine's `general_gemm` does with `out=` and `out_dtype=` together, on a GPU.

MG007's `out_dtype=` change (`out_dtype=<out>.dtype`) is shown, not applied by `maingrad fix`: TE 2.20.2's
Python `general_gemm` passes `out` and `out_dtype` unchanged to its compiled `tex.generic_gemm`, so whether
a mismatch raises, casts into `out`, or is ignored cannot be read from the wheel's Python. This script runs
each case of the wgrad call (`general_gemm(x, dy, out_dtype=..., layout="NT", out=buf, accumulate=...)`)
and prints one JSON document: per case, whether it raised (and the message), the dtype of what it returned,
whether that is `buf` itself, and how far `buf` is from the fp32 reference (0 = exact up to the GEMM's
rounding).

    python tests/gpu/mg007_out_dtype.py > mg007_out_dtype.json

Needs only torch and transformer_engine (any TE 2.x with `transformer_engine.pytorch.cpp_extensions`).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch


def _gemm() -> Any:
    from transformer_engine.pytorch.cpp_extensions import general_gemm

    return general_gemm


def _case(
    gemm: Any, buf_dtype: torch.dtype | None, out_dtype: torch.dtype | None, accumulate: bool
) -> dict[str, Any]:
    torch.manual_seed(0)
    x = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)  # activations [tokens, in]
    dy = torch.randn(64, 16, device="cuda", dtype=torch.bfloat16)  # grad output [tokens, out]
    reference = dy.float().t() @ x.float()  # wgrad [out, in]
    start = torch.randn(16, 32, device="cuda", dtype=torch.float32)
    buf = start.to(buf_dtype) if buf_dtype is not None else None
    before = buf.clone() if buf is not None else None
    record: dict[str, Any] = {
        "buf_dtype": str(buf_dtype) if buf_dtype is not None else None,
        "out_dtype": str(out_dtype) if out_dtype is not None else None,
        "accumulate": accumulate,
    }
    try:
        result = gemm(x, dy, out_dtype=out_dtype, layout="NT", out=buf, accumulate=accumulate, grad=True)
        torch.cuda.synchronize()
    except Exception as exc:  # the point: which combinations TE refuses
        record.update(raised=True, error=f"{type(exc).__name__}: {exc}"[:400])
        return record
    out = result[0]
    record.update(raised=False, returned_dtype=str(out.dtype) if out is not None else None)
    if buf is not None:
        assert before is not None
        expected = before.float() + reference if accumulate else reference
        record["returned_is_buf"] = out is not None and out.data_ptr() == buf.data_ptr()
        record["buf_dtype_after"] = str(buf.dtype)
        record["buf_rel_error"] = float((buf.float() - expected).norm() / expected.norm())
        record["buf_unchanged"] = bool(torch.equal(buf, before))
    if out is not None:
        record["returned_rel_error_vs_fresh_wgrad"] = float(
            (out.float() - reference).norm() / reference.norm()
        )
    return record


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        return 1
    import transformer_engine

    gemm = _gemm()
    cases = [
        # out=None: what dtype does the GEMM produce by default, and with out_dtype?
        (None, None, False),
        (None, torch.float32, False),
        # fp32 buffer (the usual main_grad): no out_dtype, a matching one, the activations' dtype.
        (torch.float32, None, False),
        (torch.float32, None, True),
        (torch.float32, torch.float32, False),
        (torch.float32, torch.float32, True),
        (torch.float32, torch.bfloat16, False),
        (torch.float32, torch.bfloat16, True),
        # bf16 buffer (Megatron without fp32 grad accumulation): matching, and an fp32 out_dtype.
        (torch.bfloat16, None, True),
        (torch.bfloat16, torch.bfloat16, True),
        (torch.bfloat16, torch.float32, False),
        (torch.bfloat16, torch.float32, True),
    ]
    results = [_case(gemm, *case) for case in cases]
    print(
        json.dumps(
            {
                "torch": torch.__version__,
                "transformer_engine": getattr(transformer_engine, "__version__", "unknown"),
                "device": torch.cuda.get_device_name(),
                "cases": results,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
