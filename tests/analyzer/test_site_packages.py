"""Acceptance 4 (issue 2): every .py file of this environment's site-packages (torch included, well over
10,000 files) is scanned by the real CLI, in worker processes, without a crash."""

from __future__ import annotations

import importlib.util
import json
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
    assert report["files_scanned"] >= 10_000
