"""A CPU population for maingrad.hooks.preflight: small models (MLP, GPT-like with attention, layer norm, tied
embeddings and cross-entropy, a top-1 MoE with an expert that gets no tokens, a CNN; fp32 and bf16; plain and
under the Megatron DDP / Megatron-FSDP emulators) and injected gradient bugs, each with the verdicts it must get.

Bugs are injected on one named parameter through autograd itself (tensor hooks, a custom autograd.Function
that drops the weight gradient, a main_grad outside the wrapper's buffer), so the model, the wrapper and
preflight run unchanged. `HELD_OUT` names the models and bugs that were not looked at while the thresholds
were set; `test_preflight_zoo.py` reports them separately.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from emulators import DenseBlock, MegatronDDP, MegatronFSDP
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]


# -- models ---------------------------------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self, dim: int = 12, hidden: int = 24, depth: int = 3) -> None:
        super().__init__()
        sizes = [dim] + [hidden] * (depth - 1) + [dim]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:], strict=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = self.drop(att.masked_fill(mask, float("-inf")).softmax(-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(
        self, vocab: int = 32, dim: int = 16, heads: int = 2, layers: int = 2, seq: int = 8, *,
        tied: bool = True, dropout: float = 0.0,
    ) -> None:  # fmt: skip
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.1)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class Expert(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, 2 * dim)
        self.w2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.nn.functional.silu(self.w1(x)))


class TinyMoE(nn.Module):
    """Top-1 routing over `experts`; the last expert is masked out of the routing: it never gets a token."""

    def __init__(self, dim: int = 12, experts: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(Expert(dim) for _ in range(experts))
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        scores = self.router(h)
        scores = scores.masked_fill(torch.arange(scores.shape[-1]) == scores.shape[-1] - 1, float("-inf"))
        probs = scores.softmax(-1)
        choice = probs.argmax(-1)
        y = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            mask = choice == e
            if mask.any():
                y[mask] = expert(h[mask]) * probs[mask, e : e + 1]
        return self.out(h + y)


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(3, 6, 3, padding=1)
        self.norm = nn.GroupNorm(2, 6)
        self.conv2 = nn.Conv1d(6, 4, 3, padding=1)
        self.head = nn.Linear(4 * 10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.conv1(x)))
        return self.head(torch.tanh(self.conv2(h)).flatten(1))


# -- batches and losses ----------------------------------------------------------------------------------------------
def regression_batches(n: int, dim: int = 12, tokens: int = 16, seed: int = 3) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(tokens, dim, generator=gen), torch.randn(tokens, dim, generator=gen)) for _ in range(n)
    ]


def token_batches(n: int, vocab: int = 32, seq: int = 8, rows: int = 4, seed: int = 4) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, vocab, (rows, seq), generator=gen),
            torch.randint(0, vocab, (rows, seq), generator=gen),
        )
        for _ in range(n)
    ]


def image_batches(n: int, seed: int = 6) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(8, 3, 10, generator=gen), torch.randint(0, 5, (8,), generator=gen)) for _ in range(n)
    ]


def _dtype_of(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def mse(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    dtype = _dtype_of(model)
    return ((model(x.to(dtype)).float() - y) ** 2).mean()


def cross_entropy(model: nn.Module, batch: Batch) -> torch.Tensor:
    idx, target = batch
    logits = model(idx).float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def classify(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, target = batch
    return torch.nn.functional.cross_entropy(model(x.to(_dtype_of(model))).float(), target)


def microbatch(
    loss_fn: Callable[[nn.Module, Batch], torch.Tensor],
) -> Callable[[nn.Module, Batch], torch.Tensor]:
    def run(model: nn.Module, batch: Batch) -> torch.Tensor:
        loss = loss_fn(model, batch)
        loss.backward()
        return loss.detach()

    return run


@dataclass
class ModelCase:
    name: str
    make: Callable[[], nn.Module]
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    batches: Callable[[int], list[Batch]]
    wrapper: str = "plain"  # plain | ddp | fsdp
    targets: dict[str, str] = field(default_factory=dict)  # role -> parameter name for the bugs


def _seeded(make: Callable[[], nn.Module], dtype: torch.dtype = torch.float32) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return make().to(dtype)

    return build


_GPT_TARGETS = {
    "one": "blocks.0.attn.qkv.weight",
    "other": "blocks.1.fc1.weight",
    "bias": "blocks.1.fc2.bias",
    "embedding": "emb.weight",
}
_MLP_TARGETS = {"one": "layers.1.weight", "other": "layers.0.weight", "bias": "layers.2.bias"}
_MOE_TARGETS = {
    "one": "experts.1.w1.weight",
    "other": "inp.weight",
    "bias": "out.bias",
    "expert": "experts.0",
}

MODELS: dict[str, ModelCase] = {
    case.name: case
    for case in [
        ModelCase("mlp", _seeded(MLP), mse, regression_batches, targets=_MLP_TARGETS),
        ModelCase("mlp-bf16", _seeded(MLP, torch.bfloat16), mse, regression_batches, targets=_MLP_TARGETS),
        ModelCase("gpt-tied", _seeded(TinyGPT), cross_entropy, token_batches, targets=_GPT_TARGETS),
        ModelCase(
            "gpt-untied",
            _seeded(lambda: TinyGPT(tied=False)),
            cross_entropy,
            token_batches,
            targets={**_GPT_TARGETS, "embedding": "head.weight"},
        ),  # fmt: skip
        ModelCase(
            "gpt-dropout",
            _seeded(lambda: TinyGPT(dropout=0.1)),
            cross_entropy,
            token_batches,
            targets=_GPT_TARGETS,
        ),  # fmt: skip
        ModelCase(
            "gpt-bf16", _seeded(TinyGPT, torch.bfloat16), cross_entropy, token_batches, targets=_GPT_TARGETS
        ),
        ModelCase("moe", _seeded(TinyMoE), mse, regression_batches, targets=_MOE_TARGETS),
        ModelCase(
            "cnn",
            _seeded(CNN),
            classify,
            image_batches,
            targets={"one": "conv2.weight", "other": "head.weight", "bias": "conv1.bias"},
        ),  # fmt: skip
        ModelCase("mlp-ddp", _seeded(MLP), mse, regression_batches, wrapper="ddp", targets=_MLP_TARGETS),
        ModelCase(
            "gpt-ddp", _seeded(TinyGPT), cross_entropy, token_batches, wrapper="ddp", targets=_GPT_TARGETS
        ),
        ModelCase("moe-ddp", _seeded(TinyMoE), mse, regression_batches, wrapper="ddp", targets=_MOE_TARGETS),
        ModelCase(
            "dense-fsdp",
            _seeded(lambda: DenseBlock("te", hidden=12)),
            mse,
            regression_batches,
            wrapper="fsdp",
            targets={"one": "out.weight", "other": "inp.weight", "bias": "inp.bias"},
        ),  # fmt: skip
    ]
}


def wrap(case: ModelCase, model: nn.Module) -> nn.Module:
    if case.wrapper == "ddp":
        return MegatronDDP(model)
    if case.wrapper == "fsdp":
        return MegatronFSDP(model, "no_shard", unit_types=(), data_parallel_size=1)
    return model


def param_of(model: nn.Module, name: str) -> nn.Parameter:
    return dict(model.named_parameters())[name]


# -- bugs -------------------------------------------------------------------------------------------------------------
class _DropWeightGrad(torch.autograd.Function):
    """A linear layer's custom backward that returns None for the weight (the gradient is silently dropped)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.has_bias = bias is not None
        out = x @ weight.t()
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor | None]:  # type: ignore[override]
        (weight,) = ctx.saved_tensors
        dbias = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias else None
        return dy @ weight, None, dbias


