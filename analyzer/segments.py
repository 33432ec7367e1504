"""Large files in pieces: memory and time that scale with what the rules need, not with the file.

A whole-file `ast.parse` of a 5 MB module holds about 0.9 GB, and a whole-file `libcst.parse_module` about
0.45 GB per MB of source, so one large generated file could take a CI runner's memory. Above
`SEGMENT_MIN_CHARS` the engine therefore reads a file as a sequence of *chunks* of whole top-level statements:

1. Split: candidate boundaries are lines that start a statement at column 0 (not a comment, not a closing
   bracket, not `else`/`elif`/`except`/`finally`, not after a decorator or a backslash continuation).
   Consecutive candidates are grouped into chunks of at least `CHUNK_CHARS` characters.
2. Verify: each chunk is parsed on its own with `ast.parse` (one chunk's tree alive at a time). A chunk that
   parses ends where its last statement ends in the whole file too (the tokenizer is back at column 0 with
   no open bracket, string or continuation, or the chunk would not parse), so chunks that all parse are a
   partition of the file into top-level statements. A chunk that does not parse (the cut fell inside a
   string or a bracketed literal) is merged with the following chunks, doubling each time; when even the
   rest of the file does not parse, the file has a syntax error and `split()` returns None (the engine then
   parses it whole, which reports the error exactly as for any other file).
3. Select: the *relevant* chunks are those whose text holds a needle of an active rule; every finding lies
   in one of them. The *context* every piece of analysis sees besides its own chunks: all top-level imports
   and the chunks that define (def, class, assignment) a name the relevant chunks use, transitively.
4. Group: relevant chunks are analyzed in groups of about `GROUP_CHARS`, each as one libcst module made of
   the context and the group's chunks in their original order; a line map turns its lines back into the
   file's. Only violations inside the group's own chunks are kept, so nothing is reported twice.

`MAINGRAD_SEGMENT_MIN_CHARS` overrides the threshold (tests set it to 0 to compare both paths on real code).
"""

from __future__ import annotations

import ast
import os
import re
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from maingrad.analyzer import gcpause

SEGMENT_MIN_CHARS = 1_000_000
CHUNK_CHARS = 32_000
GROUP_CHARS = 200_000

_NOT_A_START = re.compile(r"(?:else|elif|except|finally)\b|[\s#)\]}]")
_LINE = re.compile(r"[^\n]*\n|[^\n]+$")
_LONE_CR = re.compile(r"\r(?!\n)")


def min_chars() -> int:
    value = os.environ.get("MAINGRAD_SEGMENT_MIN_CHARS", "").strip()
    return int(value) if value.isdigit() else SEGMENT_MIN_CHARS


@dataclass
class Chunk:
    start: int  # character offsets [start, end) in the file
    end: int
    first_line: int  # 1-based line of `start`
    lines: int  # number of lines
    defines: set[str] = field(default_factory=set)  # top-level names it binds
    imports: list[tuple[int, int]] = field(default_factory=list)  # (first, last) file lines of its imports
    uses: set[str] | None = None  # names it reads (only computed when needed)


@dataclass
class Piece:
    """One module to analyze: its source, the file lines it maps from, and which of its lines are its own."""

    source: str
    starts: list[int]  # module line where each segment begins (1-based, ascending)
    offsets: list[int]  # file line minus module line, per segment
    own: list[bool]  # segment belongs to this piece's group (else: context)

    def file_line(self, line: int) -> int:
        index = bisect_right(self.starts, line) - 1
        return line + self.offsets[max(index, 0)]

    def is_own(self, line: int) -> bool:
        index = bisect_right(self.starts, line) - 1
        return self.own[max(index, 0)]


def _candidates(source: str) -> Iterator[tuple[int, int]]:
    """(offset, line) of lines that may start a top-level statement, the first line included."""
    yield 0, 1
    offset, line = 0, 1
    previous = ""  # the last line with code, stripped
    for match in _LINE.finditer(source):
        text = match.group()
        if (
            line > 1
            and text
            and not _NOT_A_START.match(text)
            and not previous.startswith("@")
            and not previous.endswith("\\")
        ):
            yield offset, line
        stripped = text.rstrip("\r\n")
        if stripped.strip() and not stripped.lstrip().startswith("#"):
            previous = stripped
        offset = match.end()
        line += 1


