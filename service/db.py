"""Engines and sessions: SQLite in WAL mode with explicit BEGIN IMMEDIATE for writers, or PostgreSQL.

pysqlite's implicit transactions make a reader that later writes fail with "database is locked" under
concurrency; we take over BEGIN ourselves so write transactions lock up front and wait (busy_timeout).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from maingrad.service.config import Settings
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker


def normalize_url(url: str) -> str:
    """Accept plain `postgresql://` / `postgres://` URLs and route them to psycopg 3."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def make_engine(settings: Settings) -> Engine:
    url = normalize_url(settings.database_url)
    if url.startswith("sqlite"):
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": settings.sqlite_busy_timeout_ms / 1000},
            pool_size=settings.db_pool_size,
            max_overflow=40,
            pool_timeout=60,
        )
        _configure_sqlite(engine, settings.sqlite_busy_timeout_ms)
        return engine
    return create_engine(
        url,
        pool_size=settings.db_pool_size,
        max_overflow=30,
        pool_timeout=60,
        pool_pre_ping=True,
    )


def _configure_sqlite(engine: Engine, busy_timeout_ms: int) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves (see module docstring)
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode: a commit survives a killed process (the WAL is in the OS cache); only power
        # loss can drop the last transactions.
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn) -> None:  # type: ignore[no-untyped-def]
        mode = conn.get_execution_options().get("sqlite_begin", "DEFERRED")
        conn.exec_driver_sql(f"BEGIN {mode}")


@dataclass
class Database:
    """One engine plus a reader and a writer session factory (the writer locks SQLite up front)."""

    engine: Engine
    read: sessionmaker[Session]
    write: sessionmaker[Session]

    @classmethod
    def from_settings(cls, settings: Settings) -> Database:
        engine = make_engine(settings)
        writer = (
            engine.execution_options(sqlite_begin="IMMEDIATE") if engine.dialect.name == "sqlite" else engine
        )
        return cls(
            engine=engine,
            read=sessionmaker(engine, expire_on_commit=False),
            write=sessionmaker(writer, expire_on_commit=False),
        )

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @contextmanager
    def writing(self) -> Iterator[Session]:
        """A write transaction: commit on success, roll back on error."""
        with self.write() as session, session.begin():
            yield session

    @contextmanager
    def reading(self) -> Iterator[Session]:
        with self.read() as session, session.begin():
            yield session

    def dispose(self) -> None:
        self.engine.dispose()
