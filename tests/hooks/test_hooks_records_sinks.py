"""Record schema, ring buffer, sinks (memory, per-rank JSONL, HTTP against a real local server), the CLI and
the public expose_main_grad()."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from emulators import MegatronFSDP, batches, fsdp_run, make_layer

from maingrad.cli.main import main as cli_main
from maingrad.contracts.records import FIELDS, validate
from maingrad.hooks import HttpSink, JsonlSink, MemorySink, expose_main_grad, install
from maingrad.hooks.records import CallEntry, PlainRow, RecordRing, Row, RunMeta, to_dict, to_dicts, view


def _train(**kwargs):
    model = MegatronFSDP(make_layer(), "optim_grads_params")
    handle = install(model, run="r1", rank=3, commit="abc123", **kwargs)
    fsdp_run(model, batches(2, 2), on_step=handle.step)
    return handle


def test_records_follow_the_schema_exactly() -> None:
    handle = _train()
    records = handle.records()
    handle.remove()
    assert len(records) == 2 * 2 * 2 * 8  # steps x micro-batches x phases x parameters
    for record in records:
        assert tuple(record) == FIELDS
        assert validate(record) == []
        json.dumps(record, allow_nan=False)
    assert [r["id"] for r in records[:2]] == ["r1:3:1", "r1:3:2"]
    assert {(r["run"], r["rank"], r["commit"], r["mode"], r["schema"]) for r in records} == {
        ("r1", 3, "abc123", "fix", 1)
    }
    assert {r["is_fsdp_param"] for r in records} == {True}
    assert all(isinstance(r["data_ptr"], int) and r["data_ptr"] > 0 for r in records)
    t = [r["t_ns"] for r in records]
    assert t == sorted(t)


def test_validate_reports_problems() -> None:
    record = _train().records()[0]
    assert validate({**record, "phase": "sideways"}) == [
        "phase='sideways' not in ('forward', 'backward', 'preflight')"
    ]
    assert any("bool" in p for p in validate({**record, "rank": True}))
    assert any("unknown anomaly" in p for p in validate({**record, "anomaly": "gremlins"}))
    assert any("fields differ" in p for p in validate({k: v for k, v in record.items() if k != "t_ns"}))
    assert validate({**record, "shape": None, "dtype": None, "device": None, "data_ptr": None}) == []


def test_commit_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAINGRAD_COMMIT", "feedbeef")
    monkeypatch.setenv("MAINGRAD_RUN", "envrun")
    monkeypatch.setenv("RANK", "5")
    model = MegatronFSDP(make_layer(), "optim")
    handle = install(model)
    assert (handle.meta.commit, handle.run, handle.rank) == ("feedbeef", "envrun", 5)
    handle.remove()


def _entry(rows: int, site: int = 0) -> tuple:
    """A ring entry of `rows` rows (parameter missing), as a hook pushes it for one call."""
    slots = [(PlainRow, i, False, None, None, None, False, 0, "param_missing") for i in range(rows)]
    entry = (CallEntry, rows, slots, 123, 0, 0, 0, site)
    assert view(entry) == CallEntry(CallEntry, rows, slots, 123, 0, 0, 0, site)
    return entry


def test_ring_buffer_is_bounded_and_counts_overflow() -> None:
    ring = RecordRing(4)
    for _ in range(3):
        ring.push(_entry(1))
    assert [r[0] for r in ring.take_new()] == [1, 2, 3]
    assert ring.take_new() == []
    for _ in range(6):
        ring.push(_entry(1))
    assert [r[0] for r in ring.take_new()] == [6, 7, 8, 9]
    assert ring.overflow == 2 and len(ring) == 4
    # entries of several rows: the newest `capacity` rows survive, as in a deque(maxlen=capacity) of rows
    ring = RecordRing(5)
    ring.push(_entry(3, site=1))
    ring.push(_entry(3, site=2))
    assert [(r[0], r[5], r[6]) for r in ring.snapshot()] == [
        (2, 1, 1),
        (3, 1, 2),
        (4, 2, 0),
        (5, 2, 1),
        (6, 2, 2),
    ]
    ring.push(_entry(3, site=3))
    assert [r[0] for r in ring.take_new()] == [5, 6, 7, 8, 9]
    assert ring.overflow == 4 and ring.take_new() == []
    ring.push(_entry(7))
    assert ring.skip_new() == 5 and ring.overflow == 6 and ring.take_new() == []
    assert [r[0] for r in ring.snapshot()] == [12, 13, 14, 15, 16]
    # memory: whole generations are freed, so fewer than 2 x capacity rows plus one call's are ever held
    ring = RecordRing(100)
    for size in [1, 7, 30, 3, 128] * 40:
        ring.push(_entry(size))
        assert ring.held + ring.held_previous < 2 * 100 + 128
        assert len(ring) == min(100, ring.total)
    assert [r[0] for r in ring.take_new()] == list(range(ring.total - 99, ring.total + 1))
    handle = _train(capacity=10, sinks=["memory"])
    summary = handle.summary()
    handle.remove()
    # 32 rows per step, ring of 10 flushed at each step: 22 lost per step
    assert summary.ring_overflow == 44
    assert handle.sinks[0].stats()["emitted"] == 20


def test_overflow_is_counted_without_sinks_too() -> None:
    handle = _train(capacity=10)
    assert handle.summary().ring_overflow == 44
    assert len(handle.records()) == 10
    assert [r["id"] for r in handle.records()] == [f"r1:3:{n}" for n in range(55, 65)]
    handle.remove()


def test_batch_conversion_equals_to_dict() -> None:
    model = MegatronFSDP(make_layer(), "optim")
    handle = install(model, "observe", run="c", rank=1, commit="cafe")  # 0.18.2 fails: anomaly rows too
    with pytest.raises(RuntimeError):
        fsdp_run(model, batches(1, 1))
    rows = handle._rt.ring.snapshot()
    good = _train()
    rows_good = good._rt.ring.snapshot()
    error_row = Row(
        99,
        5,
        0,
        1,
        1,
        0,
        -1,
        False,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        False,
        3,
        "hook_error",
    )
    for h, rs in ((handle, rows + [error_row]), (good, rows_good)):
        want = [to_dict(r, h.meta, h._modules, h._params) for r in rs]
        got = to_dicts(rs, h.meta, h._modules, h._params)
        assert got == want and all(tuple(r) == FIELDS for r in got)
        shapes = [r["shape"] for r in got if r["shape"] is not None]
        assert len({id(s) for s in shapes}) == len(shapes)  # every record owns its shape list
    handle.remove()
    good.remove()


def test_the_ring_holds_no_tensor() -> None:
    """Rows keep dtype/shape/device objects and ints only: no main_grad buffer outlives its owner because of us."""
    import gc
    from collections import deque

    handle = _train()
    seen, todo, kinds = set(), [handle._rt.ring], set()
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        kinds.add(type(obj))
        assert not isinstance(obj, torch.Tensor)
        if isinstance(obj, (RecordRing, tuple, list, deque)):
            todo.extend(gc.get_referents(obj))
    assert torch.Size in kinds and torch.device in kinds and torch.dtype in kinds
    handle.remove()


def test_memory_and_jsonl_sinks(tmp_path: Path) -> None:
    memory = MemorySink()
    jsonl = JsonlSink(tmp_path / "out" / "records.jsonl")
    handle = _train(sinks=[memory, jsonl])
    in_ring = handle.records()
    handle.remove()
    assert memory.records == in_ring
    path = tmp_path / "out" / "records.rank3.jsonl"
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == in_ring
    assert jsonl.stats()["written"] == len(in_ring)
    templated = JsonlSink(tmp_path / "{run}-{rank}.jsonl")
    templated.open(RunMeta("r9", 1, "fix", None))
    assert templated.path == tmp_path / "r9-1.jsonl"


class _Collector(BaseHTTPRequestHandler):
    requests: list[tuple[str, dict, bytes]] = []
    gate: threading.Event | None = None
    status = 201
    shed = 0  # answer this many more requests 503 + Retry-After: 0 first (a server shedding load)

    def do_POST(self) -> None:  # noqa: N802 - http.server API
        if self.gate is not None:
            self.gate.wait(30)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).requests.append((self.path, dict(self.headers), body))
        if type(self).shed > 0:
            type(self).shed -= 1
            self.send_response(503)
            self.send_header("Retry-After", "0")
        else:
            self.send_response(self.status)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server():
    class Handler(_Collector):
        requests = []
        gate = None
        status = 201
        shed = 0

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd, Handler
    if Handler.gate is not None:
        Handler.gate.set()
    httpd.shutdown()
    httpd.server_close()


def _send_all(sink: HttpSink, records: list[dict]) -> HttpSink:
    """One run's whole life on `sink`: open, emit `records`, close (which waits for the queue, or gives up)."""
    sink.open(RunMeta("r", 0, "observe", None))
    sink.emit(records)
    sink.close()
    return sink


