"""The CI gate: statuses, baseline choice, matching passes, triage, runtime anomalies and SARIF out."""

from __future__ import annotations

from typing import Any

from conftest import ProjectCtx
from svc_helpers import finding, ndjson, record, report, sarif, sarif_result, sha

from maingrad.contracts.records import end_marker

MG001 = finding()
MG003 = finding(
    rule="MG003", path="megatron/core/optimizer/clip.py", line=50, snippet="if p.main_grad:", severity="error"
)
WARN = finding(
    rule="MG006",
    path="megatron/core/fsdp.py",
    line=7,
    snippet="p.overwrite_main_grad = True",
    severity="warning",
)


def test_pending_until_something_arrives(project: ProjectCtx) -> None:
    gate = project.gate(sha("nothing"))
    assert gate["status"] == "pending" and gate["analyses"] == [] and gate["reason"]


def test_no_baseline_makes_every_finding_new(project: ProjectCtx) -> None:
    project.upload(report(MG001, WARN), sha(1), branch="feature")
    gate = project.gate(sha(1))
    assert gate["status"] == "fail"
    assert gate["baseline"] == {"commit_sha": None, "how": "none", "branch": None, "analysis_ids": []}
    assert gate["summary"]["new"] == 2 and gate["summary"]["new_failing"] == 1
    cond = {c["name"]: c for c in gate["conditions"]}
    assert cond["new_findings"]["actual"] == 1 and cond["new_findings"]["passed"] is False
    assert cond["runtime_anomalies"]["actual"] == 0 and cond["runtime_anomalies"]["passed"] is True
    assert [f["rule"] for f in gate["new"]] == ["MG001", "MG006"]  # errors first
    assert gate["new"][0]["snippet"] == MG001["snippet"]


def test_warnings_alone_pass(project: ProjectCtx) -> None:
    project.upload(report(WARN), sha(2))
    assert project.gate(sha(2))["status"] == "pass"


def test_default_branch_baseline_new_unchanged_fixed(project: ProjectCtx) -> None:
    project.upload(report(MG001, MG003), sha(10), branch="main")
    # The next commit fixes MG001, keeps MG003 and adds a new error.
    new_err = finding(
        rule="MG002",
        path="megatron/core/tensor_parallel/layers.py",
        line=300,
        snippet="wgrad_gemm_accum_fp32(x, y, w.main_grad)",
    )
    project.upload(report(MG003, new_err), sha(11), branch="feature")
    gate = project.gate(sha(11))
    assert gate["baseline"]["commit_sha"] == sha(10) and gate["baseline"]["how"] == "default_branch"
    assert [f["rule"] for f in gate["new"]] == ["MG002"]
    assert [f["rule"] for f in gate["unchanged"]] == ["MG003"] and gate["unchanged"][0][
        "match"
    ] == "fingerprint"
    assert [f["rule"] for f in gate["fixed"]] == ["MG001"]
    assert gate["status"] == "fail"
    # Explicit base wins over the default branch.
    explicit = project.gate(sha(11), base=sha(11))
    assert explicit["baseline"]["how"] == "explicit" and explicit["summary"]["new"] == 0
    assert explicit["status"] == "pass"


def test_baseline_is_the_latest_default_branch_analysis_before_this_one(project: ProjectCtx) -> None:
    project.upload(report(MG001), sha(20), branch="main")
    project.upload(report(MG001, MG003), sha(21), branch="main")
    project.upload(report(MG001, MG003), sha(22), branch="topic")
    assert project.gate(sha(22))["baseline"]["commit_sha"] == sha(21)
    assert project.gate(sha(21))["baseline"]["commit_sha"] == sha(20)
    assert project.gate(sha(20))["baseline"]["how"] == "none"
    project.client.patch(project.url(), json={"default_branch": "topic"}, headers=project.headers("admin"))
    assert project.gate(sha(22))["baseline"]["how"] == "none"


