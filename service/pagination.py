"""Opaque cursors for keyset pagination (stable under inserts, no OFFSET scans)."""

from __future__ import annotations

import base64
import json

from maingrad.service.problems import ProblemError


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
