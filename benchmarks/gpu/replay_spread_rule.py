"""Replay of the spread rule (`LossFD._spread_band`) on the loss-level probe trees a GPU zoo run recorded.

    python3 benchmarks/gpu/replay_spread_rule.py docs/evidence/h200-2026-12-05/run-0e7e1cd/zoo.json.gz

An estimate, not a measurement: each recorded bf16 probe tree (`result.groups`: key, depth, names, reported /
estimated `scale`, `error`, `verdict`, `levels`) is walked again, and below a split that stayed within a weight's
tolerance a half is taken as accepted where the rule would accept it: it was split, deviates no more than its
group plus two of its error bars, and its sibling's estimate (not inconclusive) agrees with the group's within two
of the sibling's error bars. Its subtree is then not measured. Prints per case the loss evaluations of the
recorded tree (2 per recorded level, inferred levels included: an upper bound) and of the replayed one, and for
the injected bugs whether the culprit would sit inside an accepted subtree (it would be bounded, not named).
"""

from __future__ import annotations

import gzip
import json
import math
import sys
from typing import Any

LTOL = math.log1p(2.0**-4)  # bf16: 16 units of round-off
BF16_UNIT = 2.0**-9  # a probe whose unit round-off is at least this computes in bf16 or coarser


def _tree(result: dict[str, Any]) -> list[dict[str, Any]]:
    groups = [
        dict(g, ns=set(g["names"]), kids=[])
        for g in result["groups"]
        if not g["zero_gradient"] and "(all micro-batches)" not in g["key"] and "(anchored)" not in g["key"]
    ]
    for g in groups:
        parents = [p for p in groups if p["depth"] == g["depth"] - 1 and g["ns"] <= p["ns"]]
        if parents:
            min(parents, key=lambda p: len(p["ns"]))["kids"].append(g)
    return groups


def _dev(g: dict[str, Any]) -> float:
    return abs(math.log(g["scale"])) if g["scale"] and g["scale"] > 0 else math.inf


def _accepted(g: dict[str, Any], half: dict[str, Any], sibling: dict[str, Any]) -> bool:
    agrees = (
        sibling["verdict"] != "inconclusive"
        and sibling["error"] is not None
        and bool(sibling["scale"])
        and abs(math.log(sibling["scale"]) - math.log(g["scale"])) <= 2 * sibling["error"]
    )
    return (
        half["verdict"] == "split"
        and agrees
        and half["error"] is not None
        and _dev(half) <= _dev(g) + 2 * half["error"]
    )


def _walk(g: dict[str, Any], hidden: list[str], target: str | None) -> int:
    """Loss evaluations of g's subtree under the rule; halves that would hide `target` go to `hidden`."""
    cost = 2 * len(g["levels"])
    bounded = g["error"] is not None and _dev(g) <= LTOL + 3 * g["error"]
    if g["verdict"] != "split" or len(g["kids"]) != 2 or not bounded:
        return cost + sum(_walk(k, hidden, target) for k in g["kids"])
    a, b = g["kids"]
    for half, sibling in ((a, b), (b, a)):
        if _accepted(g, half, sibling):
            cost += 2 * len(half["levels"])
            if target in half["ns"]:
                hidden.append(half["key"])
        else:
            cost += _walk(half, hidden, target)
    return cost


def main(path: str) -> int:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        cases = json.load(handle)
    before = after = 0
    for case in cases:
        groups = _tree(case["result"])
        if not groups or groups[0]["unit"] < BF16_UNIT:
            continue  # the rule holds only in bf16 and coarser compute
        hidden: list[str] = []
        recorded = sum(2 * len(g["levels"]) for g in groups)
        replayed = sum(_walk(g, hidden, case.get("target")) for g in groups if g["depth"] == 0)
        before, after = before + recorded, after + replayed
        note = f"; culprit {case['target']} hidden in {hidden}" if hidden else ""
        print(f"{case['case']:36s} {recorded:4d} -> {replayed:4d} loss evaluations{note}")
    print(f"all bf16 cases: {before} -> {after}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
