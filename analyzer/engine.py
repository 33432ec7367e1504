"""The engine: pre-filter, parse, run rules, and turn violations into findings (and fixes).

It owns everything rules must not care about: parsing, positions, fingerprints, snippets and applying
fixes. Discovery, config, caching and workers live in their own modules and call `analyze_source`.

Two pre-filters run before the libcst parse: the text needles (`needed_rules`), then the syntax gate
(`gated_rules`, see `maingrad.analyzer.syntax_index`): a file no active rule passes is not parsed, exactly
like a file no needle matches. `gate=False` (or `MAINGRAD_NO_GATE=1`) skips the second stage.
"""

from __future__ import annotations

import ast
import re
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import libcst as cst

from maingrad.analyzer import gcpause
from maingrad.analyzer.context import FileContext, RuleSettings
from maingrad.analyzer.needles import needles_match
from maingrad.analyzer.positions import LazyPositions
from maingrad.analyzer.rules.base import Fix, Rule, Violation
from maingrad.analyzer.segments import Piece
from maingrad.analyzer.segments import min_chars as min_segment_chars
from maingrad.analyzer.segments import pieces as segment_pieces
from maingrad.analyzer.segments import split as split_segments
from maingrad.analyzer.syntax_index import build_index, gate_enabled
from maingrad.contracts.report import Finding, ParseError, Severity, fingerprint

if TYPE_CHECKING:
    from maingrad.analyzer.fixes import Edit
    from maingrad.analyzer.suppressions import Suppressions

SNIPPET_MAX_LINES = 20


@dataclass
class FileResult:
    path: str
    parsed: bool = False
    findings: list[Finding] = field(default_factory=list)
    parse_error: ParseError | None = None
    # Fixes by finding fingerprint, kept only in-process (not serialized into the report).
    fixes: dict[str, Fix] = field(default_factory=dict)
    # Per finding fingerprint: the first line of the innermost statement holding the reported node, where
    # a `# maingrad: ignore[...]` comment also suppresses it (when it differs from the reported line).
    anchors: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Rules that raised on this file ("MG001: ValueError: ..."), when analyze_source(catch_rule_errors=True).
    rule_errors: list[str] = field(default_factory=list)


def needed_rules(source: str, rules: Sequence[Rule]) -> list[Rule]:
    """The cheap text pre-filter: rules whose needles occur in the source."""
    return [rule for rule in rules if needles_match(rule.needles, source)]


def gated_rules(
    source: str,
    path: str,
    rules: Sequence[Rule],
    settings: RuleSettings,
    gate: bool | None = None,
    catch_gate_errors: bool = False,
) -> list[Rule]:
    """The syntax gate: the rules (already past their needles) whose `gate` passes on the file's
    SyntaxIndex. Rules without a gate always pass; when the stdlib parser cannot read the file there is no
    index and every rule passes (libcst then parses it and reports its error as without the gate). A gate
    that raises propagates (tests see gate bugs) unless `catch_gate_errors`: then its rule passes, which
    is always sound."""
    return _gate(source, path, rules, settings, gate, catch_gate_errors)[0]


def _gate(
    source: str,
    path: str,
    rules: Sequence[Rule],
    settings: RuleSettings,
    gate: bool | None,
    catch_gate_errors: bool,
) -> tuple[list[Rule], ast.Module | None]:
    """`gated_rules`, plus the stdlib tree the gate parsed (positions reuse it), when it parsed one."""
    if not rules or not gate_enabled(gate) or not any(rule.has_gate() for rule in rules):
        return list(rules), None
    index = build_index(source, path)
    if index is None:
        return list(rules), None
    passed: list[Rule] = []
    for rule in rules:
        try:
            keep = not rule.has_gate() or rule.gate(index, settings)
        except Exception:
            if not catch_gate_errors:
                raise
            keep = True
        if keep:
            passed.append(rule)
    return passed, index.tree


def parse(source: str, path: str) -> cst.Module | ParseError:
    try:
        return cst.parse_module(source)
    except cst.ParserSyntaxError as exc:
        return _syntax_error(source, path, exc)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # exotic input: other libcst errors, even a native parser panic
        return ParseError(path=path, message=f"cannot parse: {type(exc).__name__}: {exc}", line=1, column=1)


_LIBCST_WHERE = re.compile(r"^parser error: error at (\d+):(\d+): ")


