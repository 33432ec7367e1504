"""The capture protocol of `hooks/preflight/graphs.py`, on the CPU with stand-ins for torch's CUDA graph and
stream (tests/gpu/test_preflight_graphs_gpu.py runs the real ones): a capture on a stream of its own that the
current stream waits for again whatever happens, a failed capture's graph dropped before the heal, and the
call left eager with the reason."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from maingrad.hooks.preflight import graphs


class _Graph:
    made: list[_Graph] = []

    def __init__(self) -> None:
        self.events: list[str] = []
        _Graph.made.append(self)

    def capture_begin(self, capture_error_mode: str = "global") -> None:
        self.events.append(f"begin:{capture_error_mode}")

    def capture_end(self) -> None:
        self.events.append("end")

    def replay(self) -> None:
        self.events.append("replay")


class _Stream:
    waits: list[str] = []

    def __init__(self, name: str = "side") -> None:
        self.name = name

    def wait_stream(self, other: _Stream) -> None:
        _Stream.waits.append(f"{self.name}<-{other.name}")


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    _Graph.made, _Stream.waits = [], []
    current = _Stream("current")
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: torch.ones(1))


def test_a_capture_runs_on_its_own_stream_and_the_current_one_waits_for_it(fake_cuda: None) -> None:
    graph, out = graphs._captured(lambda: 7)
    assert out == 7 and graph.events == ["begin:thread_local", "end"]
    assert _Stream.waits == ["side<-current", "current<-side"]


def test_a_failed_capture_ends_it_raises_and_the_current_stream_still_waits(fake_cuda: None) -> None:
    def breaks() -> Any:  # noqa: ANN401
        raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError, match="not permitted"):
        graphs._captured(breaks)
    assert _Graph.made[0].events == ["begin:thread_local", "end"]
    assert _Stream.waits == ["side<-current", "current<-side"]


def test_a_loss_forward_that_fails_its_capture_is_healed_and_left_eager(fake_cuda: None) -> None:
    """The heal is a second capture, of one operation, after the failed one; the call stays eager and says
    why."""
    calls: list[str] = []
    check = SimpleNamespace(batches=[object()], syncs=0)
    loss_graph = graphs.LossGraph(check)  # type: ignore[arg-type]

    def forward(batch: Any) -> Any:  # noqa: ANN401
        calls.append("forward")
        raise RuntimeError("captured a host sync")

    loss_graph._capture(check.batches[0], torch.ones(()), lambda: calls.append("before"), forward)
    assert calls == ["before", "forward"]
    assert [g.events for g in _Graph.made] == [["begin:thread_local", "end"]] * 2  # the failed one, the heal
    assert loss_graph.state == "off" and loss_graph.replays == 0
    assert (
        loss_graph.summary() == "loss forwards eager: the loss forward could not be captured (RuntimeError)"
    )


def test_an_interrupt_during_the_capture_is_healed_and_raised_again(fake_cuda: None) -> None:
    check = SimpleNamespace(batches=[object()], syncs=0)
    loss_graph = graphs.LossGraph(check)  # type: ignore[arg-type]

    def interrupted(batch: Any) -> Any:  # noqa: ANN401
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        loss_graph._capture(check.batches[0], torch.ones(()), lambda: None, interrupted)
    assert len(_Graph.made) == 2 and loss_graph.state == "off"
