"""The CI recipes of docs/github-actions.md, run as written in a fresh virtual environment and a temporary git
repository: the light install from a built wheel and from a git URL, the pre-commit `repo: local` hook (with
pre-commit itself, installed into the same environment), and the one-line message of a command whose extra is
missing. Packages come from the configured index (pip's own configuration)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "github-actions.md"
EXAMPLE = ROOT / "examples" / "buggy_grouped_mlp.py"

pytestmark = [pytest.mark.slow, pytest.mark.network]


def _run(*args: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: int = 600) -> subprocess.CompletedProcess[str]:  # fmt: skip
    return subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)  # fmt: skip


def _venv(path: Path) -> Path:
    """A fresh environment that sees nothing of this one (no system site-packages, no editable maingrad)."""
    done = _run(sys.executable, "-m", "venv", path)
    assert done.returncode == 0, done.stderr
    return path / "bin"


def _git_repo(path: Path, files: dict[str, str]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    for args in (
        ("init", "-q"),
        ("add", "."),
        ("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init"),
    ):
        assert _run("git", *args, cwd=path).returncode == 0
    return path


def _doc_block(marker: str) -> str:
    """The fenced block of docs/github-actions.md that contains `marker`, as written."""
    blocks = re.findall(r"```(?:yaml|bash)\n(.*?)```", DOCS.read_text(), flags=re.S)
    (block,) = [b for b in blocks if marker in b]
    return block


@pytest.fixture(scope="module")
def light(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The light install from a wheel built from this checkout, plus pre-commit, in a fresh venv."""
    root = tmp_path_factory.mktemp("light")
    dist = root / "dist"
    built = _run(
        sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dist, ROOT
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = dist.glob("maingrad-*.whl")
    bin_dir = _venv(root / "venv")
    installed = _run(bin_dir / "python", "-m", "pip", "install", "-q", wheel, "pre-commit")
    assert installed.returncode == 0, installed.stderr
    return bin_dir


def _env(bin_dir: Path, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAINGRAD_", "VIRTUAL_ENV", "PYTHON"))}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PRE_COMMIT_HOME"] = str(home / "pre-commit-cache")
    return env


def test_the_light_install_checks_and_names_missing_extras(light: Path, tmp_path: Path) -> None:
    env = _env(light, tmp_path)
    assert _run(light / "python", "-c", "import fastapi", env=env).returncode != 0  # really the light install
    repo = _git_repo(tmp_path / "repo", {"src/model.py": EXAMPLE.read_text()})
    check = _run(light / "maingrad", "check", "--format", "json", "--output", "r.json", cwd=repo, env=env)
    assert check.returncode == 1, check.stderr  # the example's two errors
    assert '"rule": "MG001"' in (repo / "r.json").read_text()
    for command in (("serve",), ("upload", "r.json", "--project", "p", "--commit", "abc123"), ("gate", "--commit", "abc123")):  # fmt: skip
        done = _run(light / "maingrad", *command, cwd=repo, env=env)
        assert done.returncode == 2, (command, done.stdout, done.stderr)
        assert done.stderr.count("\n") == 1, done.stderr  # one line, no traceback
        assert 'pip install "maingrad[service]"' in done.stderr, done.stderr


def test_the_documented_pre_commit_hook_runs_in_a_fresh_repository(light: Path, tmp_path: Path) -> None:
    config = _doc_block("repo: local")
    assert "rev:" not in config  # no tag to pin: the local hook runs the installed maingrad
    env = _env(light, tmp_path)
    buggy = _git_repo(
        tmp_path / "buggy", {".pre-commit-config.yaml": config, "src/model.py": EXAMPLE.read_text()}
    )
    failed = _run(light / "pre-commit", "run", "--all-files", cwd=buggy, env=env)
    assert failed.returncode == 1 and "MG001" in failed.stdout and "Failed" in failed.stdout, failed.stdout
    clean = _git_repo(tmp_path / "clean", {".pre-commit-config.yaml": config, "src/ok.py": "x = 1\n"})
    passed = _run(light / "pre-commit", "run", "--all-files", cwd=clean, env=env)
    assert passed.returncode == 0 and "Passed" in passed.stdout, passed.stdout + passed.stderr


def test_the_repository_hook_definitions_run_as_pre_commit_calls_them(light: Path, tmp_path: Path) -> None:
    """`.pre-commit-hooks.yaml` (for a `repo:` URL with a `rev:`): its entries, then the staged file names."""
    import shlex

    import yaml

    env = _env(light, tmp_path)
    repo = _git_repo(tmp_path / "repo", {"src/model.py": EXAMPLE.read_text(), "src/ok.py": "x = 1\n"})
    for hook in yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text()):
        entry = shlex.split(hook["entry"])
        assert _run(*entry, "src/ok.py", cwd=repo, env=env).returncode == 0, hook["id"]
        if hook["id"] == "maingrad":
            assert _run(*entry, "src/model.py", "src/ok.py", cwd=repo, env=env).returncode == 1


def test_install_from_the_git_url(tmp_path: Path) -> None:
    """The documented `pip install "maingrad @ git+URL@REV"`, with this repository's committed HEAD as URL."""
    if shutil.which("git") is None:
        pytest.fail("git is needed to install from a git URL")
    line = next(line for line in _doc_block("git+https://").splitlines() if "git+https://" in line)
    requirement = re.search(r'"(maingrad @ git\+https://[^"]+)"', line)
    assert requirement is not None, line
    bin_dir = _venv(tmp_path / "venv")
    # The same requirement form, pointed at this checkout's committed HEAD by its SHA (a REV: tag or SHA).
    sha = _run("git", "rev-parse", "HEAD", cwd=ROOT).stdout.strip()
    url = f"maingrad @ git+file://{ROOT}@{sha}"
    # CI images carry a current pip; the venv's bundled one (23.x on Python 3.11) cannot parse the URL.
    assert _run(bin_dir / "python", "-m", "pip", "install", "-q", "--upgrade", "pip").returncode == 0
    installed = _run(bin_dir / "python", "-m", "pip", "install", "-q", url)
    assert installed.returncode == 0, installed.stderr
    repo = _git_repo(tmp_path / "repo", {"src/model.py": EXAMPLE.read_text()})
    check = _run(bin_dir / "maingrad", "check", "--concise", cwd=repo, env=_env(bin_dir, tmp_path))
    assert check.returncode == 1 and "MG001 error" in check.stdout, check.stdout + check.stderr
