"""Schema migrations through Alembic, with the scripts shipped inside the package (wheel-safe)."""

from __future__ import annotations

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, text

SCRIPT_LOCATION = "maingrad.service:migrations"
_PG_LOCK_ID = 0x6D61696E  # "main": serializes concurrent replicas migrating one PostgreSQL database


def alembic_config(url: str | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", SCRIPT_LOCATION)
    if url:
        cfg.set_main_option("sqlalchemy.url", url)
    return cfg


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the database to `revision` (an empty database gets the whole schema)."""
    cfg = alembic_config()
    # Several workers or replicas may start at once: SQLite takes its write lock up front (BEGIN
    # IMMEDIATE), PostgreSQL an advisory lock; the second migrator then finds the schema current.
    with engine.execution_options(sqlite_begin="IMMEDIATE").begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_LOCK_ID})
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def downgrade(engine: Engine, revision: str) -> None:
    cfg = alembic_config()
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)


def is_current(engine: Engine) -> bool:
    return current_revision(engine) == head_revision()
