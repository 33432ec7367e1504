"""Project facts: what one scan's files, taken together, say that no single file can.

A rule reads them from `RuleSettings.project` (`ctx.settings.project`); the scan (`runner.scan`) runs one
cheap pass over every file it scans before analyzing any of them:

1. `file_facts(relpath, text)`: the facts one file contributes, from its path and text alone (a substring
   test, then the standard library's `ast` on the few files that pass it). Its answer depends on nothing
   but the path and the bytes, so it is cached with the file's result.
2. `ProjectFacts.of(...)`: what follows from the union over the scanned files, a frozen set of fact names.
   A union does not depend on the order of the files or on how they are split between worker processes, so
   the facts, and every result computed under them, are the same with any `jobs` and with or without the
   cache.

Analyzing one file alone (`engine.analyze_source` with default settings) sees no project facts: rules then
report as if the rest of the project were unknown.

A file's cached result records the project facts it was computed under; a later scan whose facts differ
analyzes it again (see `maingrad.analyzer.runner.scan`).

Standard library only, like the syntax gate: a warm scan of unchanged files never imports libcst.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass

from maingrad.analyzer.facts import OVERWRITE_FLAG, is_test_path, is_wrapper_path, posix

# Per file: a wrapper module (Megatron-FSDP's) writes `overwrite_main_grad = True`; a wrapper module writes it
# with any other value (derived from the sharding strategy, `False`, a name).
_WRAPPER_WRITES_TRUE = "wrapper-writes-overwrite-main-grad-true"
_WRAPPER_WRITES_OTHER = "wrapper-writes-overwrite-main-grad-other"
# Per scan: the scanned tree's Megatron-FSDP writes the flag, and only ever as the constant `True`
# (megatron-core 0.19.2: on every unshard but `no_shard`'s; Megatron-LM main derives it from the strategy).
# Then wherever the flag exists on a parameter it is `True`, and writing `True` where it exists changes
# nothing.
FSDP_ONLY_SETS_OVERWRITE_TRUE = "megatron-fsdp-only-sets-overwrite-main-grad-true"
FACTS = frozenset({FSDP_ONLY_SETS_OVERWRITE_TRUE})


@dataclass(frozen=True)
class ProjectFacts:
    facts: frozenset[str] = frozenset()

    @classmethod
    def of(cls, per_file: Iterable[Iterable[str]]) -> ProjectFacts:
        """The scan's facts from its files' (a union, then what follows from it: order-independent)."""
        seen = frozenset(fact for facts in per_file for fact in facts)
        derived = set()
        if _WRAPPER_WRITES_TRUE in seen and _WRAPPER_WRITES_OTHER not in seen:
            derived.add(FSDP_ONLY_SETS_OVERWRITE_TRUE)
        return cls(frozenset(derived))

    def __contains__(self, fact: object) -> bool:
        return fact in self.facts

    def key(self) -> list[str]:
        """A JSON-able, order-independent form (what a cached result records)."""
        return sorted(self.facts)


def file_facts(relpath: str, text: str) -> list[str]:
    """The facts `text` (the file at `relpath`) contributes to its scan, sorted (JSON-able, cacheable)."""
    if OVERWRITE_FLAG not in text or not is_wrapper_path(relpath) or is_test_path(relpath):
        return []
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    fsdp = "fsdp" in posix(relpath).rsplit("/", 1)[-1].lower()
    found: set[str] = set()
    for value in _flag_writes(tree):
        if isinstance(value, ast.Constant) and value.value is True:
            if fsdp:
                found.add(_WRAPPER_WRITES_TRUE)
        else:
            found.add(_WRAPPER_WRITES_OTHER)
    return sorted(found)


def _flag_writes(tree: ast.Module) -> list[ast.expr]:
    """The value of every write of `X.overwrite_main_grad` (`=`, annotated, augmented, `setattr`)."""
    values: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            if any(_is_flag(t) for t in node.targets):
                values.append(node.value)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            if _is_flag(node.target) and node.value is not None:
                values.append(node.value if isinstance(node, ast.AnnAssign) else node.target)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            args = node.args
            if len(args) == 3 and isinstance(args[1], ast.Constant) and args[1].value == OVERWRITE_FLAG:
                values.append(args[2])
    return values


def _is_flag(target: ast.expr) -> bool:
    if isinstance(target, (ast.Tuple, ast.List)):
        return any(_is_flag(t) for t in target.elts)
    return isinstance(target, ast.Attribute) and target.attr == OVERWRITE_FLAG
