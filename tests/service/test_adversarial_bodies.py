"""Any body within the size caps costs a bounded amount of server CPU and memory.

A real server process (SQLite) receives the audit's reproducers and Hypothesis-generated adversarial bodies
(quotes, escapes, nesting, many small values), each filled up to the decompressed-size cap and sent gzipped.
The server's own CPU time (utime + stime from /proc) is read around every request, and its peak resident set
(VmHWM) at the end: a request may cost at most 1 s of CPU, and the peak may grow at most 512 MB over the
server's size after start-up. The old value counter took 40 s of CPU for the first reproducer and +1.4 GB for
the second, so both bounds fail on it.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from svc_helpers import ADMIN, Server, sha, unique

from maingrad.service.jsonscan import ValueScanner, count_json_values

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")

CAP = 32 * 1024 * 1024  # the default max_decompressed_bytes
CPU_PER_REQUEST_S = 1.0
RSS_GROWTH_MB = 512


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


class Target:
    def __init__(self, server: Server, project: str, token: str) -> None:
        self.server = server
        self.project = project
        self.token = token
        assert server.proc is not None
        self.pid = server.proc.pid
        self.worst_cpu = 0.0
        self.costs: list[tuple[float, int, str]] = []
        self.codes: list[str] = []

    def post(self, raw: bytes, label: str, path: str = "/reports") -> int:
        body = gzip.compress(raw, 6)
        before = _cpu_s(self.pid)
        r = httpx.post(
            f"{self.server.url}/api/v1/projects/{self.project}{path}",
            params={"commit_sha": sha(label), **({"category": "adv"} if path == "/reports" else {})},
            content=body,
            headers={
                "Authorization": f"Bearer {self.token}",
                "Content-Encoding": "gzip",
                "Content-Type": "application/json",
            },
            timeout=120,
        )
        cost = _cpu_s(self.pid) - before
        self.costs.append((cost, r.status_code, label))
        self.codes.append(r.json().get("code", "") if r.status_code >= 400 else "")
        assert r.status_code < 500, (label, r.status_code, r.text[:300])
        assert cost <= CPU_PER_REQUEST_S, f"{label}: {cost:.2f} s of server CPU ({r.status_code})"
        return r.status_code


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    tmp = tmp_path_factory.mktemp("adversarial")
    server = Server(f"sqlite:///{tmp / 'adv.db'}", tmp).start()
    try:
        h = {"Authorization": f"Bearer {ADMIN}"}
        name = unique("adv")
        httpx.post(f"{server.url}/api/v1/projects", json={"name": name}, headers=h).raise_for_status()
        token = httpx.post(
            f"{server.url}/api/v1/projects/{name}/tokens", json={"scopes": ["upload"]}, headers=h
        ).json()["token"]
        t = Target(server, name, token)
        t.post(b'{"version":"2.1.0","runs":[{"tool":{"driver":{"name":"warm"}},"results":[]}]}', "warm-up")
        t.baseline_mb = _peak_mb(t.pid)  # type: ignore[attr-defined]
        yield t
        growth = _peak_mb(t.pid) - t.baseline_mb  # type: ignore[attr-defined]
        worst = max(t.costs)
        print(
            f"\nadversarial bodies: {len(t.costs)} requests, worst CPU {worst[0]:.2f} s ({worst[2]}), "
            f"peak RSS growth {growth:.0f} MB"
        )
        assert growth <= RSS_GROWTH_MB, f"server peak RSS grew {growth:.0f} MB"
    finally:
        server.stop()


def _fill(prefix: bytes, unit: bytes, suffix: bytes) -> bytes:
    count = max(1, (CAP - len(prefix) - len(suffix)) // max(len(unit), 1))
    return prefix + unit * count + suffix


def test_n1_unclosed_quote_reproducer(target: Target) -> None:
    # 1,980 bytes gzipped: 57 s of CPU in the old counter.
    assert target.post(b'"' + b'\\"' * 1000 + b"," * 2_000_001, "n1-quote") in (413, 422)


def test_n1_many_small_strings_reproducer(target: Target) -> None:
    # ~32 KB gzipped of "a", repeated (the audit's 8.4 M; here 7.9 M, so the text stays under the inflate cap
    # and reaches the value counter): +1,460 MB in the old counter.
    r = target.post(b'["a",' + b'"a",' * 7_900_000 + b'"a"]', "n1-strings")
    assert r == 413 and target.codes[-1] == "too_many_json_values"


def test_n2_results_count_across_runs(target: Target) -> None:
    result = {"ruleId": "R", "level": "error", "message": {"text": "m"}}
    run = {"tool": {"driver": {"name": "t"}}, "results": [result] * 2_000}
    log = {"version": "2.1.0", "runs": [run] * 13}  # 26,000 results: each run is small, the report is not
    assert target.post(json.dumps(log).encode(), "n2-runs") == 413
    assert target.codes[-1] == "too_many_results"


def test_records_batch_of_many_tiny_values_per_line(target: Target) -> None:
    # 1,000 lines of 21,000 empty lists each (60 MB inflated, under the records caps): parsing every line
    # before validating any took +1.3 GB; now a slice at a time.
    line = b'{"id":"r:0:0","x":[' + b"[]," * 20_000 + b"[]]}\n"
    assert target.post(line * 1_000, "records-tiny", "/runs/r/records") == 422


_UNITS = st.sampled_from(
    [
        b'"',
        b'\\"',
        b"\\",
        b"\\\\",
        b",",
        b'"a",',
        b"[",
        b"{",
        b"[]",
        b"{},",
        b'{"a":1},',
        b"1,",
        b'"\\u0000",',
    ]
)
_WRAPS = st.sampled_from(
    [
        (b"", b""),
        (b"[", b"]"),
        (b'{"version":"2.1.0","runs":[{"tool":{"driver":{"name":"t"}},"results":[', b"{}]}]}"),
        (b'{"version":"2.1.0","runs":[{"tool":{"driver":{"name":"t"}},"properties":{"x":[', b"1]}}]}"),
        (b'{"version":1,"tool":{"name":"maingrad"},"findings":[', b"]}"),
        (b'{"version":"2.1.0","runs":[{"tool":{"driver":{"name":"t","rules":[', b"{}]}}}]}"),
    ]
)


@settings(
    max_examples=12,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(wrap=_WRAPS, units=st.lists(_UNITS, min_size=1, max_size=4), lead=_UNITS)
def test_generated_adversarial_bodies_cost_bounded_cpu(
    target: Target, wrap: tuple[bytes, bytes], units: list[bytes], lead: bytes
) -> None:
    body = _fill(wrap[0] + lead, b"".join(units), wrap[1])
    target.post(body, f"gen-{len(target.costs)}")


@settings(max_examples=300, deadline=None, database=None)
@given(
    doc=st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(alphabet='"\\,[]{}a:\n', max_size=6),
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(st.text(alphabet='"\\,[]{}a', max_size=4), inner, max_size=4)
        ),
        max_leaves=30,
    ),
    chunk=st.integers(min_value=1, max_value=9),
)
def test_value_scanner_bounds_the_values_in_any_chunking(doc: object, chunk: int) -> None:
    """The bound holds for every split of the text into chunks (quotes and escapes cut anywhere)."""

    def values(v: object) -> int:
        if isinstance(v, list):
            return 1 + sum(values(x) for x in v)
        if isinstance(v, dict):
            return 1 + sum(values(x) for x in v.values())
        return 1

    text = json.dumps(doc).encode()
    scanner = ValueScanner()
    for start in range(0, len(text), chunk):
        scanner.feed(text[start : start + chunk])
    assert scanner.values >= values(doc)
    assert count_json_values(text, 0) >= min(values(doc), 1)