def _syntax_error(source: str, path: str, exc: cst.ParserSyntaxError) -> ParseError:
    """The interpreter's own message and position when it rejects the file too (they name the cause:
    "'(' was never closed"), else libcst's, at the position its message gives (its `raw_line` points at
    the start of the statement, not at the error)."""
    try:
        ast.parse(source)
    except SyntaxError as error:
        if error.lineno:
            return ParseError(path, f"syntax error: {error.msg}", error.lineno, max(1, error.offset or 1))
    except (ValueError, RecursionError, MemoryError):
        pass
    message = exc.message
    match = _LIBCST_WHERE.match(message)
    if match:
        line, column = int(match.group(1)), int(match.group(2)) + 1
        message = message[match.end() :]
    else:
        line, column = exc.raw_line, exc.raw_column + 1
    return ParseError(path, f"syntax error: {message}", line, column)


def analyze_source(
    source: str,
    path: str,
    rules: Sequence[Rule],
    settings: RuleSettings | None = None,
    severities: dict[str, Severity] | None = None,
    catch_rule_errors: bool = False,
    gate: bool | None = None,
) -> FileResult:
    """Findings of `rules` on one file. A rule that raises propagates (tests see rule bugs) unless
    `catch_rule_errors`, where the scan records it in `rule_errors` and keeps the other rules' findings.
    `gate`: apply the syntax gate (default: unless `MAINGRAD_NO_GATE` is set)."""
    settings = settings or RuleSettings()
    with gcpause.paused():  # one file's parse and analysis, all its pieces: see maingrad.analyzer.gcpause
        if len(source) >= min_segment_chars():
            segmented = _analyze_segmented(source, path, rules, settings, severities, catch_rule_errors, gate)
            if segmented is not None:
                return segmented
        return _analyze_whole(source, path, rules, settings, severities, catch_rule_errors, gate)


def _analyze_whole(
    source: str,
    path: str,
    rules: Sequence[Rule],
    settings: RuleSettings,
    severities: dict[str, Severity] | None,
    catch_rule_errors: bool,
    gate: bool | None,
) -> FileResult:
    """A file analyzed as one module."""
    result = FileResult(path=path)
    checked = _check_module(
        source, path, needed_rules(source, rules), settings, gate, catch_rule_errors, result
    )
    if isinstance(checked, ParseError):
        result.parse_error = checked
    elif checked is not None:
        ctx, collected, tree = checked
        if collected:
            result.findings, result.fixes, result.anchors = _to_findings(
                ctx, collected, severities or {}, tree=tree
            )
    return result


def _check_module(
    source: str,
    path: str,
    needed: Sequence[Rule],
    settings: RuleSettings,
    gate: bool | None,
    catch_rule_errors: bool,
    result: FileResult,
) -> tuple[FileContext, list[tuple[Rule, Violation]], ast.Module | None] | ParseError | None:
    """Gate, parse and run the rules on one module (a whole file or one piece of a large one): its context,
    the violations and the gate's `ast` tree; None when the gate leaves no rule to run; the ParseError when
    libcst rejects it (its lines are the module's own)."""
    active, tree = _gate(source, path, needed, settings, gate, catch_rule_errors)
    if not active:
        return None
    parsed = parse(source, path)
    if isinstance(parsed, ParseError):
        return parsed
    result.parsed = True
    ctx = FileContext(path=path, source=source, module=parsed, settings=settings)
    return ctx, _run_rules(ctx, active, catch_rule_errors, result), tree


def _run_rules(
    ctx: FileContext, active: Sequence[Rule], catch_rule_errors: bool, result: FileResult
) -> list[tuple[Rule, Violation]]:
    collected: list[tuple[Rule, Violation]] = []
    for rule in active:
        if not catch_rule_errors:
            collected.extend((rule, violation) for violation in rule.check(ctx))
            continue
        try:
            violations = list(rule.check(ctx))
        except Exception as exc:  # a rule bug must not lose the rest of the scan
            result.rule_errors.append(f"{rule.id}: {type(exc).__name__}: {exc}")
            continue
        collected.extend((rule, violation) for violation in violations)
    return collected