def _send_batches_of_5(httpd: ThreadingHTTPServer, n: int) -> HttpSink:
    """`n` records sent to the test server in batches of 5."""
    sink = HttpSink(f"http://127.0.0.1:{httpd.server_port}", "p", batch_size=5)
    return _send_all(sink, [{"n": i} for i in range(n)])


def _record_posts(handler: type[_Collector]) -> list[tuple[str, dict, bytes]]:
    return [r for r in handler.requests if "/records" in r[0]]


@pytest.mark.timeout(60)
def test_http_sink_posts_ndjson_batches(server) -> None:
    httpd, handler = server
    url = f"http://127.0.0.1:{httpd.server_port}/"
    sink = HttpSink(url, "my proj", token="tok", batch_size=20)
    handle = _train(sinks=[sink])
    records = handle.records()
    handle.remove()  # final flush + close waits for the queue to drain
    assert sink.stats()["sent"] == len(records) == 64 and sink.dropped == 0 and sink.failed == 0
    *posts, end = handler.requests  # the end marker comes last, once every batch is acknowledged
    assert {path for path, _, _ in posts} == {"/api/v1/projects/my%20proj/runs/r1/records?commit_sha=abc123"}
    assert end[0] == "/api/v1/projects/my%20proj/runs/r1/end?commit_sha=abc123" and sink.ended
    assert json.loads(end[2]) == {
        "schema": 1,
        "run": "r1",
        "rank": 3,
        "world_size": 4,
        "records": 64,
        "lost": 0,
    }
    handler.requests = posts
    _, headers, _ = handler.requests[0]
    assert headers["Authorization"] == "Bearer tok"
    assert headers["Content-Type"] == "application/x-ndjson"
    received = [json.loads(line) for _, _, body in handler.requests for line in body.decode().splitlines()]
    assert sorted(received, key=lambda r: r["t_ns"]) == sorted(records, key=lambda r: r["t_ns"])
    assert max(len(body.decode().splitlines()) for _, _, body in handler.requests) <= 20


