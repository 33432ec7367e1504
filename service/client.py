"""A small HTTP client for the CLI (standard library only: `maingrad upload` stays cheap to import)."""

from __future__ import annotations

import gzip
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any


class ClientError(Exception):
    """A request that failed: `status` is the HTTP status (0: no answer); `problem` the RFC 9457 body."""

    def __init__(self, status: int, message: str, problem: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.problem = problem or {}


@dataclass
class Client:
    url: str
    token: str | None = None
    timeout: float = 60.0
    retries: int = 3

    def _request(
        self,
        method: str,
        path: str,
        *,
        query: dict[str, Any] | None = None,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        qs = urllib.parse.urlencode({k: v for k, v in (query or {}).items() if v is not None})
        full = self.url.rstrip("/") + path + (f"?{qs}" if qs else "")
        hdrs = {"Accept": "application/json", "User-Agent": "maingrad-cli", **(headers or {})}
        if self.token:
            hdrs["Authorization"] = f"Bearer {self.token}"
        last: Exception | None = None
        for attempt in range(self.retries):
            request = urllib.request.Request(full, data=body, method=method, headers=hdrs)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return response.status, json.loads(response.read() or b"null")
            except urllib.error.HTTPError as exc:
                raw = exc.read()
                try:
                    problem = json.loads(raw)
                except ValueError:
                    problem = {"detail": raw.decode("utf-8", "replace")[:500]}
                if exc.code >= 500 and attempt < self.retries - 1:
                    last = exc
                    time.sleep(0.5 * 2**attempt)
                    continue
                detail = problem.get("detail") if isinstance(problem, dict) else None
                raise ClientError(exc.code, f"HTTP {exc.code}: {detail or exc.reason}", problem) from None
            except (urllib.error.URLError, OSError) as exc:
                last = exc
                if attempt < self.retries - 1:
                    time.sleep(0.5 * 2**attempt)
                    continue
        raise ClientError(0, f"no answer from {self.url}: {last}")

    def upload(
        self,
        project: str,
        report: bytes,
        *,
        commit_sha: str,
        branch: str | None,
        category: str | None,
        idempotency_key: str | None = None,
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
        )

    def gate(self, project: str, commit_sha: str, base_sha: str | None = None) -> dict[str, Any]:
        _, body = self._request(
            "GET",
            f"/api/v1/projects/{urllib.parse.quote(project, safe='')}/gate",
            query={"commit_sha": commit_sha, "base_sha": base_sha},
        )
        return body

    def create_token(
        self, project: str, scopes: list[str], name: str, expires_in_days: int | None
    ) -> dict[str, Any]:
        payload = {"name": name, "scopes": scopes, "expires_in_days": expires_in_days}
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
