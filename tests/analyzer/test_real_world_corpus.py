"""The list of third-party code bases behind the second table of docs/real-world.md: well-formed, large
enough, and split into tuning/held-out by the fixed rule it states (not by hand)."""

from __future__ import annotations

import importlib.util
import json
import re
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
CORPUS = ROOT / "benchmarks" / "real_world_corpus.json"


def _real_world() -> typing.Any:
    spec = importlib.util.spec_from_file_location(
        "maingrad_real_world", ROOT / "benchmarks" / "real_world.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_corpus_entries_are_pinned_and_distinct() -> None:
    entries = json.loads(CORPUS.read_text(encoding="utf-8"))["corpus"]
    repos = [e["repo"] for e in entries]
    assert len(set(repos)) == len(repos) >= 25
    for entry in entries:
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", entry["repo"]), entry
        assert re.fullmatch(r"[0-9a-f]{40}", entry["commit"]), entry


def test_held_out_is_every_third_repository_alphabetically() -> None:
    entries = json.loads(CORPUS.read_text(encoding="utf-8"))["corpus"]
    split = [e for e in entries if e["repo"] != "NVIDIA/TransformerEngine"]  # the TE v2.6 recall bed
    ordered = sorted(split, key=lambda e: e["repo"].lower())
    expected = {e["repo"] for i, e in enumerate(ordered, 1) if i % 3 == 0}
    assert {e["repo"] for e in entries if e["held_out"]} == expected
    assert len(expected) >= 10


def test_missing_tree_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no tree for"):
        _real_world().corpus_trees(tmp_path, "held-out")
