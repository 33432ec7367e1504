"""What a passing finite-difference comparison leaves open on one weight (`judge.hidden_factor`), and when a
self-consistent estimate is still no ground for blame (`measure.contradicted`, `measure.refuting`)."""

from __future__ import annotations

import math
import random

import pytest

from maingrad.hooks.preflight.judge import hidden_factor
from maingrad.hooks.preflight.measure import Estimate, contradicted, finer, refuting


def _set_ratio(share: float, factor: float) -> float | None:
    """reported / true of a set in which one weight carrying `share` of the (reported) prediction is off by
    `factor` and the others are right; None where the set's true change has the other sign."""
    x = share * (1 - 1 / factor)
    return None if x >= 1 else 1 / (1 - x)


def test_every_factor_a_comparison_passes_is_inside_its_hidden_factor() -> None:
    """On 200,000 draws of (band, share, factor), every factor whose set still passes within `band` lies in
    the band hidden_factor gives (the linear 1 + band / share misses about a quarter of them)."""
    rng = random.Random(0)
    hidden = missed_by_linear = 0
    for _ in range(200_000):
        band, share = 10 ** rng.uniform(-4, 0), 10 ** rng.uniform(-3, 0)
        factor = rng.choice((-1, 1)) * 10 ** rng.uniform(-1.5, 1.5)
        ratio = _set_ratio(share, factor)
        if ratio is None or abs(math.log(ratio)) > band:
            continue
        hidden += 1
        assert abs(factor - 1) <= hidden_factor(band, share) - 1 + 1e-12, (band, share, factor)
        missed_by_linear += abs(factor - 1) > band / share
    assert hidden > 10_000 and missed_by_linear > hidden / 10


@pytest.mark.parametrize("share", [1.0, 0.5, 0.1, 0.01])
def test_the_hidden_factor_is_reached(share: float) -> None:
    """Tight: the factor at the bound's upper end passes exactly at the band (not a loose over-estimate)."""
    band = 0.004
    upper = 1 / (1 + math.expm1(-band) / share)
    ratio = _set_ratio(share, upper)
    assert ratio is not None and math.log(ratio) == pytest.approx(band, rel=1e-9)
    assert hidden_factor(band, share) == pytest.approx(upper, rel=1e-12)


def test_a_share_below_the_band_bounds_nothing() -> None:
    assert hidden_factor(0.01, 0.009) == math.inf
    assert hidden_factor(0.01, 0.0) == math.inf
    assert hidden_factor(0.01, 1.0) == pytest.approx(math.exp(0.01))  # alone: |log f| <= band


def test_smaller_steps_that_disagree_beyond_the_noise_contradict_a_blame() -> None:
    """The bf16 case found in the untuned population: steps 2^-6 and 2^-7 agree on true/reported 1.19, while
    2^-8 and 2^-9 (less truncation) read 0.92 and 0.76, fifteen times the measured noise away."""
    levels = [
        (2.0**-6, 0.012090, 0.010179),
        (2.0**-7, 0.006086, 0.0050746),
        (2.0**-8, 0.002314, 0.0025275),
        (2.0**-9, 0.000788, 0.0010383),
    ]
    est = Estimate(ratio=1.1994, error=0.0207, step=2.0**-7, pair=(2.0**-6, 2.0**-7), reliable=True)
    why = contradicted(levels, est, noise=4.48e-5)
    assert why is not None and "2^-8" in why and "larger than measured" in why
    # the same levels with the smaller steps on the line: no contradiction
    agreeing = [(s, 1.1994 * p + 2e-5, p) for s, _, p in levels]
    assert contradicted(agreeing, est, noise=4.48e-5) is None
    # only smaller steps count (a larger one is where truncation grows), and only a reliable estimate
    assert contradicted(levels[:2], est, noise=4.48e-5) is None
    assert contradicted(levels, Estimate(ratio=1.2, reason="no two steps agree"), noise=4.48e-5) is None


def test_a_loss_that_jumps_is_refuted_one_step_below_the_pair() -> None:
    """A top-k router in bf16 (`preflight_wild.py`'s grouped MoE, seed 50): two tokens' choices flip within
    the two steps, and the loss's jumps grew in proportion by chance (x13.45 and x13.49). The reported
    gradient's change one step below is near the noise, so `finer` has no step; the blame's own change there
    is 19 noises, so `refuting` asks for it, and the jump (or no change at all) contradicts the line."""
    noise = 3.65e-5
    pair = [(2.0**-6, 0.002784, 0.000207), (2.0**-7, 0.001407, 0.0001043)]
    est = Estimate(ratio=13.49, error=0.042, step=2.0**-7, pair=(2.0**-6, 2.0**-7), reliable=True)
    assert finer(pair, noise) is None
    assert refuting(pair, est, noise) == 2.0**-8
    for c in (0.0014, 0.0):  # the same jump still crossed, or none
        assert contradicted([*pair, (2.0**-8, c, 5.2e-5)], est, noise) is not None
    # a gradient truly 13.49x too small stays blamed there
    assert contradicted([*pair, (2.0**-8, 13.49 * 5.2e-5 + noise, 5.2e-5)], est, noise) is None
    # asked once: not where a level below the pair exists, nor where the blame's change there is within noise
    assert refuting([*pair, (2.0**-8, 0.0, 5.2e-5)], est, noise) is None
    small = Estimate(ratio=1.5, error=0.042, step=2.0**-7, pair=(2.0**-6, 2.0**-7), reliable=True)
    assert refuting(pair, small, noise) is None
