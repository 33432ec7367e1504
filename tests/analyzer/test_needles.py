"""The pre-filter: string needles (any-of) and tuple needles (all-of), as the engine and runner apply them."""

from __future__ import annotations

from maingrad.analyzer.catalog import RuleMeta
from maingrad.analyzer.engine import analyze_source
from maingrad.analyzer.needles import needles_match
from maingrad.analyzer.rules import rules_by_id
from maingrad.contracts.report import Severity


def test_string_and_tuple_needles() -> None:
    needles = (("Sequential", "transformer_engine"), "OperationFuser")
    assert needles_match(needles, "import transformer_engine\nx = Sequential()")
    assert needles_match(needles, "fuser = OperationFuser(ops)")
    assert not needles_match(needles, "x = torch.nn.Sequential()")  # one part of the tuple is not enough
    assert not needles_match((), "anything")


def test_tuple_needles_survive_the_catalog_round_trip() -> None:
    meta = RuleMeta("MG999", "x", Severity.ERROR, "s", "u", "d", (("a", "b"), "c"), False)
    again = RuleMeta.from_dict(meta.to_dict())
    assert again.needles == (("a", "b"), "c")


def test_a_file_without_te_is_never_parsed_for_mg005() -> None:
    source = "import torch\nseq = torch.nn.Sequential(\n"  # unparsable: parsing it would be an error
    result = analyze_source(source, "x.py", [rules_by_id()["MG005"]()])
    assert result.parse_error is None and not result.parsed