@pytest.mark.timeout(60)
def test_http_sink_drops_when_full_and_never_blocks(server) -> None:
    httpd, handler = server
    handler.gate = threading.Event()  # the server hangs until released
    sink = HttpSink(
        f"http://127.0.0.1:{httpd.server_port}", "p", batch_size=1, max_queue=2, close_timeout=0.5
    )
    sink.open(RunMeta("r", 0, "observe", None))
    sink.emit([{"n": i} for i in range(50)])  # returns at once (the test would time out otherwise)
    assert sink.dropped >= 47 and sink.enqueued + sink.dropped == 50
    sink.close()  # gives up after close_timeout, does not raise
    handler.gate.set()


@pytest.mark.timeout(60)
def test_http_sink_counts_failures(server) -> None:
    httpd, handler = server
    handler.status = 401
    sink = _send_batches_of_5(httpd, 12)
    assert sink.failed == 12 and sink.sent == 0 and sink.last_status == 401
    assert len(_record_posts(handler)) == 3 and sink.retried == 0  # a 4xx is never tried again
    assert json.loads(handler.requests[-1][2])["lost"] == 12 and not sink.ended  # the end marker says so
    dead = HttpSink("http://127.0.0.1:9", "p", timeout=2, backoff=0.01)  # nothing listens on the discard port
    _send_all(dead, [{"n": 1}])
    assert dead.failed == 1 and dead.retried == 3 and "URLError" in dead.stats()["last_error"]