def _drop_linear(module: nn.Module) -> None:
    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return _DropWeightGrad.apply(x, self.weight, self.bias)

    module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]


def _module_of(model: nn.Module, param_name: str) -> nn.Module:
    return model.get_submodule(param_name.rpartition(".")[0])


def scale(k: float) -> Callable[[nn.Module, str], None]:
    def inject(model: nn.Module, name: str) -> None:
        param_of(model, name).register_hook(lambda g: g * k)

    return inject


def overwrite(model: nn.Module, name: str) -> None:
    """Each backward replaces the accumulated gradient with its own (plain modules: .grad keeps the last)."""
    param = param_of(model, name)
    last: dict[str, torch.Tensor] = {}
    param.register_hook(lambda g: last.__setitem__("g", g.detach().clone()))

    def replace(p: torch.Tensor) -> None:
        p.grad = last["g"].clone()

    param.register_post_accumulate_grad_hook(replace)


def every_second_halved(model: nn.Module, name: str) -> None:
    """A hook that halves the gradient on every second backward (a global counter)."""
    count = {"n": 0}

    def hook(g: torch.Tensor) -> torch.Tensor:
        count["n"] += 1
        return g * 0.5 if count["n"] % 2 == 0 else g

    param_of(model, name).register_hook(hook)


def later_doubled(model: nn.Module, name: str) -> None:
    """Position-dependent: every micro-batch after the first of a step (the buffer already holds one) x2."""
    param = param_of(model, name)
    seen = {"n": 0}

    def hook(g: torch.Tensor) -> torch.Tensor:
        holder = getattr(param, "main_grad", None)
        started = param.grad is not None or (holder is not None and bool(holder.abs().sum() > 0))
        return g * 2 if started else g

    param.register_hook(hook)
    del seen


