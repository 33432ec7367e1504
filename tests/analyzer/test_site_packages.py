"""Every .py file of this environment's site-packages (torch included: thousands of
files, how many depends on what is installed) is scanned by the real CLI, in worker processes, without a
crash, and discovery finds exactly the files an independent walk finds."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_scan_all_of_site_packages(tmp_path: Path) -> None:
    purelib = Path(sysconfig.get_paths()["purelib"])
    torch_spec = importlib.util.find_spec("torch")
    assert torch_spec is not None and torch_spec.origin, "the environment under test must include torch"
    torch_site = Path(torch_spec.origin).parents[1]  # a virtualenv's torch may live in the system site dir
    roots = sorted({str(purelib), str(torch_site)})
    report_path = tmp_path / "report.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "maingrad.cli",
            "check",
            *roots,
            "--no-cache",  # never write into site-packages
            "--no-respect-gitignore",
            "--no-progress",
            "--format",
            "json",
            "--output",
            str(report_path),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert done.returncode in (0, 1), done.stderr[-3000:]  # 2 would be a usage or internal error
    report = json.loads(report_path.read_text())
    internal = [e for e in report["parse_errors"] if e["message"].startswith("internal error")]
    print(
        f"\nsite-packages {roots}: {report['files_scanned']} files scanned, {report['files_parsed']} parsed, "
        f"{len(report['parse_errors'])} parse errors, {len(report['findings'])} findings, "
        f"{report['duration_s']:.1f} s"
    )
    for error in report["parse_errors"][:20]:
        print(f"  parse error: {error['path']}: {error['message'][:120]}")
    assert internal == []
    expected = _python_files(roots)
    assert report["files_scanned"] == len(expected)
    # torch alone ships thousands of modules; a small count would mean the roots were wrong.
    assert len(expected) >= len(_python_files([str(Path(torch_spec.origin).parent)])) >= 1_000


def _python_files(roots: list[str]) -> set[str]:
    """What the CLI must find with --no-respect-gitignore: every *.py file, symlinked directories not
    followed, tool and VCS directories skipped, as `maingrad.analyzer.discovery` documents."""
    from maingrad.analyzer.discovery import DEFAULT_EXCLUDED_DIRS

    found: set[str] = set()
    for root in roots:
        for directory, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d not in DEFAULT_EXCLUDED_DIRS]
            for name in files:
                path = os.path.join(directory, name)
                if name.endswith(".py") and os.path.isfile(path):
                    found.add(os.path.realpath(os.path.dirname(path)) + os.sep + name)
    return found
