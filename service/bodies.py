"""Reading request bodies under limits: wire size, and decompressed size for gzip (zip-bomb safe).

The body is streamed: we stop reading past the wire limit even when Content-Length lies or is absent,
and gzip is inflated incrementally with `max_length`, so a 10 MB bomb never expands past the cap in memory.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request

from maingrad.service.config import Settings
from maingrad.service.problems import ProblemError, problem_response

SMALL_BODY = 64 * 1024  # every JSON endpoint (projects, tokens, triage) and the login form

_CHUNK = 256 * 1024


async def read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > max_bytes:
                raise _too_large(max_bytes)
        except ValueError:
            raise ProblemError(400, "invalid_content_length", "Content-Length is not an integer") from None
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        parts.append(chunk)
    return b"".join(parts)


def _too_large(limit: int) -> ProblemError:
    return ProblemError(413, "body_too_large", f"request body exceeds {limit} bytes", limit=limit)


def decode_content(
    body: bytes, encoding: str | None, max_decompressed: int, max_line: int | None = None
) -> bytes | bytearray:
    """Undo Content-Encoding (identity or gzip) with a hard cap on the inflated size and, for gzipped NDJSON,
    on the length of one line; both are enforced while inflating, so a bomb stops at the cap."""
    encoding = (encoding or "identity").strip().lower()
    if encoding in ("", "identity"):
        if len(body) > max_decompressed:
            raise _inflated_too_large(max_decompressed)
        return body  # bounded by the wire limit; NDJSON lines are measured as the batch is split
    if encoding not in ("gzip", "x-gzip"):
        raise ProblemError(
            415, "unsupported_encoding", f"Content-Encoding {encoding!r} is not supported (use gzip)"
        )
    return gunzip_capped(body, max_decompressed, max_line)


def _inflated_too_large(limit: int) -> ProblemError:
    return ProblemError(
        413, "decompressed_too_large", f"decompressed body exceeds {limit} bytes", limit=limit
    )


def _line_too_long(limit: int, line: int) -> ProblemError:
    return ProblemError(
        413, "line_too_long", f"line {line}: longer than {limit} bytes", limit=limit, line=line
    )


def _check_lines(chunk: bytes | bytearray, carried: int, limit: int, lines_before: int = 0) -> int:
    """Length of the unterminated line at the end of `chunk` (`carried`: the open line's bytes before it);
    raises when any line is longer than `limit`."""
    first = chunk.find(b"\n")
    if first < 0:
        if carried + len(chunk) > limit:
            raise _line_too_long(limit, lines_before + 1)
        return carried + len(chunk)
    if carried + first > limit:
        raise _line_too_long(limit, lines_before + 1)
    last = chunk.rfind(b"\n")
    if last - first > limit:  # some complete line in between may be too long
        for offset, line in enumerate(bytes(chunk[first + 1 : last]).split(b"\n"), start=2):
            if len(line) > limit:
                raise _line_too_long(limit, lines_before + offset)
    if len(chunk) - last - 1 > limit:
        raise _line_too_long(limit, lines_before + chunk.count(b"\n") + 1)
    return len(chunk) - last - 1


def gunzip_capped(data: bytes, limit: int, max_line: int | None = None) -> bytearray:
    out = bytearray()
    remaining = data
    open_line = 0
    lines = 0

    def take(chunk: bytes) -> None:
        nonlocal open_line, lines
        out.extend(chunk)
        if len(out) > limit:
            raise _inflated_too_large(limit)
        if max_line is not None and chunk:
            open_line = _check_lines(chunk, open_line, max_line, lines)
            lines += chunk.count(b"\n")

    try:
        while remaining:
            inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
            pending = remaining
            while pending:
                room = limit - len(out)
                chunk = inflater.decompress(pending, min(_CHUNK, room + 1))
                take(chunk)
                pending = inflater.unconsumed_tail
                if inflater.eof:
                    break
                if not chunk and not pending:
                    break
            while not inflater.eof:  # flush what is buffered, still under the cap
                room = limit - len(out)
                chunk = inflater.decompress(b"", min(_CHUNK, room + 1))
                if not chunk:
                    break
                take(chunk)
            if not inflater.eof:
                raise ProblemError(422, "invalid_gzip", "gzip stream is truncated")
            remaining = inflater.unused_data  # concatenated gzip members are one stream (RFC 1952)
    except zlib.error as exc:
        raise ProblemError(422, "invalid_gzip", f"gzip stream is corrupt: {exc}") from None
    return out


class BodyTooLarge(HTTPException):
    """Raised from `receive` when a streamed body passes its limit (FastAPI re-raises HTTPExceptions)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds {limit} bytes")
        self.limit = limit


def body_limits(settings: Settings) -> Callable[[str, str], int]:
    def limit_for(method: str, path: str) -> int:
        if method == "POST" and path.endswith("/reports"):
            return settings.max_body_bytes
        if method == "POST" and path.endswith("/records"):
            return settings.max_records_body_bytes
        return SMALL_BODY

    return limit_for


class BodyLimitMiddleware:
    """Caps every request body before any handler buffers it (by Content-Length up front, else as it
    streams) and refuses NUL characters in the URL."""

    def __init__(self, app: Any, limit_for: Callable[[str, str], int]) -> None:
        self.app = app
        self.limit_for = limit_for

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = (
            bytes(scope.get("raw_path") or scope["path"].encode())
            + b"?"
            + bytes(scope.get("query_string", b""))
        )
        if b"%00" in raw or b"\x00" in raw:
            # PostgreSQL text cannot hold NUL; no name, SHA or filter legitimately contains one.
            response = problem_response(422, "invalid_character", "NUL characters are not allowed in URLs")
            await response(scope, receive, send)
            return
        limit = self.limit_for(scope["method"], scope["path"])
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > limit:
                    response = problem_response(
                        413,
                        "body_too_large",
                        f"request body exceeds {limit} bytes",
                        instance=scope["path"],
                        limit=limit,
                    )
                    await response(scope, receive, send)
                    return
        seen = 0

        async def limited() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, limited, send)
