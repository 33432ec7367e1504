"""The analyzer's own reports, in both formats, through the service's gate: JSON and SARIF of the same findings
give the same verdicts, also when the code moved between the baseline and the head.

The analyzer runs for real (`maingrad check`) on a temporary tree; the head tree moves the buggy code 60 lines
down and adds a second copy in a new file, so every verdict has unchanged, new and (none) fixed findings to get
right. Before the fingerprint key was shared (`contracts.sarif`), a JSON baseline and a SARIF head of the same
findings failed the gate with 2 new + 2 fixed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import ProjectCtx
from svc_helpers import sha

from maingrad.cli.main import main
from maingrad.contracts import sarif as contract
from maingrad.contracts.report import Severity

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "buggy_grouped_mlp.py"


def _check(tree: Path, fmt: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    out = tree.parent / f"{tree.name}.{fmt}"
    monkeypatch.chdir(tree)
    assert main(["check", ".", "--format", fmt, "--output", str(out), "--exit-zero"]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict[str, Any]]:
    """(tree, format) -> report, for the base tree and the head tree (code moved, one file added)."""
    root = tmp_path_factory.mktemp("roundtrip")
    source = EXAMPLE.read_text()
    base, head = root / "base", root / "head"
    (base / "pkg").mkdir(parents=True)
    (head / "pkg").mkdir(parents=True)
    (base / "pkg" / "mlp.py").write_text(source)
    # Sixty lines of comments before the code: every finding moves 60 lines down, nothing else changes.
    (head / "pkg" / "mlp.py").write_text("".join(f"# moved {i}\n" for i in range(60)) + source)
    shutil.copy(EXAMPLE, head / "pkg" / "copy.py")
    out: dict[tuple[str, str], dict[str, Any]] = {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        for tree in (base, head):
            for fmt in ("json", "sarif"):
                out[(tree.name, fmt)] = _check(tree, fmt, monkeypatch)
    return out


def _legacy(log: dict[str, Any]) -> dict[str, Any]:
    """The SARIF as analyzers before the shared key wrote it (`maingradFingerprint/v1`)."""
    old = json.loads(json.dumps(log))
    for run in old["runs"]:
        for result in run["results"]:
            value = result["partialFingerprints"].pop(contract.FINGERPRINT_KEY)
            result["partialFingerprints"][contract.LEGACY_FINGERPRINT_KEYS[0]] = value
    return old


def _verdict(gate: dict[str, Any]) -> tuple[Any, ...]:
    summary = gate["summary"]
    return (
        gate["status"],
        summary["new"],
        summary["unchanged"],
        summary["fixed"],
        sorted((f["rule"], f["path"]) for f in gate["new"]),
        sorted((f["rule"], f["path"]) for f in gate["fixed"]),
    )


def test_the_analyzers_findings_move_the_same_in_json_and_sarif(
    project: ProjectCtx, reports: dict[tuple[str, str], dict[str, Any]]
) -> None:
    base_json, head_json = reports[("base", "json")], reports[("head", "json")]
    assert len(base_json["findings"]) == 2 and len(head_json["findings"]) == 4
    moved = {f["fingerprint"]: f["line"] for f in head_json["findings"] if f["path"] == "pkg/mlp.py"}
    assert {
        fp: moved[fp] - f["line"] for f in base_json["findings"] if (fp := f["fingerprint"]) in moved
    } == {f["fingerprint"]: 60 for f in base_json["findings"]}
    head_sarif = reports[("head", "sarif")]
    assert [r["partialFingerprints"] for r in head_sarif["runs"][0]["results"]] == [
        {contract.FINGERPRINT_KEY: f["fingerprint"]} for f in head_json["findings"]
    ]

    verdicts = {}
    for n, (base_fmt, head_fmt) in enumerate(
        [("json", "json"), ("json", "sarif"), ("sarif", "json"), ("sarif", "sarif"), ("json", "legacy")]
    ):
        base_doc = reports[("base", base_fmt)]
        head_doc = _legacy(head_sarif) if head_fmt == "legacy" else reports[("head", head_fmt)]
        base_sha, head_sha = sha(f"rt-base-{n}"), sha(f"rt-head-{n}")
        assert project.upload(base_doc, base_sha, branch="main").status_code in (200, 201)
        assert project.upload(head_doc, head_sha, branch="feature").status_code in (200, 201)
        verdicts[(base_fmt, head_fmt)] = _verdict(project.gate(head_sha, base=base_sha))
    # The moved findings are unchanged, the copies new (errors: the gate fails), nothing fixed; in every pairing.
    expected = ("fail", 2, 2, 0, [("MG001", "pkg/copy.py"), ("MG003", "pkg/copy.py")], [])
    assert verdicts == dict.fromkeys(verdicts, expected)


def test_sarif_names_no_local_path(reports: dict[tuple[str, str], dict[str, Any]], tmp_path: Path) -> None:
    for tree in ("base", "head"):
        text = json.dumps(reports[(tree, "sarif")])
        run = reports[(tree, "sarif")]["runs"][0]
        assert "file://" not in text and "/tmp" not in text and str(tmp_path.parent) not in text
        assert run["originalUriBaseIds"] == contract.original_uri_base_ids()
        assert "helpUri" not in text and "informationUri" not in text
        for result in run["results"]:
            location = result["locations"][0]["physicalLocation"]["artifactLocation"]
            assert location["uriBaseId"] == contract.SRCROOT and not location["uri"].startswith("/")


def test_the_service_serves_a_json_upload_as_the_analyzers_own_sarif(
    project: ProjectCtx, reports: dict[tuple[str, str], dict[str, Any]]
) -> None:
    """One finding -> SARIF result mapping (`contracts.sarif.result`): what the service stores for a JSON upload
    and serves back as SARIF is, result for result, what the analyzer writes as SARIF."""
    uploaded = project.upload(reports[("head", "json")], sha("rt-served"), branch="main")
    assert uploaded.status_code in (200, 201), uploaded.text
    served = project.client.get(
        project.url(f"/analyses/{uploaded.json()['id']}"),
        headers=project.headers("read", Accept="application/sarif+json"),
    ).json()
    (run,) = served["runs"]
    own = reports[("head", "sarif")]["runs"][0]["results"]
    assert len(run["results"]) == len(own) == 4
    for got, want in zip(run["results"], own, strict=True):
        assert got["partialFingerprints"].pop("maingrad/alert")  # the service's own alert identity, added
        assert {k: v for k, v in want.items() if k != "ruleIndex"} == got
    levels = {d["id"]: d["defaultConfiguration"]["level"] for d in run["tool"]["driver"]["rules"]}
    assert levels["MG001"] == contract.LEVELS[Severity.ERROR] == "error"
    assert "helpUri" not in json.dumps(served) and "informationUri" not in json.dumps(served)