@pytest.mark.timeout(60)
def test_http_sink_retries_a_server_shedding_load(server) -> None:
    """503 + Retry-After (the service shedding load) delays a batch, it does not lose it."""
    httpd, handler = server
    handler.shed = 2
    sink = _send_batches_of_5(httpd, 10)
    assert (sink.sent, sink.failed, sink.retried, len(_record_posts(handler))) == (10, 0, 2, 4)
    bodies = [body for _, _, body in _record_posts(handler)]
    assert sorted(set(bodies)) == sorted(bodies[2:])  # the two shed posts were re-sent as they were
    handler.shed = 10  # more than the retries allow: counted as failed, never raised
    stubborn = _send_all(HttpSink(f"http://127.0.0.1:{httpd.server_port}", "p", retries=2), [{"n": 1}])
    assert (stubborn.sent, stubborn.failed, stubborn.retried, stubborn.last_status) == (0, 1, 2, 503)


def test_cli_summary_and_validate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    handle = _train(sinks=[f"jsonl:{tmp_path}/rec.jsonl"])
    handle.remove()
    path = str(tmp_path / "rec.rank3.jsonl")
    assert cli_main(["hooks", "summary", path]) == 0
    out = capsys.readouterr().out
    assert "module.experts" in out and "overwrite_main_grad seen" in out
    assert "fwd=true:32 bwd=true:32" in out and "\noverwrite_main_grad seen: the flag's value" in out
    assert cli_main(["hooks", "summary", "--json", path]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["modules"][0]["forward_calls"] == 4 and data["modules"][0]["params"] == 8
    assert cli_main(["hooks", "validate", path]) == 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"schema": 1}) + "\n")
    assert cli_main(["hooks", "validate", str(bad)]) == 1


def test_cli_summary_exit_code_reflects_anomalies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = MegatronFSDP(make_layer(), "optim")
    handle = install(model, "observe", sinks=[f"jsonl:{tmp_path}/o.jsonl"])
    with pytest.raises(RuntimeError):
        fsdp_run(model, batches(1, 1))
    handle.remove()
    assert cli_main(["hooks", "summary", str(tmp_path / "o.rank0.jsonl")]) == 1
    assert "main_grad_missing=8" in capsys.readouterr().out


def test_summary_table_prints() -> None:
    handle = _train()
    text = str(handle.summary())
    handle.remove()
    assert "module.experts" in text and "fused_container" in text and "internal_errors=0" in text


# -- expose_main_grad ---------------------------------------------------------------------------------------
def _param(**attrs) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.ones(2, 2))
    for name, value in attrs.items():
        setattr(param, name, value)
    return param


def test_expose_main_grad_semantics() -> None:
    buf = torch.zeros(2, 2)
    absent = _param(get_main_grad=lambda: buf, overwrite_main_grad=False)
    none = _param(get_main_grad=lambda: buf, main_grad=None)
    present = _param(get_main_grad=lambda: torch.ones(2, 2), main_grad=torch.full((2, 2), 7.0))
    ddp = _param(main_grad=torch.zeros(2, 2))  # DDP: main_grad always there, no get_main_grad
    bare = _param()
    assert expose_main_grad([absent, none, present, ddp, bare]) == 2
    assert absent.main_grad is buf and none.main_grad is buf
    assert present.main_grad.eq(7).all() and not hasattr(bare, "main_grad")
    assert absent.overwrite_main_grad is False  # keep
    assert expose_main_grad([absent, ddp], overwrite_policy="force_true") == 0
    assert absent.overwrite_main_grad is True and not hasattr(ddp, "overwrite_main_grad")
    with pytest.raises(TypeError, match="not a tensor"):
        expose_main_grad([_param(get_main_grad=lambda: None)])
    with pytest.raises(ValueError):
        expose_main_grad([], overwrite_policy="sometimes")


def test_expose_main_grad_on_a_module_fixes_the_fused_path() -> None:
    model = MegatronFSDP(make_layer(), "optim_grads")
    experts = model.module.experts
    experts.register_forward_pre_hook(lambda module, args: expose_main_grad(module) and None)
    grads, _ = fsdp_run(model, batches(1, 2))
    assert all(torch.isfinite(g).all() for g in grads[0].values())
