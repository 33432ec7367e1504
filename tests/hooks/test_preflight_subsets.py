"""preflight's subsets (`measure.Subsets`): every run's strided subset of each gradient lands in its parameter's
row, and the fit residual formed on the device equals the one computed parameter by parameter. A population of
random parameter sizes (1 element to several subsets' worth, some absent from a run), several seeds."""

from __future__ import annotations

import random
import types

import pytest
import torch

from maingrad.hooks.preflight.measure import SUBSET, Dist, Stats, Subsets


def _entries(sizes: list[int]) -> list[types.SimpleNamespace]:
    return [
        types.SimpleNamespace(name=f"layers.{k}.weight", opt_param=torch.zeros(n))
        for k, n in enumerate(sizes)
    ]


def _expected_row(subsets: Subsets, i: int, f: torch.Tensor) -> torch.Tensor:
    offset, stride, count = subsets.pick(i, f.numel())
    row = torch.zeros(SUBSET)
    row[:count] = f[offset : offset + stride * count : stride]
    return row


@pytest.mark.parametrize("seed", range(6))
def test_each_parameters_subset_lands_in_its_row(seed: int) -> None:
    rng = random.Random(seed)
    sizes = [rng.choice([1, 3, 64, SUBSET - 1, SUBSET, SUBSET + 5, 3 * SUBSET + 7, rng.randint(1, 40000)])
             for _ in range(rng.randint(1, 40))]  # fmt: skip
    entries = _entries(sizes)
    subsets = Subsets(entries)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(seed)
    for run in range(3):  # some parameters absent from some runs: their rows stay zero
        flats: list[torch.Tensor | None] = [
            None if rng.random() < 0.2 else torch.randn(n, generator=gen) for n in sizes
        ]
        subsets.take(f"r{run}", flats)
        mat = subsets.mats[f"r{run}"][torch.device("cpu")]
        for i, f in enumerate(flats):
            row = mat[subsets.row_of[i]]
            if f is None:
                assert not row.any()
            else:
                assert torch.equal(row, _expected_row(subsets, i, f))


@pytest.mark.parametrize("seed", range(4))
def test_the_fit_residual_equals_the_direct_one(seed: int) -> None:
    """|sum_k c_k row_k|^2 per parameter, against the same sum formed row by row in float64."""
    rng = random.Random(seed)
    sizes = [rng.randint(1, 3 * SUBSET) for _ in range(12)]
    subsets = Subsets(_entries(sizes))  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(100 + seed)
    keys = ["s0", "s1", "s2", "seq"]
    runs = {key: [torch.randn(n, generator=gen) for n in sizes] for key in keys}
    for key, flats in runs.items():
        subsets.take(key, list(flats))
    coeffs = {i: [rng.uniform(-2, 2) for _ in keys[:-1]] + [-1.0] for i in range(0, len(sizes), 2)}
    stats = Stats(len(sizes), Dist(sharded=False))
    subsets.residual2(stats, "res2", keys, coeffs)
    got = stats.host(["res2"])["res2"]
    for i in range(len(sizes)):
        if i not in coeffs:
            assert got[i] is None
            continue
        rows = [_expected_row(subsets, i, runs[key][i]).double() for key in keys]
        direct = sum(c * r for c, r in zip(coeffs[i], rows, strict=True))
        assert isinstance(direct, torch.Tensor)
        assert got[i] == pytest.approx(float((direct * direct).sum()), rel=1e-5)
