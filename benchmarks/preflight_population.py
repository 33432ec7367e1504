"""Grades of maingrad.hooks.preflight on the CPU populations, as counts (the tests only pass or fail).

    python3 benchmarks/preflight_population.py [--seeds tuned|held-out] [--batches ABCDEF] [--late]
                                               [--declared] [--jitter-seeds K] [--jsonl FILE]

Every case of `tests/hooks/preflight_wild.py` (architectures of the chosen batches x their seeds x correct
and each bug kind of the batch) is run once and graded by `preflight_wild.grade`, as the tests grade it:
correct models `pass` (or `stateful-inconclusive`: inconclusive only on account of buffers the forward
writes), else `inconclusive`, `error` or `false-alarm`; bugs `named` (on their parameter, with their
anomaly), `visible-miss` (the parameter inconclusive, or its fd_resolution admits the factor), `wrong-blame`
(another parameter named), `wrong-verdict` or `silent-miss`. `--late` turns on the loss-level probe after the
screening (`check.AFTER_SCREENING`, off by default) and lowers the threshold under which a weight always stays in
that probe to 64 elements, so that most models take the path where that probe
waits for the module-local screening. Prints the counts, the cases that are neither passing, named nor
visibly missed, and the loss evaluations and module reruns of the correct models (the passing path's cost).
`--declared` passes batch E's own module classes as `module_fd_classes` (`preflight_wild.DECLARED`).
`--jitter-seeds K` runs the correct models only, each under K seeds of the noise's jitter (`moves.JITTER_SEED`):
the loss's noise in a bf16 forward is one draw of its rounding, and the spread of the loss evaluations over the
draws (their sum, the largest, the calls above 14 and 30) is what a low draw costs.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "hooks"))

from preflight_wild import BUGS_OF, CASES, CAUGHT, HELD_OUT_SEEDS, PASSING, SEEDS, grade  # noqa: E402

from maingrad.hooks.preflight import check as check_module  # noqa: E402
from maingrad.hooks.preflight import moves  # noqa: E402


def graded_row(name: str, seed: int, bug: str | None, declared: bool, jitter: int | None = None) -> dict:
    if jitter is not None:
        moves.JITTER_SEED = jitter
    verdict, result, target = grade(name, seed, bug, declared=declared)
    return {
        "case": name,
        "seed": seed,
        "bug": bug,
        "jitter_seed": moves.JITTER_SEED,
        "fd_noise": result.tolerances.get("fd_noise"),
        "fd_noise_drawn": result.tolerances.get("fd_noise_drawn"),
        "target": target,
        "grade": verdict,
        "status": result.status,
        "named": {p.name: p.anomalies for p in result.params if p.anomalies},
        "loss_evaluations": result.cost["loss_evaluations"],
        "module_reruns": result.cost["module_reruns"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", choices=("tuned", "held-out"), default="held-out")
    parser.add_argument("--batches", default="ABCDEF")
    parser.add_argument("--late", action="store_true")
    parser.add_argument("--declared", action="store_true")
    parser.add_argument("--jitter-seeds", type=int, default=0, metavar="K")
    parser.add_argument("--jsonl")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.late:
        check_module.AFTER_SCREENING = True
        check_module.END_TO_END_MAX = 64
    seeds = SEEDS if args.seeds == "tuned" else HELD_OUT_SEEDS
    jobs = [
        (name, seed, bug)
        for name, case in CASES.items()
        if case.batch in args.batches
        for seed in seeds[case.batch]
        for bug in (None, *BUGS_OF[case.batch])
    ]
    if args.jitter_seeds:
        return jitter_spread(jobs, args)
    rows = [graded_row(*job, declared=args.declared) for job in jobs]
    if args.jsonl:
        Path(args.jsonl).write_text("".join(json.dumps(row) + "\n" for row in rows))
    counts = collections.Counter(row["grade"] for row in rows)
    print(
        f"{len(rows)} calls ({args.seeds} seeds, batches {args.batches}"
        f"{', late path forced' if args.late else ''}{', module classes declared' if args.declared else ''})"
    )
    print("  " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    correct = [row for row in rows if row["bug"] is None]
    print(
        f"  correct models: {sum(r['loss_evaluations'] for r in correct)} loss evaluations, "
        f"{sum(r['module_reruns'] for r in correct)} module reruns"
    )
    for row in rows:
        if row["grade"] not in PASSING + CAUGHT:
            print(
                f"  {row['grade']}: {row['case']} seed {row['seed']} {row['bug']} on {row['target']}: {row['named']}"
            )
    return 0


def jitter_spread(jobs: list[tuple[str, int, str | None]], args: argparse.Namespace) -> int:
    """The correct models under K jitter seeds (`--jitter-seeds`): grades and the loss evaluations' spread."""
    base = moves.JITTER_SEED
    rows = [
        graded_row(name, seed, None, args.declared, base + 100003 * k)
        for name, seed, bug in jobs
        if bug is None
        for k in range(args.jitter_seeds)
    ]
    moves.JITTER_SEED = base
    if args.jsonl:
        Path(args.jsonl).write_text("".join(json.dumps(row) + "\n" for row in rows))
    counts = collections.Counter(row["grade"] for row in rows)
    evaluations = [row["loss_evaluations"] for row in rows]
    print(f"{len(rows)} calls (correct models, {args.seeds} seeds x {args.jitter_seeds} jitter seeds)")
    print("  " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    print(
        f"  loss evaluations: {sum(evaluations)} in all, at most {max(evaluations)}, "
        f"{sum(e > 14 for e in evaluations)} calls above 14, {sum(e > 30 for e in evaluations)} above 30; "
        f"the noise raised above its draw in {sum(r['fd_noise'] > r['fd_noise_drawn'] for r in rows)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
