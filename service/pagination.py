"""Opaque cursors for keyset pagination (stable under inserts, no OFFSET scans)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import BigInteger, Select, false
from sqlalchemy.orm import InstrumentedAttribute, Session

from maingrad.service.problems import ProblemError


def keyset_page(
    session: Session,
    query: Select[Any],
    id_column: InstrumentedAttribute[int],
    cursor: str | None,
    limit: int,
    *,
    newest_first: bool,
) -> tuple[list[Any], str | None]:
    """One page of `query` (already ordered by `id_column` in that direction) after the cursor's id, and the
    cursor of the next page (None at the end)."""
    last_id = decode_cursor(cursor)
    if last_id is not None:
        query = after_id(query, id_column, last_id, newest_first)
    rows: list[Any] = list(session.execute(query.limit(limit + 1)).scalars())
    return rows[:limit], encode_cursor(rows[limit - 1].id) if len(rows) > limit else None


def after_id(query: Select[Any], id_column: Any, last_id: int, newest_first: bool) -> Select[Any]:
    """Rows past the cursor's id. A cursor wider than the id column (any 18-digit string is a cursor) is not
    sent to the database, whose INTEGER parameter would overflow: every id is before it, none after it."""
    widest = 2**63 - 1 if isinstance(id_column.type, BigInteger) else 2**31 - 1
    if last_id > widest:
        return query if newest_first else query.where(false())
    return query.where(id_column < last_id if newest_first else id_column > last_id)


# Cursors are opaque to clients, but their shape is published (a pattern in the OpenAPI document) and every
# string of that shape is a cursor the server accepts: a contract fuzzer's valid request is never refused,
# and a malformed cursor is refused by the query's validation (422) before any handler runs.
ID_CURSOR_PATTERN = r"^[0-9]{1,18}$"
KEY_CURSOR_PATTERN = r"^(?:[0-9a-f]{2}){1,1020}$"


def encode_cursor(last_id: int) -> str:
    return str(last_id)


def decode_cursor(cursor: str | None) -> int | None:
    if not cursor:
        return None
    if not cursor.isascii() or not cursor.isdigit() or len(cursor) > 18:
        raise ProblemError(422, "invalid_cursor", "cursor is not one this server issued")
    return int(cursor)


def encode_key_cursor(last_key: str) -> str:
    return last_key.encode("utf-8").hex()


def decode_key_cursor(cursor: str | None) -> str | None:
    """The record key after which the page starts; any hex string decodes (bytes that are not UTF-8, and
    NUL, which PostgreSQL text cannot hold, become U+FFFD: such a key only moves the start of the page)."""
    if not cursor:
        return None
    try:
        raw = bytes.fromhex(cursor)
    except ValueError:
        raise ProblemError(422, "invalid_cursor", "cursor is not one this server issued") from None
    return raw.decode("utf-8", "replace").replace("\x00", "\ufffd")