def _analyze_segmented(
    source: str,
    path: str,
    rules: Sequence[Rule],
    settings: RuleSettings,
    severities: dict[str, Severity] | None,
    catch_rule_errors: bool,
    gate: bool | None,
) -> FileResult | None:
    """A large file analyzed piece by piece (see `maingrad.analyzer.segments`); None when it cannot be
    split (a syntax error somewhere), and the caller then analyzes it whole."""
    result = FileResult(path=path)
    needed = needed_rules(source, rules)
    if not needed:
        return result
    chunks = split_segments(source)
    if chunks is None:
        return None
    seen: dict[tuple[str, str], int] = {}
    for piece in segment_pieces(source, chunks, lambda text: bool(needed_rules(text, needed))):
        checked = _check_module(
            piece.source, path, needed_rules(piece.source, needed), settings, gate, catch_rule_errors, result
        )
        if checked is None:
            continue
        if isinstance(checked, ParseError):  # libcst rejects what `ast` accepted: report it where it is
            line = piece.file_line(checked.line) if checked.line else None
            result.parse_error = ParseError(path, checked.message, line, checked.column, checked.kind)
            result.findings, result.fixes, result.anchors = [], {}, {}
            return result
        ctx, collected, tree = checked
        if collected:
            findings, fixes, anchors = _to_findings(ctx, collected, severities or {}, piece, seen, tree)
            result.findings.extend(findings)
            result.fixes.update(fixes)
            result.anchors.update(anchors)
        del ctx, collected, tree, checked
    return result


def _positions(ctx: FileContext, tree: ast.Module | None = None) -> LazyPositions:
    """Positions that generate only the top-level statements holding reported nodes."""

    def top_level(node: cst.CSTNode) -> cst.CSTNode | None:
        current: cst.CSTNode | None = node
        for ancestor in ctx.ancestors(node):
            if isinstance(ancestor, cst.Module):
                return current
            current = ancestor
        return None  # the module itself, or a node outside the index (trivia)

    return LazyPositions(ctx.module, ctx.source, top_level, tree)


def _code(ctx: FileContext, node: cst.CSTNode, positions: LazyPositions) -> str:
    """`ctx.code(node)` from the source text: positions have generated the node's statement already (to
    place the finding), and its span is exactly the text code generation would give, without generating
    it again."""
    start, end = positions.span(node)
    text = ctx.source[start:end]
    return text if text else ctx.code(node)


