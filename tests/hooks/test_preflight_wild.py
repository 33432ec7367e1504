"""maingrad.hooks.preflight on the untuned population of `preflight_wild.py` (66 architectures, fp32 and
bf16, 3 or 10 seeds each, 4 to 9 bug kinds on a parameter drawn at random; the same again with the held-out
seeds): a correct model passes (a stateful forward: or is inconclusive on that account alone); a bug is named
on its parameter and nowhere else, with the anomaly its kind must get, or its miss is visible (the parameter
is inconclusive, or its `fd_resolution` admits the factor). Never a false alarm, a wrong blame or a silent
miss (the misses the population found are held as such: `KNOWN_MISSES`)."""

from __future__ import annotations

import pytest
from preflight_wild import (
    BUGS,
    BUGS_OF,
    CASES,
    CAUGHT,
    DECLARED,
    HELD_OUT_SEEDS,
    KNOWN_MISSES,
    PASSING,
    SEEDS,
    build,
    grade,
)


def _cases(seeds: dict[str, tuple[int, ...]]) -> tuple[list[tuple[str, int]], list[tuple[str, int, str]]]:
    """(correct, buggy) cases of every architecture with the seeds of its batch."""
    correct = [(name, seed) for name, case in CASES.items() for seed in seeds[case.batch]]
    return correct, [(name, seed, bug) for name, seed in correct for bug in BUGS_OF[CASES[name].batch]]


CORRECT, BUGGY = _cases(SEEDS)
HELD_OUT_CORRECT, HELD_OUT_BUGGY = _cases(HELD_OUT_SEEDS)


def correct_params() -> list[object]:
    """CORRECT and HELD_OUT_CORRECT as parameters."""
    return [
        pytest.param(n, s, id=f"{prefix}{n}-{s}")
        for prefix, cases in (("", CORRECT), ("held-out-", HELD_OUT_CORRECT))
        for n, s in cases
    ]


@pytest.mark.parametrize(("name", "seed"), correct_params())
def test_a_correct_model_passes(name: str, seed: int) -> None:
    verdict, result, _ = grade(name, seed, None)
    assert verdict in PASSING, f"{verdict}\n{result.table()}"


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
    verdict, result, target = grade(name, seed, bug)
    assert verdict in CAUGHT, f"{verdict} ({bug} on {target})\n{result.table()}"


def declared_params() -> list[object]:
    """Batch E's cases (correct and buggy, both seed sets), for the run with its own module classes declared."""
    out: list[object] = []
    for prefix, seeds in (("", SEEDS), ("held-out-", HELD_OUT_SEEDS)):
        for n, case in CASES.items():
            if case.batch != "E":
                continue
            for s in seeds["E"]:
                for b in (None, *BUGS_OF["E"]):
                    why = KNOWN_MISSES.get((n, s, b, False)) if b else None
                    marks = [pytest.mark.xfail(strict=True, reason=f"known miss: {why}")] if why else []
                    out.append(pytest.param(n, s, b, marks=marks, id=f"{prefix}{n}-{s}-{b or 'correct'}"))
    return out


@pytest.mark.parametrize(("name", "seed", "bug"), declared_params())
def test_declared_module_classes_are_judged_on_their_output(name: str, seed: int, bug: str | None) -> None:
    """With batch E's own norm-and-linear, skipped-bias, output-layer, zero-centred-norm and transposed modules
    passed as `module_fd_classes`: a correct model still passes, and a wrong factor on a weight of one of
    those modules is named (without them most of those misses are visible: the loss cannot resolve a norm's
    bias)."""
    verdict, result, target = grade(name, seed, bug, declared=True)
    if bug is None:
        assert verdict in PASSING, f"{verdict}\n{result.table()}"
        return
    assert verdict in CAUGHT, f"{verdict} ({bug} on {target})\n{result.table()}"
    model, _ = build(CASES[name], seed, None)
    owner = model.get_submodule(target.rpartition(".")[0]) if target and "." in target else model
    if isinstance(owner, DECLARED) and BUGS[bug][2] is not None:
        assert verdict == "named", f"{verdict} ({bug} on {target})\n{result.table()}"
