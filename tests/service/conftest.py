"""Service test fixtures: the same suite on SQLite and, when MAINGRAD_TEST_POSTGRES_URL is set, PostgreSQL.

Each PostgreSQL session gets a fresh schema (dropped at the end), selected through the connection's
search_path, so concurrent test runs on one database never see each other. No database is ever mocked.
"""

from __future__ import annotations

import os
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

with warnings.catch_warnings():  # starlette's notice about httpx2; irrelevant to these tests
    warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient`")
    from fastapi.testclient import TestClient
from svc_helpers import ADMIN, SECRET, admin_headers, unique

from maingrad.service.app import create_app
from maingrad.service.config import Settings

PG_URL = os.environ.get("MAINGRAD_TEST_POSTGRES_URL")
BACKENDS = [
    "sqlite",
    pytest.param(
        "postgres", marks=pytest.mark.skipif(not PG_URL, reason="MAINGRAD_TEST_POSTGRES_URL is not set")
    ),
]


def _pg_admin_url(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def make_pg_schema() -> tuple[str, str]:
    """(sqlalchemy url bound to a fresh schema, schema name)."""
    import psycopg

    assert PG_URL
    schema = f"mgtest_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(_pg_admin_url(PG_URL), autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    sep = "&" if "?" in PG_URL else "?"
    return f"{PG_URL}{sep}options={quote(f'-csearch_path={schema}')}", schema


def drop_pg_schema(schema: str) -> None:
    import psycopg

    assert PG_URL
    with psycopg.connect(_pg_admin_url(PG_URL), autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@contextmanager
def pg_schema_url() -> Iterator[str]:
    """The URL of a fresh PostgreSQL schema, dropped afterwards."""
    url, schema = make_pg_schema()
    try:
        yield url
    finally:
        drop_pg_schema(schema)


@pytest.fixture(scope="session", params=BACKENDS)
def database_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('db') / 'maingrad.db'}"
    else:
        with pg_schema_url() as url:
            yield url


@pytest.fixture
def fresh_database_url(request: pytest.FixtureRequest, database_url: str, tmp_path: Path) -> Iterator[str]:
    """An empty database of the session's backend, for tests that need one to themselves."""
    if database_url.startswith("sqlite"):
        yield f"sqlite:///{tmp_path / 'fresh.db'}"
    else:
        with pg_schema_url() as url:
            yield url


def settings_for(url: str, **over: Any) -> Settings:
    return Settings(database_url=url, secret=SECRET, admin_token=ADMIN, **over)


@pytest.fixture(scope="session")
def client(database_url: str) -> Iterator[TestClient]:
    with TestClient(create_app(settings_for(database_url)), raise_server_exceptions=False) as c:
        yield c


@dataclass
class ProjectCtx:
    """A fresh project with one token per scope (plus all scopes) on the session's app."""

    client: TestClient
    name: str
    tokens: dict[str, str]

    def headers(self, scope: str = "all", **extra: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[scope]}", **extra}

    def url(self, suffix: str = "") -> str:
        return f"/api/v1/projects/{self.name}{suffix}"

    def upload(
        self, body: bytes | dict[str, Any], commit: str, branch: str | None = "main", **kw: Any
    ) -> Any:
        import json

        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        params = {"commit_sha": commit, **({"branch": branch} if branch else {}), **kw.pop("params", {})}
        return self.client.post(
            self.url("/reports"),
            params=params,
            content=data,
            headers=self.headers("upload", **kw.pop("headers", {})),
        )

    def every_item(self, suffix: str, limit: int) -> list[Any]:
        """Every item of a paginated listing, `limit` a page, following `next_cursor` to the end."""
        items: list[Any] = []
        cursor = None
        while True:
            params = {"limit": str(limit), **({"cursor": cursor} if cursor else {})}
            page = self.client.get(self.url(suffix), params=params, headers=self.headers("read")).json()
            items += page["items"]
            cursor = page["next_cursor"]
            if not cursor:
                return items

    def gate(self, commit: str, base: str | None = None) -> dict[str, Any]:
        params = {"commit_sha": commit, **({"base_sha": base} if base else {})}
        response = self.client.get(self.url("/gate"), params=params, headers=self.headers("read"))
        assert response.status_code == 200, response.text
        return response.json()


def new_project(client: TestClient, default_branch: str = "main") -> ProjectCtx:
    name = unique()
    r = client.post(
        "/api/v1/projects", json={"name": name, "default_branch": default_branch}, headers=admin_headers()
    )
    assert r.status_code == 201, r.text
    tokens = {}
    for scope, scopes in {
        "upload": ["upload"],
        "read": ["read"],
        "triage": ["triage"],
        "admin": ["admin"],
        "all": ["upload", "read", "triage", "admin"],
    }.items():
        r = client.post(
            f"/api/v1/projects/{name}/tokens", json={"scopes": scopes, "name": scope}, headers=admin_headers()
        )
        assert r.status_code == 201, r.text
        tokens[scope] = r.json()["token"]
    return ProjectCtx(client, name, tokens)


@pytest.fixture
def project(client: TestClient) -> ProjectCtx:
    return new_project(client)
