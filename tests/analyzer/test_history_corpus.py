"""The history corpus (tests/analyzer/history): every upstream fix pair behaves as labelled.

Per pair: the expected rule fires on `before` and is silent on `after`; the other rules fire exactly as the
labels triage them. A pair whose rule does not behave yet carries `known` and runs as a strict xfail (visible
in the run, counted in docs/real-world.md's recall table); fixing the rule turns it into an XPASS failure so the
label must be updated.
"""

from __future__ import annotations

import importlib.util
import sys
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load() -> typing.Any:
    spec = importlib.util.spec_from_file_location(
        "maingrad_history_corpus", Path(__file__).parent / "history" / "corpus.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


corpus = _load()
PAIRS = corpus.pairs()


def _expected_params() -> list[typing.Any]:
    out = []
    for pair in PAIRS:
        if pair.expect == "none":
            continue
        marks = [pytest.mark.xfail(strict=True, reason=pair.known)] if pair.known else []
        out.append(pytest.param(pair, id=pair.dir, marks=marks))
    return out


def test_corpus_is_wide_and_labelled() -> None:
    assert len(PAIRS) >= 40
    assert {p.repo for p in PAIRS} >= {
        "NVIDIA/TransformerEngine",
        "NVIDIA/Megatron-LM",
        "NVIDIA-NeMo/Megatron-Bridge",
    }
    reasons = corpus.reasons()
    for pair in PAIRS:
        for key in ("fix-commit", "parent-commit", "path", "license", "upstream"):
            assert pair.header(key), (pair.dir, key)
        assert pair.expect == "none" or pair.expect.startswith("MG"), pair.dir
        if pair.expect == "none":
            assert pair.mechanism in reasons, pair.dir
    assert any(p.held_out for p in PAIRS)


@pytest.mark.parametrize("pair", _expected_params())
def test_rule_fires_before_and_not_after(pair: typing.Any) -> None:
    result = corpus.outcome(pair)
    assert pair.expect in result.before, f"{pair.expect} silent on before: {pair.dir}"
    assert pair.expect not in result.after, f"{pair.expect} still fires on after: {pair.dir}"


@pytest.mark.parametrize("pair", PAIRS, ids=[p.dir for p in PAIRS])
def test_other_findings_are_triaged(pair: typing.Any) -> None:
    result = corpus.outcome(pair)
    expected = {pair.expect} if pair.expect != "none" and not pair.known else set()
    assert result.before - expected == set(pair.before), pair.dir
    assert result.after == set(pair.after), pair.dir


def test_recall_table_in_docs_is_current() -> None:
    text = corpus.table([corpus.outcome(p) for p in PAIRS])
    assert corpus.generated(ROOT / "docs" / "real-world.md") == text, (
        "regenerate: python3 tests/analyzer/history/corpus.py --write docs/real-world.md"
    )
