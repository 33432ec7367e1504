"""Every CLI error is one clear line on stderr and an exit code, never a traceback: each subcommand (but the
service's, tested in tests/service) with a missing file, a bad revision, a non-Python path, an unknown rule."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def _maingrad(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "maingrad.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "README.md").write_text("# not Python\n")
    (tmp_path / "bad.jsonl").write_text('{"schema": 1}\nnot json\n')
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    return tmp_path


CASES = {
    "check missing file": (("check", "missing.py", "--no-cache"), "missing.py: no such file or directory"),
    "fix missing file": (("fix", "missing.py", "--no-cache"), "missing.py: no such file or directory"),
    "check non-Python file": (("check", "README.md", "--no-cache"), "README.md: not a Python file"),
    "fix non-Python file": (("fix", "README.md", "--no-cache"), "README.md: not a Python file"),
    "check bad revision": (("check", "--diff-only", "nonexistent-rev", "--no-cache"), "no such commit"),
    "fix --diff bad revision": (
        ("fix", "--diff", "--diff-only", "nonexistent-rev", "--no-cache"),
        "no such commit",
    ),
    "check missing config": (
        ("check", "--config", "missing.toml"),
        "config file missing.toml does not exist",
    ),
    "check missing baseline": (("check", "--baseline", "missing.json", "--no-cache"), "missing.json"),
    "check unwritable output": (("check", "-o", "missing/r.json", "--no-cache"), "No such file or directory"),
    "explain unknown rule": (("explain", "MG123"), "unknown rule 'MG123'"),
    "hooks summary missing file": (
        ("hooks", "summary", "missing.jsonl"),
        "missing.jsonl: No such file or directory",
    ),
    "hooks validate missing file": (
        ("hooks", "validate", "missing.jsonl"),
        "missing.jsonl: No such file or directory",
    ),
    "hooks summary not JSON": (("hooks", "summary", "bad.jsonl"), "bad.jsonl: line 2: not JSON"),
    "hooks validate not JSON": (("hooks", "validate", "bad.jsonl"), "bad.jsonl: line 2: not JSON"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_line_and_exit_2(repo: Path, case: str) -> None:
    args, expected = CASES[case]
    done = _maingrad(*args, cwd=repo)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("maingrad: error: "), done.stderr
    assert expected in lines[0]
    assert lines[0].rstrip()[-1] not in ":(", lines[0]  # no empty reason at the end


def test_diff_only_outside_git_says_so(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    done = _maingrad("check", "--diff-only", "main", "--no-cache", cwd=tmp_path)
    assert done.returncode == 2 and "is not inside a git work tree" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_rules_and_usage_errors_are_argparse_errors(repo: Path) -> None:
    for args in (("rules", "--format", "xml"), ("check", "--format", "xml"), ("nonsense",)):
        done = _maingrad(*args, cwd=repo)
        assert done.returncode == 2 and "Traceback" not in done.stderr
        assert done.stderr.strip().splitlines()[-1].startswith("maingrad")  # "maingrad ...: error: ..."
    rules = _maingrad("rules", "--format", "json", cwd=repo)
    assert rules.returncode == 0 and "MG999" in {r["id"] for r in json.loads(rules.stdout)}


def _commands() -> list[tuple[str, ...]]:
    """Every command and subcommand of `maingrad`, as argv prefixes."""
    import argparse

    from maingrad.cli.main import build_parser

    def walk(parser: argparse.ArgumentParser, prefix: tuple[str, ...]) -> list[tuple[str, ...]]:
        out = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    out.append((*prefix, name))
                    out.extend(walk(sub, (*prefix, name)))
        return out

    return walk(build_parser(), ())


def test_exit_codes_are_documented_in_help(repo: Path) -> None:
    commands = _commands()
    assert {("check",), ("fix",), ("gate",), ("upload",), ("serve",), ("token", "create"), ("hooks", "summary"), ("preflight",)} <= set(commands)  # fmt: skip
    for command in commands:
        text = _maingrad(*command, "--help", cwd=repo).stdout
        assert "exit codes:" in text, command
        assert "\n  0  " in text and "\n  2  " in text, (command, text)
    for command in ("check", "fix"):
        text = _maingrad(command, "--help", cwd=repo).stdout
        for code in ("0  ", "1  ", "2  "):
            assert f"\n  {code}" in text, text
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "exit codes" in readme.lower() and "MG999" in readme


def test_the_extras_table_matches_pyproject() -> None:
    """contracts/extras.py names, for each import of an optional dependency, the extra pyproject installs it with."""
    import re

    from maingrad.contracts.extras import EXTRA_OF_MODULE

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    # distribution name -> import name, where they differ
    imports = {"pydantic-settings": "pydantic_settings", "python-multipart": "multipart", "transformer-engine": "transformer_engine", "megatron-core": "megatron"}  # fmt: skip
    for extra in ("service", "runtime", "megatron"):
        for requirement in pyproject["project"]["optional-dependencies"][extra]:
            name = re.split(r"[\[<>=!; ]", requirement, maxsplit=1)[0]
            assert EXTRA_OF_MODULE[imports.get(name, name)] == extra, requirement


def test_a_missing_extra_names_the_install_in_one_line(repo: Path) -> None:
    """A light install (here: the service's web server made unimportable) ends in one line naming the extra."""
    code = (
        "import sys; sys.modules['uvicorn'] = None; sys.modules['fastapi'] = None\n"
        "from maingrad.cli.main import main; sys.exit(main(sys.argv[1:]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "serve", "--database-url", f"sqlite:///{repo}/db.sqlite"],
        cwd=repo, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert 'pip install "maingrad[service]"' in done.stderr and "Traceback" not in done.stderr