def _parse(text: str) -> ast.Module | None:
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def split(source: str) -> list[Chunk] | None:
    """Verified chunks of whole top-level statements, or None when some part of the file does not parse."""
    if _LONE_CR.search(source):
        return None  # old-Mac line ends: line numbers would need the tokenizer's rules; parse it whole
    bounds: list[tuple[int, int]] = []
    for offset, line in _candidates(source):
        if not bounds or offset - bounds[-1][0] >= CHUNK_CHARS:
            bounds.append((offset, line))
    bounds.append((len(source), source.count("\n", bounds[-1][0]) + bounds[-1][1]))
    chunks: list[Chunk] = []
    with gcpause.paused():
        index = 0
        while index < len(bounds) - 1:
            step = 1
            while True:
                last = min(index + step, len(bounds) - 1)
                start, first_line = bounds[index]
                end, end_line = bounds[last]
                tree = _parse(source[start:end])
                if tree is not None:
                    break
                if last == len(bounds) - 1:
                    return None  # the rest of the file does not parse: a syntax error
                step *= 2
            chunk = Chunk(start, end, first_line, end_line - first_line)
            _summarize(tree, chunk)
            del tree
            chunks.append(chunk)
            index = last
    return chunks


def _summarize(tree: ast.Module, chunk: Chunk) -> None:
    offset = chunk.first_line - 1
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            chunk.imports.append((node.lineno + offset, (node.end_lineno or node.lineno) + offset))
            for alias in node.names:
                chunk.defines.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            chunk.defines.add(node.name)
        else:  # assignments, and whatever `if`/`try`/`with`/`for` at module level binds
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    chunk.defines.add(sub.id)
                elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    chunk.defines.add(sub.name)
                elif isinstance(sub, (ast.Import, ast.ImportFrom)):
                    chunk.defines.update((a.asname or a.name).split(".")[0] for a in sub.names)


_IDENTIFIER = re.compile(r"[^\W\d]\w*")


def _uses(source: str, chunk: Chunk) -> set[str]:
    """Every identifier in the chunk's text: a superset of the names it reads (attribute names, words in
    strings and comments too), which can only add context, never miss some; and a regex is far cheaper
    than walking a tree."""
    if chunk.uses is None:
        chunk.uses = set(_IDENTIFIER.findall(source, chunk.start, chunk.end))
    return chunk.uses


def pieces(source: str, chunks: Sequence[Chunk], relevant: Callable[[str], bool]) -> Iterator[Piece]:
    """The modules to analyze, in file order (see the module docstring, steps 3 and 4)."""
    wanted = [i for i, c in enumerate(chunks) if relevant(source[c.start : c.end])]
    if not wanted:
        return
    definers: dict[str, list[int]] = {}
    for index, chunk in enumerate(chunks):
        for name in chunk.defines:
            definers.setdefault(name, []).append(index)
    context: set[int] = set()
    frontier = list(wanted)
    seen = set(wanted)
    while frontier:
        index = frontier.pop()
        for name in _uses(source, chunks[index]):
            for definer in definers.get(name, ()):
                if definer not in seen:
                    seen.add(definer)
                    context.add(definer)
                    frontier.append(definer)
    imports = [(i, span) for i, c in enumerate(chunks) for span in c.imports]
    group: list[int] = []
    size = 0
    for index in wanted:
        group.append(index)
        size += chunks[index].end - chunks[index].start
        if size >= GROUP_CHARS:
            yield _piece(source, chunks, group, context, imports)
            group, size = [], 0
    if group:
        yield _piece(source, chunks, group, context, imports)


def _piece(
    source: str,
    chunks: Sequence[Chunk],
    group: list[int],
    context: set[int],
    imports: list[tuple[int, tuple[int, int]]],
) -> Piece:
    own = set(group)
    # (file line, text, own) segments: whole chunks, plus the import statements of chunks not included.
    segments: list[tuple[int, str, bool]] = []
    for index in sorted(own | context):
        chunk = chunks[index]
        segments.append((chunk.first_line, source[chunk.start : chunk.end], index in own))
    included = own | context
    lines: list[str] | None = None
    for index, (first, last) in imports:
        if index in included:
            continue
        if lines is None:
            lines = source.splitlines(keepends=True)
        segments.append((first, "".join(lines[first - 1 : last]), False))
    segments.sort(key=lambda s: s[0])
    parts: list[str] = []
    starts: list[int] = []
    offsets: list[int] = []
    owned: list[bool] = []
    line = 1
    for file_line, text, is_own in segments:
        if not text.endswith("\n"):
            text += "\n"
        starts.append(line)
        offsets.append(file_line - line)
        owned.append(is_own)
        parts.append(text)
        line += text.count("\n")
    return Piece("".join(parts), starts, offsets, owned)
