"""Where records go at step boundaries: memory, a per-rank JSONL file, or the service over HTTP.

Sinks are fed by `Handle.step()`/`flush()`/`remove()`, never from inside a hook. None of them raises into
training: failures are counted in `stats()`. The HTTP sink posts from a background thread through a
bounded queue and drops (counting) whole batches when the queue is full, so a slow or dead service costs
the training loop one `put_nowait` per batch.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from maingrad.contracts import records as records_contract
from maingrad.hooks.records import RunMeta


@runtime_checkable
class Sink(Protocol):
    def open(self, meta: RunMeta) -> None: ...

    def emit(self, records: Sequence[dict]) -> None: ...

    def close(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...


def dumps(record: dict) -> str:
    return json.dumps(record, separators=(",", ":"), allow_nan=False)


class MemorySink:
    """Keeps the last `maxlen` records as dicts (tests, notebooks, `handle.summary()` of a short run)."""

    def __init__(self, maxlen: int = 100_000) -> None:
        self._records: deque[dict] = deque(maxlen=maxlen)
        self.emitted = 0

    def open(self, meta: RunMeta) -> None:
        self.meta = meta

    def emit(self, records: Sequence[dict]) -> None:
        self._records.extend(records)
        self.emitted += len(records)

    @property
    def records(self) -> list[dict]:
        return list(self._records)

    def close(self) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {"sink": "memory", "emitted": self.emitted, "kept": len(self._records)}


class JsonlSink:
    """Appends NDJSON to one file per rank: `{rank}`/`{run}` in the path are filled in, otherwise
    `.rank<N>` is inserted before the suffix (`records.jsonl` -> `records.rank0.jsonl`)."""

    def __init__(self, path: str | Path) -> None:
        self.template = str(path)
        self.path: Path | None = None
        self._file: Any = None
        self.written = 0
        self.errors = 0
        self.last_error: str | None = None

    def open(self, meta: RunMeta) -> None:
        template = self.template
        if "{rank}" in template or "{run}" in template:
            path = Path(template.format(rank=meta.rank, run=meta.run))
        else:
            base = Path(template)
            path = base.with_name(f"{base.stem}.rank{meta.rank}{base.suffix or '.jsonl'}")
        self.path = path

    def emit(self, records: Sequence[dict]) -> None:
        if not records or self.path is None:
            return
        try:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open across steps
            self._file.write("".join(dumps(r) + "\n" for r in records))
            self._file.flush()
            self.written += len(records)
        except Exception as exc:  # noqa: BLE001 - a full disk must not stop training
            self.errors += len(records)
            self.last_error = f"{type(exc).__name__}: {exc}"

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(Exception):
                self._file.close()
            self._file = None

    def stats(self) -> dict[str, Any]:
        return {
            "sink": "jsonl",
            "path": str(self.path),
            "written": self.written,
            "errors": self.errors,
            "last_error": self.last_error,
        }


_STOP = object()
# Answers worth trying again: the server shed load or is restarting (its ingest is idempotent on record ids).
_TRANSIENT = frozenset({429, 502, 503, 504})


def _retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header in its delta-seconds form (the service sends that form)."""
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


