"""Shared request parameters."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path, Query

SHA = r"^[0-9a-fA-F]{4,64}$"

CommitQuery = Annotated[
    str, Query(pattern=SHA, description="Commit SHA (hex, 4-64 chars).", examples=["4fe2a92c0ffee"])
]
OptionalCommitQuery = Annotated[str | None, Query(pattern=SHA, description="Commit SHA (hex).")]
CursorQuery = Annotated[str | None, Query(max_length=200, description="Opaque cursor from `next_cursor`.")]
LimitQuery = Annotated[int, Query(ge=1, le=500, description="Page size.")]
IdPath = Annotated[int, Path(ge=1, le=2**31 - 1)]