def test_moved_code_is_not_new(project: ProjectCtx) -> None:
    # Same code moved 200 lines down: fingerprint does not depend on lines.
    project.upload(report(MG001), sha(30), branch="main")
    project.upload(report(finding(line=210)), sha(31), branch="x")
    gate = project.gate(sha(31))
    assert gate["summary"]["new"] == 0 and gate["unchanged"][0]["match"] == "fingerprint"
    # Context edited but same rule, path and message two lines away: the nearby pass.
    project.upload(
        report(finding(line=12, snippet="ops.GroupedLinear(accumulate_into_main_grad=fuse)")),
        sha(32),
        branch="x",
    )
    gate = project.gate(sha(32), base=sha(30))
    assert gate["summary"]["new"] == 0 and gate["unchanged"][0]["match"] == "nearby"
    # Far away and edited: really new (and the old one fixed).
    project.upload(report(finding(line=400, snippet="totally_different()")), sha(33), branch="x")
    gate = project.gate(sha(33), base=sha(30))
    assert gate["summary"]["new"] == 1 and gate["summary"]["fixed"] == 1
    # File renamed, same code: the rename pass.
    renamed = finding(path="megatron/core/transformer/moe/grouped_experts.py")
    project.upload(report(renamed), sha(34), branch="x")
    gate = project.gate(sha(34), base=sha(30))
    assert gate["summary"]["new"] == 0 and gate["unchanged"][0]["match"] == "renamed"
    assert gate["unchanged"][0]["base_path"] == MG001["path"]


def test_sarif_suppression_keeps_the_gate_green(project: ProjectCtx) -> None:
    log = sarif(sarif_result(level="error", suppressions=[{"kind": "inSource", "justification": "known"}]))
    project.upload(log, sha(40))
    gate = project.gate(sha(40))
    assert gate["status"] == "pass" and gate["summary"]["suppressed"] == 1 and gate["summary"]["new"] == 0


def test_dismissed_alert_does_not_fail_the_gate(project: ProjectCtx) -> None:
    project.upload(report(MG001), sha(50), branch="topic")
    assert project.gate(sha(50))["status"] == "fail"
    alert = project.client.get(project.url("/alerts"), headers=project.headers("read")).json()["items"][0]
    r = project.client.patch(
        project.url(f"/alerts/{alert['id']}"),
        json={"state": "dismissed", "reason": "false_positive", "comment": "DDP only"},
        headers=project.headers("triage"),
    )
    assert r.status_code == 200, r.text
    gate = project.gate(sha(50))  # recomputed on read
    assert (
        gate["status"] == "pass" and gate["new"][0]["dismissed"] is True and gate["summary"]["dismissed"] == 1
    )


def test_runtime_anomalies_fail_the_gate(project: ProjectCtx) -> None:
    commit = sha(60)
    project.upload(report(), commit)
    recs = [record("run-a", i, commit=commit) for i in range(20)]
    recs[5]["anomaly"] = "main_grad is None at forward under FSDP"
    r = project.client.post(
        project.url("/runs/run-a/records"), content=ndjson(recs), headers=project.headers("upload")
    )
    assert r.status_code == 200, r.text
    gate = project.gate(commit)
    assert (
        gate["status"] == "fail"
        and gate["runtime"]["anomalies"] == 1
        and gate["runtime"]["runs"] == ["run-a"]
    )
    assert gate["runtime"]["samples"][0]["anomaly"].startswith("main_grad is None")
    cond = {c["name"]: c for c in gate["conditions"]}
    assert cond["runtime_anomalies"]["passed"] is False and cond["new_findings"]["passed"] is True


def _gate(project: ProjectCtx, commit: str, *require: str) -> dict[str, Any]:
    params = {"commit_sha": commit, "require": list(require)}
    response = project.client.get(project.url("/gate"), params=params, headers=project.headers("read"))
    assert response.status_code == 200, response.text
    return response.json()


