"""maingrad.hooks end to end on a CPU: a fused weight-gradient module under a minimal Megatron-FSDP-like
wrapper, run without hooks, then with the hooks in `check`, `observe` and `fix` mode, and the records.

    python3 examples/hooks_cpu.py

Needs only torch (the `runtime` extra). The two classes below stand in for the real ones and keep exactly
the parts of the contract that matter (no code copied):

- `FusedWgradLinear` is shaped like Transformer Engine's op-fuser `GroupedLinear` built with
  `accumulate_into_main_grad=True`: its forward refuses to run without `weight.main_grad`
  (`MAIN GRAD NOT FOUND` / `MAIN GRAD IS NONE`), and its backward adds dW into `weight.main_grad` instead of
  `.grad` (or writes it where the parameter's `overwrite_main_grad` says so), refreshing it first from
  `get_main_grad()` as TE does for Megatron-FSDP parameters.
- `MiniFSDP` does to parameters what Megatron-FSDP does at world size 1: each gets `get_main_grad()` (a view
  of a persistent fp32 buffer) and `__fsdp_param__`, but no `main_grad` until the first backward, and
  `zero_grad_buffer()` resets `main_grad` to None before every step.

So the first fused forward fails exactly as megatron-core 0.18.2's fused `TEGroupedMLP` does under
Megatron-FSDP; `maingrad.hooks.install(model)` (mode "fix") exposes `main_grad` right before it, and the
gradients come out equal to plain autograd's.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path

import torch

import maingrad.hooks
from maingrad.hooks import MainGradContractError


class _FusedWgrad(torch.autograd.Function):
    """y = x W^T; backward writes dW into W.main_grad (fused wgrad accumulation), not into W.grad."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.param = weight  # the Parameter object itself: its main_grad is where dW goes
        return x @ weight.t()

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        param = ctx.param
        if getattr(param, "__fsdp_param__", False):  # TE: refresh from Megatron-FSDP in backward
            param.main_grad = param.get_main_grad()
        wgrad = dy.t().float() @ x.float()
        if getattr(param, "overwrite_main_grad", False):  # Megatron-FSDP asks for an overwrite: TE obeys
            param.main_grad.copy_(wgrad)
        else:
            param.main_grad.add_(wgrad)
        param.grad_added_to_main_grad = True
        return dy @ weight, None


class FusedWgradLinear(torch.nn.Module):
    """A TE-op-fuser-like linear with `accumulate_into_main_grad=True` (what discovery looks for)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(out_features, in_features) / in_features**0.5)
        self.accumulate_into_main_grad = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self.weight, "main_grad"):  # TE checks in the fused FORWARD
            raise RuntimeError("MAIN GRAD NOT FOUND")
        if self.weight.main_grad is None:
            raise RuntimeError("MAIN GRAD IS NONE")
        return _FusedWgrad.apply(x, self.weight)


class MiniFSDP(torch.nn.Module):
    """Megatron-FSDP's parameter contract at world size 1 (no sharding, no communication)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self.buffers_: dict[str, torch.Tensor] = {}
        for name, param in module.named_parameters():
            buffer = torch.zeros(param.shape, dtype=torch.float32)
            self.buffers_[name] = buffer
            param.__fsdp_param__ = True
            param.grad_added_to_main_grad = False
            param.get_main_grad = lambda buffer=buffer: buffer  # main_grad itself stays absent for now

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.module(*args)

    def finish_grad_sync(self) -> None:
        """Megatron-FSDP reduces (or reduce-scatters) the gradients here; at world size 1 there is nothing to do."""

    def zero_grad_buffer(self) -> None:
        """Zero the gradient buffers; `main_grad` goes back to None until the next backward."""
        for name, param in self.module.named_parameters():
            self.buffers_[name].zero_()
            if hasattr(param, "main_grad"):
                param.main_grad = None
            param.grad_added_to_main_grad = False


def build(seed: int = 0) -> MiniFSDP:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(FusedWgradLinear(8, 16), torch.nn.Tanh(), FusedWgradLinear(16, 4))
    return MiniFSDP(net)  # wrap first, then install the hooks


def train(model: MiniFSDP, handle: object | None, steps: int = 2, microbatches: int = 2) -> None:
    torch.manual_seed(1)
    for _ in range(steps):
        model.zero_grad_buffer()
        for _ in range(microbatches):
            model(torch.randn(3, 8)).square().mean().backward()
        model.finish_grad_sync()
        if handle is not None:
            handle.step()  # step boundary: records go to the sinks


def reference_grads(steps: int = 2, microbatches: int = 2) -> list[torch.Tensor]:
    """The same model and data through plain autograd: what main_grad must hold after the last step."""
    model = build()
    plain = torch.nn.Sequential(
        torch.nn.Linear(8, 16, bias=False), torch.nn.Tanh(), torch.nn.Linear(16, 4, bias=False)
    )
    with torch.no_grad():
        plain[0].weight.copy_(model.module[0].weight)
        plain[2].weight.copy_(model.module[2].weight)
    torch.manual_seed(1)
    for _ in range(steps):
        plain.zero_grad()
        for _ in range(microbatches):
            plain(torch.randn(3, 8)).square().mean().backward()
    return [plain[0].weight.grad, plain[2].weight.grad]


def main() -> int:
    warnings.simplefilter("ignore", maingrad.hooks.MainGradHooksWarning)
    print("1. no hooks:")
    try:
        train(build(), None)
    except RuntimeError as exc:
        print(f"   the first fused forward fails: RuntimeError: {exc}")

    print("2. mode='check': the hooks raise before the fused kernel would, naming the parameter:")
    model = build()
    handle = maingrad.hooks.install(model, mode="check")
    try:
        train(model, handle)
    except MainGradContractError as exc:
        print(f"   MainGradContractError: {str(exc).splitlines()[0]}")
    handle.remove()

    print("3. mode='observe': nothing is changed, every call is recorded (the run still fails):")
    model = build()
    sink = maingrad.hooks.MemorySink()
    handle = maingrad.hooks.install(model, mode="observe", sinks=[sink])
    try:
        train(model, handle)
    except RuntimeError as exc:
        print(f"   RuntimeError: {exc}")
    handle.remove()  # flushes the records of the failed call
    for record in sink.records:
        print(f"   record: module={record['module']} param={record['param']} anomaly={record['anomaly']}")

    print("4. mode='fix' (the default): main_grad is exposed before each fused forward and the run trains:")
    model = build()
    with tempfile.TemporaryDirectory() as tmp:
        records = Path(tmp) / "records.jsonl"
        handle = maingrad.hooks.install(model, sinks=[f"jsonl:{records}"], run="example", rank=0)
        train(model, handle)
        expected = reference_grads()
        got = [model.module[0].weight.main_grad, model.module[2].weight.main_grad]
        same = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, expected, strict=True))
        print(f"   main_grad equals plain autograd's gradient: {same}")
        print("   " + str(handle.summary()).replace("\n", "\n   "))
        handle.remove()
        files = sorted(Path(tmp).glob("records*.jsonl"))
        lines = [line for path in files for line in path.read_text().splitlines()]
        print(f"   {len(lines)} records in {', '.join(p.name for p in files)}; the first one:")
        print("   " + json.dumps(json.loads(lines[0]), sort_keys=True))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
