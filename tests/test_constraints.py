"""constraints.txt and pyproject agree: every dependency the README installs is pinned, every pin satisfies
pyproject's bounds, and the README's first command and .ci/run install with it."""

from __future__ import annotations

import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
EXTRAS = ("dev", "service", "runtime")  # what the README and .ci/run install


def _pins() -> dict[str, Version]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def _requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    names = list(project["dependencies"])
    for extra in EXTRAS:
        names += project["optional-dependencies"][extra]
    return [Requirement(r) for r in names]


def test_every_direct_dependency_is_pinned_within_its_bounds() -> None:
    pins = _pins()
    for requirement in _requirements():
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement} has no pin in constraints.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {name}=={pins[name]}, outside pyproject's {requirement}"
        )


def test_dev_tools_have_upper_bounds() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    for text in project["optional-dependencies"]["dev"]:
        requirement = Requirement(text)
        assert any(s.operator in ("<", "<=", "==", "~=") for s in requirement.specifier), (
            f"dev tool without an upper bound: {text}"
        )


def test_readme_and_ci_install_with_the_constraints() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    first_command = readme.split("```bash\n", 1)[1].splitlines()[0]
    assert first_command.count("-c constraints.txt") == 2 and "maingrad check" in first_command
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    installs = [line for line in ci.splitlines() if "pip install" in line]
    assert installs and all("-c constraints.txt" in line for line in installs)
