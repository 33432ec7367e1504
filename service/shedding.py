"""Admission: a worker answers 503 with Retry-After at once when it already has enough requests in hand.

Without it, 500 concurrent clients queued in the thread pool and waited up to 10 s for answers that were then
useless to them (a CI poll times out, a training rank's sink drops the batch). A bounded number of requests in
flight per worker keeps latency near the service time; the surplus is told to come back (`Retry-After`), which
`maingrad gate --wait`, the CLI and the hooks' sink do. Liveness, readiness and metrics are never shed.

Three rules keep one client from starving another:

- Only requests being processed count as in flight. A request with a body is admitted once its body has
  arrived whole; while it arrives it holds a *receiving* slot instead. 130 bodies sent at 1 byte/s by one
  project used to hold every in-flight slot, and all of another project's gate polls answered 503.
- Slots are counted per key as well as in total: the project named in the path (`/api/v1/projects/{name}/...`,
  `/projects/{name}`), else the credential (a digest of the bearer token or session cookie). One key may hold
  at most `per_key_limit` of the `limit` slots (and as many receiving slots), so another project always finds
  room: one project's traffic cannot make another's gate answer 503.
- A body must arrive within `body_timeout_s` of the request's start (408 otherwise), and past its size limit
  it is refused (413) as soon as the excess arrives, so a slow or endless sender holds its slot for a bounded
  time and bounded memory.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from typing import Any

from maingrad.service.problems import problem_response

EXEMPT = ("/healthz", "/readyz", "/metrics")
_BODYLESS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE"})


def admission_key(scope: dict[str, Any]) -> str:
    """Whose request this is: `p:<project>` from the path, else `t:<credential digest>`, else `anon`."""
    parts = scope.get("path", "").split("/")
    # /api/v1/projects/{name}/... or /projects/{name}[/...]
    for index in (4, 2):
        if len(parts) > index and parts[index - 1] == "projects" and parts[index]:
            if index == 4 and parts[1:3] != ["api", "v1"]:
                continue
            return "p:" + parts[index]
    for name, value in scope.get("headers", ()):
        if name in (b"authorization", b"cookie"):
            return "t:" + hashlib.blake2b(value, digest_size=8).hexdigest()
    return "anon"


def _has_body(scope: dict[str, Any]) -> bool:
    if scope.get("method") in _BODYLESS:
        return False
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return value.strip() not in (b"0", b"")
        if name == b"transfer-encoding":
            return True
    return False


class LoadShedMiddleware:
    """Counts requests in flight in this worker (in total and per admission key); past a limit the request
    is answered 503 without running."""

    def __init__(
        self,
        app: Any,
        limit: int,
        retry_after_s: int,
        on_shed: Any = None,
        *,
        per_key_limit: int | None = None,
        max_receiving: int | None = None,
        body_timeout_s: float = 60.0,
        limit_for: Callable[[str, str], int] | None = None,
    ) -> None:
        self.app = app
        self.limit = limit
        self.per_key_limit = per_key_limit if per_key_limit is not None else limit
        self.max_receiving = max_receiving if max_receiving is not None else 2 * limit
        self.body_timeout_s = body_timeout_s
        self.limit_for = limit_for
        self.retry_after = str(retry_after_s)
        self.on_shed = on_shed
        self.in_flight = 0
        self.receiving = 0
        self.per_key: dict[str, int] = {}
        self.receiving_per_key: dict[str, int] = {}

    def _shed(self, scope: dict[str, Any], why: str) -> Any:
        if self.on_shed is not None:
            self.on_shed()
        return problem_response(
            503,
            "overloaded",
            why,
            instance=scope["path"],
            headers={"Retry-After": self.retry_after},
            limit=self.limit,
        )

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self.limit <= 0 or scope["path"] in EXEMPT:
            await self.app(scope, receive, send)
            return
        key = admission_key(scope)
        if _has_body(scope):
            buffered = await self._receive_body(scope, key, receive, send)
            if buffered is None:
                return  # answered already (shed, too slow, too large, or the client left)
            receive = _replay(buffered, receive)
        # One event loop per worker: the checks and the increments below run without a switch in between.
        if self.in_flight >= self.limit:
            await self._shed(scope, f"the server has {self.limit} requests in hand; retry later")(
                scope, receive, send
            )
            return
        if self.per_key.get(key, 0) >= self.per_key_limit:
            await self._shed(
                scope, f"this project or token has {self.per_key_limit} requests in hand; retry later"
            )(scope, receive, send)
            return
        self.in_flight += 1
        _take(self.per_key, key)
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            _release(self.per_key, key)

    async def _receive_body(
        self, scope: dict[str, Any], key: str, receive: Any, send: Any
    ) -> list[dict[str, Any]] | None:
        """The body's messages, received under a receiving slot, the deadline and the size limit."""
        if self.receiving >= self.max_receiving or self.receiving_per_key.get(key, 0) >= self.per_key_limit:
            await self._shed(scope, "too many request bodies are arriving; retry later")(scope, receive, send)
            return None
        self.receiving += 1
        _take(self.receiving_per_key, key)
        try:
            return await self._read(scope, receive, send)
        finally:
            self.receiving -= 1
            _release(self.receiving_per_key, key)

    async def _read(self, scope: dict[str, Any], receive: Any, send: Any) -> list[dict[str, Any]] | None:
        limit = self.limit_for(scope["method"], scope["path"]) if self.limit_for is not None else None
        deadline = time.monotonic() + self.body_timeout_s
        parts: list[bytes] = []
        size = 0
        while True:
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise TimeoutError
                message = await asyncio.wait_for(receive(), remaining)
            except TimeoutError:
                detail = f"the request body did not arrive within {self.body_timeout_s:g} s"
                response = _closing_problem(scope, 408, "body_timeout", detail, limit=self.body_timeout_s)
                await response(scope, _disconnected, send)
                return None
            if message["type"] != "http.request":
                return None  # http.disconnect: nobody is waiting for an answer
            chunk = message.get("body", b"")
            parts.append(chunk)
            size += len(chunk)
            if limit is not None and size > limit:
                response = _closing_problem(
                    scope, 413, "body_too_large", f"request body exceeds {limit} bytes", limit=limit
                )
                await response(scope, _disconnected, send)
                return None
            if not message.get("more_body", False):
                return [{"type": "http.request", "body": b"".join(parts), "more_body": False}]


def _closing_problem(scope: dict[str, Any], status: int, code: str, detail: str, *, limit: float) -> Any:
    """A problem answer about the body that also closes the connection (the rest of the body is never read)."""
    return problem_response(
        status, code, detail, instance=scope["path"], headers={"Connection": "close"}, limit=limit
    )


async def _disconnected() -> dict[str, Any]:
    return {"type": "http.disconnect"}


def _replay(messages: list[dict[str, Any]], receive: Any) -> Any:
    pending = list(reversed(messages))

    async def replayed() -> dict[str, Any]:
        if pending:
            return pending.pop()
        return await receive()  # after the body: http.disconnect when the client leaves

    return replayed


def _take(counts: dict[str, int], key: str) -> None:
    counts[key] = counts.get(key, 0) + 1


def _release(counts: dict[str, int], key: str) -> None:
    """One fewer in hand for `key`; a key with none left leaves the table (it holds only busy keys)."""
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]
