"""maingrad.hooks.preflight on the untuned population of `preflight_wild.py` (52 architectures, fp32 and
bf16, 3 or 10 seeds each, 4 to 9 bug kinds on a parameter drawn at random; the same again with the held-out
seeds): a correct model passes (a stateful forward: or is inconclusive on that account alone); a bug is named
on its parameter and nowhere else, with the anomaly its kind must get, or its miss is visible (the parameter
is inconclusive, or its `fd_resolution` admits the factor). Never a false alarm, a wrong blame or a silent
miss (the misses the population found are held as such: `KNOWN_MISSES`)."""

from __future__ import annotations

import pytest
from preflight_wild import BUGS, BUGS_OF, CASES, HELD_OUT_SEEDS, KNOWN_MISSES, SEEDS, build
from preflight_zoo import microbatch

from maingrad.hooks.preflight.run import preflight


def _cases(seeds: dict[str, tuple[int, ...]]) -> tuple[list[tuple[str, int]], list[tuple[str, int, str]]]:
    """(correct, buggy) cases of every architecture with the seeds of its batch."""
    correct = [(name, seed) for name, case in CASES.items() for seed in seeds[case.batch]]
    return correct, [(name, seed, bug) for name, seed in correct for bug in BUGS_OF[CASES[name].batch]]


CORRECT, BUGGY = _cases(SEEDS)
HELD_OUT_CORRECT, HELD_OUT_BUGGY = _cases(HELD_OUT_SEEDS)


@pytest.mark.parametrize(
    ("name", "seed"),
    CORRECT + HELD_OUT_CORRECT,
    ids=[f"{n}-{s}" for n, s in CORRECT] + [f"held-out-{n}-{s}" for n, s in HELD_OUT_CORRECT],
)
def test_a_correct_model_passes(name: str, seed: int) -> None:
    case = CASES[name]
    model, _ = build(case, seed, None)
    result = preflight(model, microbatch(case.loss), case.batches(3, seed), loss_fn=case.loss)
    if case.stateful and result.status == "inconclusive":  # only on account of the buffers' drift
        unsure = [p for p in result.params if p.inconclusive]
        assert all("the forward writes buffers" in " ".join(p.notes) for p in unsure), result.table()
        return
    assert result.status == "pass", result.table()


def buggy_params(late: bool) -> list[object]:
    """BUGGY and HELD_OUT_BUGGY as parameters, the known misses (`KNOWN_MISSES`) of this path marked."""
    out: list[object] = []
    for prefix, cases in (("", BUGGY), ("held-out-", HELD_OUT_BUGGY)):
        for n, s, b in cases:
            why = KNOWN_MISSES.get((n, s, b, False)) or (KNOWN_MISSES.get((n, s, b, True)) if late else None)
            marks = [pytest.mark.xfail(strict=True, reason=f"known miss: {why}")] if why else []
            out.append(pytest.param(n, s, b, marks=marks, id=f"{prefix}{n}-{s}-{b}"))
    return out


@pytest.mark.parametrize(("name", "seed", "bug"), buggy_params(late=False))
def test_a_bug_is_named_on_its_parameter_or_visibly_missed(name: str, seed: int, bug: str) -> None:
    case = CASES[name]
    model, target = build(case, seed, bug)
    result = preflight(model, microbatch(case.loss), case.batches(3, seed), loss_fn=case.loss)
    named = {p.name: p.anomalies for p in result.params if p.anomalies}
    assert set(named) <= {target}, result.table()  # nothing else blamed
    _, code, factor = BUGS[bug]
    p = next(p for p in result.params if p.name == target)
    if target in named:
        # (a scalar's singles are parallel: which were kept cannot be told, only that the sum is off)
        assert code is None or code in named[target] or p.numel == 1, result.table()
        return
    # a miss: only of a bug the finite differences must find (the runs name every accumulation bug), and
    # visible on the parameter (a zeroed gradient: inconclusive, never `unused`)
    assert factor is not None, result.table()
    assert p.inconclusive or (factor != 0.0 and p.could_hide(factor)), result.table()
