"""preflight's loss forwards replayed from a CUDA graph (`hooks/preflight/graphs.py`); skipped without CUDA.

    PYTHONPATH=/tmp/mg python3 -m pytest tests/gpu/test_preflight_graphs_gpu.py -v

Plain torch models on the GPU: a call that replays gives every number a call without graphs gives (a replay is
the eager forward bit for bit, checked before it is used); a forward that reads a device value on the host is
never captured; a capture that fails leaves the call eager and the device's random generator usable; an
injected bug is named the same way with and without graphs; no graph outlives the probe.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hooks"))

from preflight_zoo import TinyGPT, cross_entropy, microbatch, scale  # noqa: E402

from maingrad.hooks.preflight import graphs  # noqa: E402
from maingrad.hooks.preflight.run import preflight  # noqa: E402


def _batches(
    n: int = 3, vocab: int = 128, seq: int = 32, rows: int = 4
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(5)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (rows, seq + 1), device="cuda", generator=gen)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def _model(dtype: torch.dtype = torch.bfloat16, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return TinyGPT(vocab=128, dim=64, heads=4, layers=3, seq=32, dropout=dropout).cuda().to(dtype)


def _numbers(result) -> list[tuple]:  # noqa: ANN001
    return [
        (p.name, p.anomalies, p.fd_scale, p.fd_error, p.fd_step, p.fd_local, p.inconclusive)
        for p in result.params
    ]


def _both(model: nn.Module, loss_fn=cross_entropy, **kwargs):  # noqa: ANN001, ANN003, ANN202
    run, batches = microbatch(loss_fn), _batches()
    eager = preflight(model, run, batches, loss_fn=loss_fn, cuda_graphs=False, **kwargs)
    replayed = preflight(model, run, batches, loss_fn=loss_fn, **kwargs)
    return eager, replayed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_replayed_call_gives_every_number_an_eager_one_gives(dtype: torch.dtype) -> None:
    eager, replayed = _both(_model(dtype))
    assert eager.cost["loss_replays"] == 0 and "cuda_graphs=False" in eager.cost["loss_graph"]
    assert replayed.cost["loss_replays"] > 0, replayed.cost["loss_graph"]
    assert replayed.cost["forward_passes"] == eager.cost["forward_passes"]
    assert replayed.status == eager.status == "pass"
    assert _numbers(replayed) == _numbers(eager)


def test_a_bug_is_named_the_same_with_a_graph() -> None:
    model = _model()
    target = "blocks.1.fc2.weight"
    scale(2.0)(model, target)
    eager, replayed = _both(model)
    assert replayed.cost["loss_replays"] > 0
    assert _numbers(replayed) == _numbers(eager)
    named = [p.name for p in replayed.params if p.anomalies]
    assert named == [target]


def test_dropout_replays_the_masks_the_eager_forward_draws() -> None:
    """The random state is set before each replay as before each eager forward: the same masks, so the same
    numbers (a graph that drew other masks would fail the bit-for-bit check and not be used)."""
    eager, replayed = _both(_model(dropout=0.1))
    assert replayed.cost["loss_replays"] > 0, replayed.cost["loss_graph"]
    assert _numbers(replayed) == _numbers(eager)


def test_a_forward_that_synchronizes_is_never_captured() -> None:
    def loss_with_item(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        loss = cross_entropy(model, batch)
        if loss.item() < 0:  # a host read of a device value: host-side control flow a graph would freeze
            loss = -loss
        return loss

    eager, replayed = _both(_model(), loss_fn=loss_with_item)
    assert replayed.cost["loss_replays"] == 0
    assert "synchronizes with the host" in replayed.cost["loss_graph"]
    assert _numbers(replayed) == _numbers(eager)


def test_a_failed_capture_leaves_the_random_generator_usable() -> None:
    """Without the heal, a draw after a capture that failed raises "Offset increment outside graph capture"."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with pytest.raises(Exception), torch.cuda.stream(stream):  # noqa: B017,PT011 - torch's own error types
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            x = torch.rand(4, device="cuda")
            float(x.sum())  # a host read: the capture fails
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    del graph
    with pytest.raises(RuntimeError, match="Offset increment outside graph capture"):
        torch.rand(2, device="cuda")
    graphs._heal()
    torch.cuda.manual_seed(3)
    a = torch.rand(8, device="cuda")
    torch.cuda.manual_seed(3)
    b = torch.rand(8, device="cuda")
    assert torch.equal(a, b)
    assert nn.functional.dropout(torch.ones(16, device="cuda"), 0.5).shape == (16,)


def test_the_graph_is_released_before_the_runs_after_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """The graph's memory pool lives only while the probe on the first micro-batch's loss runs: the singles and
    the sequence after it see none (their peak is a step's, as without graphs)."""
    from maingrad.hooks.preflight import check as check_module

    seen: list[tuple[str, bool]] = []
    single = check_module.Check.single

    def watched(self, k: int) -> None:  # noqa: ANN001
        seen.append((self.graphs.state, self.graphs._graph is None))
        single(self, k)

    monkeypatch.setattr(check_module.Check, "single", watched)
    result = preflight(_model(), microbatch(cross_entropy), _batches(), loss_fn=cross_entropy)
    assert result.cost["loss_replays"] > 0
    assert seen and all(state == "released" and gone for state, gone in seen), seen


def test_a_capture_that_fails_falls_back_to_eager_forwards_and_heals() -> None:
    """A forward that passes the sync check but cannot be captured (here it reads a device value only while
    captured): the call runs eagerly, its numbers are the eager call's, and the device's random draws work."""

    def capture_breaker(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        loss = cross_entropy(model, batch)
        if torch.cuda.is_current_stream_capturing():
            float(loss)
        return loss

    eager, replayed = _both(_model(dropout=0.1), loss_fn=capture_breaker)
    assert replayed.cost["loss_replays"] == 0
    assert "could not be captured" in replayed.cost["loss_graph"], replayed.cost["loss_graph"]
    assert _numbers(replayed) == _numbers(eager)
    assert torch.rand(4, device="cuda").shape == (4,)
