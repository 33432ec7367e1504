"""Real test beds: released packages (megatron-core, Transformer Engine, and the code bases built on them),
downloaded from PyPI at test time into a cache directory (never committed) and unpacked once (their `.py`
files only). Wheels are preferred; deepspeed and colossalai publish only source archives, which are unpacked
the same way. Versions are pinned: `docs/real-world.md` lists every finding on exactly these.

`MAINGRAD_TESTBED_CACHE` overrides the cache (default: ~/.cache/maingrad/testbeds).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
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
_SDIST = ["--no-binary=:all:"]
TESTBEDS: dict[str, tuple[str, list[str]]] = {
    "megatron-core-0.16.1": ("megatron-core==0.16.1", _PY312 + _LINUX),
    "megatron-core-0.18.2": ("megatron-core==0.18.2", _PY312 + _LINUX),
    "megatron-core-0.19.2": ("megatron-core==0.19.2", _PY312 + _LINUX),
    # 276 MB, cached: its Python sources are what users run (the 1.2 MB pure wheel lacks the pytorch part).
    "transformer-engine-2.20.2": (
        "transformer-engine-cu13==2.20.2",
        _PY312 + ["--platform", "manylinux_2_28_x86_64"],
    ),
    # The code bases built on them (the newest releases when the real-world table was made).
    "megatron-bridge-0.3.1": ("megatron-bridge==0.3.1", _PY312),
    "nemo-toolkit-3.0.0": ("nemo-toolkit==3.0.0", _PY312),
    "nvidia-modelopt-0.47.0": ("nvidia-modelopt==0.47.0", _PY312),
    "nanotron-0.4": ("nanotron==0.4", _PY312),
    "torchtitan-0.3.0": ("torchtitan==0.3.0", _PY312),
    "deepspeed-0.19.8": ("deepspeed==0.19.8", _SDIST),
    "colossalai-0.5.0": ("colossalai==0.5.0", _SDIST),
}
# Beds whose findings `benchmarks/real_world.py` tabulates (all of them).
REAL_WORLD = tuple(TESTBEDS)


def testbed(name: str) -> Path:
    """Directory holding the unzipped wheel `name` (downloads on first use; raises on failure)."""
    requirement, args = TESTBEDS[name]
    target = CACHE / name
    done = target / ".unpacked"
    if done.exists():
        return target
    wheels = CACHE / "wheels" / name
    wheels.mkdir(parents=True, exist_ok=True)
    if not any(wheels.glob("*.whl")) and not any(wheels.glob("*.tar.gz")):
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
    (archive_path,) = sorted([*wheels.glob("*.whl"), *wheels.glob("*.tar.gz")])
    target.mkdir(parents=True, exist_ok=True)
    if archive_path.name.endswith(".whl"):
        with zipfile.ZipFile(archive_path) as archive:
            members = [m for m in archive.namelist() if m.endswith(".py")]
            archive.extractall(target, members)
    else:
        _unpack_sdist(archive_path, target)
    done.touch()
    return target


def _unpack_sdist(path: Path, target: Path) -> None:
    """The `.py` files of a source archive, without its top folder (`deepspeed-0.19.8/deepspeed/x.py` ->
    `deepspeed/x.py`, the layout a wheel has); links and absolute or `..` paths are skipped."""
    with tarfile.open(path) as archive:
        for member in archive.getmembers():
            parts = Path(member.name).parts
            if not member.isfile() or not member.name.endswith(".py") or len(parts) < 2:
                continue
            relative = Path(*parts[1:])
            if relative.is_absolute() or ".." in relative.parts:
                continue
            source = archive.extractfile(member)
            if source is None:
                continue
            destination = target / relative
            destination.parent.mkdir(parents=True, exist_ok=True)
            destination.write_bytes(source.read())
