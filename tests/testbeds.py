"""Real test beds: released wheels of megatron-core and Transformer Engine, downloaded from PyPI at test
time into a cache directory (never committed) and unzipped once.

`MAINGRAD_TESTBED_CACHE` overrides the cache (default: ~/.cache/maingrad/testbeds).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

CACHE = Path(os.environ.get("MAINGRAD_TESTBED_CACHE", Path.home() / ".cache" / "maingrad" / "testbeds"))

# name -> (pip requirement, extra pip args)
_PY312 = ["--python-version", "3.12", "--only-binary=:all:", "--implementation", "cp"]
_LINUX = [
    "--platform",
    "manylinux_2_28_x86_64",
    "--platform",
    "manylinux_2_24_x86_64",
    "--platform",
    "manylinux_2_17_x86_64",
]
TESTBEDS: dict[str, tuple[str, list[str]]] = {
    "megatron-core-0.18.2": ("megatron-core==0.18.2", _PY312 + _LINUX),
    "megatron-core-0.19.2": ("megatron-core==0.19.2", _PY312 + _LINUX),
    # 276 MB, cached: its Python sources are what users run (the 1.2 MB pure wheel lacks the pytorch part).
    "transformer-engine-2.20.2": (
        "transformer-engine-cu13==2.20.2",
        _PY312 + ["--platform", "manylinux_2_28_x86_64"],
    ),
}


def testbed(name: str) -> Path:
    """Directory holding the unzipped wheel `name` (downloads on first use; raises on failure)."""
    requirement, args = TESTBEDS[name]
    target = CACHE / name
    done = target / ".unpacked"
    if done.exists():
        return target
    wheels = CACHE / "wheels" / name
    wheels.mkdir(parents=True, exist_ok=True)
    if not any(wheels.glob("*.whl")):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-q",
                "-d",
                str(wheels),
                *args,
                requirement,
            ],
            check=True,
        )
    (wheel,) = sorted(wheels.glob("*.whl"))
    target.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.namelist() if m.endswith(".py")]
        archive.extractall(target, members)
    done.touch()
    return target
