"""Service speed on loopback: gate-query latency under open-loop load, and runtime-record ingest throughput.

    python3 benchmarks/service.py [--backends sqlite,postgres] [--rates 50,100,200,400] [--duration 5]
                                  [--batches 150] [--senders 8] [--json FILE]

For each backend a real `maingrad serve` process (uvicorn, `--workers` processes, access log off) runs on a fresh
database: a temporary SQLite file, and PostgreSQL in a fresh schema when MAINGRAD_BENCH_POSTGRES_URL or
MAINGRAD_TEST_POSTGRES_URL is set (dropped afterwards).

1. Gate latency. A project with a default-branch baseline and a feature commit (20 findings each, some new,
   some moved, some fixed) plus a runtime run for the commit. Requests are sent open-loop at a fixed rate
   (request i is due at t0 + i/rate, whatever happened before) for `--duration` seconds; latency is counted
   from the moment a request was due, so a server that falls behind is charged for the queue. p50/p99 and
   the achieved rate per offered rate, next to /healthz (the floor of client, HTTP stack and machine load
   at that moment). Polling one commit is what CI does (`maingrad gate --wait`), so answers are reused
   between unchanged reads; the same load is then run on a server with reuse off (`gate (no reuse)`:
   every request recomputes everything).
2. Ingest. `--senders` clients post pre-serialized NDJSON batches of 1,000 records (`--batches` in all) to
   one run as fast as the server acknowledges them; records/s = records stored / wall time.

3. Concurrency (`--clients 50,200,500`): that many clients each poll the gate back to back on their own
   keep-alive connection for `--duration` seconds; a client answered 503 waits its Retry-After, as the CLI
   does. Reported: answers/s, p50/p99/max latency of the 200s, and how many were shed (503): the server
   should shed rather than queue requests for seconds.
4. Memory (`--memory`): a fresh one-worker server per case; its peak RSS (VmHWM of /proc/PID/status) after the
   case, next to the same server's peak after start-up and a warm-up upload (the floor). Cases: the D1 gzip
   bomb (0.24 MiB inflating to 250 MiB of `{}`), the D1 records line (one 120 MiB NDJSON line, gzipped), the D2
   template expansion (100 KB template x 2,000 results), and the largest report accepted by default (25,000
   SARIF results). Target: every peak under 512 MB.

Targets: gate p99 <= 20 ms at 200 req/s; ingest >= 50,000 records/s.
Everything is bounded: requests = rate x duration per step, batches fixed, and a hard time limit.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "service"))

from svc_helpers import ADMIN, Server, finding, ndjson, record, report, sha  # noqa: E402

from maingrad.service.cli import default_workers  # noqa: E402

HEADERS = {"Authorization": f"Bearer {ADMIN}"}


def _pg_url() -> str | None:
    return os.environ.get("MAINGRAD_BENCH_POSTGRES_URL") or os.environ.get("MAINGRAD_TEST_POSTGRES_URL")


def _pg_schema(url: str) -> tuple[str, str]:
    import psycopg

    schema = f"mgbench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}options={quote(f'-csearch_path={schema}')}", schema


def _pg_drop(url: str, schema: str) -> None:
    import psycopg

    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def seed(server: Server) -> tuple[str, str]:
    """A project with a baseline on main and a feature commit to gate; returns (project url, head sha)."""
    name = f"bench-{uuid.uuid4().hex[:6]}"
    httpx.post(f"{server.url}/api/v1/projects", json={"name": name}, headers=HEADERS).raise_for_status()
    base = f"{server.url}/api/v1/projects/{name}"
    base_findings = [
        finding(path=f"pkg/mod{i % 7}.py", line=10 * i, snippet=f"call_{i}(x)") for i in range(20)
    ]
    head_findings = base_findings[:12] + [
        finding(path=f"pkg/mod{i % 7}.py", line=10 * i + 1, snippet=f"call_{i}(y)") for i in range(12, 16)
    ]
    head_findings += [
        finding(rule="MG003", path=f"pkg/new{i}.py", line=i, snippet=f"if p{i}.main_grad:") for i in range(4)
    ]
    for sha_, branch, findings in (
        (sha("base"), "main", base_findings),
        (sha("head"), "feature", head_findings),
    ):
        r = httpx.post(
            f"{base}/reports",
            params={"commit_sha": sha_, "branch": branch},
            content=json.dumps(report(*findings)),
            headers=HEADERS,
        )
        r.raise_for_status()
    recs = [record("gate-run", i, commit=sha("head")) for i in range(2_000)]
    httpx.post(
        f"{base}/runs/gate-run/records", content=ndjson(recs), headers=HEADERS, timeout=60
    ).raise_for_status()
    return base, sha("head")


class _Conn:
    """A bare keep-alive HTTP/1.1 connection: the load generator shares the machine's two cores with the
    server, so it must cost far less per request than the server does (httpx costs about as much)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, host: str, port: int) -> _Conn:
        return cls(*await asyncio.open_connection(host, port))

    async def get(self, request: bytes) -> int:
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        await self.reader.readexactly(length)
        return status

    def close(self) -> None:
        self.writer.close()


