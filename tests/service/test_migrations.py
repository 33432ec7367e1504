"""Alembic: an empty database gets the whole schema, the migration matches the models, readiness tracks it."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from conftest import settings_for
from fastapi.testclient import TestClient
from sqlalchemy import inspect

from maingrad.service import migrate
from maingrad.service.app import create_app
from maingrad.service.db import Database
from maingrad.service.models import Base


def test_empty_database_is_migrated_to_head_and_matches_the_models(fresh_database_url: str) -> None:
    db = Database.from_settings(settings_for(fresh_database_url))
    try:
        assert migrate.current_revision(db.engine) is None
        migrate.upgrade(db.engine)
        assert migrate.is_current(db.engine)
        assert set(Base.metadata.tables) <= set(inspect(db.engine).get_table_names())
        with db.engine.connect() as conn:
            diff = compare_metadata(
                MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata
            )
        assert diff == [], diff
        migrate.upgrade(db.engine)  # idempotent
        migrate.downgrade(db.engine, "base")  # the downgrade works too
        assert "projects" not in inspect(db.engine).get_table_names()
    finally:
        db.dispose()


def test_server_start_migrates_and_reports_ready(fresh_database_url: str) -> None:
    with TestClient(create_app(settings_for(fresh_database_url))) as c:
        ready = c.get("/readyz")
        assert ready.status_code == 200 and ready.json()["revision"] == migrate.head_revision()
        assert c.get("/healthz").json() == {"status": "ok"}


def test_sqlite_runs_in_wal_mode(tmp_path) -> None:  # type: ignore[no-untyped-def]
    db = Database.from_settings(settings_for(f"sqlite:///{tmp_path / 'w.db'}"))
    with db.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    db.dispose()


def test_bootstrap_admin_token_is_minted_once_when_no_admin_exists(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from maingrad.service.app import bootstrap_admin
    from maingrad.service.config import Settings

    settings = Settings(database_url=f"sqlite:///{tmp_path / 'b.db'}", secret="s")
    db = Database.from_settings(settings)
    migrate.upgrade(db.engine)
    first = bootstrap_admin(db, settings)
    assert first and first.startswith("mga_")
    assert bootstrap_admin(db, settings) is None
    with TestClient(create_app(settings)) as c:
        assert c.get("/api/v1/projects", headers={"Authorization": f"Bearer {first}"}).status_code == 200
    db.dispose()


def test_metrics_endpoint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with TestClient(create_app(settings_for(f"sqlite:///{tmp_path / 'm.db'}"))) as c:
        c.get("/healthz")
        c.get("/api/v1/projects/none/gate?commit_sha=abcd")
        text = c.get("/metrics").text
    assert "# TYPE maingrad_http_requests_total counter" in text
    assert (
        'maingrad_http_requests_total{method="GET",route="/api/v1/projects/{project}/gate",status="401"} 1'
        in text
    )
    assert 'route="/healthz"' in text


def test_bootstrap_admin_token_goes_to_a_private_file_not_the_log(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    import logging
    import stat

    from maingrad.service.config import Settings

    token_file = tmp_path / "admin-token"
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'boot.db'}", secret="s", bootstrap_token_file=str(token_file)
    )
    with caplog.at_level(logging.WARNING, logger="maingrad.service"), TestClient(create_app(settings)):
        pass
    secret = token_file.read_text().strip()
    assert secret.startswith("mga_") and stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert secret not in caplog.text and str(token_file) in caplog.text
