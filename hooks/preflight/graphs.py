"""The finite differences' loss forwards on the first micro-batch, replayed from one CUDA graph.

On a GPU the loss forward of a Megatron GPT with a few thousand tokens per micro-batch is bound by the host:
megatron-core's and Transformer Engine's Python and the kernel launches. On an H100 a 541M GPT's loss forward
took 17 ms inside a call against 5 ms replayed from a graph. The probe on the first micro-batch's loss evaluates
it at least 6 times, with the weights moved in place: the same kernels on the same addresses. Captured once,
each later evaluation is one replay.

What a replay rests on, and how each is checked before one is used:
- the forward reads the weights, buffers and batch where the capture found them. preflight moves the weights
  in place and restores the buffers in place. Graphs are tried only under the wrappers that keep parameters
  where they are (plain modules, Megatron DDP), on a single process, without FP8 (Transformer Engine casts
  the weights again at each step's first micro-batch, by host-side flags);
- nothing in the forward waits for the device. A host sync cannot be captured, and host-side control flow on
  device values would be frozen into the graph. The first evaluation runs eagerly with torch's sync debug
  mode at "warn" (recorded, not raised: the forward runs as always); a forward that synchronises where the
  mode sees it (a host read such as `.item()`) is never captured. A sync the mode does not report fails the
  capture (megatron-core's MoE token dispatcher synchronises its stream: `_maybe_dtoh_and_synchronize`);
- a replay computes what the eager forward computes. Right after the first eager evaluation the forward is
  captured and replayed from the same weights, buffers and random state; its loss must equal the eager one
  bit for bit, else the graph is dropped.

A capture that fails leaves torch's CUDA generator marked as capturing: every later random draw of the process
would raise. A one-operation capture after it clears the mark (`_heal`). Every evaluation that does not replay
runs eagerly, as without graphs. The graph and its memory pool are released once the probe on the first
micro-batch's loss is done (`release`): the runs after it keep the memory they always had.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from maingrad.hooks.preflight.check import Check

WRAPPERS = ("plain", "megatron-ddp")  # wrappers whose parameters stay where they are between forwards
# torch's sync debug message (not its notice, at the mode's first use, that it "does not yet detect all
# synchronizing operations": those that escape it fail the capture, or its check against the eager loss)
SYNC_WARNING = "called a synchronizing CUDA operation"


class LossGraph:
    """One call's graph of the loss forward on the first micro-batch: `untried` until that loss is first
    evaluated, then `ready` (replayed) or `off` (eager, with the reason), and `released` after the probe."""

    def __init__(self, check: Check, enabled: bool = True) -> None:
        self.check = check
        self.enabled = enabled  # preflight's cuda_graphs
        self.state = "untried"
        self.reason = ""
        self.replays = 0
        self._graph: Any = None  # torch.cuda.CUDAGraph
        self._output: torch.Tensor | None = None
        self._batch: Any = None

    def loss(self, batch: Any, before: Callable[[], None], forward: Callable[[Any], Any]) -> Any:  # noqa: ANN401
        """The loss of `batch`: `before()` (the buffers, flags and random state every evaluation starts from),
        then a replay where the graph of this batch is ready, else `forward(batch)`, the eager loss forward."""
        before()
        if self.state == "ready" and batch is self._batch and self._output is not None:
            self._graph.replay()
            self.replays += 1
            return self._output.clone()  # (the next replay overwrites the graph's output)
        if self.state != "untried" or batch is not self.check.batches[0]:
            return forward(batch)
        why = self._ineligible()
        if why:
            self._off(why)
            return forward(batch)
        loss, synced = _watching_syncs(lambda: forward(batch))
        if synced:
            self._off("the loss forward synchronizes with the host")
        elif not (isinstance(loss, torch.Tensor) and loss.is_cuda):
            self._off("the loss is not a CUDA tensor")
        else:
            self._capture(batch, loss, before, forward)
        return loss

    def release(self) -> None:
        """Drop the graph and its memory pool; later evaluations run eagerly."""
        self._graph = self._output = self._batch = None
        if self.state in ("untried", "ready"):
            self.state = "released"

    def summary(self) -> str:
        """What the cost reports: the replays, or why there were none."""
        if self.replays:
            return f"{self.replays} loss forwards replayed from a CUDA graph"
        return f"loss forwards eager: {self.reason}" if self.reason else "loss forwards eager"

    # -- internals ----------------------------------------------------------------------------------------
    def _ineligible(self) -> str:
        check = self.check
        if not self.enabled:
            return "cuda_graphs=False"
        if not torch.cuda.is_available() or not check.entries:
            return "no CUDA device"
        if check.entries[0].raw_param.device.type != "cuda":
            return "the model is not on a CUDA device"
        if check.adapter.kind not in WRAPPERS:
            return f"the {check.adapter.kind} wrapper may move parameters between forwards"
        if check.dist.world != 1:
            return "several processes"
        if check.fp8_known or check.fp8_entries:
            return "FP8 (its weight casts follow host-side flags)"
        if torch.cuda.is_current_stream_capturing():
            return "called inside a graph capture"
        return ""

    def _off(self, reason: str) -> None:
        self.state, self.reason = "off", reason
        self._graph = self._output = self._batch = None

    def _capture(
        self, batch: Any, eager: torch.Tensor, before: Callable[[], None], forward: Callable[[Any], Any]
    ) -> None:
        """Capture the forward from the state the eager one started from, replay it once and keep it where its
        loss is the eager loss bit for bit (one host transfer)."""
        before()  # (its buffers restored on the current stream, which the capture's stream waits for)
        graph: Any = None
        out: Any = None
        failure: BaseException | None = None
        try:
            graph, out = _captured(lambda: forward(batch))
        except BaseException as exc:  # noqa: BLE001 - reported as the reason, re-raised below if not an Exception
            failure = exc
        if failure is not None:
            _heal()
            self._off(f"the loss forward could not be captured ({type(failure).__name__})")
            if not isinstance(failure, Exception):
                raise failure
            return
        if not isinstance(out, torch.Tensor) or out.shape != eager.shape or out.dtype != eager.dtype:
            self._off("the captured loss is not the eager one's kind of tensor")
            return
        before()
        graph.replay()
        self.check.syncs += 1
        if not bool(torch.equal(out, eager)):
            self._off("a replay did not give the eager loss bit for bit")
            return
        self.state, self._graph, self._output, self._batch = "ready", graph, out, batch


def _watching_syncs(run: Callable[[], Any]) -> tuple[Any, bool]:
    """run() with torch's sync debug mode at "warn": its result, and whether it synchronised with the host. The
    forward's other warnings are issued again as they came."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = run()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    synced = False
    for w in seen:
        if SYNC_WARNING in str(w.message):
            synced = True
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    return result, synced


def _captured(run: Callable[[], Any]) -> tuple[Any, Any]:
    """run() captured as a CUDA graph on a stream of its own that waits for the current one (which waits for
    it again, whatever happens): (the graph, run()'s result). Other threads' CUDA calls do not break the capture
    (`thread_local`); one that fails raises from here."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                out = run()
            finally:
                graph.capture_end()
    except BaseException:
        del graph  # (a failed capture's graph and memory pool go first: its traceback keeps this frame)
        raise
    finally:
        torch.cuda.current_stream().wait_stream(stream)
    return graph, out


def _heal() -> None:
    """A capture of one operation: its begin and end set the capture mark of torch's CUDA generators again,
    which a capture that failed between them leaves set (every later random draw on the device would raise
    "Offset increment outside graph capture")."""
    _captured(lambda: torch.zeros(1, device="cuda").add_(1))