async def _open_loop(url: str, params: dict[str, str], rate: float, duration: float) -> dict[str, float]:
    n = max(1, int(rate * duration))
    parsed = httpx.URL(url).copy_merge_params(params)
    request = (
        f"GET {parsed.raw_path.decode()} HTTP/1.1\r\nHost: {parsed.host}:{parsed.port}\r\n"
        f"Authorization: {HEADERS['Authorization']}\r\nAccept: application/json\r\n\r\n"
    ).encode()
    idle: list[_Conn] = [await _Conn.open(parsed.host, parsed.port) for _ in range(32)]
    for conn in idle[:8]:  # warm up
        assert await conn.get(request) == 200
    latencies: list[float] = []
    errors = 0
    t0 = time.perf_counter() + 0.05

    async def one(i: int) -> None:
        nonlocal errors
        due = t0 + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        ok = False
        for _attempt in range(2):  # a kept-alive connection the server closed meanwhile: reconnect once
            conn = idle.pop() if idle else await _Conn.open(parsed.host, parsed.port)
            try:
                ok = await conn.get(request) == 200
                idle.append(conn)
                break
            except (OSError, asyncio.IncompleteReadError, ValueError):
                conn.close()
        if ok:
            latencies.append(time.perf_counter() - due)
        else:
            errors += 1

    await asyncio.gather(*(one(i) for i in range(n)))
    elapsed = time.perf_counter() - t0
    for conn in idle:
        conn.close()
    latencies.sort()
    return {
        "offered_rps": rate,
        "requests": n,
        "achieved_rps": n / elapsed,
        "p50_ms": 1000 * statistics.median(latencies) if latencies else float("nan"),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
        if latencies
        else float("nan"),
        "errors": errors,
    }


def _run(coro: Any) -> Any:
    try:
        import uvloop  # accurate timers: the schedule, not the client's wake-up jitter, sets "due"

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def gate_latency(
    base: str, head: str, rates: list[float], duration: float, label: str = "gate", floor: bool = True
) -> list[dict[str, Any]]:
    """Gate latency per offered rate, next to /healthz at the same rate: the floor of this client, the
    HTTP stack and the machine's load at that moment (measured in the same run)."""
    url = f"{base}/gate"
    check = httpx.get(url, params={"commit_sha": head}, headers=HEADERS).json()
    assert check["status"] == "fail" and check["summary"]["new"] > 0, check["summary"]
    health = base.split("/api/")[0] + "/healthz"
    out = []
    for rate in rates:
        out.append({"endpoint": label, **_run(_open_loop(url, {"commit_sha": head}, rate, duration))})
        if floor:
            out.append({"endpoint": "healthz", **_run(_open_loop(health, {}, rate, duration))})
    return out


def _post_raw(sock: socket.socket, request: bytes) -> tuple[int, bytes]:
    """POST pre-built bytes on a kept-alive socket; returns (status, body). The client must cost next to
    nothing (httpx spends more CPU on a 550 KB body than the server spends storing it)."""
    sock.sendall(request)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("server closed the connection")
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    while len(body) < length:
        body += sock.recv(65536)
    return int(head[9:12]), body


