"""Which files to scan: .py files under the given paths, minus what .gitignore and `exclude` rule out.

Directories that cannot be listed (and entries whose type cannot be read) are never fatal: they are
collected into `skipped` so that the report says what was not analyzed (MG999), instead of passing it
silently. Explicitly named files are always scanned (unless `force_exclude`, for pre-commit, which passes every
changed file). An explicitly named directory is scanned even when an `exclude` or .gitignore pattern
covers the directory as a whole (`maingrad check examples/` with `exclude = ["examples/**"]`): patterns
that exclude the named directory itself are dropped below it; all other patterns still apply.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from maingrad.contracts.report import NotAnalyzed, ParseError

if TYPE_CHECKING:
    import pathspec


# Directories nobody wants scanned (tool caches, VCS metadata, virtual environments).
DEFAULT_EXCLUDED_DIRS = frozenset(
    {
        ".git",
        ".hg",
        ".svn",
        ".bzr",
        "__pycache__",
        ".maingrad_cache",
        ".mypy_cache",
        ".ruff_cache",
        ".pytest_cache",
        ".tox",
        ".nox",
        ".venv",
        ".eggs",
        "node_modules",
        "__pypackages__",
    }
)
_PROBE = "__maingrad_probe__.py"


@dataclass(frozen=True)
class SourceFile:
    path: Path  # absolute
    relpath: str  # relative to the scan root, POSIX style


def relpath_of(path: Path, root: Path) -> str:
    return Path(os.path.relpath(path, root)).as_posix()


class _PySuffix:
    """The default include (`*.py`) without pathspec: its import alone is a fifth of a warm run."""

    @staticmethod
    def match_file(path: str) -> bool:
        return path.endswith(".py")


def _spec(patterns: Iterable[str]) -> Any:
    patterns = [p for p in patterns if p.strip()]
    if not patterns:
        return None
    if patterns == ["*.py"]:
        return _PySuffix()
    import pathspec

    return pathspec.GitIgnoreSpec.from_lines(patterns)


def _covers(spec: pathspec.PathSpec, rel_dir: str) -> bool:
    """True when `spec` excludes the directory `rel_dir` as a whole."""
    return bool(spec.match_file(rel_dir + "/") or spec.match_file(f"{rel_dir}/{_PROBE}"))


def _without_covering(patterns: Sequence[str], rel_dir: str) -> pathspec.PathSpec | None:
    """`patterns` minus those that exclude `rel_dir` as a whole."""
    if rel_dir in ("", "."):
        return _spec(patterns)
    kept = [p for p in patterns if not (p.strip() and _covers(_spec([p]), rel_dir))]
    return _spec(kept)


class _GitIgnores:
    """The .gitignore files that apply to a directory, deepest last (a deeper file overrides)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._loaded: dict[Path, pathspec.PathSpec | None] = {}

    def spec_for(self, directory: Path) -> pathspec.PathSpec | None:
        if not self.enabled:
            return None
        if directory not in self._loaded:
            spec = None
            lines: list[str] = []
            for name in (".gitignore", ".git/info/exclude"):
                with contextlib.suppress(OSError):
                    lines += (directory / name).read_text(encoding="utf-8", errors="replace").splitlines()
            if any(line.strip() for line in lines):
                import pathspec

                spec = pathspec.GitIgnoreSpec.from_lines(lines)
            self._loaded[directory] = spec
        return self._loaded[directory]

    def ancestors(self, directory: Path) -> list[tuple[Path, pathspec.PathSpec]]:
        """Specs from the enclosing git work tree's root (or `directory` itself outside git) down to it."""
        if not self.enabled:
            return []
        chain = [directory]
        for parent in directory.parents:
            if (chain[-1] / ".git").exists():
                break
            chain.append(parent)
        else:
            if not (chain[-1] / ".git").exists():
                chain = [directory]  # not in a git work tree: only the scanned tree's own .gitignore files
        result = []
        for d in reversed(chain):
            spec = self.spec_for(d)
            if spec is not None:
                result.append((d, spec))
        return result


