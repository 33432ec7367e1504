"""[tool.maingrad] discovery, validation and CLI overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from maingrad.analyzer.config import ConfigError, find_config, load_config

pytestmark = pytest.mark.usefixtures("test_rules")

SOURCE = {"pkg/a.py": "x = p.main_grad\nbad_call()\n", "tests/t.py": "y = q.main_grad\n"}


def test_config_found_by_walking_up_from_the_paths(project, run) -> None:
    root = project(SOURCE, 'select = ["MG901"]\n')
    assert find_config([root / "pkg" / "a.py"]) == root / "pyproject.toml"
    result = run("check", "--format", "json", "pkg")
    data = result.json()
    assert {f["rule"] for f in data["findings"]} == {"MG901"}
    assert [f["path"] for f in data["findings"]] == ["pkg/a.py"]  # relative to the config's directory


def test_nearest_pyproject_without_table_is_skipped(project, tmp_path: Path) -> None:
    root = project(SOURCE)
    (root / "pkg" / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    assert find_config([root / "pkg"]) == root / "pyproject.toml"


def test_select_ignore_and_cli_overrides(project, run) -> None:
    project(SOURCE, 'select = ["MG90"]\nignore = ["MG902"]\n')
    assert {f["rule"] for f in run("check", "--format", "json").json()["findings"]} == {"MG901"}
    # --select replaces the configured selection (and its ignore list)
    assert {f["rule"] for f in run("check", "--format", "json", "--select", "MG902").json()["findings"]} == {
        "MG902"
    }
    # --ignore adds to the configured one
    assert run("check", "--format", "json", "--ignore", "MG901").json()["findings"] == []


def test_exclude_and_per_file_ignores(project, run) -> None:
    project(
        SOURCE, 'select = ["MG901"]\nexclude = ["tests/**"]\nper-file-ignores = { "pkg/*.py" = ["MG901"] }\n'
    )
    assert run("check", "--format", "json").json()["findings"] == []
    # an explicitly named file is scanned even when excluded; per-file ignores still apply only to pkg/
    data = run("check", "--format", "json", "tests/t.py").json()
    assert [f["path"] for f in data["findings"]] == ["tests/t.py"]


def test_severity_override_and_exposure_helpers(project, run) -> None:
    project(
        {"a.py": "expose_all(model)\nother(model)\nx = p.main_grad\n"},
        'select = ["MG901", "MG904"]\nexposure-helpers = ["expose_all"]\nseverity = { MG901 = "info" }\n',
    )
    data = run("check", "--format", "json").json()
    by_rule = {f["rule"]: f for f in data["findings"]}
    assert by_rule["MG904"]["message"] == "helper expose_all() called"
    assert by_rule["MG901"]["severity"] == "info"
    assert {r["id"]: r["severity"] for r in data["rules"]}["MG901"] == "info"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ('select = ["MG9999"]\n', "unknown rule code 'MG9999'"),
        ('selct = ["MG901"]\n', "unknown key(s) selct"),
        ('select = "MG901"\n', "select must be a list of strings"),
        ('severity = { MG901 = "fatal" }\n', "severity.MG901 must be"),
        ('per-file-ignores = { "a.py" = ["NOPE1"] }\n', "unknown rule code 'NOPE1'"),
        ("select = [\n", "invalid TOML"),
        ("warn-unused-ignores = 1\n", "warn-unused-ignores must be true or false"),
    ],
)
def test_bad_config_exits_2_with_a_clear_message(project, run, config: str, message: str) -> None:
    project(SOURCE, config)
    result = run("check")
    assert result.code == 2
    assert message in result.err
    assert result.out == ""


def test_unknown_cli_code_exits_2(project, run) -> None:
    project(SOURCE)
    result = run("check", "--select", "XX1")
    assert result.code == 2 and "unknown rule code 'XX1'" in result.err


def test_no_config_uses_working_directory_as_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    config = load_config([Path("sub")])
    assert config.path is None and config.root == tmp_path.resolve()
    with pytest.raises(ConfigError):
        load_config([Path("sub")], tmp_path / "missing.toml")