def ingest(base: str, batches: int, senders: int, batch_size: int = 1_000) -> dict[str, float]:
    run = f"ingest-{uuid.uuid4().hex[:6]}"
    url = httpx.URL(f"{base}/runs/{run}/records")
    with httpx.Client(headers=HEADERS, timeout=60) as warm:  # create the run outside the timed part
        warm.post(str(url), content=ndjson([record(run, 10**9)])).raise_for_status()
    # Warm every worker outside the timed part too (its first request builds routes, connections and
    # statement caches): one full batch per sender connection, into a run of its own.
    warm_url = f"{base}/runs/{run}-warm/records"
    for s in range(senders):
        with httpx.Client(headers=HEADERS, timeout=60) as warm:
            body = ndjson([record(f"{run}-warm", s * batch_size + i) for i in range(batch_size)])
            warm.post(warm_url, content=body).raise_for_status()
    requests = []
    for b in range(batches):
        body = ndjson([record(run, b * batch_size + i) for i in range(batch_size)])
        head = (
            f"POST {url.raw_path.decode()} HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n"
            f"Authorization: {HEADERS['Authorization']}\r\nContent-Type: application/x-ndjson\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        requests.append(head + body)
    queue = list(range(batches))
    lock = threading.Lock()
    errors: list[str] = []

    def sender() -> None:
        sock = socket.create_connection((url.host, url.port))
        try:
            while True:
                with lock:
                    if not queue:
                        return
                    b = queue.pop()
                status, body = _post_raw(sock, requests[b])
                if status != 200 or json.loads(body)["inserted"] != batch_size:
                    errors.append(f"{status} {body[:200]!r}")
        finally:
            sock.close()

    threads = [threading.Thread(target=sender) for _ in range(senders)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    stored = httpx.get(f"{base}/runs/{run}", headers=HEADERS, timeout=120).json()["record_count"] - 1
    if errors:
        raise RuntimeError(f"ingest errors: {errors[:3]}")
    assert stored == batches * batch_size, stored
    return {"records": stored, "seconds": elapsed, "records_per_s": stored / elapsed, "senders": senders}


async def _closed_loop(url: str, params: dict[str, str], clients: int, duration: float) -> dict[str, float]:
    """`clients` keep-alive connections polling back to back; a 503 makes that client wait its Retry-After."""
    parsed = httpx.URL(url).copy_merge_params(params)
    request = (
        f"GET {parsed.raw_path.decode()} HTTP/1.1\r\nHost: {parsed.host}:{parsed.port}\r\n"
        f"Authorization: {HEADERS['Authorization']}\r\nAccept: application/json\r\n\r\n"
    ).encode()
    latencies: list[float] = []
    counts = {"ok": 0, "shed": 0, "errors": 0}
    stop = time.perf_counter() + duration

    async def client() -> None:
        conn: _Conn | None = None
        while time.perf_counter() < stop:
            try:
                if conn is None:
                    conn = await _Conn.open(parsed.host, parsed.port)
                started = time.perf_counter()
                status = await conn.get(request)
            except (OSError, asyncio.IncompleteReadError, ValueError):
                counts["errors"] += 1
                conn = None
                await asyncio.sleep(0.05)
                continue
            if status == 200:
                latencies.append(time.perf_counter() - started)
                counts["ok"] += 1
            elif status == 503:
                counts["shed"] += 1
                await asyncio.sleep(2.0)  # the server's Retry-After
            else:
                counts["errors"] += 1
        if conn is not None:
            conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    elapsed = time.perf_counter() - t0
    latencies.sort()

    def pct(q: float) -> float:
        return (
            1000 * latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else float("nan")
        )

    return {
        "clients": clients,
        "answered_per_s": counts["ok"] / elapsed,
        "p50_ms": pct(0.5),
        "p99_ms": pct(0.99),
        "max_ms": 1000 * latencies[-1] if latencies else float("nan"),
        "ok": counts["ok"],
        "shed_503": counts["shed"],
        "errors": counts["errors"],
    }


def concurrency(base: str, head: str, clients: list[int], duration: float) -> list[dict[str, Any]]:
    return [_run(_closed_loop(f"{base}/gate", {"commit_sha": head}, n, duration)) for n in clients]


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def _cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds (its own CPU, whatever else runs on the machine)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _gzip_json(value: Any) -> bytes:
    return gzip.compress(json.dumps(value).encode())


def _gzip_parts(parts: Any) -> bytes:
    import zlib

    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    return b"".join([packer.compress(p) for p in parts] + [packer.flush()])


def _memory_cases() -> list[tuple[str, str, bytes, dict[str, str]]]:
    """(name, path suffix, body, headers): the D1/D2 reproducers and the largest default-accepted report."""
    gz = {"Content-Encoding": "gzip"}
    n = (250 << 20) // 3
    bomb = _gzip_parts(
        [b'{"version":"2.1.0","runs":[{"tool":{"driver":{"name":"x"}},"results":[']
        + [b"{}," * (1 << 20)] * (n >> 20)
        + [b"{}]}]}"]
    )
    line = b'{"id":"u1","rank":0,"step":1,"phase":"forward","module":"' + b"m" * (120 << 20) + b'"}\n'
    long_line = _gzip_parts([line[i : i + (8 << 20)] for i in range(0, len(line), 8 << 20)])
    template = {
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "t",
                        "rules": [{"id": "R", "messageStrings": {"m": {"text": "x" * 100_000 + "{0}"}}}],
                    }
                },
                "results": [
                    {"ruleId": "R", "message": {"id": "m", "arguments": ["i"]}} for _ in range(2_000)
                ],
            }
        ],
    }
    results = [
        {
            "ruleId": f"R{i % 50}",
            "level": "warning",
            "message": {"text": f"finding {i}: something odd about this call"},
            "locations": [
                {
                    "physicalLocation": {
                        "artifactLocation": {"uri": f"src/pkg{i % 97}/mod{i % 13}.py"},
                        "region": {
                            "startLine": i % 5000 + 1,
                            "startColumn": 5,
                            "snippet": {"text": f"call_{i}(x, y)"},
                        },
                    }
                }
            ],
            "partialFingerprints": {"primaryLocationLineHash": f"{i:016x}"},
        }
        for i in range(25_000)
    ]
    largest = {"version": "2.1.0", "runs": [{"tool": {"driver": {"name": "big"}}, "results": results}]}
    # The worst a body may do under the default caps: as many values as allowed (the most objects per byte,
    # in a property bag, which is kept), and as many bytes as allowed (one string just under the inflate cap).
    values = _gzip_parts(
        [b'{"version":"2.1.0","runs":[{"tool":{"driver":{"name":"x"}},"properties":{"bag":[']
        + [b"{}," * 1000] * 1990
        + [b'{}]},"results":[]}]}']
    )
    text = _gzip_parts(
        [b'{"version":"2.1.0","runs":[{"tool":{"driver":{"name":"x"}},"properties":{"blob":"']
        + [b"a" * (1 << 20)] * 31
        + [b'"},"results":[]}]}']
    )
    # An unclosed quote, then escapes and commas (57 s of CPU in the old counter); "a", x 8.4 M
    # (+1,460 MB); 20 runs x 25,000 results (+1 GB, accepted before the per-report cap).
    quote = gzip.compress(b'"' + b'\\"' * 1000 + b"," * 2_000_001, 9)
    strings = _gzip_parts([b'["a",'] + [b'"a",' * 100_000] * 79 + [b'"a"]'])  # 7.9 M: under the inflate cap
    small = {"ruleId": "R", "message": {"text": "m"}}
    runs = {
        "version": "2.1.0",
        "runs": [{"tool": {"driver": {"name": f"t{k}"}}, "results": [small] * 25_000} for k in range(20)],
    }
    return [
        ("N1 unclosed quote + escapes + 2M commas", "/reports?commit_sha=n1q", quote, gz),
        ('N1 "a", x 7.9 M', "/reports?commit_sha=n1s", strings, gz),
        ("N2 20 runs x 25,000 results", "/reports?commit_sha=n2", _gzip_json(runs), gz),
        ("D1 gzip bomb (250 MiB of {})", "/reports?commit_sha=b4", bomb, gz),
        ("D1 one 120 MiB record line", "/runs/r/records", long_line, gz),
        ("D2 100 KB template x 2,000", "/reports?commit_sha=t1", _gzip_json(template), gz),
        ("largest accepted: 25,000 results", "/reports?commit_sha=big", _gzip_json(largest), gz),
        ("at the value budget: 1.99M objects", "/reports?commit_sha=v1", values, gz),
        ("at the inflate cap: a 31 MiB string", "/reports?commit_sha=s1", text, gz),
    ]


