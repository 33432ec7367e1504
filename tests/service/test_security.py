"""Every endpoint x (no token, malformed, wrong project, wrong scope, revoked, expired) -> 401/403/404;
injection attempts in paths, queries and bodies change nothing."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from conftest import new_project
from fastapi.testclient import TestClient
from sqlalchemy import func, select, update
from svc_helpers import admin_headers, finding, login_nonce, ndjson, record, report, sha

from maingrad.service.models import Alert, Analysis, Project, Record, Run, Token

# (method, path template) -> required scope. Must list every project-scoped API operation.
REQUIRED = {
    ("GET", "/api/v1/projects/{project}"): "read",
    ("PATCH", "/api/v1/projects/{project}"): "admin",
    ("POST", "/api/v1/projects/{project}/tokens"): "admin",
    ("GET", "/api/v1/projects/{project}/tokens"): "admin",
    ("DELETE", "/api/v1/projects/{project}/tokens/{token_id}"): "admin",
    ("POST", "/api/v1/projects/{project}/reports"): "upload",
    ("GET", "/api/v1/projects/{project}/analyses"): "read",
    ("GET", "/api/v1/projects/{project}/analyses/{analysis_id}"): "read",
    ("GET", "/api/v1/projects/{project}/analyses/{analysis_id}/findings"): "read",
    ("GET", "/api/v1/projects/{project}/commits"): "read",
    ("GET", "/api/v1/projects/{project}/gate"): "read",
    ("GET", "/api/v1/projects/{project}/gate/sarif"): "read",
    ("POST", "/api/v1/projects/{project}/runs/{run}/records"): "upload",
    ("POST", "/api/v1/projects/{project}/runs/{run}/end"): "upload",
    ("GET", "/api/v1/projects/{project}/runs"): "read",
    ("GET", "/api/v1/projects/{project}/runs/{run}"): "read",
    ("GET", "/api/v1/projects/{project}/runs/{run}/timeline"): "read",
    ("GET", "/api/v1/projects/{project}/runs/{run}/records"): "read",
    ("GET", "/api/v1/projects/{project}/alerts"): "read",
    ("GET", "/api/v1/projects/{project}/alerts/{alert_id}"): "read",
    ("PATCH", "/api/v1/projects/{project}/alerts/{alert_id}"): "triage",
}
# A token whose scopes do not reach the required one.
TOO_SMALL = {"read": "upload", "upload": "read", "triage": "upload", "admin": "triage"}


def api_operations(client: TestClient) -> set[tuple[str, str]]:
    schema = client.get("/api/v1/openapi.json").json()
    return {
        (method.upper(), path)
        for path, item in schema["paths"].items()
        if path.startswith("/api/v1/projects/")
        for method in item
    }


def test_the_matrix_covers_every_project_endpoint(client: TestClient) -> None:
    assert api_operations(client) == set(REQUIRED)


class Target:
    """A project holding one of everything, so every path parameter names something that exists."""

    def __init__(self, client: TestClient) -> None:
        self.p = new_project(client)
        self.other = new_project(client)
        up = self.p.upload(report(finding()), sha(1))
        self.analysis_id = up.json()["id"]
        client.post(
            self.p.url("/runs/run-1/records"),
            content=ndjson([record("run-1", 0)]),
            headers=self.p.headers("upload"),
        )
        self.alert_id = client.get(self.p.url("/alerts"), headers=self.p.headers("read")).json()["items"][0][
            "id"
        ]
        spare = client.post(self.p.url("/tokens"), json={"scopes": ["read"]}, headers=self.p.headers("admin"))
        self.token_id = spare.json()["id"]  # what DELETE .../tokens/{token_id} may revoke
        revoked = client.post(
            self.p.url("/tokens"), json={"scopes": ["admin"]}, headers=self.p.headers("admin")
        ).json()
        client.delete(self.p.url(f"/tokens/{revoked['id']}"), headers=self.p.headers("admin"))
        expired = client.post(
            self.p.url("/tokens"), json={"scopes": ["admin"]}, headers=self.p.headers("admin")
        ).json()
        with client.app.state.db.writing() as session:  # type: ignore[attr-defined]
            session.execute(
                update(Token)
                .where(Token.id == expired["id"])
                .values(expires_at=dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1))
            )
        self.revoked, self.expired = revoked["token"], expired["token"]

    def request(
        self, client: TestClient, method: str, template: str, token: str | None, project: str | None = None
    ) -> Any:
        path = template.format(
            project=project or self.p.name,
            analysis_id=self.analysis_id,
            alert_id=self.alert_id,
            token_id=self.token_id,
            run="run-1",
        )
        kwargs: dict[str, Any] = {"headers": {"Authorization": f"Bearer {token}"} if token else {}}
        if path.endswith("/gate") or path.endswith("/gate/sarif") or path.endswith("/reports"):
            kwargs["params"] = {"commit_sha": sha(1)}
        if path.endswith("/reports"):
            kwargs["content"] = json.dumps(report()).encode()
        elif path.endswith("/records") and method == "POST":
            kwargs["content"] = ndjson([record("run-1", 99)])
        elif path.endswith("/end") and method == "POST":
            kwargs["json"] = {"rank": 0, "world_size": 1, "records": 1, "lost": 0}
        elif method == "PATCH" and "/alerts/" in path:
            kwargs["json"] = {"state": "dismissed", "reason": "false_positive"}
        elif method == "PATCH":
            kwargs["json"] = {"default_branch": "main"}
        elif method == "POST":
            kwargs["json"] = {"scopes": ["read"]}
        return client.request(method, path, **kwargs)


@pytest.fixture(scope="module")
def target(client: TestClient) -> Target:
    return Target(client)


OPS = sorted(REQUIRED)


@pytest.mark.parametrize(("method", "template"), OPS)
def test_endpoint_access_matrix(client: TestClient, target: Target, method: str, template: str) -> None:
    scope = REQUIRED[(method, template)]
    p = target.p
    cases = {
        "no token": (None, None, 401, "missing_token"),
        "malformed": ("mgp_short", None, 401, "invalid_token"),
        "unknown": ("mgp_" + "A" * 36, None, 401, "invalid_token"),
        "revoked": (target.revoked, None, 401, "token_revoked"),
        "expired": (target.expired, None, 401, "token_expired"),
        "wrong project": (target.other.tokens["all"], None, 404, "project_not_found"),
        "missing project": (p.tokens["all"], "no-such-project", 404, "project_not_found"),
        "wrong scope": (p.tokens[TOO_SMALL[scope]], None, 403, "insufficient_scope"),
    }
    for name, (token, project, status, code) in cases.items():
        r = target.request(client, method, template, token, project)
        assert r.status_code == status, f"{name}: {r.status_code} {r.text}"
        assert r.headers["content-type"].startswith("application/problem+json"), name
        assert r.json()["code"] == code, f"{name}: {r.json()}"
    # And the right scope is enough (admin of another project on this one is still 404, checked above).
    ok = target.request(client, method, template, p.tokens[scope])
    assert ok.status_code < 400, ok.text


def test_instance_endpoints(client: TestClient, target: Target) -> None:
    assert client.get("/api/v1/projects").status_code == 401
    assert (
        client.get("/api/v1/projects", headers={"Authorization": f"Bearer {target.revoked}"}).status_code
        == 401
    )
    assert (
        client.get("/api/v1/projects", headers={"Authorization": f"Bearer {target.expired}"}).status_code
        == 401
    )
    assert client.post("/api/v1/projects", json={"name": "x"}).status_code == 401
    assert (
        client.post("/api/v1/projects", json={"name": "x"}, headers=target.p.headers("admin")).status_code
        == 403
    )


def _state(client: TestClient) -> dict[str, int]:
    with client.app.state.db.reading() as session:  # type: ignore[attr-defined]
        return {
            m.__name__: session.execute(select(func.count()).select_from(m)).scalar_one()
            for m in (Project, Token, Analysis, Alert, Run, Record)
        }


INJECTIONS = [
    "x' OR '1'='1",
    "x'; DROP TABLE projects; --",
    '" OR ""="',
    "../../../etc/passwd",
    "..%2F..%2Fetc%2Fpasswd",
    "%00",
    "x%27%3B%20DROP%20TABLE%20analyses%3B--",
]


@pytest.mark.parametrize("evil", INJECTIONS)
def test_injection_in_project_path_changes_nothing(client: TestClient, target: Target, evil: str) -> None:
    before = _state(client)
    for method, template in OPS:
        r = target.request(client, method, template, target.p.tokens["all"], project=evil)
        assert r.status_code in (404, 405, 422), (method, template, r.status_code)
        r = target.request(client, method, template, None, project=evil)
        assert r.status_code in (401, 404, 405, 422)
    assert _state(client) == before


def test_injection_in_queries_and_bodies_is_data(client: TestClient, target: Target) -> None:
    p = target.p
    evil = "x'); DELETE FROM analyses; --"
    before = _state(client)
    r = client.get(p.url("/gate"), params={"commit_sha": evil}, headers=p.headers("read"))
    assert r.status_code == 422
    r = client.get(p.url("/alerts"), params={"rule": evil}, headers=p.headers("read"))
    assert r.status_code == 200 and r.json()["items"] == []
    r = client.get(p.url("/runs/" + evil), headers=p.headers("read"))
    assert r.status_code == 404
    after = _state(client)
    assert after == before
    # Stored verbatim as data, never executed.
    r = p.upload(report(finding(path=evil, message=evil)), sha(2), params={"category": evil, "branch": evil})
    assert r.status_code == 201 and r.json()["category"] == evil and r.json()["branch"] == evil
    r = client.post(
        p.url("/runs/inj/records"),
        content=ndjson([record("inj", 0, module=evil)]),
        headers=p.headers("upload"),
    )
    assert r.status_code == 200
    assert client.get(p.url("/runs/inj"), headers=p.headers("read")).json()["modules"][0]["key"] == evil
    final = _state(client)
    assert final["Analysis"] == before["Analysis"] + 1 and final["Project"] == before["Project"]


@pytest.mark.parametrize(
    "path",
    ["/static/../service/config.py", "/static/%2e%2e/%2e%2e/pyproject.toml", "/static/..%2f..%2fconfig.py"],
)
def test_static_path_traversal(client: TestClient, path: str) -> None:
    r = client.get(path)
    assert r.status_code == 404
    assert "MAINGRAD" not in r.text and "[project]" not in r.text


def test_login_csrf_is_refused(client: TestClient, target: Target) -> None:
    """Login CSRF: another site posts its own token to /login to sign the visitor in as itself."""
    client.cookies.clear()
    token = target.other.tokens["read"]
    for data, headers in (
        ({"token": token}, {}),  # no nonce at all (a cross-site form carries no Strict cookie)
        ({"token": token, "csrf": "guessed"}, {}),
    ):
        r = client.post("/login", data=data, headers=headers, follow_redirects=False)
        assert r.status_code == 403 and "maingrad_token" not in r.headers.get("set-cookie", ""), r.text
    nonce = login_nonce(client)
    r = client.post(
        "/login",
        data={"token": token, "csrf": nonce},
        headers={"Origin": "https://evil.example"},
        follow_redirects=False,
    )
    assert r.status_code == 403  # the right nonce, but posted from another origin
    client.cookies.clear()
    r = client.post(
        "/login", data={"token": token, "csrf": "guessed"}, headers={"Origin": "null"}, follow_redirects=False
    )
    assert r.status_code == 403  # a sandboxed cross-site form: Origin null and no Strict cookie
    # The dashboard's own form: its no-referrer pages make Chromium send `Origin: null` with the nonce.
    nonce = login_nonce(client)
    r = client.post(
        "/login", data={"token": token, "csrf": nonce}, headers={"Origin": "null"}, follow_redirects=False
    )
    assert r.status_code == 303 and "maingrad_token=" in r.headers["set-cookie"]
    client.cookies.clear()
    nonce = login_nonce(client)
    r = client.post("/login", data={"token": token, "csrf": nonce}, follow_redirects=False)
    assert r.status_code == 303 and "maingrad_token=" in r.headers["set-cookie"]
    client.cookies.clear()


def test_dashboard_requires_login(client: TestClient, target: Target) -> None:
    client.cookies.clear()
    for path in ("/", f"/projects/{target.p.name}", f"/projects/{target.p.name}/runs/run-1"):
        r = client.get(path, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/login"
    client.cookies.clear()
    r = client.post(
        "/login",
        data={"token": target.other.tokens["read"], "csrf": login_nonce(client)},
        follow_redirects=False,
    )
    assert r.status_code == 303
    # The other project's token cannot see this project's pages.
    page = client.get(f"/projects/{target.p.name}")
    assert page.status_code == 404 and page.headers["cache-control"] == "no-store"
    client.cookies.clear()
    r = client.post(
        "/login", data={"token": target.revoked, "csrf": login_nonce(client)}, follow_redirects=False
    )
    assert (
        r.status_code == 200
        and "revoked" in r.text
        and "maingrad_token" not in r.headers.get("set-cookie", "")
    )


def test_admin_env_token_is_compared_not_prefixed(client: TestClient) -> None:
    assert client.get("/api/v1/projects", headers={"Authorization": "Bearer mga_test"}).status_code == 401
    assert client.get("/api/v1/projects", headers=admin_headers()).status_code == 200


def test_nul_characters_are_refused_or_neutralised(client: TestClient, target: Target) -> None:
    p = target.p
    r = client.get(p.url("/runs/a%00b"), headers=p.headers("read"))
    assert r.status_code == 422 and r.json()["code"] == "invalid_character"
    r = client.patch(p.url(), json={"default_branch": "ma\x00in"}, headers=p.headers("admin"))
    assert r.status_code == 422
    # Escaped NULs inside uploaded documents are stored (as U+FFFD), on every backend.
    r = p.upload(report(finding(message="bad\x00byte", path="a\x00.py")), sha(3))
    assert r.status_code == 201, r.text
    r = client.post(
        p.url("/runs/nul/records"),
        content=ndjson([record("nul", 0, module="m\x00")]),
        headers=p.headers("upload"),
    )
    assert r.status_code == 200, r.text
    assert client.get(p.url("/runs/nul"), headers=p.headers("read")).json()["modules"][0]["key"] == "m\ufffd"
