"""The rule API: one class per rule, with its metadata, docs and VALID/INVALID examples.

Modelled on Fixit/TorchFix: a rule only inspects a parsed file through `FileContext` and yields
`Violation`s; the engine owns parsing, name resolution, positions, suppressions and fixes; reporters never
see rules. Every rule's examples are run by tests/analyzer/test_rule_examples.py.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import libcst as cst

from maingrad.analyzer.catalog import rule_doc_path
from maingrad.analyzer.context import FileContext, RuleSettings
from maingrad.analyzer.needles import Needle
from maingrad.analyzer.syntax_index import SyntaxIndex
from maingrad.contracts.report import Severity


@dataclass(frozen=True)
class Example:
    """A code sample for a rule. For INVALID examples, `line` is the 1-based line the first finding must
    be reported on and `fixed` (when the rule has a fix) the exact expected source after `maingrad fix`."""

    code: str
    line: int | None = None
    fixed: str | None = None
    config: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Fix:
    """A rewrite: replace each key node by its value (identity-based, applied in one libcst transform).

    `safe` fixes are applied by `maingrad fix`; unsafe ones need `--unsafe-fixes`.
    """

    replacements: Mapping[cst.CSTNode, cst.CSTNode | cst.RemovalSentinel | cst.FlattenSentinel]
    description: str
    safe: bool = True


@dataclass(frozen=True)
class Violation:
    node: cst.CSTNode
    message: str
    fix: Fix | None = None
    # The node whose code forms the fingerprint context (default: `node`). Use a stable enclosing
    # statement when `node` is tiny (a Name) so that identical names elsewhere do not collide.
    context_node: cst.CSTNode | None = None


class Rule:
    id: ClassVar[str]
    name: ClassVar[str]  # kebab-case, e.g. "fused-op-without-main-grad-exposure"
    severity: ClassVar[Severity]
    summary: ClassVar[str]  # one line: what it detects
    # Markdown with the sections "What it does", "Why is this bad?", "Example", "Use instead".
    docs: ClassVar[str]
    # The cheap text pre-filter: a file is parsed for this rule only if one needle matches. A needle is a
    # string that must occur in the file, or a tuple of strings that must all occur.
    needles: ClassVar[tuple[Needle, ...]] = ("main_grad",)
    fixable: ClassVar[bool] = False
    # In the default selection? An opt-in rule (False) runs only when `select` names it (id or prefix,
    # not `ALL`): its precision on code it was not written for is below what a default rule must meet.
    default: ClassVar[bool] = True
    VALID: ClassVar[list[Example]] = []
    INVALID: ClassVar[list[Example]] = []

    def check(self, ctx: FileContext) -> Iterator[Violation]:
        raise NotImplementedError

    def gate(self, index: SyntaxIndex, settings: RuleSettings) -> bool:
        """The syntax gate (see `maingrad.analyzer.syntax_index`): False only when `check` cannot report
        anything on this file. It must over-approximate `check` (a file it rejects is never parsed for this
        rule); precision only buys speed. Default: always passes."""
        return True

    @classmethod
    def has_gate(cls) -> bool:
        """Whether the rule overrides `gate` (only then is a file's SyntaxIndex worth building for it)."""
        return cls.gate is not Rule.gate

    @classmethod
    def help_uri(cls) -> str:
        return rule_doc_path(cls.id)