def third_only_lost(model: nn.Module, name: str) -> None:
    """Only micro-batches at position 3 and later of a step lose their gradient (needs >= 3 micro-batches)."""
    param = param_of(model, name)
    state = {"pos": 0, "last": None}

    def hook(g: torch.Tensor) -> torch.Tensor:
        holder = getattr(param, "main_grad", None)
        empty = param.grad is None and (holder is None or not bool(holder.abs().sum() > 0))
        state["pos"] = 1 if empty else state["pos"] + 1  # type: ignore[operator]
        return g * 0 if state["pos"] >= 3 else g

    param.register_hook(hook)


def dropped(model: nn.Module, name: str) -> None:
    _drop_linear(_module_of(model, name))


def expert_lost(model: nn.Module, name: str) -> None:
    """Every weight of one expert (one that gets tokens) drops its gradient."""
    expert = model.get_submodule(name)
    for module in expert.modules():
        if isinstance(module, nn.Linear):
            _drop_linear(module)


def stale(model: nn.Module, name: str) -> None:
    """Megatron DDP with this parameter's main_grad replaced by a tensor outside the gradient buffer:
    zero_grad_buffer() never zeroes it, so every step adds the previous steps' gradients."""
    param = param_of(model, name)
    param.main_grad = torch.zeros_like(param.main_grad)


@dataclass
class BugCase:
    name: str
    inject: Callable[[nn.Module, str], None]
    target: str  # role in ModelCase.targets
    expect: Callable[[ModelCase, nn.Module], dict[str, list[str]]]  # parameter -> anomalies
    wrappers: tuple[str, ...] = ("plain", "ddp")
    min_batches: int = 3


def _on(role: str, *codes: str) -> Callable[[ModelCase, nn.Module], dict[str, list[str]]]:
    return lambda case, model: {case.targets[role]: list(codes)}


def _expert(case: ModelCase, model: nn.Module) -> dict[str, list[str]]:
    prefix = case.targets["expert"]
    return {f"{prefix}.w1.weight": ["grad_lost"], f"{prefix}.w2.weight": ["grad_lost"]}


def _pair(case: ModelCase, model: nn.Module) -> dict[str, list[str]]:
    return {case.targets["one"]: ["grad_scaled"], case.targets["other"]: ["grad_overwritten"]}


def _scaled_and_overwritten(model: nn.Module, name: str) -> None:
    raise NotImplementedError  # replaced in BUGS by a two-parameter injection


BUGS: dict[str, BugCase] = {
    bug.name: bug
    for bug in [
        BugCase("x2", scale(2.0), "one", _on("one", "grad_scaled")),
        BugCase("x3", scale(3.0), "one", _on("one", "grad_scaled")),
        BugCase("x0.5", scale(0.5), "one", _on("one", "grad_scaled")),
        BugCase("x1.3", scale(1.3), "one", _on("one", "grad_scaled")),
        BugCase("x2-bias", scale(2.0), "bias", _on("bias", "grad_scaled")),
        BugCase("sign", scale(-1.0), "one", _on("one", "grad_inconsistent")),
        BugCase("overwrite", overwrite, "one", _on("one", "grad_overwritten"), wrappers=("plain",)),
        BugCase("dropped", dropped, "one", _on("one", "grad_lost")),
        BugCase("every-second-halved", every_second_halved, "one", _on("one", "grad_inconsistent")),
        BugCase("later-doubled", later_doubled, "one", _on("one", "grad_inconsistent")),
        BugCase("third-lost", third_only_lost, "one", _on("one", "grad_inconsistent")),
        BugCase("stale", stale, "one", _on("one", "grad_stale"), wrappers=("ddp",)),
        BugCase("expert-lost", expert_lost, "expert", _expert),
        BugCase(
            "x2+overwritten-neighbour",
            lambda model, name: None,  # two injections: see inject_bug
            "one",
            _pair,
            wrappers=("plain",),
        ),
    ]
}

# Not looked at while the thresholds and steps were chosen; reported separately.
HELD_OUT_MODELS = {"cnn", "gpt-untied", "moe-ddp"}
HELD_OUT_BUGS = {"x0.5", "later-doubled", "expert-lost", "x2-bias"}


def applicable(model: ModelCase, bug: BugCase) -> bool:
    if model.wrapper not in bug.wrappers:
        return False
    if bug.name == "dropped" and model.name == "cnn":
        return False  # the CNN's target is a convolution; the dropped-gradient function is a linear's
    if bug.name == "x2+overwritten-neighbour" and model.name == "cnn":
        return True
    return all(role in model.targets for role in [bug.target])


def inject_bug(bug: BugCase, case: ModelCase, model: nn.Module) -> None:
    """Inject into the unwrapped model (hooks) or the wrapped one (stale: its main_grad)."""
    if bug.name == "x2+overwritten-neighbour":
        scale(2.0)(model, case.targets["one"])
        overwrite(model, case.targets["other"])
        return
    bug.inject(model, case.targets[bug.target])
