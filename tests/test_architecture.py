"""The parts' import boundaries, checked on the source: parts import `maingrad.contracts`, never each other.

- `contracts` imports the standard library only (the hooks load it on a training process's start-up path);
- `hooks` imports the standard library, torch and `maingrad.contracts` (no numpy, no service, no analyzer);
- `analyzer` and `service` import `maingrad.contracts` and themselves, never one another or the hooks;
- `cli` is the entry point that dispatches to the parts, so it alone may import any of them.
A relative import counts as an import of its own part. Imports inside functions count too.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
    "package-dir"
]
PARTS = {package.split(".")[1]: folder for package, folder in PACKAGE_DIR.items()}

# part -> the maingrad parts it may import (besides itself)
ALLOWED_PARTS = {
    "contracts": set(),
    "hooks": {"contracts"},
    "analyzer": {"contracts"},
    "service": {"contracts"},
    "cli": set(PARTS),
}
# part -> third-party top-level modules it may import (None: any)
ALLOWED_THIRD_PARTY: dict[str, set[str] | None] = {
    "contracts": set(),
    "hooks": {"torch"},
    "analyzer": None,
    "service": None,
    "cli": None,
}


def _imports(path: Path, part: str, folder: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, relative ones resolved within `part`."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = ["maingrad", part, *path.parent.relative_to(folder).parts]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                found.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
            elif node.module:
                found.append((node.lineno, node.module))
    return found


def _problems(part: str, folder: Path) -> list[str]:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    problems = []
    for path in sorted(folder.rglob("*.py")):
        for line, module in _imports(path, part, folder):
            top = module.split(".")[0]
            where = f"{path.relative_to(folder.parent)}:{line}: {module}"
            if top == "maingrad":
                other = module.split(".")[1] if module.count(".") else None
                if other is None:
                    problems.append(f"{where} (import the part, not the namespace)")
                elif other != part and other not in ALLOWED_PARTS[part]:
                    problems.append(f"{where} ({part} may not import {other}; share it through contracts)")
            elif top not in stdlib:
                allowed = ALLOWED_THIRD_PARTY[part]
                if allowed is not None and top not in allowed:
                    problems.append(
                        f"{where} ({part} may import only the standard library and {sorted(allowed)})"
                    )
    return problems


def test_every_part_is_checked() -> None:
    assert set(PARTS) == set(ALLOWED_PARTS), "a part was added or renamed: give it its rules here"


@pytest.mark.parametrize("part", sorted(ALLOWED_PARTS))
def test_part_imports_only_what_it_may(part: str) -> None:
    problems = _problems(part, ROOT / PARTS[part])
    assert not problems, "\n".join(problems)


def test_the_check_catches_each_kind_of_violation(tmp_path: Path) -> None:
    """The check itself: a cross-part import (absolute, relative climbing out, inside a function) and a
    third-party import where only torch is allowed are each reported."""
    folder = tmp_path / "hooks"
    (folder / "sub").mkdir(parents=True)
    (folder / "ok.py").write_text(
        "import json\nimport torch\nfrom maingrad.contracts import records\nfrom . import ok\n"
    )
    (folder / "sub" / "bad.py").write_text(
        "from maingrad.service import app\nfrom ...analyzer import engine\n"
        "def f():\n    import numpy\n    import maingrad\n"
    )
    problems = _problems("hooks", folder)
    assert [p.split(": ")[1].split(" (")[0] for p in problems] == [
        "maingrad.service",
        "maingrad.analyzer",
        "numpy",
        "maingrad",
    ]
