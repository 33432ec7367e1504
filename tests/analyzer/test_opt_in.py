"""Opt-in rules: out of the default selection and of `ALL`, in when `select` names them.

MG002 is opt-in because on Megatron/TE forks and ports it reported only false alarms (docs/real-world.md,
second table); the snippets below are trimmed from two of them (apex.transformer, 2021-2025; a Megatron-LM
fork of 2025 without Megatron-FSDP) and stay silent by default.
"""

from __future__ import annotations

import json

import pytest

from maingrad.analyzer.config import Config
from maingrad.analyzer.rules import all_rules

APEX_STYLE = """\
import fused_weight_gradient_mlp_cuda


def backward(ctx, grad_output):
    total_input, weight = ctx.saved_tensors
    if ctx.gradient_accumulation_fusion:
        if weight.main_grad.dtype == torch.float32:
            fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(total_input, grad_output, weight.main_grad)
        elif weight.main_grad.dtype in (torch.float16, torch.bfloat16):
            fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16(total_input, grad_output, weight.main_grad)
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
            grad_weight = torch.empty_like(weight)
        else:
            grad_weight = None
    else:
        grad_weight = grad_output.t().matmul(total_input)
    return grad_output.matmul(weight), grad_weight
"""


def test_only_mg002_is_opt_in() -> None:
    assert [r.id for r in all_rules() if not r.default] == ["MG002"]


@pytest.mark.parametrize(
    ("select", "enabled"),
    [(None, False), (("ALL",), False), (("MG002",), True), (("MG00",), True), (("MG001", "MG002"), True)],
)
def test_selection_of_an_opt_in_rule(tmp_path, select, enabled) -> None:  # type: ignore[no-untyped-def]
    known = ("MG001", "MG002", "MG003")
    chosen = Config(root=tmp_path, select=select).selected(known, opt_in=("MG002",))
    assert ("MG002" in chosen) is enabled
    assert ("MG003" in chosen) is (select is None or "ALL" in select or "MG00" in select)


def test_default_check_is_silent_on_pre_fsdp_code_and_select_enables_it(project, run) -> None:  # type: ignore[no-untyped-def]
    project({"layers.py": APEX_STYLE}, config="")
    default = run("check", "layers.py", "--format", "json")
    assert default.code == 0, default.out
    selected = run("check", "layers.py", "--select", "MG002", "--format", "json")
    assert selected.code == 1
    rules = {f["rule"] for f in json.loads(selected.out)["findings"]}
    assert rules == {"MG002"}


def test_rules_listing_marks_opt_in(run) -> None:  # type: ignore[no-untyped-def]
    line = next(row for row in run("rules").out.splitlines() if row.startswith("MG002"))
    assert line.endswith("(opt-in)")
