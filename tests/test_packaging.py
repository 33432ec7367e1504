"""The regular (wheel) install: one `maingrad` namespace holding the three parts and the CLI, data files
included, nothing installed as a bare top-level `analyzer`/`hooks`/`service`, and it runs from the wheel."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Run the CLI from the unpacked wheel only: drop the editable install's finders and this checkout from the path.
_BOOTSTRAP = """
import sys
site = sys.argv[1]
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
sys.path_hooks[:] = [h for h in sys.path_hooks if "editable" not in getattr(h, "__module__", "")]
root = sys.argv[2].rstrip("/")
# this checkout only: a venv beside it (/x/repo-venv next to /x/repo) shares the prefix but not the folder, and
# a venv inside it (/x/repo/.venv, the interpreter's own prefix) keeps its site-packages
def ours(p):
    return p == root or (p.startswith(root + "/") and not p.startswith(sys.prefix.rstrip("/") + "/"))
sys.path[:] = [site] + [p for p in sys.path if p and not ours(p)]
sys.path_importer_cache.clear()
import maingrad.analyzer, maingrad.hooks, maingrad.service, maingrad.cli.main as cli
for module in (maingrad.analyzer, maingrad.hooks, maingrad.service, cli):
    assert module.__file__.startswith(site), module.__file__
sys.exit(cli.main(sys.argv[3:]))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(dist),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    (built,) = dist.glob("maingrad-*.whl")
    return built


def test_wheel_holds_one_namespace_with_data_files(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"maingrad", wheel.name.split("-py3")[0] + ".dist-info"}
    assert not any(name.startswith("maingrad/__init__") for name in names)  # an implicit namespace package
    for expected in (
        "maingrad/analyzer/engine.py",
        "maingrad/analyzer/rules/mg001_fused_op_without_exposure.py",
        "maingrad/hooks/api.py",
        "maingrad/hooks/preflight/run.py",  # a subpackage: listed in pyproject's packages
        "maingrad/hooks/py.typed",  # a user's type checker reads install() / preflight() types
        "maingrad/service/app.py",
        "maingrad/service/migrations/env.py",
        "maingrad/service/dashboard/templates/base.html",
        "maingrad/cli/main.py",
    ):
        assert expected in names, expected
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "maingrad = maingrad.cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_the_unpacked_wheel_runs_check(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    example = ROOT / "examples" / "buggy_grouped_mlp.py"
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _BOOTSTRAP,
            str(site),
            str(ROOT),
            "check",
            str(example),
            "--no-cache",
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stderr  # 1: findings
    rules = {finding["rule"] for finding in json.loads(done.stdout)["findings"]}
    assert rules == {"MG001", "MG003"}