def _statement_line(ctx: FileContext, node: cst.CSTNode, positions: LazyPositions) -> int | None:
    candidate: cst.CSTNode | None = node
    while candidate is not None:
        if isinstance(candidate, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            return positions[candidate].start.line
        candidate = ctx.parent(candidate)
    return None


def _to_findings(
    ctx: FileContext,
    collected: Iterable[tuple[Rule, Violation]],
    severities: dict[str, Severity],
    piece: Piece | None = None,
    seen: dict[tuple[str, str], int] | None = None,
    tree: ast.Module | None = None,
) -> tuple[list[Finding], dict[str, Fix], dict[str, tuple[int, ...]]]:
    """Findings of the collected violations. With `piece` (a part of a large file): only violations on the
    piece's own lines, with lines mapped back to the file's; `seen` counts identical contexts across pieces
    (for fingerprints). `tree`: the stdlib tree of the same source, when the gate parsed one."""
    positions = _positions(ctx, tree)
    lines = ctx.source.splitlines()
    seen = {} if seen is None else seen
    findings: list[Finding] = []
    fixes: dict[str, Fix] = {}
    anchors: dict[str, tuple[int, ...]] = {}
    # Each violation's range once (a CodeRange per lookup adds up at 10^5 findings), sorted stably by it.
    placed = [(positions[violation.node], rule, violation) for rule, violation in collected]
    placed.sort(key=lambda item: (item[0].start.line, item[0].start.column, item[1].id))
    for where, rule, violation in placed:
        if piece is not None and not piece.is_own(where.start.line):
            continue  # context: its own piece reports it
        context = _code(ctx, violation.context_node or violation.node, positions)
        key = (rule.id, " ".join(context.split()))
        occurrence = seen.get(key, 0)
        seen[key] = occurrence + 1
        fp = fingerprint(rule.id, ctx.path, context, occurrence)
        # The flagged lines (capped: a finding on a whole class must not put the class into every report).
        last = min(where.end.line, where.start.line + SNIPPET_MAX_LINES - 1)
        snippet = "\n".join(lines[where.start.line - 1 : last]) if lines else ""
        start_line, end_line = where.start.line, where.end.line
        if piece is not None:
            start_line, end_line = piece.file_line(start_line), piece.file_line(end_line)
        findings.append(
            Finding(
                rule=rule.id,
                severity=severities.get(rule.id, rule.severity),
                path=ctx.path,
                line=start_line,
                column=where.start.column + 1,
                end_line=end_line,
                end_column=where.end.column + 1,
                message=violation.message,
                fingerprint=fp,
                fix_available=violation.fix is not None,
                snippet=snippet,
                fix_applicability=None
                if violation.fix is None
                else ("safe" if violation.fix.safe else "unsafe"),
            )
        )
        if violation.fix is not None:
            fixes[fp] = violation.fix
        statement_line = _statement_line(ctx, violation.node, positions)
        if statement_line is not None and statement_line != where.start.line:
            anchors[fp] = (piece.file_line(statement_line) if piece is not None else statement_line,)
    return findings, fixes, anchors


def fix_source(
    source: str,
    path: str,
    rules: Sequence[Rule],
    settings: RuleSettings | None = None,
    unsafe: bool = False,
    max_rounds: int = 4,
    honor_suppressions: bool = False,
    gate: bool | None = None,
) -> str:
    """Source after applying every (safe, or also unsafe) fix.

    Unparsable input is returned unchanged. Each round re-parses (and re-gates), so fixes never see stale
    nodes; a further round runs only when a round had to drop a replacement (two fixes on one node, or a
    replaced node inside another), so a second `fix` finds nothing more. A round costs what `check` costs
    plus the touched statements (see `maingrad.analyzer.fixes`): large files are fixed piece by piece like
    they are checked (`maingrad.analyzer.segments`). With `honor_suppressions`, violations silenced by a
    `# maingrad: ignore` comment are not fixed either. `gate` as in `analyze_source`.
    """
    settings = settings or RuleSettings()
    current = source
    with gcpause.paused():
        for _ in range(max_rounds):
            updated, again = _fix_round(current, path, rules, settings, unsafe, honor_suppressions, gate)
            if updated == current:
                return current
            current = updated
            if not again:
                break
    return current


def _fix_round(
    source: str,
    path: str,
    rules: Sequence[Rule],
    settings: RuleSettings,
    unsafe: bool,
    honor_suppressions: bool,
    gate: bool | None,
) -> tuple[str, bool]:
    """One round of fixes: (new source, whether another round is needed)."""
    from maingrad.analyzer.suppressions import parse_suppressions

    needed = needed_rules(source, rules)
    if not needed:
        return source, False
    suppressions = parse_suppressions(source) if honor_suppressions else None
    if suppressions is not None and suppressions.empty:
        suppressions = None
    if len(source) >= min_segment_chars():
        segmented = _fix_segmented(source, path, needed, settings, unsafe, suppressions, gate)
        if segmented is not None:
            return segmented
    return _fix_whole(source, path, needed, settings, unsafe, suppressions, gate)


def _fix_whole(
    source: str,
    path: str,
    needed: Sequence[Rule],
    settings: RuleSettings,
    unsafe: bool,
    suppressions: Suppressions | None,
    gate: bool | None,
) -> tuple[str, bool]:
    from maingrad.analyzer.fixes import apply_fixes, splice

    checked = _check_module(source, path, needed, settings, gate, False, FileResult(path=path))
    if checked is None or isinstance(checked, ParseError):
        return source, False
    ctx, collected, tree = checked
    positions = _positions(ctx, tree)
    fixes = _fixes_to_apply(ctx, collected, unsafe, suppressions, positions, None)
    if not fixes:
        return source, False
    edits = _fix_edits(ctx, fixes, positions, None, None)
    if edits is not None:
        fixed = splice(source, edits[0])
        if fixed is not None:
            return fixed, edits[1]
    return apply_fixes(ctx.module, fixes).code, True  # the whole-module transform: always right


def _fix_segmented(
    source: str,
    path: str,
    needed: Sequence[Rule],
    settings: RuleSettings,
    unsafe: bool,
    suppressions: Suppressions | None,
    gate: bool | None,
) -> tuple[str, bool] | None:
    """A round on a large file, piece by piece as `_analyze_segmented` checks it; None when the file cannot
    be split, or a piece's edit does not map back onto the file (the caller then fixes it whole)."""
    from maingrad.analyzer.fixes import splice

    chunks = split_segments(source)
    if chunks is None:
        return None
    file_lines = _line_starts(source)
    edits: list[Edit] = []
    again = False
    for piece in segment_pieces(source, chunks, lambda text: bool(needed_rules(text, needed))):
        checked = _check_module(
            piece.source,
            path,
            needed_rules(piece.source, needed),
            settings,
            gate,
            False,
            FileResult(path=path),
        )
        if checked is None:
            continue
        if isinstance(checked, ParseError):
            return None
        ctx, collected, tree = checked
        positions = _positions(ctx, tree)
        fixes = _fixes_to_apply(ctx, collected, unsafe, suppressions, positions, piece)
        if fixes:
            found = _fix_edits(ctx, fixes, positions, piece, file_lines)
            if found is None:
                return None
            edits.extend(found[0])
            again |= found[1]
        del ctx, collected, tree, checked, positions
    fixed = splice(source, edits)
    return None if fixed is None else (fixed, again)


def _line_starts(text: str) -> list[int]:
    """Offsets where each line begins, lines ending at `\n` only (as `segments` counts them)."""
    return [0, *(m.end() for m in re.finditer("\n", text))]


def _fixes_to_apply(
    ctx: FileContext,
    collected: Iterable[tuple[Rule, Violation]],
    unsafe: bool,
    suppressions: Suppressions | None,
    positions: LazyPositions,
    piece: Piece | None,
) -> list[Fix]:
    """The fixes of the collected violations that this run applies: safe ones (unsafe too with `unsafe`),
    on the piece's own lines, not silenced by a suppression comment."""
    fixes: list[Fix] = []
    for rule, violation in collected:
        if violation.fix is None or not (violation.fix.safe or unsafe):
            continue
        if piece is None and suppressions is None:
            fixes.append(violation.fix)
            continue
        line = positions[violation.node].start.line
        if piece is not None and not piece.is_own(line):
            continue
        if suppressions is not None:
            lines = [line]
            statement_line = _statement_line(ctx, violation.node, positions)
            if statement_line is not None:
                lines.append(statement_line)
            if piece is not None:
                lines = [piece.file_line(n) for n in lines]
            if suppressions.suppresses(rule.id, lines):
                continue
        fixes.append(violation.fix)
    return fixes


def _fix_edits(
    ctx: FileContext,
    fixes: Sequence[Fix],
    positions: LazyPositions,
    piece: Piece | None,
    file_lines: list[int] | None,
) -> tuple[list[Edit], bool] | None:
    """One text edit per replaced node (its span, `LazyPositions.span`, gets the replacement's code), and
    whether a replacement was dropped; None when a span does not verify or map onto the file (see
    `maingrad.analyzer.fixes`)."""
    from maingrad.analyzer.fixes import Edit, merge, node_code

    replacements, dropped = merge(fixes)
    keys = {id(node) for node in replacements}
    piece_lines = _line_starts(ctx.source) if piece is not None else None
    newline = ctx.module.default_newline
    edits: list[Edit] = []
    for old, new in replacements.items():
        blocks: list[cst.IndentedBlock] = []
        inside_module = False
        outer = False
        for ancestor in ctx.ancestors(old):
            if id(ancestor) in keys:
                outer = True  # an enclosing replacement wins, as in a whole-module transform
                break
            if isinstance(ancestor, cst.IndentedBlock):
                blocks.append(ancestor)
            elif isinstance(ancestor, cst.Module):
                inside_module = True
        if outer:
            dropped = True  # the next round looks again
            continue
        if not inside_module or isinstance(old, cst.Module):
            return None
        indents = [b.indent if b.indent is not None else ctx.module.default_indent for b in reversed(blocks)]
        start, end = positions.span(old)
        old_text = ctx.source[start:end]
        new_text = node_code(ctx.module, new, indents)  # type: ignore[arg-type]
        generated = node_code(ctx.module, old, indents)
        if generated != old_text:
            # The last statement of a file without a final newline: codegen drops that newline too.
            if not (generated == old_text + newline and end == len(ctx.source)):
                return None
            new_text = new_text.removesuffix(newline)
        if piece is not None:
            assert piece_lines is not None and file_lines is not None
            mapped_start = _file_offset(start, piece, piece_lines, file_lines)
            mapped_end = _file_offset(end, piece, piece_lines, file_lines)
            if mapped_start is None or mapped_end is None or mapped_end - mapped_start != end - start:
                return None
            start, end = mapped_start, mapped_end
        edits.append(Edit(start, end, old_text, new_text))
    return edits, dropped


def _file_offset(offset: int, piece: Piece, piece_lines: list[int], file_lines: list[int]) -> int | None:
    """The file offset of a piece offset (its line mapped through the piece's line map)."""
    index = bisect_right(piece_lines, offset) - 1
    file_line = piece.file_line(index + 1)
    if not 1 <= file_line <= len(file_lines):
        return None
    return file_lines[file_line - 1] + offset - piece_lines[index]
