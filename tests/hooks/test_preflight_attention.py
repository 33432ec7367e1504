"""maingrad.hooks.preflight on the attention population of `preflight_attention.py` (torch's
`nn.MultiheadAttention` alone and in its encoder and decoder layers, each branch scaled into a residual stream):
a correct model passes, and a zeroed gradient on each attention weight is `grad_lost` on exactly that weight
(`KNOWN_MISSES` held as strict xfails). A part of sets 1 and 2 and all of set 3, the held-out one."""

from __future__ import annotations

import itertools

import pytest
import torch
from preflight_attention import KNOWN_MISSES, TESTED, attention_check, attention_model, attention_weights


def _params() -> list[object]:
    out: list[object] = []
    for case, (seeds, scales, dropouts, dtypes) in TESTED.items():
        for seed, scale, dropout, dtype in itertools.product(seeds, scales, dropouts, dtypes):
            model = attention_model(case, seed, scale, dropout, dtype)
            names = attention_weights(model)
            kind = str(dtype).removeprefix("torch.")
            for bug in (None, *names):
                out.append(
                    pytest.param(
                        case,
                        seed,
                        scale,
                        dropout,
                        dtype,
                        bug,
                        id=f"{case}-{seed}-{scale:g}-drop{dropout:g}-{kind}-{bug or 'correct'}",
                        marks=[pytest.mark.xfail(strict=True, reason=f"known miss: {why}")]
                        if (why := KNOWN_MISSES.get((case, bug or ""))) is not None
                        else [],
                    )
                )
    return out


@pytest.mark.parametrize(("case", "seed", "scale", "dropout", "dtype", "bug"), _params())
def test_a_zeroed_attention_gradient_is_named_and_a_correct_model_passes(
    case: str, seed: int, scale: float, dropout: float, dtype: torch.dtype, bug: str | None
) -> None:
    model = attention_model(case, seed, scale, dropout, dtype)
    if bug is not None:
        dict(model.named_parameters())[bug].register_hook(torch.zeros_like)
    result = attention_check(case, seed, model)
    named = {p.name: p.anomalies for p in result.params if p.anomalies}
    if bug is None:
        assert result.status == "pass", result.table()
    else:
        assert named == {bug: ["grad_lost"]}, result.table()
