"""A small Prometheus registry (text exposition format 0.0.4), per process, no dependency.

An ASGI middleware counts requests and observes latency by route template (never by raw path, so
project names and ids cannot blow up the label space).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import defaultdict
from typing import Any

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _labels(pairs: tuple[tuple[str, str], ...]) -> str:
    if not pairs:
        return ""
    esc = (v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for _, v in pairs)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(pairs, esc, strict=True)) + "}"


class Registry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, dict[tuple[tuple[str, str], ...], float]] = defaultdict(dict)
        self._hist: dict[str, dict[tuple[tuple[str, str], ...], list[float]]] = defaultdict(dict)
        self._help: dict[str, tuple[str, str]] = {}

    def describe(self, name: str, kind: str, text: str) -> None:
        self._help[name] = (kind, text)

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            series = self._counters[name]
            series[key] = series.get(key, 0.0) + value

    def observe(self, name: str, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            series = self._hist[name]
            data = series.get(key)
            if data is None:
                data = series[key] = [0.0] * (len(BUCKETS) + 2)  # buckets..., sum, count
            index = bisect.bisect_left(BUCKETS, value)  # first bucket whose bound >= value
            if index < len(BUCKETS):
                data[index] += 1
            data[-2] += value
            data[-1] += 1

    def render(self) -> str:
        lines: list[str] = []
        with self._lock:
            for name in sorted(set(self._counters) | set(self._hist)):
                kind, text = self._help.get(
                    name, ("counter" if name in self._counters else "histogram", name)
                )
                lines.append(f"# HELP {name} {text}")
                lines.append(f"# TYPE {name} {kind}")
                for key, value in sorted(self._counters.get(name, {}).items()):
                    lines.append(f"{name}{_labels(key)} {_num(value)}")
                for key, data in sorted(self._hist.get(name, {}).items()):
                    cumulative = 0.0
                    for bound, count in zip(BUCKETS, data[: len(BUCKETS)], strict=True):
                        cumulative += count
                        lines.append(
                            f"{name}_bucket{_labels(key + (('le', repr(bound)),))} {_num(cumulative)}"
                        )
                    lines.append(f"{name}_bucket{_labels(key + (('le', '+Inf'),))} {_num(data[-1])}")
                    lines.append(f"{name}_sum{_labels(key)} {data[-2]:.6f}")
                    lines.append(f"{name}_count{_labels(key)} {_num(data[-1])}")
        return "\n".join(lines) + "\n"


def _num(value: float) -> str:
    return str(int(value)) if value == int(value) else repr(value)


def new_registry() -> Registry:
    """One registry per app (tests run many apps in one process; each must count alone)."""
    reg = Registry()
    reg.describe("maingrad_http_requests_total", "counter", "HTTP requests by method, route and status.")
    reg.describe("maingrad_http_request_duration_seconds", "histogram", "HTTP request latency by route.")
    reg.describe("maingrad_reports_total", "counter", "Report uploads by outcome.")
    reg.describe(
        "maingrad_records_ingested_total", "counter", "Runtime records stored (duplicates excluded)."
    )
    reg.describe("maingrad_records_duplicate_total", "counter", "Runtime records received again and ignored.")
    return reg


def route_template(scope: dict[str, Any]) -> str:
    """The matched path with parameters put back as {name}; 'unmatched' when routing found nothing."""
    if scope.get("route") is None and "endpoint" not in scope:
        return "unmatched"
    path = scope.get("path", "")
    position = 0
    for name, value in (scope.get("path_params") or {}).items():  # in path order
        if name == "path":  # static files: one series for the mount
            return path[: len(path) - len(str(value))] + "{path}"
        segment = "/" + str(value)
        index = path.find(segment, position)
        while index >= 0 and path[index + len(segment) : index + len(segment) + 1] not in ("", "/"):
            index = path.find(segment, index + 1)
        if index >= 0:
            placeholder = "/{" + name + "}"
            path = path[:index] + placeholder + path[index + len(segment) :]
            position = index + len(placeholder)
    return path


class MetricsMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware overhead on the hot path)."""

    def __init__(self, app: Any, registry: Registry) -> None:
        self.app = app
        self.registry = registry

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = {"code": 500}

        async def send_wrapper(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            template = route_template(scope)
            elapsed = time.perf_counter() - start
            self.registry.inc(
                "maingrad_http_requests_total",
                method=scope["method"],
                route=template,
                status=str(status["code"]),
            )
            self.registry.observe("maingrad_http_request_duration_seconds", elapsed, route=template)
