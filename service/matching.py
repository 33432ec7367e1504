"""New / unchanged / fixed: match head findings to baseline findings in three passes.

1. the same fingerprint (category, rule, path, code context or the tool's own fingerprint);
2. the same rule, path and message within a few lines (the code around it was edited);
3. the same rule, message and code context in another file (the file was renamed or moved).
Passes 2 and 3 only see what the earlier passes left unmatched, so moved code is not reported as new.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from maingrad.contracts.report import normalize_context


@dataclass(frozen=True)
class Item:
    """What matching needs of a finding; `ref` carries the caller's row."""

    fingerprint: str
    category: str
    rule: str
    path: str
    message: str
    start_line: int | None
    context_hash: str | None
    ref: Any = None


@dataclass
class Matching:
    new: list[Item] = field(default_factory=list)
    unchanged: list[tuple[Item, Item, str]] = field(default_factory=list)  # (head, base, how)
    fixed: list[Item] = field(default_factory=list)


def match(head: list[Item], base: list[Item], line_window: int = 3) -> Matching:
    out = Matching()
    used: set[int] = set()  # indexes into base already matched
    by_fp: dict[str, list[int]] = defaultdict(list)
    for i, b in enumerate(base):
        by_fp[b.fingerprint].append(i)
    rest: list[Item] = []
    for h in head:
        candidates = by_fp.get(h.fingerprint)
        if candidates:
            i = candidates.pop(0)
            used.add(i)
            out.unchanged.append((h, base[i], "fingerprint"))
        else:
            rest.append(h)

    # Pass 2: same rule, path and message, nearest start line within the window.
    nearby: dict[tuple[str, str, str, str], list[int]] = defaultdict(list)
    for i, b in enumerate(base):
        if i not in used:
            nearby[(b.category, b.rule, b.path, normalize_context(b.message))].append(i)
    rest2: list[Item] = []
    for h in rest:
        pool: list[int] = [
            i
            for i in nearby.get((h.category, h.rule, h.path, normalize_context(h.message)), ())
            if i not in used
        ]
        best = _nearest(h, base, pool, line_window)
        if best is None:
            rest2.append(h)
        else:
            used.add(best)
            out.unchanged.append((h, base[best], "nearby"))

    # Pass 3: same rule, message and code context, different path (a rename).
    renamed: dict[tuple[str, str, str, str], list[int]] = defaultdict(list)
    for i, b in enumerate(base):
        if i not in used and b.context_hash:
            renamed[(b.category, b.rule, b.context_hash, normalize_context(b.message))].append(i)
    for h in rest2:
        pool = []
        if h.context_hash:
            key = (h.category, h.rule, h.context_hash, normalize_context(h.message))
            pool = [i for i in renamed.get(key, ()) if i not in used and base[i].path != h.path]
        if pool:
            used.add(pool[0])
            out.unchanged.append((h, base[pool[0]], "renamed"))
        else:
            out.new.append(h)
    out.fixed = [b for i, b in enumerate(base) if i not in used]
    return out


def _nearest(h: Item, base: list[Item], pool: list[int], window: int) -> int | None:
    """The pool index whose start line is closest to h's, if within the window."""
    if h.start_line is None:
        return next((i for i in pool if base[i].start_line is None), None)
    best, best_distance = None, window + 1
    for i in pool:
        line = base[i].start_line
        if line is not None and abs(line - h.start_line) < best_distance:
            best, best_distance = i, abs(line - h.start_line)
    return best