class HttpSink:
    """Batched NDJSON POSTs to `{url}/api/v1/projects/{project}/runs/{run}/records?commit_sha=...`.

    `emit()` only splits records into batches and `put_nowait`s them on a bounded queue (full: the batch is
    dropped and counted); a daemon thread serializes and sends them with urllib. A transient failure (429,
    502, 503, 504, or no connection) is tried again up to `retries` times, after the server's Retry-After or
    an exponential backoff from `backoff` seconds, each wait capped at `max_delay`; a 4xx is never retried
    (re-sent records are harmless: the service ignores a record id it already has). `close()` waits at most
    `close_timeout` seconds for the queue to drain; no retry starts after that deadline.
    """

    def __init__(
        self,
        url: str,
        project: str,
        *,
        token: str | None = None,
        run: str | None = None,
        commit: str | None = None,
        batch_size: int = 1000,
        max_queue: int = 64,
        timeout: float = 10.0,
        close_timeout: float = 10.0,
        retries: int = 3,
        backoff: float = 0.5,
        max_delay: float = 30.0,
    ) -> None:
        if batch_size < 1 or max_queue < 1:
            raise ValueError("batch_size and max_queue must be >= 1")
        if retries < 0 or backoff < 0 or max_delay < 0:
            raise ValueError("retries, backoff and max_delay must be >= 0")
        self.base = url.rstrip("/")
        self.project = project
        self.token = token
        self.run = run
        self.commit = commit
        self.batch_size = batch_size
        self.timeout = timeout
        self.close_timeout = close_timeout
        self.retries = retries
        self.backoff = backoff
        self.max_delay = max_delay
        self._closing = threading.Event()
        self._deadline = float("inf")  # set by close(): no retry starts after it
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.endpoint: str | None = None
        self.enqueued = 0
        self.sent = 0
        self.dropped = 0
        self.failed = 0
        self.posts = 0
        self.retried = 0
        self.last_error: str | None = None
        self.last_status: int | None = None
        self.ended = False
        self._meta: RunMeta | None = None
        self._end_endpoint = ""

    def open(self, meta: RunMeta) -> None:
        run = self.run or meta.run
        commit = self.commit if self.commit is not None else meta.commit
        quote = urllib.parse.quote
        run_url = f"{self.base}/api/v1/projects/{quote(self.project, safe='')}/runs/{quote(run, safe='')}"
        query = "?" + urllib.parse.urlencode({"commit_sha": commit}) if commit else ""
        self.endpoint = f"{run_url}/records{query}"
        self._end_endpoint = f"{run_url}/{records_contract.END_PATH}{query}"
        self._meta = RunMeta(run=run, rank=meta.rank, mode=meta.mode, commit=commit)
        self._thread = threading.Thread(target=self._worker, name="maingrad-http-sink", daemon=True)
        self._thread.start()

    def emit(self, records: Sequence[dict]) -> None:
        if self._thread is None:
            self.dropped += len(records)
            return
        size = self.batch_size
        for start in range(0, len(records), size):
            batch = list(records[start : start + size])
            try:
                self._queue.put_nowait(batch)
                self.enqueued += len(batch)
            except queue.Full:
                self.dropped += len(batch)

    def _post(self, batch: list[dict]) -> None:
        body = ("\n".join(dumps(r) for r in batch) + "\n").encode("utf-8")
        headers = {"Content-Type": "application/x-ndjson"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(self.endpoint or "", data=body, headers=headers, method="POST")
        with urllib.request.urlopen(request, timeout=self.timeout) as response:  # noqa: S310 - user-given URL
            response.read()
            self.last_status = response.status

    def _worker(self) -> None:
        while True:
            batch = self._queue.get()
            try:
                if batch is _STOP:
                    return
                self._send(batch)
            finally:
                self._queue.task_done()

    def _send(self, batch: list[dict]) -> None:
        """Post one batch, retrying transient failures; never raises."""
        attempt = 0
        while True:
            wait: float | None = None
            try:
                self._post(batch)
                with self._lock:
                    self.sent += len(batch)
                    self.posts += 1
                return
            except urllib.error.HTTPError as exc:
                error: Exception = exc
                transient = exc.code in _TRANSIENT
                wait = _retry_after(exc.headers.get("Retry-After") if exc.headers else None)
            except (
                urllib.error.URLError,
                OSError,
            ) as exc:  # refused, reset, timed out: the server may return
                error, transient = exc, True
            except Exception as exc:  # noqa: BLE001 - anything else: count and go on
                error, transient = exc, False
            with self._lock:
                self.last_error = f"{type(error).__name__}: {error}"[:500]
                self.last_status = getattr(error, "code", None)
            delay = min(self.backoff * 2**attempt if wait is None else wait, self.max_delay)
            if not transient or attempt >= self.retries or time.monotonic() + delay > self._deadline:
                with self._lock:
                    self.failed += len(batch)
                return
            attempt += 1
            with self._lock:
                self.retried += 1
            self._closing.wait(delay)  # close() cuts a long wait short; the deadline then decides

    def close(self) -> None:
        thread = self._thread
        if thread is None:
            return
        self._thread = None
        self._deadline = time.monotonic() + self.close_timeout
        self._closing.set()
        try:
            self._queue.put(_STOP, timeout=self.close_timeout)
        except queue.Full:
            return
        thread.join(self.close_timeout)
        if not thread.is_alive():
            self._send_end()

    def _send_end(self) -> None:
        """Tell the service this rank is done (contracts.records.end_marker): until every rank has, the gate
        treats the run's records as partial evidence. Records still queued or lost are reported as lost."""
        meta = self._meta
        if meta is None or not self._end_endpoint:
            return
        with self._lock:
            lost = self.dropped + self.failed + max(0, self.enqueued - self.sent - self.failed)
            # A rank given by hand without a launcher's WORLD_SIZE still names at least its own world.
            world = max(records_contract.world_size_from_env(), meta.rank + 1)
            marker = records_contract.end_marker(meta.run, meta.rank, world, self.sent, lost)
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(
            self._end_endpoint, data=json.dumps(marker).encode(), headers=headers, method="POST"
        )
        timeout = max(0.1, min(self.timeout, self._deadline - time.monotonic()))
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - user-given URL
                response.read()
            self.ended = True
        except Exception as exc:  # noqa: BLE001 - never raise into training; the gate stays pending
            with self._lock:
                self.last_error = f"end marker: {type(exc).__name__}: {exc}"[:500]

    def stats(self) -> dict[str, Any]:
        return {
            "sink": "http",
            "endpoint": self.endpoint,
            "enqueued": self.enqueued,
            "sent": self.sent,
            "dropped": self.dropped,
            "failed": self.failed,
            "posts": self.posts,
            "retried": self.retried,
            "last_status": self.last_status,
            "last_error": self.last_error,
            "ended": self.ended,
        }


def make_sink(spec: Any, *, env: dict[str, str] | None = None) -> Sink:
    """A sink from an object or a short string: "memory", "jsonl:PATH", or an http(s) URL (project and token
    from MAINGRAD_PROJECT / MAINGRAD_TOKEN)."""
    if isinstance(spec, str):
        import os

        env = dict(os.environ) if env is None else env
        if spec == "memory":
            return MemorySink()
        if spec.startswith("jsonl:"):
            return JsonlSink(spec[len("jsonl:") :])
        if spec.startswith(("http://", "https://")):
            project = env.get("MAINGRAD_PROJECT")
            if not project:
                raise ValueError("an HTTP sink given as a URL needs MAINGRAD_PROJECT in the environment")
            return HttpSink(spec, project, token=env.get("MAINGRAD_TOKEN"))
        raise ValueError(
            f"unknown sink {spec!r}: use 'memory', 'jsonl:PATH', an http(s) URL or a Sink object"
        )
    for method in ("open", "emit", "close", "stats"):
        if not callable(getattr(spec, method, None)):
            raise TypeError(f"sink {spec!r} lacks a callable {method}()")
    return spec
