"""Load shedding: a worker answers 503 with Retry-After at once when it already has enough requests in hand.

Without it, 500 concurrent clients queued in the thread pool and waited up to 10 s for answers that were then
useless to them (a CI poll times out, a training rank's sink drops the batch). A bounded number of requests in
flight per worker keeps latency near the service time; the surplus is told to come back (`Retry-After`), which
`maingrad gate --wait`, the CLI and the hooks' sink do. Liveness, readiness and metrics are never shed.
"""

from __future__ import annotations

from typing import Any

from maingrad.service.problems import problem_response

EXEMPT = ("/healthz", "/readyz", "/metrics")


class LoadShedMiddleware:
    """Counts requests in flight in this worker; past `limit` the request is answered 503 without running."""

    def __init__(self, app: Any, limit: int, retry_after_s: int, on_shed: Any = None) -> None:
        self.app = app
        self.limit = limit
        self.retry_after = str(retry_after_s)
        self.on_shed = on_shed
        self.in_flight = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self.limit <= 0 or scope["path"] in EXEMPT:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            if self.on_shed is not None:
                self.on_shed()
            response = problem_response(
                503,
                "overloaded",
                f"the server has {self.limit} requests in hand; retry later",
                instance=scope["path"],
                headers={"Retry-After": self.retry_after},
                limit=self.limit,
            )
            await response(scope, receive, send)
            return
        self.in_flight += 1  # one event loop per worker: no lock needed
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
