"""Builders for service tests: reports, SARIF logs, records, a real uvicorn server in a subprocess, the
`maingrad` command line, and ASGI requests straight through a middleware."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ADMIN = "mga_test_bootstrap_admin_token"  # the MAINGRAD_ADMIN_TOKEN of every test app
SECRET = "test-secret-for-hmac"


def unique(prefix: str = "p") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def sha(n: int | str) -> str:
    """A deterministic 40-hex commit SHA."""
    import hashlib

    return hashlib.sha1(str(n).encode()).hexdigest()


def finding(
    rule: str = "MG001",
    path: str = "megatron/core/transformer/moe/experts.py",
    line: int = 10,
    message: str = "op-fuser op accumulates into main_grad with no exposure",
    severity: str = "error",
    snippet: str = "ops.GroupedLinear(accumulate_into_main_grad=self.fuse)",
    fingerprint: str | None = None,
) -> dict[str, Any]:
    from maingrad.contracts.report import fingerprint as fp

    return {
        "rule": rule,
        "severity": severity,
        "path": path,
        "line": line,
        "column": 5,
        "end_line": line,
        "end_column": 40,
        "message": message,
        "fingerprint": fingerprint or fp(rule, path, snippet),
        "fix_available": False,
        "snippet": snippet,
    }


def report(*findings: dict[str, Any], files_scanned: int = 10) -> dict[str, Any]:
    return {
        "version": 1,
        "tool": {"name": "maingrad", "version": "0.1.0"},
        "root": ".",
        "files_scanned": files_scanned,
        "files_parsed": files_scanned,
        "parse_errors": [],
        "findings": list(findings),
        "rules": [
            {
                "id": "MG001",
                "name": "fused-op-without-exposure",
                "severity": "error",
                "summary": "s",
                "help_uri": "",
            }
        ],
        "duration_s": 0.1,
    }


def sarif_result(
    rule: str = "X1",
    path: str = "src/a.py",
    line: int = 3,
    message: str = "something odd",
    level: str | None = "warning",
    snippet: str | None = "x = 1",
    **extra: Any,
) -> dict[str, Any]:
    region: dict[str, Any] = {"startLine": line}
    if snippet is not None:
        region["snippet"] = {"text": snippet}
    result: dict[str, Any] = {
        "ruleId": rule,
        "message": {"text": message},
        "locations": [{"physicalLocation": {"artifactLocation": {"uri": path}, "region": region}}],
        **extra,
    }
    if level is not None:
        result["level"] = level
    return result


def sarif(
    *results: dict[str, Any], tool: str = "othertool", runs: int = 1, **run_extra: Any
) -> dict[str, Any]:
    return {
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [
            {
                "tool": {"driver": {"name": tool, "version": "1.2", "rules": []}},
                "results": list(results),
                **run_extra,
            }
            for _ in range(runs)
        ],
    }


def record(
    run: str, i: int, *, step: int | None = None, rank: int = 0, commit: str | None = None, **over: Any
) -> dict[str, Any]:
    rec = {
        "schema": 1,
        "id": f"{run}:{rank}:{i}",
        "run": run,
        "rank": rank,
        "step": i // 8 if step is None else step,
        "microbatch": i % 2,
        "phase": "forward" if i % 4 < 2 else "backward",
        "module": f"decoder.layers.{i % 2}.mlp.experts",
        "param": f"weight{i % 4}",
        "has_main_grad": i % 5 != 0,
        "main_grad_is_none": i % 3 == 0,
        "dtype": "torch.float32",
        "shape": [128, 64],
        "device": "cuda:0",
        "data_ptr": 140000000 + i,
        "overwrite_main_grad": None,
        "grad_added_to_main_grad": False,
        "is_fsdp_param": True,
        "action": "exposed" if i % 3 == 0 else "none",
        "anomaly": None,
        "mode": "fix",
        "commit": commit,
        "t_ns": 1_000_000 + i,
    }
    rec.update(over)
    return rec


def ndjson(records: list[dict[str, Any]]) -> bytes:
    return ("\n".join(json.dumps(r) for r in records) + "\n").encode()


CLI = [sys.executable, "-m", "maingrad.cli.main"]


def cli_env(*, keep_test_database: bool) -> dict[str, str]:
    """The environment a test's `maingrad` command runs with: none of the caller's MAINGRAD_, GITHUB_ or CI_
    variables (but MAINGRAD_TEST_POSTGRES_URL if `keep_test_database`), and the tests' secret."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MAINGRAD_", "GITHUB_", "CI_"))
        or (keep_test_database and k == "MAINGRAD_TEST_POSTGRES_URL")
    }
    env["MAINGRAD_SECRET"] = SECRET
    return env


def run_cli(*args: str, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """`maingrad ARGS` to its end, its output captured as text."""
    return subprocess.run([*CLI, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def start_cli(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """`maingrad ARGS` in the background, its output piped as text (`communicate()` collects it)."""
    return subprocess.Popen(
        [*CLI, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


def held_app(release: asyncio.Event) -> ASGIApp:
    """An ASGI app whose every request waits for `release`, then answers 200 "ok"."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    return app


async def asgi_get(app: ASGIApp, path: str) -> tuple[int, dict[bytes, bytes]]:
    """A GET of `path` straight through the ASGI `app`: the status and headers it starts its answer with."""
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    await app({"type": "http", "path": path, "method": "GET", "headers": []}, receive, send)
    return int(sent[0]["status"]), dict(sent[0]["headers"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """`maingrad serve` in a subprocess on loopback (a real server process, killable with SIGKILL)."""

    database_url: str
    workdir: Path
    env_extra: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> Server:
        self.port = self.port or free_port()
        env = {
            **os.environ,
            "MAINGRAD_DATABASE_URL": self.database_url,
            "MAINGRAD_SECRET": SECRET,
            "MAINGRAD_ADMIN_TOKEN": ADMIN,
            **self.env_extra,
        }
        log = open(self.workdir / f"server-{self.port}.log", "ab")  # noqa: SIM115 (closed by the process)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "maingrad.cli.main",
                "serve",
                "--port",
                str(self.port),
                "--no-access-log",
                "--log-level",
                "warning",
                "--workers",  # one process unless a test asks for more (metrics are per process)
                "1",
                *self.args,
            ],
            cwd=self.workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log()[-3000:]}")
            try:
                if httpx.get(self.url + "/readyz", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server did not become ready: {self.log()[-3000:]}")

    def log(self) -> str:
        path = self.workdir / f"server-{self.port}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()


def admin_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN}"}


class TcpProxy:
    """A loopback TCP forwarder to simulate a database outage without touching the shared server: `stop()`
    closes the listener and cuts every connection (the database becomes unreachable), `start()` brings it
    back on the same port."""

    def __init__(self, target_host: str, target_port: int, port: int = 0) -> None:
        import threading

        self.target = (target_host, target_port)
        self.port = port or free_port()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None

    def start(self) -> TcpProxy:
        import threading

        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def _accept(self, listener: socket.socket) -> None:
        import threading

        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        if self._listener is not None:
            # shutdown() wakes the thread blocked in accept() (close() alone leaves the port listening).
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            self._listener = None
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


def login_nonce(client: Any) -> str:
    """The sign-in form's one-time nonce (its cookie is now in the client's jar): POST /login needs both."""
    page = client.get("/login")
    assert page.headers["cache-control"] == "no-store"
    return page.text.split('name="csrf" value="', 1)[1].split('"', 1)[0]
