"""Alembic environment. Normally driven by maingrad.service.migrate, which passes an open connection."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from maingrad.service.db import normalize_url
from maingrad.service.models import Base, UTCDateTime

config = context.config
target_metadata = Base.metadata


def _render_item(type_: str, obj, autogen_context):
    """Render our TypeDecorators as their plain SQL types, so migrations never import the models."""
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def _configure(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        render_item=_render_item,
    )


def run_offline() -> None:
    context.configure(
        url=normalize_url(config.get_main_option("sqlalchemy.url") or ""), target_metadata=target_metadata
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(normalize_url(config.get_main_option("sqlalchemy.url") or "sqlite:///maingrad.db"))
    with engine.begin() as conn:
        _configure(conn)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
