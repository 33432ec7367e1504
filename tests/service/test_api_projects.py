"""Projects and tokens: creation, visibility, token format, hashing at rest, revocation, expiry, last use."""

from __future__ import annotations

import datetime as dt

from conftest import ProjectCtx
from fastapi.testclient import TestClient
from sqlalchemy import select, text, update
from svc_helpers import SECRET, admin_headers, unique

from maingrad.service import tokens
from maingrad.service.models import Token


def test_create_project_conflict_and_validation(client: TestClient) -> None:
    name = unique()
    assert client.post("/api/v1/projects", json={"name": name}, headers=admin_headers()).status_code == 201
    dup = client.post("/api/v1/projects", json={"name": name}, headers=admin_headers())
    assert dup.status_code == 409 and dup.json()["code"] == "project_exists"
    for bad in ("", "has space", "-leading", "x" * 101, "a/b", "é"):
        r = client.post("/api/v1/projects", json={"name": bad}, headers=admin_headers())
        assert r.status_code == 422, bad
        assert r.json()["code"] == "validation_failed" and r.json()["errors"]
    r = client.post("/api/v1/projects", json={"name": unique(), "extra": 1}, headers=admin_headers())
    assert r.status_code == 422


def test_project_tokens_see_only_their_project(client: TestClient, project: ProjectCtx) -> None:
    listing = client.get("/api/v1/projects", headers=project.headers("read")).json()
    assert [p["name"] for p in listing["items"]] == [project.name]
    everything = client.get("/api/v1/projects", params={"limit": 500}, headers=admin_headers()).json()
    assert project.name in [p["name"] for p in everything["items"]]
    r = client.post("/api/v1/projects", json={"name": unique()}, headers=project.headers("admin"))
    assert r.status_code == 403 and r.json()["code"] == "insufficient_scope"


def test_token_format_and_storage(client: TestClient, project: ProjectCtx) -> None:
    r = client.post(
        project.url("/tokens"), json={"scopes": ["read"], "name": "ci"}, headers=project.headers("admin")
    )
    assert r.status_code == 201
    body = r.json()
    secret = body["token"]
    assert secret.startswith("mgp_") and len(secret) == 40 and tokens.well_formed(secret)
    assert body["prefix"] == secret[:8] and body["scopes"] == ["read"]
    broken = secret[:-1] + ("A" if secret[-1] != "A" else "B")
    assert not tokens.well_formed(broken)
    r = client.get(project.url(), headers={"Authorization": f"Bearer {broken}"})
    assert r.status_code == 401 and r.json()["code"] == "invalid_token"
    assert r.headers["www-authenticate"].startswith("Bearer")
    # At rest: only the HMAC; the secret appears nowhere in the table.
    db = client.app.state.db  # type: ignore[attr-defined]
    with db.reading() as session:
        row = session.get(Token, body["id"])
        assert row is not None and row.token_hash == tokens.hash_token(secret, SECRET.encode())
        dump = session.execute(text("SELECT * FROM tokens")).all()
    assert all(secret not in str(value) for r_ in dump for value in r_)
    # Listing never shows secrets.
    listing = client.get(project.url("/tokens"), headers=project.headers("admin")).json()
    assert all("token" not in t for t in listing["items"]) and body["id"] in [
        t["id"] for t in listing["items"]
    ]


def test_revocation_expiry_and_last_used(client: TestClient, project: ProjectCtx) -> None:
    created = client.post(
        project.url("/tokens"), json={"scopes": ["read"]}, headers=project.headers("admin")
    ).json()
    hdr = {"Authorization": f"Bearer {created['token']}"}
    assert client.get(project.url(), headers=hdr).status_code == 200
    listing = client.get(project.url("/tokens"), headers=project.headers("admin")).json()["items"]
    assert next(t for t in listing if t["id"] == created["id"])["last_used_at"] is not None
    r = client.delete(project.url(f"/tokens/{created['id']}"), headers=project.headers("admin"))
    assert r.status_code == 200 and r.json()["revoked_at"] is not None
    r = client.get(project.url(), headers=hdr)
    assert r.status_code == 401 and r.json()["code"] == "token_revoked"
    assert client.delete(project.url("/tokens/999999"), headers=project.headers("admin")).status_code == 404

    soon = client.post(
        project.url("/tokens"),
        json={"scopes": ["read"], "expires_in_days": 1},
        headers=project.headers("admin"),
    ).json()
    assert soon["expires_at"] is not None
    assert client.get(project.url(), headers={"Authorization": f"Bearer {soon['token']}"}).status_code == 200
    db = client.app.state.db  # type: ignore[attr-defined]
    with db.writing() as session:
        past = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=1)
        session.execute(update(Token).where(Token.id == soon["id"]).values(expires_at=past))
    r = client.get(project.url(), headers={"Authorization": f"Bearer {soon['token']}"})
    assert r.status_code == 401 and r.json()["code"] == "token_expired"


def test_token_create_validation(client: TestClient, project: ProjectCtx) -> None:
    for body in (
        {"scopes": []},
        {"scopes": ["root"]},
        {"scopes": ["read"], "expires_in_days": 0},
        {"scopes": ["read"], "expires_in_days": 1, "expires_at": "2030-01-01T00:00:00Z"},
    ):
        assert (
            client.post(project.url("/tokens"), json=body, headers=project.headers("admin")).status_code
            == 422
        )


def test_default_branch_update(client: TestClient, project: ProjectCtx) -> None:
    r = client.patch(project.url(), json={"default_branch": "develop"}, headers=project.headers("admin"))
    assert r.status_code == 200 and r.json()["default_branch"] == "develop"
    assert client.get(project.url(), headers=project.headers("read")).json()["default_branch"] == "develop"


def test_token_hash_lookup_is_unique(client: TestClient) -> None:
    db = client.app.state.db  # type: ignore[attr-defined]
    with db.reading() as session:
        hashes = session.execute(select(Token.token_hash)).scalars().all()
    assert len(hashes) == len(set(hashes))