def _ignored(stack: list[tuple[Path, pathspec.PathSpec]], path: Path, is_dir: bool) -> bool:
    for base, spec in reversed(stack):
        rel = path.relative_to(base).as_posix() + ("/" if is_dir else "")
        verdict = spec.check_file(rel).include
        if verdict is not None:
            return bool(verdict)
    return False


def discover(
    paths: Sequence[Path],
    root: Path,
    include: Sequence[str] = ("*.py",),
    exclude: Sequence[str] = (),
    respect_gitignore: bool = True,
    force_exclude: bool = False,
    skipped: list[ParseError] | None = None,
) -> list[SourceFile]:
    """Files to scan, sorted by relative path, without duplicates. Missing paths raise FileNotFoundError.
    Directories (or entries) that could not be read are appended to `skipped` when it is given."""
    skipped = skipped if skipped is not None else []
    root = root.resolve()
    include_spec = _spec(include)
    gitignores = _GitIgnores(respect_gitignore)
    found: dict[str, SourceFile] = {}
    for given in paths or [Path(".")]:
        path = Path(given).resolve()
        if not path.exists():
            raise FileNotFoundError(f"{given}: no such file or directory")
        rel = relpath_of(path, root)
        if path.is_file():
            if force_exclude and _excluded_file(path, rel, exclude, gitignores):
                continue
            found.setdefault(rel, SourceFile(path, rel))
            continue
        exclude_spec = _without_covering(exclude, rel)
        stack = gitignores.ancestors(path)
        if stack and _ignored(stack, path, True):
            stack = [(path, s) for d, s in stack if d == path]  # the named directory itself is ignored
        _walk(path, root, include_spec, exclude_spec, gitignores, stack, found, skipped)
    return [found[key] for key in sorted(found)]


def _excluded_file(path: Path, rel: str, exclude: Sequence[str], gitignores: _GitIgnores) -> bool:
    spec = _spec(exclude)
    if spec is not None and spec.match_file(rel):
        return True
    stack = gitignores.ancestors(path.parent)
    return bool(stack) and _ignored(stack, path, False)


def _walk(
    directory: Path,
    root: Path,
    include_spec: pathspec.PathSpec | None,
    exclude_spec: pathspec.PathSpec | None,
    gitignores: _GitIgnores,
    stack: list[tuple[Path, pathspec.PathSpec]],
    found: dict[str, SourceFile],
    skipped: list[ParseError],
) -> None:
    try:
        with os.scandir(directory) as iterator:
            entries = sorted(iterator, key=lambda e: e.name)
    except OSError as exc:  # never fatal, never silent
        message = f"cannot read directory: {exc.strerror or exc}; its files were not analyzed"
        skipped.append(ParseError(relpath_of(directory, root), message, kind=NotAnalyzed.DIRECTORY))
        return
    for entry in entries:
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
            is_file = not is_dir and entry.is_file()
        except OSError as exc:
            message = f"cannot read directory entry: {exc.strerror or exc}"
            skipped.append(
                ParseError(relpath_of(Path(entry.path), root), message, kind=NotAnalyzed.DIRECTORY)
            )
            continue
        if not (is_dir or is_file):
            continue
        path = Path(entry.path)
        rel = relpath_of(path, root)
        if is_dir:
            if entry.name in DEFAULT_EXCLUDED_DIRS:
                continue
            if exclude_spec is not None and exclude_spec.match_file(rel + "/"):
                continue
            if stack and _ignored(stack, path, True):
                continue
            own = gitignores.spec_for(path)
            _walk(
                path,
                root,
                include_spec,
                exclude_spec,
                gitignores,
                [*stack, (path, own)] if own else stack,
                found,
                skipped,
            )
        else:
            if include_spec is not None and not include_spec.match_file(rel):
                continue
            if exclude_spec is not None and exclude_spec.match_file(rel):
                continue
            if stack and _ignored(stack, path, False):
                continue
            found.setdefault(rel, SourceFile(path, rel))
