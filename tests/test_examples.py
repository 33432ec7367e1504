"""The README's and docs' examples run as written: examples/hooks_cpu.py end to end, and every ```python
block of README.md and docs/hooks.md (from the repository root, as they say)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )


def test_hooks_cpu_example() -> None:
    done = _run(["examples/hooks_cpu.py"])
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "the first fused forward fails: RuntimeError: MAIN GRAD NOT FOUND" in out  # no hooks
    assert "MainGradContractError: maingrad: module.0: parameter 'weight'" in out  # check
    assert "record: module=module.0 param=weight anomaly=main_grad_missing" in out  # observe
    assert "main_grad equals plain autograd's gradient: True" in out  # fix
    assert "module.2  op_fuser" in out and '"action": "exposed"' in out  # the summary and a record
    assert done.stderr == ""  # no warning either (numpy is in the runtime extra)


@pytest.mark.parametrize("document", ["README.md", "docs/hooks.md"])
def test_python_blocks_run_as_written(document: str) -> None:
    """A document's blocks run in order in one interpreter, as a reader pasting them one after the other
    would (a later block may use what an earlier one defined)."""
    blocks = _BLOCK.findall((REPO / document).read_text(encoding="utf-8"))
    assert blocks, f"{document} has no python block"
    script = "\n".join(f"print('--- block {i}', flush=True)\n{block}" for i, block in enumerate(blocks))
    done = _run(["-c", script])
    assert done.returncode == 0, f"{document}:\n{done.stdout[-2000:]}\n{done.stderr}"
    assert "Traceback" not in done.stderr and f"--- block {len(blocks) - 1}" in done.stdout


def test_readme_walkthrough_finds_exactly_the_two_documented_findings() -> None:
    """README's first command checks examples/ and says the gate fails on two findings (the megatron-core
    0.18.2 fused grouped MLP's MG001 and MG003); every other example must stay clean, or the walkthrough
    says less than it shows."""
    import json

    done = _run(["-m", "maingrad.cli", "check", "examples/", "--format", "json"])
    report = json.loads(done.stdout)
    found = sorted((f["rule"], Path(f["path"]).name) for f in report["findings"])
    assert found == [("MG001", "buggy_grouped_mlp.py"), ("MG003", "buggy_grouped_mlp.py")], done.stdout
    assert "two findings" in (REPO / "README.md").read_text(encoding="utf-8")
