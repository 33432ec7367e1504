"""Opaque cursors for keyset pagination (stable under inserts, no OFFSET scans)."""

from __future__ import annotations

import base64
import json
from typing import Any

from sqlalchemy import Select
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
        query = query.where(id_column < last_id if newest_first else id_column > last_id)
    rows = list(session.execute(query.limit(limit + 1)).scalars())
    return rows[:limit], encode_cursor(rows[limit - 1].id) if len(rows) > limit else None


def encode_cursor(last_id: int) -> str:
    raw = json.dumps({"id": last_id}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str | None) -> int | None:
    if not cursor:
        return None
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        value = json.loads(base64.urlsafe_b64decode(padded.encode("ascii")))
        last_id = value["id"]
        if not isinstance(last_id, int) or isinstance(last_id, bool) or last_id < 0:
            raise ValueError
        return last_id
    except Exception:
        raise ProblemError(422, "invalid_cursor", "cursor is not one this server issued") from None


def encode_key_cursor(last_key: str) -> str:
    raw = json.dumps({"k": last_key}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_key_cursor(cursor: str | None) -> str | None:
    if not cursor:
        return None
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        value = json.loads(base64.urlsafe_b64decode(padded.encode("ascii")))
        key = value["k"]
        if not isinstance(key, str) or "\x00" in key:
            raise ValueError
        return key
    except Exception:
        raise ProblemError(422, "invalid_cursor", "cursor is not one this server issued") from None