def memory(url: str, workdir: Path, only: str | None = None) -> list[dict[str, Any]]:
    out = []
    for name, suffix, body, headers in _memory_cases():
        if only and only.lower() not in name.lower():
            continue
        server = Server(url, workdir, args=["--workers", "1"]).start()
        try:
            assert server.proc is not None
            base, _head = seed(server)  # a warm server: every code path imported and used once
            floor = _peak_rss_mb(server.proc.pid)
            cpu = _cpu_s(server.proc.pid)
            r = httpx.post(base + suffix, content=body, headers={**HEADERS, **headers}, timeout=600)
            cpu = _cpu_s(server.proc.pid) - cpu
            peak = _peak_rss_mb(server.proc.pid)
            out.append(
                {
                    "case": name,
                    "wire_kib": len(body) / 1024,
                    "status": r.status_code,
                    "code": r.json().get("code", r.json().get("outcome")),
                    "floor_mb": floor,
                    "peak_mb": peak,
                    "peak_over_floor": peak / floor,
                    "cpu_s": cpu,
                }
            )
        finally:
            server.stop()
    return out


def bench_backend(name: str, url: str, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    if args.memory:
        return {"backend": name, "workers": 1, "memory": memory(url, workdir, args.case)}
    env = (
        {"MAINGRAD_MAX_CONCURRENT_REQUESTS": str(args.max_concurrent)}
        if args.max_concurrent is not None
        else {}
    )
    server = Server(url, workdir, args=["--workers", str(args.workers)], env_extra=env).start()
    gate: list[dict[str, Any]] = []
    ing: dict[str, Any] = {}
    try:
        base, head = seed(server)
        if "gate" in args.parts:
            gate = gate_latency(base, head, args.rates, args.duration)
        if "ingest" in args.parts:
            ing = ingest(base, args.batches, args.senders)
        crowd = concurrency(base, head, args.clients, args.duration) if "concurrency" in args.parts else []
    finally:
        server.stop()
    if "gate" not in args.parts:
        return {"backend": name, "workers": args.workers, "gate": gate, "ingest": ing, "concurrency": crowd}
    # The same polling with answer reuse off: every request recomputes the gate from scratch.
    cold = Server(
        url, workdir, args=["--workers", str(args.workers)], env_extra={"MAINGRAD_GATE_CACHE_SIZE": "0"}
    )
    cold.start()
    try:
        base, head = seed(cold)
        gate += gate_latency(base, head, args.rates, args.duration, label="gate (no reuse)", floor=False)
    finally:
        cold.stop()
    return {"backend": name, "workers": args.workers, "gate": gate, "ingest": ing, "concurrency": crowd}


# The markdown tables printed per section of a backend's results: title, header, alignment, and a row of the
# table per item of the section (the memory cases, gate endpoints, concurrency levels; ingest is one item).
_TABLES: dict[str, tuple[str, str, str, Callable[[dict[str, Any], dict[str, Any]], str]]] = {
    "memory": (
        "Peak server RSS per request (one worker; target < 512 MB)",
        "| backend | case | on the wire KiB | answer | floor MB | peak MB | peak / floor | server CPU s |",
        "|---|---|---:|---|---:|---:|---:|---:|",
        lambda res, m: (
            f"| {res['backend']} | {m['case']} | {m['wire_kib']:,.0f} | {m['status']} {m['code']} | "
            f"{m['floor_mb']:.0f} | {m['peak_mb']:.0f} | {m['peak_over_floor']:.2f} | {m['cpu_s']:.2f} |"
        ),
    ),
    "gate": (
        "Gate latency (open loop; target p99 <= 20 ms at 200 req/s)",
        "| backend | workers | endpoint | offered req/s | achieved req/s | p50 ms | p99 ms | errors |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
        lambda res, g: (
            f"| {res['backend']} | {res['workers']} | {g['endpoint']} | {g['offered_rps']:.0f} | "
            f"{g['achieved_rps']:.0f} | {g['p50_ms']:.1f} | {g['p99_ms']:.1f} | {g['errors']} |"
        ),
    ),
    "ingest": (
        "Record ingest (batches of 1,000; target >= 50,000 records/s)",
        "| backend | workers | senders | records | seconds | records/s |",
        "|---|---:|---:|---:|---:|---:|",
        lambda res, i: (
            f"| {res['backend']} | {res['workers']} | {i['senders']} | {i['records']} | {i['seconds']:.2f} | "
            f"{i['records_per_s']:,.0f} |"
        ),
    ),
    "concurrency": (
        "Concurrent gate pollers (closed loop; a 503 makes the client wait its Retry-After)",
        "| backend | workers | clients | answered/s | p50 ms | p99 ms | max ms | 200s | shed 503 | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        lambda res, c: (
            f"| {res['backend']} | {res['workers']} | {c['clients']} | {c['answered_per_s']:.0f} | "
            f"{c['p50_ms']:.1f} | {c['p99_ms']:.1f} | {c['max_ms']:.0f} | {c['ok']} | {c['shed_503']} | {c['errors']} |"
        ),
    ),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--rates", default="50,100,200,400", help="offered gate requests per second")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per offered rate")
    parser.add_argument("--batches", type=int, default=150, help="ingest batches of 1,000 records")
    parser.add_argument(
        "--senders",
        type=int,
        default=8,
        help="concurrent ingest clients (like training ranks; with 2, uvicorn's shared accept often hands both "
        "connections to one worker, which halves throughput on 2 workers)",
    )
    parser.add_argument(
        "--workers", type=int, default=default_workers(), help="worker processes (default: maingrad serve's)"
    )
    parser.add_argument("--clients", default="50,200,500", help="concurrent gate pollers ('' to skip)")
    parser.add_argument("--memory", action="store_true", help="only the peak-RSS cases (D1, D2, largest)")
    parser.add_argument(
        "--case", help="with --memory: only the cases whose name contains this (e.g. 'largest accepted')"
    )
    parser.add_argument("--parts", default="gate,ingest,concurrency", help="which measurements to run")
    parser.add_argument(
        "--max-concurrent", type=int, help="the server's MAINGRAD_MAX_CONCURRENT_REQUESTS (default: its own)"
    )
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    args.clients = [int(c) for c in args.clients.split(",") if c]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for backend in args.backends.split(","):
            if backend == "sqlite":
                results.append(bench_backend("sqlite", f"sqlite:///{tmp}/bench.db", Path(tmp), args))
            elif backend == "postgres":
                pg = _pg_url()
                if not pg:
                    print("postgres: skipped (set MAINGRAD_BENCH_POSTGRES_URL or MAINGRAD_TEST_POSTGRES_URL)")
                    continue
                url, schema = _pg_schema(pg)
                try:
                    results.append(bench_backend("postgres", url, Path(tmp), args))
                finally:
                    _pg_drop(pg, schema)
    for section in ("memory",) if args.memory else ("gate", "ingest", "concurrency"):
        title, header, align, row = _TABLES[section]
        print(f"\n{title}\n")
        print(header)
        print(align)
        for res in results:
            items = res[section]
            for item in items if isinstance(items, list) else [items] if items else []:
                print(row(res, item))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
