"""Large files analyzed in pieces (`maingrad.analyzer.segments`) give exactly the whole-file report.

The split is checked on the shapes that could fool a line-based cut (strings, brackets, decorators,
continuations, `else` at column 0), and the findings (positions, fingerprints, snippets, suppressions) are
compared with the whole-file path on generated files and on the real test beds, with the pieces made as
small as possible (one top-level statement per chunk, one chunk per piece) so that every cross-piece path
(context, line maps, fingerprint occurrences) is exercised.
"""

from __future__ import annotations

import ast
import json
import textwrap
from pathlib import Path

import pytest

from maingrad.analyzer import segments
from maingrad.analyzer.engine import analyze_source
from maingrad.analyzer.rules import all_rules
from maingrad.cli.main import main
from tests.testbeds import testbed as bed_dir

TRICKY = textwrap.dedent(
    '''\
    import torch
    from torch import nn as tnn

    DOC = """
    def not_a_function():
    x = p.main_grad
    """
    TABLE = [
    1,
    2,
    ]
    total = 1 + \\
    2
    @staticmethod
    def decorated(p):
        if p.main_grad:
            return 1
    if total:
        pass
    else:
        pass
    try:
        import numpy
    except ImportError:
        numpy = None
    class Helper(tnn.Module):
        def run(self, p):
            return p.main_grad or 0
    '''
)


@pytest.fixture
def tiny_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(segments, "CHUNK_CHARS", 1)
    monkeypatch.setattr(segments, "GROUP_CHARS", 1)
    monkeypatch.setenv("MAINGRAD_SEGMENT_MIN_CHARS", "0")


@pytest.mark.usefixtures("tiny_pieces")
def test_split_is_a_partition_into_top_level_statements() -> None:
    chunks = segments.split(TRICKY)
    assert chunks is not None
    assert "".join(TRICKY[c.start : c.end] for c in chunks) == TRICKY
    for chunk in chunks:
        ast.parse(TRICKY[chunk.start : chunk.end])  # each parses on its own
    texts = [TRICKY[c.start : c.end] for c in chunks]
    assert any(t.startswith('DOC = """') and "not_a_function" in t for t in texts)  # not cut in the string
    assert any(t.startswith("TABLE = [") and "\n]\n" in t for t in texts)  # merged past the literal
    assert any(t.startswith("@staticmethod\ndef decorated") for t in texts)
    assert any(t.startswith("if total:") and "else:" in t for t in texts)
    assert sum(c.lines for c in chunks) == TRICKY.count("\n")
    helper = next(c for c in chunks if "class Helper" in TRICKY[c.start : c.end])
    assert "Helper" in helper.defines
    top = next(c for c in chunks if c.start == 0)
    assert top.imports and "torch" in top.defines


def test_a_syntax_error_anywhere_means_no_split(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(segments, "CHUNK_CHARS", 1)
    assert segments.split(TRICKY + "def broken(:\n    pass\nx = 1\n") is None
    assert segments.split("x = 1\ry = 2\r") is None  # lone CR line ends: never split


def _whole_and_pieces(source: str, path: str, monkeypatch: pytest.MonkeyPatch) -> tuple[list, list]:
    rules = [rule() for rule in all_rules()]
    monkeypatch.setenv("MAINGRAD_SEGMENT_MIN_CHARS", str(len(source) + 1))
    whole = analyze_source(source, path, rules)
    monkeypatch.setattr(segments, "CHUNK_CHARS", 1)
    monkeypatch.setattr(segments, "GROUP_CHARS", 1)
    monkeypatch.setenv("MAINGRAD_SEGMENT_MIN_CHARS", "0")
    pieces = analyze_source(source, path, rules)
    assert whole.parse_error == pieces.parse_error and whole.anchors == pieces.anchors
    return whole.findings, pieces.findings


def test_generated_file_same_findings_as_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    body = TRICKY + "".join(
        f"\n\ndef step_{i}(p, g):\n    if p.main_grad:\n        p.main_grad.add_(g)\n"
        f"    p.overwrite_main_grad = True\n    return p.main_grad or g\n"
        for i in range(30)
    )
    whole, pieces = _whole_and_pieces(body, "gen.py", monkeypatch)
    assert len(whole) >= 90 and pieces == whole  # positions, fingerprints (occurrences), snippets
    assert len({f.fingerprint for f in whole}) == len(whole)


def test_suppressions_and_report_through_the_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    source = TRICKY + "".join(
        f"\n\ndef f{i}(p):\n    return p.main_grad or 0{'  # maingrad: ignore[MG003]' if i % 2 else ''}\n"
        for i in range(10)
    )
    (tmp_path / "big.py").write_text(source)
    monkeypatch.chdir(tmp_path)

    def report() -> dict:
        capsys.readouterr()
        main(["check", "big.py", "--no-cache", "--jobs", "1", "--format", "json"])
        return json.loads(capsys.readouterr().out)

    whole = report()
    monkeypatch.setattr(segments, "CHUNK_CHARS", 1)
    monkeypatch.setattr(segments, "GROUP_CHARS", 1)
    monkeypatch.setenv("MAINGRAD_SEGMENT_MIN_CHARS", "0")
    pieces = report()
    assert pieces["findings"] == whole["findings"] and len(whole["findings"]) == 2 + 5
    assert pieces["parse_errors"] == whole["parse_errors"] == []


@pytest.mark.network
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "bed, least", [("megatron-core-0.18.2", 3), ("megatron-core-0.19.2", 3), ("transformer-engine-2.20.2", 0)]
)
def test_real_code_same_findings_in_pieces(bed: str, least: int, monkeypatch: pytest.MonkeyPatch) -> None:
    root = bed_dir(bed)
    rules = [rule() for rule in all_rules()]
    needles = {n for rule in rules for n in rule.needles if isinstance(n, str)}
    compared = found = 0
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if not any(n in text for n in needles):
            continue
        whole, pieces = _whole_and_pieces(text, path.relative_to(root).as_posix(), monkeypatch)
        assert pieces == whole, path
        compared += 1
        found += len(whole)
    assert compared >= 10 and found >= least