def _end(project: ProjectCtx, run: str, commit: str) -> None:
    r = project.client.post(
        project.url(f"/runs/{run}/end"),
        params={"commit_sha": commit},
        json=end_marker(run, 0, 1, 10, 0),
        headers=project.headers("upload"),
    )
    assert r.status_code == 200 and r.json()["complete"], r.text


def test_runtime_only_commit_is_neutral_and_raised_action_counts(project: ProjectCtx) -> None:
    clean = [record("run-b", i) for i in range(10)]
    project.client.post(
        project.url("/runs/run-b/records"),
        params={"commit_sha": sha(70)},
        content=ndjson(clean),
        headers=project.headers("upload"),
    )
    assert project.gate(sha(70))["status"] == "pending"  # the run has not said it ended
    _end(project, "run-b", sha(70))
    assert project.gate(sha(70))["status"] == "neutral"
    raised = [record("run-c", 0, action="raised")]
    project.client.post(
        project.url("/runs/run-c/records"),
        params={"commit_sha": sha(71)},
        content=ndjson(raised),
        headers=project.headers("upload"),
    )
    gate = project.gate(sha(71))
    assert gate["status"] == "fail" and gate["runtime"]["samples"][0]["anomaly"] == "action:raised"


def test_failed_tool_run_is_error(project: ProjectCtx) -> None:
    log = sarif(sarif_result(), invocations=[{"executionSuccessful": False}])
    project.upload(log, sha(80))
    gate = project.gate(sha(80))
    assert gate["status"] == "error" and "othertool" in gate["reason"]


def test_explicit_base_without_analysis_is_pending(project: ProjectCtx) -> None:
    project.upload(report(), sha(90))
    gate = project.gate(sha(90), base=sha(91))
    assert gate["status"] == "pending" and sha(91) in gate["reason"]


def test_empty_scan_is_neutral(project: ProjectCtx) -> None:
    project.upload(report(files_scanned=0), sha(95))
    assert project.gate(sha(95))["status"] == "neutral"


