"""A small HTTP client for the CLI (standard library only: `maingrad upload` stays cheap to import).

Every call runs under one monotonic deadline that bounds the whole exchange, retries included, however slowly
the server sends (`exchange`): a hung server, or one sending a byte a second, makes `maingrad gate --wait 5`
return after about 5 s. Only what another attempt can
fix is retried: no answer, 429, 502, 503 and 504 (honouring Retry-After within the deadline). A 4xx is the
caller's mistake and a 500 a server bug: neither is retried, and the server's reason is reported once.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

RETRYABLE = frozenset({429, 502, 503, 504})


class ClientError(Exception):
    """A request that failed: `status` is the HTTP status (0: no answer); `problem` the RFC 9457 body."""

    def __init__(self, status: int, message: str, problem: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.problem = problem or {}

    @property
    def retryable(self) -> bool:
        return self.status == 0 or self.status in RETRYABLE


def check_url(url: str) -> str:
    """The server URL, or ClientError(0) saying what is wrong with it (before any request)."""
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ClientError(0, f"bad URL {url!r}: expected http://HOST[:PORT] or https://HOST[:PORT]")
    try:
        _ = parts.port
    except ValueError:
        raise ClientError(0, f"bad URL {url!r}: the port is not a number from 0 to 65535") from None
    return url.strip().rstrip("/")


def _problem_message(status: int, problem: dict[str, Any], reason: str) -> str:
    """`HTTP 422 invalid_sarif: /runs/0/results/3/level: must be one of [...]` (detail once, where first)."""
    code = problem.get("code")
    detail = problem.get("detail") or reason
    where = ""
    if problem.get("pointer") and str(problem["pointer"]) not in str(detail):
        where = f" (at {problem['pointer']})"
    elif problem.get("line") and f"line {problem['line']}" not in str(detail):
        where = f" (line {problem['line']})"
    return f"HTTP {status}{f' {code}' if code else ''}: {detail}{where}"


# A server's Retry-After is obeyed within these bounds: `Retry-After: 0` made the CLI send 646 requests in 1.5 s
# (and then overflow its backoff), a huge one would outlast any deadline anyway.
MIN_RETRY_AFTER_S = 0.5
MAX_RETRY_AFTER_S = 60.0


def retry_after_s(value: str | None, default: float) -> float:
    """Seconds to wait from a Retry-After header (delta-seconds form), clamped to a sane range; `default`
    when absent or not a number (the HTTP-date form is not sent by the service)."""
    try:
        seconds = float(value) if value is not None else default
    except ValueError:
        seconds = default
    if seconds != seconds:  # NaN
        seconds = default
    return min(max(seconds, MIN_RETRY_AFTER_S), MAX_RETRY_AFTER_S)


class HttpAnswer(Exception):
    """A non-2xx answer, read in full before the deadline."""

    def __init__(self, code: int, reason: str, headers: Any, body: bytes) -> None:
        super().__init__(f"HTTP {code}")
        self.code = code
        self.reason = reason
        self.headers = headers
        self.body = body


_MAX_ANSWER = 256 * 1024 * 1024


def exchange(request: urllib.request.Request, seconds: float) -> tuple[int, bytes]:
    """One request and its whole answer within `seconds` (monotonic), or TimeoutError.

    urllib's timeout bounds each socket operation, not the exchange: a server sending one byte a second kept
    `gate --wait 5` running for minutes. The exchange runs in a daemon thread that is abandoned (its socket
    closed) when the deadline passes; the CLI is a short-lived process, so nothing waits for it."""
    box: dict[str, Any] = {}
    done = threading.Event()
    holder: dict[str, Any] = {}

    def run() -> None:
        try:
            with urllib.request.urlopen(request, timeout=max(seconds, 0.05)) as response:  # noqa: S310
                holder["response"] = response
                box["answer"] = (response.status, response.read(_MAX_ANSWER))
        except urllib.error.HTTPError as exc:
            holder["response"] = exc
            try:
                raw = exc.read(_MAX_ANSWER)
            except Exception:  # noqa: BLE001 - a broken error body: keep the status
                raw = b""
            box["error"] = HttpAnswer(exc.code, str(exc.reason), exc.headers, raw)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = exc
        finally:
            done.set()

    thread = threading.Thread(target=run, name="maingrad-client", daemon=True)
    thread.start()
    if not done.wait(max(seconds, 0.0)):
        response = holder.get("response")
        if response is not None:
            with contextlib.suppress(Exception):  # best effort: the thread is abandoned either way
                response.close()
        raise TimeoutError(f"no complete answer within {seconds:.1f} s")
    if "error" in box:
        raise box["error"]
    return box["answer"]


@dataclass
class Client:
    url: str
    token: str | None = None
    timeout: float = 30.0  # default deadline of one call, retries included
    # How long "no answer" (refused, reset, timed out) is retried: long enough for a server that is starting
    # (`maingrad serve &` then `maingrad upload`), short enough that a wrong URL is reported in seconds.
    # `gate --wait` raises it to the wait: it polls through outages.
    connect_grace: float = 10.0

    def __post_init__(self) -> None:
        self.url = check_url(self.url)

    def _request(
        self,
        method: str,
        path: str,
        *,
        query: dict[str, Any] | None = None,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        deadline: float | None = None,
    ) -> tuple[int, Any]:
        """One call; `deadline` (time.monotonic()) defaults to now + timeout and bounds every attempt."""
        deadline = deadline if deadline is not None else time.monotonic() + self.timeout
        qs = urllib.parse.urlencode(
            [
                (k, x)
                for k, v in (query or {}).items()
                if v is not None
                for x in (v if isinstance(v, list) else [v])
            ]
        )
        full = self.url + path + (f"?{qs}" if qs else "")
        hdrs = {"Accept": "application/json", "User-Agent": "maingrad-cli", **(headers or {})}
        if self.token:
            hdrs["Authorization"] = f"Bearer {self.token}"
        attempt = 0
        give_up_unanswered = min(deadline, time.monotonic() + self.connect_grace)
        while True:
            attempt += 1
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ClientError(0, f"no answer from {self.url} before the deadline")
            request = urllib.request.Request(full, data=body, method=method, headers=hdrs)
            wait = min(0.25 * 2 ** min(attempt - 1, 5), 5.0)
            try:
                status, raw_answer = exchange(request, remaining)
                return status, json.loads(raw_answer or b"null")
            except HttpAnswer as exc:
                raw = exc.body
                try:
                    problem = json.loads(raw)
                except ValueError:
                    problem = {"detail": raw.decode("utf-8", "replace")[:500]}
                if not isinstance(problem, dict):
                    problem = {"detail": str(problem)[:500]}
                error = ClientError(exc.code, _problem_message(exc.code, problem, exc.reason), problem)
                if not error.retryable:
                    raise error from None
                wait = retry_after_s(exc.headers.get("Retry-After"), wait)
            except (TimeoutError, urllib.error.URLError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                error = ClientError(0, f"no answer from {self.url}: {reason}")
            except ValueError as exc:  # a 2xx whose body is not JSON: not the maingrad service
                raise ClientError(
                    0, f"{self.url} did not answer JSON (is it a maingrad server?): {exc}"
                ) from None
            if time.monotonic() + wait >= (deadline if error.status else give_up_unanswered):
                raise error
            time.sleep(wait)

    def upload(
        self,
        project: str,
        report: bytes,
        *,
        commit_sha: str,
        branch: str | None,
        category: str | None,
        idempotency_key: str | None = None,
        deadline: float | None = None,
    ) -> tuple[int, dict[str, Any]]:
        headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        if idempotency_key:
            headers["Idempotency-Key"] = idempotency_key
        return self._request(
            "POST",
            f"/api/v1/projects/{urllib.parse.quote(project, safe='')}/reports",
            query={"commit_sha": commit_sha, "branch": branch, "category": category},
            body=gzip.compress(report, compresslevel=6),
            headers=headers,
            deadline=deadline,
        )

    def gate(
        self,
        project: str,
        commit_sha: str,
        base_sha: str | None = None,
        require: list[str] | None = None,
        deadline: float | None = None,
    ) -> dict[str, Any]:
        _, body = self._request(
            "GET",
            f"/api/v1/projects/{urllib.parse.quote(project, safe='')}/gate",
            query={"commit_sha": commit_sha, "base_sha": base_sha, "require": require},
            deadline=deadline,
        )
        return body

    def projects(self, deadline: float | None = None) -> list[str]:
        """Names of the projects this token sees (a project token sees exactly its own)."""
        _, body = self._request("GET", "/api/v1/projects", query={"limit": 2}, deadline=deadline)
        return [p["name"] for p in body.get("items", [])]

    def create_token(
        self, project: str, scopes: list[str], name: str, expires_in_days: int | None
    ) -> dict[str, Any]:
        payload: dict[str, Any] = {"name": name, "scopes": scopes}
        if expires_in_days is not None:
            payload["expires_in_days"] = expires_in_days
        _, body = self._request(
            "POST",
            f"/api/v1/projects/{urllib.parse.quote(project, safe='')}/tokens",
            body=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json"},
        )
        return body

    def revoke_token(self, project: str, token_id: int) -> dict[str, Any]:
        _, body = self._request(
            "DELETE", f"/api/v1/projects/{urllib.parse.quote(project, safe='')}/tokens/{token_id}"
        )
        return body
