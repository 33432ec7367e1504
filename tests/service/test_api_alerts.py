"""Alerts: one per fingerprint per project, their lifecycle across uploads, audited triage, pagination."""

from __future__ import annotations

from conftest import ProjectCtx
from svc_helpers import finding, report, sha


def alerts(project: ProjectCtx, **params: str) -> list[dict]:  # type: ignore[type-arg]
    return project.client.get(project.url("/alerts"), params=params, headers=project.headers("read")).json()[
        "items"
    ]


def test_one_alert_per_fingerprint_and_default_branch_lifecycle(project: ProjectCtx) -> None:
    a, b = finding(), finding(rule="MG003", line=9, snippet="if p.main_grad:")
    project.upload(report(a, b), sha(1), branch="main")
    project.upload(report(a, b), sha(2), branch="feature")  # same findings again: still two alerts
    items = alerts(project)
    assert len(items) == 2 and {i["state"] for i in items} == {"open"}
    assert {i["first_seen_commit"] for i in items} == {sha(1)} and {i["last_seen_commit"] for i in items} == {
        sha(2)
    }
    # The default branch drops MG003: its alert is fixed; MG001 stays open.
    project.upload(report(a), sha(3), branch="main")
    states = {i["rule"]: i for i in alerts(project)}
    assert states["MG003"]["state"] == "fixed" and states["MG003"]["fixed_commit"] == sha(3)
    assert states["MG001"]["state"] == "open"
    # It comes back: open again.
    project.upload(report(a, b), sha(4), branch="main")
    assert {i["rule"]: i["state"] for i in alerts(project)} == {"MG001": "open", "MG003": "open"}
    assert [i["rule"] for i in alerts(project, state="open", rule="MG003")] == ["MG003"]


def test_triage_is_audited_and_needs_a_reason(project: ProjectCtx) -> None:
    project.upload(report(finding()), sha(10))
    alert = alerts(project)[0]
    url = project.url(f"/alerts/{alert['id']}")
    r = project.client.patch(url, json={"state": "dismissed"}, headers=project.headers("triage"))
    assert r.status_code == 422 and r.headers["content-type"].startswith("application/problem+json")
    r = project.client.patch(
        url,
        json={"state": "dismissed", "reason": "wont_fix", "comment": "upstream"},
        headers=project.headers("triage"),
    )
    assert (
        r.status_code == 200
        and r.json()["state"] == "dismissed"
        and r.json()["dismissed_reason"] == "wont_fix"
    )
    assert r.json()["dismissed_by"].startswith("token:")
    # A dismissed alert stays dismissed when the finding shows up again.
    project.upload(report(finding()), sha(11), branch="main")
    assert alerts(project)[0]["state"] == "dismissed"
    r = project.client.patch(url, json={"state": "open"}, headers=project.headers("triage"))
    detail = project.client.get(url, headers=project.headers("read")).json()
    assert r.status_code == 200 and detail["state"] == "open" and detail["dismissed_reason"] is None
    assert [(e["from_state"], e["to_state"], e["reason"]) for e in detail["events"]] == [
        ("open", "dismissed", "wont_fix"),
        ("dismissed", "open", None),
    ]
    assert detail["events"][0]["comment"] == "upstream"


def test_alert_pagination_and_404(project: ProjectCtx) -> None:
    project.upload(report(*[finding(line=i, snippet=f"call_{i}()") for i in range(7)]), sha(20))
    ids = [i["id"] for i in project.every_item("/alerts", limit=3)]
    assert len(ids) == 7 and ids == sorted(ids, reverse=True)
    r = project.client.get(project.url("/alerts/999999"), headers=project.headers("read"))
    assert r.status_code == 404 and r.json()["code"] == "alert_not_found"
