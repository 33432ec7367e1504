"""Engines and sessions: SQLite in WAL mode with explicit BEGIN IMMEDIATE for writers, or PostgreSQL.

pysqlite's implicit transactions make a reader that later writes fail with "database is locked" under
concurrency; we take over BEGIN ourselves so write transactions lock up front and wait (busy_timeout).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from maingrad.service import fastjson
from maingrad.service.config import Settings

log = logging.getLogger("maingrad.service")


def normalize_url(url: str) -> str:
    """Accept plain `postgresql://` / `postgres://` URLs and route them to psycopg 3."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


# JSON columns (each finding's SARIF, an analysis's runs) through orjson: the standard library's encoder took a
# fifth of a 25,000-result upload's CPU. Values reaching them are finite numbers and str keys already.
_JSON = {"json_serializer": fastjson.dumps_text, "json_deserializer": fastjson.loads}


def make_engine(settings: Settings, background_checkpoints: bool = False) -> Engine:
    url = normalize_url(settings.database_url)
    if url.startswith("sqlite"):
        engine = create_engine(
            url,
            **_JSON,
            connect_args={"check_same_thread": False, "timeout": settings.sqlite_busy_timeout_ms / 1000},
            pool_size=settings.db_pool_size,
            max_overflow=40,
            pool_timeout=60,
        )
        _configure_sqlite(engine, settings.sqlite_busy_timeout_ms, background_checkpoints)
        return engine
    return create_engine(
        url,
        **_JSON,
        # An unreachable server fails the request fast (503) instead of hanging it.
        connect_args={"connect_timeout": settings.db_connect_timeout_s},
        pool_size=settings.db_pool_size,
        max_overflow=30,
        pool_timeout=10,
        # A liveness ping costs a round trip per checkout; stale connections are recycled instead, and a
        # connection found dead is invalidated (with the rest of the pool) on first use.
        pool_pre_ping=settings.db_pool_pre_ping,
        pool_recycle=1800,
    )


def _configure_sqlite(engine: Engine, busy_timeout_ms: int, background_checkpoints: bool) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves (see module docstring)
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode: a commit survives a killed process (the WAL is in the OS cache); only power
        # loss can drop the last transactions.
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA journal_size_limit=67108864")
        if background_checkpoints:
            # Commits no longer copy the WAL into the database (a multi-ms stall every few MB written);
            # the Checkpointer thread does it beside them.
            cursor.execute("PRAGMA wal_autocheckpoint=0")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn) -> None:
        mode = conn.get_execution_options().get("sqlite_begin", "DEFERRED")
        conn.exec_driver_sql(f"BEGIN {mode}")


class Checkpointer:
    """Copies the SQLite WAL into the database file every `interval` seconds (PASSIVE: never blocks
    readers or writers), so commits on the request path stay cheap and the WAL stays bounded."""

    def __init__(self, engine: Engine, interval: float = 1.0) -> None:
        self.engine = engine
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="maingrad-wal-checkpoint", daemon=True)

    def start(self) -> Checkpointer:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                with self.engine.connect() as conn:
                    conn.connection.driver_connection.execute("PRAGMA wal_checkpoint(PASSIVE)")  # type: ignore[union-attr]  # SQLite: always a connection
            except Exception as exc:  # a checkpoint that fails is retried on the next tick
                log.warning("WAL checkpoint failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        try:  # leave a small WAL behind
            with self.engine.connect() as conn:
                conn.connection.driver_connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # type: ignore[union-attr]  # SQLite: always a connection
        except Exception as exc:
            log.warning("final WAL checkpoint failed: %s", exc)


class WriteQueue:
    """Queues SQLite writers in the kernel instead of in SQLite's busy handler.

    A writer that finds the database locked sleeps in SQLite's busy handler (1, 2, 5, 10 ms...) and
    polls; under many concurrent writers (several threads, several uvicorn workers) those sleeps cost
    more than the writes. A thread lock plus an flock() on a side file makes waiting writers wake the
    moment the lock is free, across processes too. The kernel drops the flock of a killed process."""

    def __init__(self, database_path: str) -> None:
        self.path = database_path + ".writelock"
        self._thread_lock = threading.Lock()
        self._fd: int | None = None

    @contextmanager
    def held(self) -> Iterator[None]:
        import fcntl

        with self._thread_lock:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)


@dataclass
class Database:
    """One engine plus a reader and a writer session factory (the writer locks SQLite up front)."""

    engine: Engine
    read: sessionmaker[Session]
    write: sessionmaker[Session]

    checkpointer: Checkpointer | None = None
    write_queue: WriteQueue | None = None

    @classmethod
    def from_settings(cls, settings: Settings, server: bool = False) -> Database:
        """`server=True`: a long-running process; SQLite gets a background WAL checkpointer."""
        engine = make_engine(settings, background_checkpoints=server)
        writer = (
            engine.execution_options(sqlite_begin="IMMEDIATE") if engine.dialect.name == "sqlite" else engine
        )
        # PostgreSQL reads see one snapshot for the whole request (READ COMMITTED would give each query its
        # own: a gate computed across a concurrent replacement could miss findings). SQLite's read
        # transactions are snapshots already.
        reader = (
            engine.execution_options(isolation_level="REPEATABLE READ")
            if engine.dialect.name == "postgresql"
            else engine
        )
        db = cls(
            engine=engine,
            read=sessionmaker(reader, expire_on_commit=False),
            write=sessionmaker(writer, expire_on_commit=False),
        )
        path = engine.url.database if engine.dialect.name == "sqlite" else None
        if path and path != ":memory:" and os.name == "posix":
            db.write_queue = WriteQueue(os.path.abspath(path))
            if server:
                db.checkpointer = Checkpointer(engine).start()
        return db

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @contextmanager
    def writing(self) -> Iterator[Session]:
        """A write transaction: commit on success, roll back on error (SQLite: queued, see WriteQueue)."""
        if self.write_queue is None:
            with self.write() as session, session.begin():
                yield session
            return
        with self.write_queue.held(), self.write() as session, session.begin():
            yield session

    @contextmanager
    def reading(self) -> Iterator[Session]:
        with self.read() as session, session.begin():
            yield session

    def dispose(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.stop()
        self.engine.dispose()
