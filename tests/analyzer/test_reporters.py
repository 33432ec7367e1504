"""Every output format: text (ruff-like, source context, statistics, colour), JSON, SARIF, GitHub."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from maingrad.analyzer.reporters.github import escape_data, escape_property
from maingrad.contracts.report import Report

pytestmark = pytest.mark.usefixtures("test_rules")

FILES = {
    "pkg/a.py": "def f(p):\n    x = p.main_grad\n    bad_call()\n",
    "pkg/b.py": "y = q.main_grad\n",
    "pkg/broken.py": "p.main_grad(\n",
}


def test_text_format(project, run) -> None:
    project(FILES)
    result = run("check", "--concise")
    assert result.code == 1
    lines = result.out.splitlines()
    assert lines == [
        "pkg/a.py:2:9: MG901 error [*] `p.main_grad` is used",
        "pkg/a.py:3:5: MG902 warning bad_call() is called",  # an unsafe fix: not applied by `maingrad fix`
        "pkg/b.py:1:5: MG901 error [*] `q.main_grad` is used",
        "pkg/broken.py:1:12: MG999 syntax error: '(' was never closed",  # the interpreter's words
        "Found 3 findings (2 errors, 1 warning) in 3 files; 1 file was not analyzed (MG999).",
        "[*] 2 fixable with `maingrad fix` (1 hidden fix can be enabled with `--unsafe-fixes`).",
    ]
    assert "\033[" not in result.out  # never colour when not a terminal
    assert result.err == ""
    unsafe = run("check", "--unsafe-fixes", "--concise").out.splitlines()
    assert "pkg/a.py:3:5: MG902 warning [*] bad_call() is called" in unsafe
    assert unsafe[-1] == "[*] 3 fixable with `maingrad fix`."


def test_quiet_statistics_and_show_source(project, run) -> None:
    project(FILES)
    assert run("check", "--quiet").out.splitlines()[-1].startswith("pkg/broken.py:1:12: MG999 syntax error")
    stats = run("check", "--statistics", "--quiet").out.splitlines()
    assert stats == [
        "2\tMG901\t[*] test-main-grad-attribute",
        "1\tMG902\t[ ] test-bad-call",
        "1\tMG999\t[ ] not-analyzed",
    ]
    shown = run("check", "--quiet", "--select", "MG902").out  # the code frame is the default
    assert shown.splitlines()[:8] == [
        "pkg/a.py:3:5: MG902 warning bad_call() is called",
        "  |",
        "2 |     x = p.main_grad",
        "3 |     bad_call()",
        "  |     ^^^^^^^^^^ MG902",
        "  |",
        "  = help: see `maingrad explain MG902`",
        "",
    ]
    assert run("check", "--show-source", "--quiet", "--select", "MG902").out == shown


def test_long_messages_split_into_a_headline_and_detail() -> None:
    from maingrad.analyzer.reporters.text import split_message

    message = (
        "truth value of tensor `p.main_grad` is taken; test presence with `p.main_grad is None` / "
        "`p.main_grad is not None` (a multi-element tensor raises, a zero one reads as missing)"
    )
    head, detail = split_message(message)
    assert head == "truth value of tensor `p.main_grad` is taken"
    assert detail.startswith("test presence with `p.main_grad is None`") and detail.endswith("missing)")
    # Boundaries inside backquotes never split, short messages stay whole.
    assert split_message("`a; b. c: d` is a long piece of code quoted in a message")[1] == ""
    assert split_message("short; message") == ("short; message", "")


def test_fail_on_matches_the_gate_default(project, run) -> None:
    from maingrad.contracts.report import DEFAULT_FAIL_ON
    from maingrad.service.config import Settings

    assert Settings().gate_fail_severity == DEFAULT_FAIL_ON.value == "error"
    project({"pkg/a.py": "def f():\n    bad_call()\n"})  # MG902: a warning only
    result = run("check", "--concise")
    assert result.code == 0, result.out  # the gate passes a warning-only report: so does check
    assert "None at or above --fail-on error: exit status 0." in result.out
    assert run("check", "--fail-on", "warning").code == 1
    assert run("check", "--fail-on", "info").code == 1
    project({"pkg/a.py": "def f(p):\n    x = p.main_grad\n"})  # MG901: an error
    assert run("check").code == 1 and run("check", "--exit-zero").code == 0


def test_no_python_file_is_a_usage_error(project, run) -> None:
    project({"notes.txt": "no python here\n"})
    result = run("check")
    assert result.code == 2 and result.out == ""
    assert (
        result.err.startswith("maingrad: error: no Python file to check in")
        and len(result.err.splitlines()) == 1
    )
    # pre-commit naming only files the project excludes (--force-exclude): nothing to do, not an error
    project({"gen/a.py": "x = p.main_grad\n"}, 'select = ["MG90"]\nexclude = ["gen/"]\n')
    excluded = run("check", "--force-exclude", "gen/a.py")
    assert excluded.code == 0 and "excluded" in excluded.err
    assert run("check", "gen/a.py").code == 1  # named without --force-exclude: checked


def test_colour_only_when_forced_or_on_a_terminal(project, run, monkeypatch: pytest.MonkeyPatch) -> None:
    project(FILES)
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert "\033[" in run("check").out
    monkeypatch.setenv("NO_COLOR", "1")
    assert "\033[" not in run("check").out


def test_output_file(project, run, tmp_path: Path) -> None:
    project(FILES)
    target = tmp_path / "report.json"
    result = run("check", "--format", "json", "--output", target)
    assert result.code == 1 and result.out == ""
    report = Report.from_json(target.read_text())
    assert [f.path for f in report.findings] == ["pkg/a.py", "pkg/a.py", "pkg/b.py"]
    assert report.parse_errors[0].path == "pkg/broken.py"
    assert report.files_scanned == 3 and report.files_parsed == 2


# What GitHub code scanning requires of an uploaded SARIF file (docs: "SARIF support for code scanning").
# No installed package ships the OASIS SARIF 2.1.0 schema, so these are the fields GitHub reads.
GITHUB_SARIF = {
    "type": "object",
    "required": ["version", "runs", "$schema"],
    "properties": {
        "version": {"const": "2.1.0"},
        "runs": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["tool", "results"],
                "properties": {
                    "tool": {
                        "type": "object",
                        "required": ["driver"],
                        "properties": {
                            "driver": {
                                "type": "object",
                                "required": ["name", "rules"],
                                "properties": {
                                    "name": {"type": "string"},
                                    "rules": {
                                        "type": "array",
                                        "items": {
                                            "type": "object",
                                            "required": [
                                                "id",
                                                "shortDescription",
                                                "fullDescription",
                                                "help",
                                                "defaultConfiguration",
                                            ],
                                            "properties": {
                                                "help": {"type": "object", "required": ["text"]},
                                                "defaultConfiguration": {
                                                    "properties": {
                                                        "level": {
                                                            "enum": ["none", "note", "warning", "error"]
                                                        }
                                                    }
                                                },
                                            },
                                        },
                                    },
                                },
                            }
                        },
                    },
                    "results": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["ruleId", "message", "locations", "partialFingerprints"],
                            "properties": {
                                "ruleId": {"type": "string"},
                                "ruleIndex": {"type": "integer", "minimum": 0},
                                "level": {"enum": ["none", "note", "warning", "error"]},
                                "message": {"type": "object", "required": ["text"]},
                                "partialFingerprints": {
                                    "type": "object",
                                    "additionalProperties": {"type": "string"},
                                },
                                "locations": {
                                    "type": "array",
                                    "minItems": 1,
                                    "maxItems": 10,
                                    "items": {
                                        "type": "object",
                                        "required": ["physicalLocation"],
                                        "properties": {
                                            "physicalLocation": {
                                                "type": "object",
                                                "required": ["artifactLocation", "region"],
                                                "properties": {
                                                    "artifactLocation": {
                                                        "type": "object",
                                                        "required": ["uri"],
                                                        "properties": {
                                                            "uri": {"type": "string", "pattern": "^[^/]"}
                                                        },
                                                    },
                                                    "region": {
                                                        "type": "object",
                                                        "required": ["startLine"],
                                                        "properties": {
                                                            "startLine": {"type": "integer", "minimum": 1},
                                                            "startColumn": {"type": "integer", "minimum": 1},
                                                            "endLine": {"type": "integer", "minimum": 1},
                                                            "endColumn": {"type": "integer", "minimum": 1},
                                                        },
                                                    },
                                                },
                                            }
                                        },
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def test_sarif(project, run) -> None:
    root = project(FILES)
    sarif = run("check", "--format", "sarif").json()
    jsonschema.validate(sarif, GITHUB_SARIF)
    (run_,) = sarif["runs"]
    rules = run_["tool"]["driver"]["rules"]
    for result in run_["results"]:
        assert rules[result["ruleIndex"]]["id"] == result["ruleId"]
        location = result["locations"][0]["physicalLocation"]
        assert location["artifactLocation"]["uriBaseId"] == "%SRCROOT%"
    first = run_["results"][0]
    assert first["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == "pkg/a.py"
    assert first["locations"][0]["physicalLocation"]["region"]["snippet"]["text"] == "    x = p.main_grad"
    # Relative URIs only: the base is named, never located (the file must not carry the checkout's path).
    assert "uri" not in run_["originalUriBaseIds"]["%SRCROOT%"]
    assert str(root.resolve()) not in json.dumps(sarif) and "file:" not in json.dumps(sarif)
    assert {r["id"] for r in rules} == {"MG901", "MG902", "MG903", "MG904", "MG999"}
    # Help is the docs `maingrad explain` prints, shipped in the package; no link to a location not verified.
    assert all("helpUri" not in r and "What it does" in r["help"]["markdown"] for r in rules)
    notes = run_["invocations"][0]["toolExecutionNotifications"]
    assert [n["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] for n in notes] == [
        "pkg/broken.py"
    ]
    assert notes[0]["descriptor"]["id"] == "MG999" and notes[0]["properties"]["kind"] == "syntax"
    assert run_["invocations"][0]["executionSuccessful"] is True  # only a failing rule makes it false
    (unanalyzed,) = [r for r in run_["results"] if r["ruleId"] == "MG999"]  # an alert, not only a note
    assert unanalyzed["level"] == "error"
    assert unanalyzed["locations"][0]["physicalLocation"]["region"]["startLine"] == 1

    # Fingerprints do not depend on line numbers: move the code down, keep the identity.
    a = root / "pkg" / "a.py"
    a.write_text("\n\n\n" + a.read_text())
    moved = run("check", "--format", "sarif").json()["runs"][0]["results"]
    assert [r["partialFingerprints"] for r in moved] == [r["partialFingerprints"] for r in run_["results"]]
    assert moved[0]["locations"][0]["physicalLocation"]["region"]["startLine"] == 5


def test_github_annotations(project, run) -> None:
    project(FILES)
    lines = run("check", "--format", "github").out.splitlines()
    assert lines[0] == (
        "::error file=pkg/a.py,line=2,col=9,endLine=2,endColumn=20,title=MG901 test-main-grad-attribute"
        "::MG901 `p.main_grad` is used"
    )
    assert lines[1].startswith("::warning file=pkg/a.py,line=3,col=5,")
    assert lines[-1].startswith("::error file=pkg/broken.py,line=1,col=12,title=MG999 not-analyzed::MG999 ")
    assert escape_data("50%\nx") == "50%25%0Ax"
    assert escape_property("a:b,c") == "a%3Ab%2Cc"


def test_json_round_trips_through_the_report_model(project, run) -> None:
    project(FILES)
    text = run("check", "--format", "json").out
    assert json.loads(Report.from_json(text).to_json()) == json.loads(text)


def test_streamed_formats_equal_the_whole_text(project, run, tmp_path: Path) -> None:
    """The CLI writes reports piece by piece; the bytes are those of the one-string renderers."""
    from maingrad.analyzer.reporters import OutputOptions, iter_render, render

    project(FILES)
    out = run("check", "--format", "json").out
    report = Report.from_json(out)
    assert out == report.to_json(indent=2) + "\n"
    options = OutputOptions(root=tmp_path)
    for fmt in ("text", "json", "github", "sarif"):
        assert "".join(iter_render(fmt, report, options)) == render(fmt, report, options)
    empty = Report(tool_version="0")
    assert "".join(iter_render("json", empty, options)) == empty.to_json(indent=2) + "\n"
