"""The generated rule pages in docs/rules/ match the rule classes (regenerate with
`python3 -m maingrad.analyzer.docs --write docs/rules`)."""

from __future__ import annotations

from pathlib import Path

from maingrad.analyzer.catalog import UNUSED_SUPPRESSION, UNUSED_SUPPRESSION_ID, load_rules_metadata
from maingrad.analyzer.docs import main, stale_pages
from maingrad.analyzer.not_analyzed import NOT_ANALYZED
from maingrad.analyzer.rules import all_rules
from maingrad.contracts.report import NOT_ANALYZED_CODE

DOCS = Path(__file__).resolve().parents[2] / "docs" / "rules"


def test_committed_rule_pages_are_current() -> None:
    problems = stale_pages(DOCS)
    assert problems == [], "run `python3 -m maingrad.analyzer.docs --write docs/rules`: " + "; ".join(
        problems
    )
    for rule in all_rules():
        page = (DOCS / f"{rule.id}.md").read_text(encoding="utf-8")
        assert f"# {rule.id}: {rule.name}" in page and rule.docs.strip() in page
        assert rule.help_uri() == f"docs/rules/{rule.id}.md"


def test_every_help_uri_is_a_committed_page() -> None:
    """The report's `help_uri` is a path relative to the source tree, never a web address."""
    metas = [*load_rules_metadata(), UNUSED_SUPPRESSION, NOT_ANALYZED]
    assert {m.id for m in metas} >= {UNUSED_SUPPRESSION_ID, NOT_ANALYZED_CODE}
    for meta in metas:
        assert meta.help_uri == f"docs/rules/{meta.id}.md"
        assert (DOCS.parents[1] / meta.help_uri).is_file()


def test_check_mode_detects_stale_and_orphan_pages(tmp_path: Path) -> None:
    assert main(["--write", str(tmp_path)]) == 0
    assert main(["--check", str(tmp_path)]) == 0
    first = sorted(tmp_path.glob("MG*.md"))[0]
    first.write_text(first.read_text() + "edited\n")
    (tmp_path / "MG998.md").write_text("old rule\n")
    assert main(["--check", str(tmp_path)]) == 1
    assert sorted(stale_pages(tmp_path)) == sorted([f"{first.name}: stale", "MG998.md: no such rule"])
