"""Grades of maingrad.hooks.preflight on the attention population, as counts (the tests only pass or fail).

    python3 benchmarks/preflight_attention.py [--sets 123] [--bugs zeroed,doubled]

Every case of `tests/hooks/preflight_attention.py` over its whole grid (`FULL`: seeds, layer scales, dropouts,
fp32 and bf16), correct and with each bug on each attention weight: `zeroed` (every micro-batch's gradient
dropped: must be `grad_lost` on it) and `doubled` (×2: attention is not affine in its weights, so this is the
loss-level probe's to find). Grades: correct models `pass`, else `inconclusive` or `false-alarm`; bugs `named`
(on its parameter, nowhere else), `wrong-blame`, `visible-miss` (the parameter inconclusive, or its
fd_resolution admits the factor) or `silent-miss` (`unused` or passing). Prints the counts per set and bug, and
the cases that are neither passing, named nor visibly missed.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "hooks"))

from preflight_attention import FULL, attention_check, attention_model, attention_weights  # noqa: E402

BUGS = {"zeroed": 0.0, "doubled": 2.0}


def grade(
    case: str, seed: int, scale: float, dropout: float, dtype: torch.dtype, bug: str | None, kind: str
) -> str:
    model = attention_model(case, seed, scale, dropout, dtype)
    if bug is not None:
        factor = BUGS[kind]
        dict(model.named_parameters())[bug].register_hook(lambda g, f=factor: g * f)
    result = attention_check(case, seed, model)
    named = {p.name: p.anomalies for p in result.params if p.anomalies}
    if bug is None:
        return (
            "pass"
            if result.status == "pass"
            else result.status
            if result.status == "inconclusive"
            else "false-alarm"
        )
    p = next(p for p in result.params if p.name == bug)
    if set(named) - {bug}:
        return "wrong-blame"
    if bug in named:
        return "named" if kind != "zeroed" or named[bug] == ["grad_lost"] else "wrong-verdict"
    factor = BUGS[kind]
    if p.inconclusive or (factor and p.could_hide(factor)):
        return "visible-miss"
    return "silent-miss"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sets", default="123")
    parser.add_argument("--bugs", default="zeroed,doubled")
    args = parser.parse_args()
    kinds = args.bugs.split(",")
    counts: dict[tuple[str, str], collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for case, (seeds, scales, dropouts, dtypes) in FULL.items():
        if case[3] not in args.sets:
            continue
        for seed, scale, dropout, dtype in itertools.product(seeds, scales, dropouts, dtypes):
            names = attention_weights(attention_model(case, seed, scale, dropout, dtype))
            for kind, bug in [("correct", None)] + [(k, n) for k in kinds for n in names]:
                g = grade(case, seed, scale, dropout, dtype, bug, kind)
                counts[(case[:4], kind)][g] += 1
                if g not in ("pass", "named", "visible-miss"):
                    print(
                        f"{g}: {case} seed {seed} scale {scale:g} dropout {dropout:g} {dtype} {kind} {bug or ''}"
                    )
    for (s, kind), c in sorted(counts.items()):
        print(f"{s} {kind}: " + ", ".join(f"{g} {n}" for g, n in sorted(c.items())))


if __name__ == "__main__":
    main()
