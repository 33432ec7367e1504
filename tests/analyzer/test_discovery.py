"""File discovery: .gitignore (nested, negations), config include/exclude, explicit paths."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from maingrad.analyzer.discovery import discover


def _rel(files) -> list[str]:  # type: ignore[no-untyped-def]
    return [f.relpath for f in files]


@pytest.fixture
def tree(tmp_path: Path, write_tree) -> Path:  # type: ignore[no-untyped-def]
    write_tree(
        tmp_path,
        {
            ".gitignore": "build/\n*_gen.py\n!keep_gen.py\n",
            "a.py": "",
            "notes.txt": "",
            "x_gen.py": "",
            "keep_gen.py": "",
            "build/b.py": "",
            "pkg/.gitignore": "local.py\n",
            "pkg/local.py": "",
            "pkg/mod.py": "",
            "pkg/__pycache__/mod.py": "",
            ".venv/lib/site.py": "",
            "docs/conf.py": "",
        },
    )
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    return tmp_path


def test_gitignore_nested_and_negated(tree: Path) -> None:
    assert _rel(discover([tree], tree)) == ["a.py", "docs/conf.py", "keep_gen.py", "pkg/mod.py"]


def test_gitignore_can_be_turned_off(tree: Path) -> None:
    found = _rel(discover([tree], tree, respect_gitignore=False))
    assert "build/b.py" in found and "pkg/local.py" in found and "x_gen.py" in found
    assert not any("__pycache__" in f or ".venv" in f for f in found)  # always skipped


def test_include_and_exclude(tree: Path) -> None:
    assert _rel(discover([tree], tree, exclude=["docs/", "keep_*.py"])) == ["a.py", "pkg/mod.py"]
    assert _rel(discover([tree], tree, include=["pkg/**/*.py"])) == ["pkg/mod.py"]


def test_explicit_files_are_always_scanned(tree: Path) -> None:
    found = _rel(discover([tree / "build" / "b.py", tree / "notes.txt"], tree, exclude=["build/"]))
    assert found == ["build/b.py", "notes.txt"]
    assert _rel(discover([tree / "build" / "b.py"], tree, exclude=["build/"], force_exclude=True)) == []
    assert _rel(discover([tree / "x_gen.py"], tree, force_exclude=True)) == []  # gitignored


def test_explicit_directory_covered_by_exclude_is_scanned(tree: Path) -> None:
    # `maingrad check docs/` with exclude = ["docs/**"]: naming the directory overrides the pattern that
    # covers it as a whole, while other patterns still apply below it.
    found = _rel(discover([tree / "docs"], tree, exclude=["docs/**", "*conf.py"]))
    assert found == []
    assert _rel(discover([tree / "docs"], tree, exclude=["docs/**"])) == ["docs/conf.py"]
    assert _rel(discover([tree / "build"], tree)) == ["build/b.py"]  # named although gitignored


def test_outside_git_only_the_trees_own_gitignores(tmp_path: Path, write_tree) -> None:  # type: ignore[no-untyped-def]
    write_tree(tmp_path, {".gitignore": "*.py\n", "sub/a.py": "", "sub/.gitignore": "b.py\n", "sub/b.py": ""})
    # scanning sub/ outside any git work tree: the parent's .gitignore does not apply, sub's does
    assert _rel(discover([tmp_path / "sub"], tmp_path / "sub")) == ["a.py"]


def test_duplicates_and_missing_paths(tree: Path) -> None:
    assert _rel(discover([tree / "a.py", tree, tree / "a.py"], tree)).count("a.py") == 1
    with pytest.raises(FileNotFoundError):
        discover([tree / "nope.py"], tree)


def test_scanning_a_subdirectory_honours_the_repository_gitignore(tree: Path, write_tree) -> None:  # type: ignore[no-untyped-def]
    write_tree(tree, {"pkg/x_gen.py": "", "pkg/build/y.py": "", "pkg/sub/keep_gen.py": ""})
    assert _rel(discover([tree / "pkg"], tree)) == ["pkg/mod.py", "pkg/sub/keep_gen.py"]
