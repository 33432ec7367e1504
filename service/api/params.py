"""Shared request parameters."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path, Query

from maingrad.service.identifiers import COMMIT_PATTERN
from maingrad.service.pagination import ID_CURSOR_PATTERN, KEY_CURSOR_PATTERN

SHA = COMMIT_PATTERN

CommitQuery = Annotated[
    str,
    Query(
        pattern=SHA,
        description="Commit SHA (or another revision id: letters, digits, . _ -; at most 64).",
        examples=["4fe2a92c0ffee"],
    ),
]
OptionalCommitQuery = Annotated[str | None, Query(pattern=SHA, description="Commit SHA (or revision id).")]
CursorQuery = Annotated[
    str | None, Query(pattern=ID_CURSOR_PATTERN, description="Opaque cursor from `next_cursor`.")
]
KeyCursorQuery = Annotated[
    str | None, Query(pattern=KEY_CURSOR_PATTERN, description="Opaque cursor from `next_cursor`.")
]
LimitQuery = Annotated[int, Query(ge=1, le=500, description="Page size.")]
IdPath = Annotated[int, Path(ge=1, le=2**31 - 1)]
RequireQuery = Annotated[
    list[Annotated[str, Query(pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:-]{0,199}$")]] | None,
    Query(
        max_length=20,
        description="Evidence the commit needs before the gate decides (repeatable): `runtime` or an analysis "
        "category. Default: the project's `required_evidence`.",
    ),
]