def test_gate_sarif_holds_only_new_results(project: ProjectCtx) -> None:
    project.upload(report(MG001), sha(100), branch="main")
    project.upload(report(MG001, MG003), sha(101), branch="feature")
    r = project.client.get(
        project.url("/gate/sarif"), params={"commit_sha": sha(101)}, headers=project.headers("read")
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/sarif+json")
    log = r.json()
    assert log["version"] == "2.1.0"
    results = [res for run in log["runs"] for res in run["results"]]
    assert [res["ruleId"] for res in results] == ["MG003"]
    assert results[0]["partialFingerprints"]["maingrad/alert"]


def test_categories_are_compared_within_themselves(project: ProjectCtx) -> None:
    project.upload(report(MG001), sha(110), branch="main")
    project.upload(sarif(sarif_result(level="error")), sha(110), branch="main")
    project.upload(report(MG001), sha(111), branch="feature")  # only the maingrad category this time
    # Nothing required: the gate waits for what main received last (both categories); the other tool's
    # report may still land with a failure.
    waiting = project.gate(sha(111))
    assert waiting["status"] == "pending" and waiting["evidence"]["missing"] == ["othertool"]
    assert waiting["evidence"]["source"] == "default_branch"
    gate = _gate(project, sha(111), "maingrad")  # the call asks for the maingrad analysis only
    assert gate["summary"] == {
        "new": 0,
        "new_failing": 0,
        "unchanged": 1,
        "fixed": 0,
        "suppressed": 0,
        "dismissed": 0,
    }
    assert gate["status"] == "pass"


def test_reused_answers_follow_every_change(project: ProjectCtx) -> None:
    """Answers are reused only while their inputs are unchanged: each change below shows at once."""
    cache = project.client.app.state.gate_cache  # type: ignore[attr-defined]
    project.upload(report(MG001), sha(200), branch="main")
    project.upload(report(MG001, MG003), sha(201), branch="feature")
    first = project.gate(sha(201))
    hits = cache.hits
    assert project.gate(sha(201)) == first and cache.hits == hits + 1  # nothing changed: reused
    assert first["status"] == "fail" and [f["rule"] for f in first["new"]] == ["MG003"]

    alert = next(
        a
        for a in project.client.get(project.url("/alerts"), headers=project.headers("read")).json()["items"]
        if a["rule"] == "MG003"
    )
    url = project.url(f"/alerts/{alert['id']}")
    project.client.patch(
        url, json={"state": "dismissed", "reason": "wont_fix"}, headers=project.headers("triage")
    )
    assert project.gate(sha(201))["status"] == "pass"  # triage
    project.client.patch(url, json={"state": "open"}, headers=project.headers("triage"))
    assert project.gate(sha(201))["status"] == "fail"  # reopened

    project.upload(report(MG001), sha(201), branch="feature")  # replaced by a clean report
    assert project.gate(sha(201))["status"] == "pass"
    recs = [record("late-run", i, commit=sha(201)) for i in range(4)]
    project.client.post(
        project.url("/runs/late-run/records"), content=ndjson(recs), headers=project.headers("upload")
    )
    assert project.gate(sha(201))["runtime"]["records"] == 4  # new records
    bad = [record("late-run", 9, commit=sha(201), anomaly="main_grad_none")]
    project.client.post(
        project.url("/runs/late-run/records"), content=ndjson(bad), headers=project.headers("upload")
    )
    assert project.gate(sha(201))["status"] == "fail"  # a runtime anomaly

    project.client.patch(project.url(), json={"default_branch": "feature"}, headers=project.headers("admin"))
    assert project.gate(sha(201))["baseline"]["how"] == "none"  # the default branch moved


def test_files_not_analyzed_fail_the_gate_in_both_formats(project: ProjectCtx) -> None:
    """A report that says a file could not be analyzed (maingrad's MG999) never passes, even with no finding:
    the verdict would cover code nobody read. The same holds for SARIF's error-level tool notifications."""
    body = report()
    body["parse_errors"] = [
        {
            "path": "src/broken.py",
            "message": "'(' was never closed",
            "line": 3,
            "column": 12,
            "kind": "syntax",
        }
    ]
    project.upload(body, sha("na1"))
    gate = project.gate(sha("na1"))
    cond = {c["name"]: c for c in gate["conditions"]}
    assert gate["status"] == "fail" and cond["all_analyzed"] == {
        **cond["all_analyzed"],
        "actual": 1,
        "passed": False,
    }
    assert gate["analyses"][0]["not_analyzed"] == 1 and gate["analyses"][0]["execution_successful"] is True

    note = {"level": "error", "message": {"text": "src/x.py: cannot decode"}}
    project.upload(
        sarif(invocations=[{"executionSuccessful": True, "toolExecutionNotifications": [note]}]), sha("na2")
    )
    # (Each commit here carries one tool's analysis, so the call names it: with nothing required, the gate
    # would wait for the maingrad analysis the default branch received last.)
    assert _gate(project, sha("na2"), "othertool")["status"] == "fail"

    warning = {**note, "level": "warning"}  # a warning says nothing was left out
    project.upload(
        sarif(invocations=[{"executionSuccessful": True, "toolExecutionNotifications": [warning]}]),
        sha("na3"),
    )
    assert _gate(project, sha("na3"), "othertool")["status"] == "pass"

    clean = report()
    project.upload(clean, sha("na4"))
    assert _gate(project, sha("na4"), "maingrad")["status"] == "pass"


def test_an_internal_error_of_the_analyzer_is_a_failed_tool_run(project: ProjectCtx) -> None:
    body = report()
    body["parse_errors"] = [{"path": "src/a.py", "message": "MG003 crashed: KeyError", "kind": "internal"}]
    project.upload(body, sha("na5"))
    gate = project.gate(sha("na5"))
    assert gate["status"] == "error" and gate["analyses"][0]["execution_successful"] is False
