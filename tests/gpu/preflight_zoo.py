"""maingrad.hooks.preflight on a model zoo and an injected-bug suite, on one GPU with the real stack.

Run on a GPU machine with Transformer Engine and megatron-core importable (the recipe in tests/gpu: TE from its
wheels under /tmp/site, megatron-core 0.19.2 under /tmp/mc19):

    PYTHONPATH=/tmp/mg:/tmp/site:/tmp/mc19 python3 tests/gpu/preflight_zoo.py --json zoo.json zoo bugs

`zoo` runs every configuration of ZOO (correct models: any failing verdict is a false alarm), `bugs` every
case of BUGS (one bug injected into one parameter of a correct model: preflight must name exactly that
parameter, with a verdict of the bug's kind), or name cases one by one. None of the models, sizes or bugs was
tuned to preflight: they are the shapes people train (GPT from 125M to 1.2B parameters with cross-entropy, tied
and untied embeddings, MoE dropless / with token dropping / with experts that get no tokens, fp32, bf16, FP8)
under the wrappers they train with (Megatron DDP, Megatron-FSDP, torch FSDP2), and bugs of the kinds that were
seen in the wild (overwritten, scaled, dropped, periodic, position-dependent, stale gradients).

A bug is injected after the training code's own backward, into the gradient the optimizer reads (`main_grad`
where the wrapper keeps one, else `.grad`): the micro-batch's contribution d = G_after - G_before is replaced by
f(d) on the target parameter only. The "stale" bug instead keeps the target's gradient across
`zero_grad_buffer()`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29581")
os.environ.setdefault("PYTHONUNBUFFERED", "1")

import mcore_parts  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from mcore_parts import gpt_model  # noqa: E402


def say(*args: object) -> None:
    print(*args, flush=True)


# -- configurations ---------------------------------------------------------------------------------------------
@dataclass
class Model:
    """One model of the zoo: a GPT (megatron-core GPTModel, TE or local spec) or a plain-torch GPT (for FSDP2)."""

    layers: int
    hidden: int
    heads: int
    vocab: int = 32000
    seq: int = 1024
    batch: int = 1
    tied: bool = True
    dtype: str = "bf16"  # bf16 | fp32
    fp8: bool = False
    spec: str = "te"  # te | local | torch | bert (megatron-core's BertModel, TE spec, masked-LM loss only)
    experts: int = 0
    topk: int = 2
    moe_ffn: int = 0
    capacity: float | None = None  # token dropping when set
    fusion: bool = True  # gradient_accumulation_fusion

    def params_estimate(self) -> float:
        per_layer = (
            12 * self.hidden**2
            if not self.experts
            else 4 * self.hidden**2 + self.experts * 3 * self.hidden * self.moe_ffn
        )
        return self.layers * per_layer + self.vocab * self.hidden * (1 if self.tied else 2)


@dataclass
class Case:
    name: str
    model: Model
    wrapper: str  # ddp | fsdp:<strategy> | fsdp2 | plain
    microbatches: int = 3
    bug: str | None = None  # kind of injected bug (see INJECTIONS)
    target: str | None = None  # parameter name (wrapper prefixes removed) the bug is injected into
    expect: str = "pass"  # pass | fail
    expect_codes: tuple[str, ...] = ()
    note: str = ""
    # parameters the model without the bug already fails on, rightly (UPSTREAM_LAYERS): found beside the target
    known: tuple[str, ...] = ()


GPT125 = dict(layers=12, hidden=768, heads=12)
GPT350 = dict(layers=24, hidden=1024, heads=16)
GPT541 = dict(layers=8, hidden=2048, heads=16, seq=2048, tied=False)  # the 541M model
GPT1B = dict(layers=20, hidden=2048, heads=16, seq=2048)
MOE = dict(layers=4, hidden=1024, heads=16, experts=8, topk=2, moe_ffn=1024)

# Not a correct model: megatron-core's own ColumnParallelLinear (the GPT output layer, which also holds the
# tied embedding's weight) overwrites main_grad in its Megatron-FSDP wgrad branch whatever the strategy
# (tensor_parallel/layers.py; docs/findings/runtime-megatron-core-layers-fsdp-overwrite.md).
UPSTREAM_LAYERS = "upstream bug: tensor_parallel/layers.py Megatron-FSDP branch overwrites main_grad"


def upstream(name: str, model: Model, target: str) -> Case:
    """A ZOO model under Megatron-FSDP no_shard, which fails on `target` by UPSTREAM_LAYERS."""
    return Case(name, model, "fsdp:no_shard", expect="fail", target=target, expect_codes=("grad_overwritten",),
                note=UPSTREAM_LAYERS)  # fmt: skip


ZOO: list[Case] = [
    Case("gpt125m-tied-ddp-bf16", Model(**GPT125), "ddp"),
    Case("gpt125m-untied-ddp-bf16", Model(**{**GPT125, "tied": False}), "ddp"),
    Case("gpt125m-tied-ddp-fp32", Model(**{**GPT125, "dtype": "fp32"}), "ddp"),
    Case("gpt125m-local-ddp-bf16", Model(**{**GPT125, "spec": "local"}), "ddp"),
    Case("gpt350m-tied-ddp-fp8", Model(**{**GPT350, "fp8": True}), "ddp"),
    Case("gpt541m-untied-ddp-bf16", Model(**GPT541), "ddp"),
    upstream("gpt541m-untied-fsdp-noshard-bf16", Model(**GPT541), "output_layer.weight"),
    Case("gpt1.2b-tied-ddp-bf16", Model(**GPT1B), "ddp"),
    Case("gpt125m-fsdp-optim-nofusion", Model(**{**GPT125, "fusion": False}), "fsdp:optim"),
    Case("gpt125m-fsdp-optimgrads-nofusion", Model(**{**GPT125, "fusion": False}), "fsdp:optim_grads"),
    Case("gpt125m-fsdp-ogp-nofusion", Model(**{**GPT125, "fusion": False}), "fsdp:optim_grads_params"),
    upstream("gpt125m-fsdp-noshard-fusion", Model(**GPT125), "embedding.word_embeddings.weight"),
    Case("moe8-dropless-ddp-bf16", Model(**MOE), "ddp"),
    Case("moe8-dropping-ddp-bf16", Model(**{**MOE, "capacity": 1.0}), "ddp"),
    Case(
        "moe64-idle-experts-ddp-bf16",
        Model(**{**MOE, "experts": 64, "topk": 1, "moe_ffn": 256, "seq": 32}),
        "ddp",
    ),
    upstream("moe8-dropless-fsdp-noshard", Model(**MOE), "embedding.word_embeddings.weight"),
    Case("torchgpt-fsdp2-bf16", Model(layers=6, hidden=512, heads=8, spec="torch"), "fsdp2"),
    Case("torchgpt-fsdp2-fp32", Model(layers=6, hidden=512, heads=8, spec="torch", dtype="fp32"), "fsdp2"),
    Case(
        "torchgpt-fsdp2-mixed",
        Model(layers=6, hidden=512, heads=8, spec="torch", dtype="fp32"),
        "fsdp2:mixed",
    ),
    Case("bert110m-ddp-bf16", Model(**{**GPT125, "spec": "bert", "seq": 512}), "ddp"),
    Case(
        "torchgpt-plain-fp32",
        Model(layers=4, hidden=256, heads=4, spec="torch", dtype="fp32", vocab=8000),
        "plain",
    ),
]

L = "decoder.layers"
_BUG_MODEL = Model(**GPT125)


def bug(
    name: str,
    kind: str,
    target: str,
    *codes: str,
    model: Model = _BUG_MODEL,
    wrapper: str = "ddp",
    known: tuple[str, ...] = (),
) -> Case:
    """A case of BUGS: `kind` injected into `target`; preflight must fail naming it with one of `codes` (and
    nothing else but `known`, the model's own upstream failure, as grad_overwritten)."""
    note = UPSTREAM_LAYERS if known else ""
    return Case(name, model, wrapper, bug=kind, target=target, expect="fail", expect_codes=codes, known=known,
                note=note)  # fmt: skip


BUGS: list[Case] = [
    bug("bug-overwrite", "overwrite", f"{L}.5.mlp.linear_fc1.weight", "grad_overwritten"),
    bug("bug-half", "x0.5", f"{L}.3.self_attention.linear_proj.weight", "grad_scaled"),
    bug("bug-x2", "x2", f"{L}.7.mlp.linear_fc2.weight", "grad_scaled"),
    bug("bug-x3-norm", "x3", f"{L}.4.mlp.linear_fc1.layer_norm_weight", "grad_scaled"),
    bug("bug-x1.3-fp32", "x1.3", f"{L}.6.self_attention.linear_qkv.weight", "grad_scaled",
        model=Model(**{**GPT125, "dtype": "fp32"})),
    bug("bug-dropped", "drop", f"{L}.2.self_attention.linear_qkv.weight", "grad_lost"),
    bug("bug-periodic-half", "periodic", f"{L}.8.mlp.linear_fc2.weight",
        "grad_inconsistent", "grad_scaled", "grad_overwritten", "grad_lost"),
    bug("bug-position3-lost", "position3", f"{L}.1.mlp.linear_fc1.weight",
        "grad_inconsistent", "grad_lost", "grad_overwritten"),
    bug("bug-stale", "stale", f"{L}.9.self_attention.linear_proj.weight",
        "grad_stale", "grad_inconsistent", "grad_nondeterministic"),
    bug("bug-expert-lost", "drop", f"{L}.2.mlp.experts.linear_fc1.weight3", "grad_lost", model=Model(**MOE)),
    bug("bug-embedding-x2-tied", "x2", "embedding.word_embeddings.weight", "grad_scaled"),
    bug("bug-fsdp2-x3", "x3", "layers.2.mlp.0.weight", "grad_scaled",
        model=Model(layers=6, hidden=512, heads=8, spec="torch"), wrapper="fsdp2"),
    bug("bug-fsdp-noshard-x0.5", "x0.5", f"{L}.10.mlp.linear_fc2.weight", "grad_scaled", wrapper="fsdp:no_shard",
        known=("embedding.word_embeddings.weight",)),
    bug("bug-fsdp2-mixed-x0.5", "x0.5", "layers.4.mlp.2.weight", "grad_scaled",
        model=Model(layers=6, hidden=512, heads=8, spec="torch", dtype="fp32"), wrapper="fsdp2:mixed"),
    bug("bug-fsdp-ogp-x2", "x2", f"{L}.6.self_attention.linear_proj.weight", "grad_scaled",
        model=Model(**{**GPT125, "fusion": False}), wrapper="fsdp:optim_grads_params"),
    bug("bug-fsdp-optim-dropped", "drop", f"{L}.9.mlp.linear_fc1.weight", "grad_lost",
        model=Model(**{**GPT125, "fusion": False}), wrapper="fsdp:optim"),
    bug("bug-541m-overwrite", "overwrite", f"{L}.4.mlp.linear_fc2.weight", "grad_overwritten", model=Model(**GPT541)),
]  # fmt: skip
CASES = {c.name: c for c in ZOO + BUGS}


# -- models -----------------------------------------------------------------------------------------------------
def mcore_config(m: Model):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw: dict[str, Any] = dict(
        num_layers=m.layers,
        hidden_size=m.hidden,
        num_attention_heads=m.heads,
        ffn_hidden_size=4 * m.hidden,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=m.dtype == "bf16",
        params_dtype=torch.bfloat16 if m.dtype == "bf16" else torch.float32,
        gradient_accumulation_fusion=m.fusion,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
    )
    if m.fp8:
        kw |= dict(fp8="hybrid", fp8_recipe="delayed")
    if m.experts:
        kw |= dict(
            num_moe_experts=m.experts,
            moe_router_topk=m.topk,
            moe_ffn_hidden_size=m.moe_ffn,
            moe_grouped_gemm=True,
            moe_token_dispatcher_type="alltoall",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            add_bias_linear=False,
        )
        if m.topk == 1:
            kw |= dict(moe_router_pre_softmax=True)
        if m.capacity is not None:
            kw |= dict(moe_expert_capacity_factor=m.capacity, moe_token_drop_policy="probs")
    return TransformerConfig(**kw)


class Block(torch.nn.Module):
    """A pre-norm transformer block in plain torch."""

    def __init__(self, m: Model) -> None:
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(m.hidden)
        self.attn = torch.nn.MultiheadAttention(m.hidden, m.heads, batch_first=True)
        self.norm2 = torch.nn.LayerNorm(m.hidden)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(m.hidden, 4 * m.hidden), torch.nn.GELU(), torch.nn.Linear(4 * m.hidden, m.hidden)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + a
        return x + self.mlp(self.norm2(x))


class TorchGPT(torch.nn.Module):
    """A small decoder-only transformer in plain torch (for torch FSDP2, which Megatron's fused paths are not for)."""

    def __init__(self, m: Model) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(m.vocab, m.hidden)
        self.pos = torch.nn.Parameter(torch.randn(m.seq, m.hidden) * 0.02)
        self.layers = torch.nn.ModuleList([Block(m) for _ in range(m.layers)])
        self.norm = torch.nn.LayerNorm(m.hidden)
        self.head = torch.nn.Linear(m.hidden, m.vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer(
            "mask", torch.triu(torch.ones(m.seq, m.seq, dtype=torch.bool), 1), persistent=False
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        x = self.embed(ids) + self.pos[:n]
        for layer in self.layers:
            x = layer(x, self.mask[:n, :n])
        return self.head(self.norm(x))


def build(case: Case) -> tuple[torch.nn.Module, Any]:
    m = case.model
    torch.manual_seed(1234)
    if m.spec == "torch":
        net = TorchGPT(m).cuda()
        if m.dtype == "bf16":
            net = net.to(torch.bfloat16)
        if case.wrapper in ("fsdp2", "fsdp2:mixed"):
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy()
            if case.wrapper == "fsdp2:mixed":  # fp32 shards, a bf16 forward and backward, fp32 reduction
                policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for layer in net.layers:
                fully_shard(layer, mp_policy=policy)
            fully_shard(net, mp_policy=policy)
        return net, None
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    model_parallel_cuda_manual_seed(1234)
    cfg = mcore_config(m)
    if m.spec == "local":
        spec = get_gpt_layer_local_spec()
    elif m.experts:
        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=m.experts, moe_grouped_gemm=True)
    else:
        spec = get_gpt_layer_with_transformer_engine_spec()
    if m.spec == "bert":
        from megatron.core.models.bert.bert_layer_specs import get_bert_layer_with_transformer_engine_spec
        from megatron.core.models.bert.bert_model import BertModel

        net = BertModel(
            cfg, num_tokentypes=0, transformer_layer_spec=get_bert_layer_with_transformer_engine_spec(),
            vocab_size=m.vocab, max_sequence_length=m.seq, share_embeddings_and_output_weights=m.tied,
            add_binary_head=False,
        ).cuda()  # fmt: skip
    else:
        net = gpt_model(cfg, spec, vocab=m.vocab, seq=m.seq, tied=m.tied)
    if m.dtype == "bf16":
        net = Float16Module(cfg, net)
    return wrap(cfg, net, case.wrapper), cfg


def wrap(cfg, net: torch.nn.Module, wrapper: str) -> torch.nn.Module:
    """The case's wrapper: `fsdp:<strategy>` (Megatron-FSDP), `ddp` (Megatron DDP), else `net` as it is."""
    if wrapper.startswith("fsdp:"):
        return mcore_parts.wrap(cfg, net, wrapper.split(":", 1)[1])
    if wrapper == "ddp":
        return mcore_parts.wrap(cfg, net, "ddp")
    return net


def make_batches(case: Case) -> list[tuple[torch.Tensor, torch.Tensor]]:
    m = case.model
    g = torch.Generator(device="cuda").manual_seed(99)
    out = []
    for _ in range(case.microbatches):
        ids = torch.randint(0, m.vocab, (m.batch, m.seq + 1), device="cuda", generator=g)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    ids, labels = batch
    inner = model
    while hasattr(inner, "module") and not isinstance(inner, TorchGPT):
        inner = inner.module
    if isinstance(inner, TorchGPT):
        logits = model(ids)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
    if type(inner).__name__ == "BertModel":  # bidirectional: every position attends, masked-LM loss per token
        losses, _ = model(ids, torch.ones_like(ids), lm_labels=labels)
        return losses.float().mean()
    pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
    losses = model(ids, pos, None, labels=labels)  # per-token cross-entropy, [b, s]
    return losses.float().mean()


def run_microbatch(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    loss = loss_fn(model, batch)
    loss.backward()
    return loss.detach()


# -- injected bugs ----------------------------------------------------------------------------------------------
def short(name: str) -> str:
    """A parameter name without wrapper prefixes (module., module.module., _orig_mod.)."""
    parts = name.split(".")
    while parts and parts[0] in ("module", "_orig_mod", "_fsdp_wrapped_module"):
        parts = parts[1:]
    return ".".join(parts)


class Injector:
    """Replaces one parameter's per-micro-batch gradient contribution d by f(d) after each backward."""

    def __init__(self, model: torch.nn.Module, case: Case) -> None:
        self.kind = case.bug
        found = [(n, p) for n, p in model.named_parameters() if short(n) == case.target]
        if not found:
            names = [short(n) for n, _ in model.named_parameters()]
            raise SystemExit(f"{case.name}: no parameter {case.target!r}; e.g. {names[:8]}")
        self.param = found[0][1]
        # Megatron-FSDP: between steps the wrapper's parameters are DTensors and the module's own parameter
        # (raw_param) carries main_grad only while a bucket is being reduced; the gradient buffer's view for
        # the parameter (get_main_grad, whole on a single rank) is where every micro-batch accumulates
        self.raw: Any = None
        for obj in (model, getattr(model, "module", None)):
            raw_params = getattr(obj, "raw_param", None)
            if isinstance(raw_params, dict):
                self.raw = next((p for n, p in raw_params.items() if short(n) == case.target), None)
                if self.raw is not None:
                    break
        self.backwards = 0  # every backward since the injector was made
        self.position = 0  # backwards since the last zeroing
        self.fired = 0
        self.changed = 0  # backwards whose contribution to the target was not zero (what a bug can act on)
        zero = getattr(model, "zero_grad_buffer", None)
        if zero is not None:

            def zero_grad_buffer(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
                keep = self._buffer()
                saved = keep.clone() if (self.kind == "stale" and keep is not None) else None
                out = zero(*args, **kwargs)
                self.position = 0
                if saved is not None:
                    self._buffer().copy_(saved)
                    self.fired += 1
                return out

            model.zero_grad_buffer = zero_grad_buffer  # type: ignore[method-assign]
        else:
            orig_zero_grad = model.zero_grad

            def zero_grad(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
                self.position = 0
                return orig_zero_grad(*args, **kwargs)

            model.zero_grad = zero_grad  # type: ignore[method-assign]

    def _buffer(self) -> torch.Tensor | None:
        get = getattr(self.raw, "get_main_grad", None)
        if callable(get):
            view = get()
            if isinstance(view, torch.Tensor):
                return view
        mg = getattr(self.param, "main_grad", None)
        if isinstance(mg, torch.Tensor):
            return mg
        g = self.param.grad
        if g is not None and hasattr(g, "_local_tensor"):
            return g._local_tensor
        return g

    def wrap(self, run: Callable[..., Any]) -> Callable[..., Any]:
        def run_with_bug(model: torch.nn.Module, batch: Any) -> Any:
            before = self._buffer()
            before = before.detach().clone() if before is not None else None
            out = run(model, batch)
            self.backwards += 1
            self.position += 1
            after = self._buffer()
            if after is None or self.kind == "stale":
                return out
            base = before if before is not None else torch.zeros_like(after)
            d = after - base
            self.changed += int(bool(torch.count_nonzero(d)))  # a sync per backward: a test driver
            k = self.kind
            if k == "overwrite":
                new = d
            elif k and k.startswith("x"):
                new = base + float(k[1:]) * d
            elif k == "drop":
                new = base
            elif k == "periodic":
                new = base + (0.5 * d if self.backwards % 2 == 0 else d)
            elif k == "position3":
                new = base if self.position >= 3 else after
            else:
                raise SystemExit(f"unknown bug {k!r}")
            with torch.no_grad():
                after.copy_(new)
            self.fired += 1
            return out

        return run_with_bug


# -- one case ---------------------------------------------------------------------------------------------------
def _visible_miss(case: Case, target: Any) -> bool:  # noqa: ANN401 - a ParamResult
    """A scale bug whose factor the target's passing probe could have passed (its fd_resolution says so)."""
    kind = case.bug or ""
    if not kind.startswith("x") or target is None or target.verdict != "ok":
        return False
    return bool(target.could_hide(float(kind[1:])))


def run_case(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    import maingrad.hooks

    out: dict[str, Any] = {"case": case.name, "wrapper": case.wrapper, "bug": case.bug, "target": case.target,
                           "expect": case.expect, "params_estimate": case.model.params_estimate()}  # fmt: skip
    t0 = time.time()
    try:
        model, _cfg = build(case)
        n_params = sum(p.numel() for p in model.parameters())
        out["params"] = n_params
        data = make_batches(case)
        run = run_microbatch
        injector = None
        if case.bug:
            injector = Injector(model, case)
            run = injector.wrap(run_microbatch)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_mem = torch.cuda.memory_allocated()
        t1 = time.time()
        result = maingrad.hooks.preflight(model, run, data, loss_fn=loss_fn, label=case.name)
        torch.cuda.synchronize()
        out["preflight_seconds"] = round(time.time() - t1, 2)
        out["preflight_peak_extra_mib"] = round((torch.cuda.max_memory_allocated() - base_mem) / 2**20, 1)
        say(result.table())
        if getattr(result, "error_traceback", None):
            say(result.error_traceback)
        named: dict[str, list[str]] = {}
        for p in result.params:
            for code in p.anomalies:
                named.setdefault(code, []).append(short(p.name))
        out["status"] = result.status
        out["named"] = named
        out["fired"] = injector.fired if injector else 0
        out["changed"] = injector.changed if injector else None
        out["result"] = result.to_dict()
        flagged = {n for names in named.values() for n in names}
        target_result = next((p for p in result.params if short(p.name) == case.target), None)
        out["target_resolution"] = target_result.fd_resolution if target_result is not None else None
        if case.expect == "pass":
            out["grade"] = "ok" if result.status == "pass" else ("false-alarm" if flagged else result.status)
        else:
            codes = {c for c, names in named.items() if case.target in names}
            known = set(case.known)
            # the model's own upstream failure, found as itself, is not a wrong blame
            upstream_only = all(
                names_of == ["grad_overwritten"]
                for names_of in ([c for c, names in named.items() if k in names] for k in known & flagged)
            )
            right_param = flagged - known == {case.target} and upstream_only
            right_code = bool(codes & set(case.expect_codes))
            out["grade"] = (
                "ok" if right_param and right_code
                # the target's own contribution was zero in every backward (an expert the router never
                # chose): the injected bug changed nothing, there was nothing to find
                else "ill-posed" if injector is not None and case.bug != "stale" and not injector.changed and not flagged
                # missed, but the result says its probe could have passed that factor on the target
                else "missed-visible" if not flagged and _visible_miss(case, target_result)
                else "missed" if not flagged
                else "wrong-blame" if not right_param
                else "wrong-verdict"
            )  # fmt: skip
        del model
    except Exception as exc:  # noqa: BLE001 - the table reports it
        out |= {"status": "driver-error", "grade": "driver-error",
                "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}  # fmt: skip
        traceback.print_exc(limit=10)
    out["seconds"] = round(time.time() - t0, 1)
    verdict = "; ".join(
        f"{c}: {', '.join(n[:4])}{' ...' if len(n) > 4 else ''}" for c, n in out.get("named", {}).items()
    )
    say(f"ZOO {out['grade']:<13} {case.name:<38} {out.get('status')} ({out['seconds']} s, "
        f"{out.get('params', 0) / 1e6:.0f}M params) | {verdict or '-'}")  # fmt: skip
    torch.cuda.empty_cache()
    return out


# -- cost: preflight against training steps, interleaved in one run ---------------------------------------------
def training_step(
    model: torch.nn.Module, optimizer: Any, run: Callable[..., Any], data: list[Any]
) -> Callable[[], None]:  # noqa: ANN401
    """Megatron's loop iteration: zero, every micro-batch forward+backward, grad sync, optimizer step."""

    def step() -> None:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        for batch in data:
            run(model, batch)
        model.finish_grad_sync()
        optimizer.step()

    return step


def make_optimizer(model: torch.nn.Module, m: Model):
    """megatron-core's own optimizer for the model (Adam, as its training loop builds it)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam", lr=1e-6, min_lr=0.0, weight_decay=0.0, bf16=m.dtype == "bf16",
        params_dtype=torch.bfloat16 if m.dtype == "bf16" else torch.float32, use_distributed_optimizer=False,
        clip_grad=1.0,
    )  # fmt: skip
    return get_megatron_optimizer(config, [model])


def cost(
    case: Case, rounds: int, batch: int | None = None, microbatches: int | None = None
) -> dict[str, Any]:
    """Median over rounds of (one preflight call) / (median training step of the same round): a training step is
    Megatron's loop iteration (zero, every micro-batch forward+backward, grad sync, optimizer step); memory is
    the peak above the base (zeroed buffers), against the bytes of the gradients the optimizer reads. `batch`
    (sequences per micro-batch) and `microbatches` (per step) replace the case's own: with one sequence of 2048
    tokens per micro-batch the 541M GPT's step is bound by the host's launching, with more by the device."""

    import maingrad.hooks

    if batch is not None:
        case = replace(case, model=replace(case.model, batch=batch))
    if microbatches is not None:
        case = replace(case, microbatches=microbatches)
    model, _cfg = build(case)
    data = make_batches(case)
    run = run_microbatch
    if case.bug:
        run = Injector(model, case).wrap(run_microbatch)
    optimizer = make_optimizer(model, case.model)
    grad_bytes = sum(
        p.main_grad.numel() * p.main_grad.element_size()
        for p in model.parameters()
        if hasattr(p, "main_grad")
    )

    step = training_step(model, optimizer, run, data)

    def timed(call: Callable[[], Any]) -> tuple[float, int]:
        return mcore_parts.timed(model, call)

    results: list[Any] = []

    def check() -> None:
        results.append(maingrad.hooks.preflight(model, run, data, loss_fn=loss_fn, label=case.name))

    for _ in range(3):
        timed(step)
    timed(check)
    ratios, step_peaks, check_peaks, steps_s, checks_s = [], [], [], [], []
    for _ in range(rounds):
        round_steps = []
        for _ in range(3):
            t, peak = timed(step)
            round_steps.append(t)
            step_peaks.append(peak)
        t, peak = timed(check)
        checks_s.append(t)
        check_peaks.append(peak)
        steps_s += round_steps
        ratios.append(t / statistics.median(round_steps))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    extra = max(check_peaks) - max(step_peaks)
    out = {
        "case": case.name,
        "params": sum(p.numel() for p in model.parameters()),
        "status": results[-1].status,
        "rounds": rounds,
        "batch": case.model.batch,
        "microbatches": case.microbatches,
        "tokens_per_microbatch": case.model.batch * case.model.seq,
        "step_s_median": statistics.median(steps_s),
        "preflight_s_median": statistics.median(checks_s),
        "steps_per_preflight_median": statistics.median(ratios),
        "steps_per_preflight_quartiles": [q[0], q[2]],
        "steps_per_preflight_rounds": ratios,  # (so that several runs can be pooled)
        "grad_bytes": grad_bytes,
        "peak_above_step_bytes": extra,
        "peak_above_step_over_grads": extra / grad_bytes if grad_bytes else None,
        "cost": results[-1].cost,
        # per round (after the warm-up call): what each call did, so that a dear round shows why (a low draw of
        # the noise, a bisection) and not only the last call's counts
        "rounds_calls": [
            {
                "status": r.status,
                "loss_evaluations": r.cost["loss_evaluations"],
                "bisection_depth": r.cost["bisection_depth"],
                "module_reruns": r.cost["module_reruns"],
                "fd_noise": r.tolerances.get("fd_noise"),
                "fd_noise_drawn": r.tolerances.get("fd_noise_drawn"),
                "fd_noise_raised": r.cost.get("fd_noise_raised"),
                "first_probe": (
                    {"step": r.groups[0].step, "scale": r.groups[0].scale, "error": r.groups[0].error}
                    if r.groups
                    else None
                ),
            }
            for r in results[1:]
        ],
    }
    say(results[-1].table())
    say("COST", json.dumps(out))
    return out


# -- scan: the finite differences of every group at every step (what the step rule is chosen from) -------------
SCAN_STEPS = [2.0**-k for k in range(3, 17)]


def scan(case: Case) -> dict[str, Any]:
    """Diagnostic, not a verdict: preflight's own probes (its Check, on the first micro-batch's gradient) at every
    step of SCAN_STEPS for each starting group, the measured noise, each parameter's predicted change per unit
    step, and the time of a loss forward, of one whole-model evaluation and of a forward+backward."""

    from maingrad.hooks.preflight.check import Check
    from maingrad.hooks.preflight.loss_fd import _Moving
    from maingrad.hooks.preflight.moves import Moves
    from maingrad.hooks.preflight.state import BufferState
    from maingrad.hooks.preflight.wrappers import choose

    model, _cfg = build(case)
    data = make_batches(case)
    adapter = choose(model, "auto")
    check = Check(model, run_microbatch, data, loss_fn=loss_fn, adapter=adapter, params=None,
                  finite_differences=True, fd_groups="mechanism", fd_step=None, fd_rtol=None, rtol=None,
                  rng_states=())  # fmt: skip
    fd = check.loss_fd
    buffers = BufferState(model)
    adapter.save_user_grads()

    out: dict[str, Any] = {"case": case.name, "params": sum(p.numel() for p in model.parameters())}
    try:
        check.first()
        moves = Moves(check)
        fd._round(moves, [], True)
        out |= {"noise": fd.noise, "floor": fd._floor(), "loss": fd.loss_level}
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(check.results):
            if i in moves.nonzero_set:
                groups.setdefault(r.group, []).append(i)
        out["groups"] = {}
        for key, idx in groups.items():
            node = fd._node(key, idx, False, 0)
            fd._round(moves, [(node, st) for st in SCAN_STEPS], False)
            contrib = {check.entries[i].name: moves.size(i, adapter.target(check.entries[i])) * moves.gnorm[i]
                       for i in idx}  # fmt: skip
            out["groups"][key] = {
                "n": len(idx),
                "per_step": sum(contrib.values()),
                "first_step": fd._first_steps([(key, idx)], moves),
                "levels": sorted((st, c, pp) for st, (c, pp) in node.levels.items()),
                "contrib": contrib,
            }
        every = sorted(moves.nonzero_set)
        with torch.no_grad():
            out["forward_s"] = clock(lambda: loss_fn(model, data[0]), 5)
        moving = _Moving(check, every, moves.directions)
        out["evaluation_s"] = clock(lambda: fd.evaluate(moving, moves.along(2.0**-10), 1.0), 5)
        moving.restore()
        check.commit()
        adapter.zero()
        out["microbatch_s"] = clock(lambda: run_microbatch(model, data[0]), 3)
    finally:
        adapter.zero()
        adapter.restore_user_grads()
        buffers.restore()
        check.rng.apply()
        check.step_start.restore()
    for key, g in out["groups"].items():
        rs = " ".join(f"{c / pp:.3f}" if pp else "-" for _, c, pp in g["levels"])
        say(
            f"SCAN {case.name} {key} n={g['n']} first=2^{math.log2(g['first_step']):.0f} r(2^-16..2^-3): {rs}"
        )
    say(f"SCAN {case.name} forward {out['forward_s'] * 1e3:.1f} ms, evaluation {out['evaluation_s'] * 1e3:.1f} ms, "
        f"forward+backward {out['microbatch_s'] * 1e3:.1f} ms, noise {out['noise']:.3g}")  # fmt: skip
    torch.cuda.empty_cache()
    return out


def clock(call: Callable[[], Any], n: int) -> float:
    """Median seconds of n synchronized calls."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def setup_distributed() -> None:
    """One GPU, one rank: the process group and megatron-core's model-parallel state the models need."""
    from megatron.core import parallel_state

    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cases", nargs="+", help="case names, or 'zoo' / 'bugs' for all of them")
    p.add_argument("--json", default=None)
    p.add_argument("--list", action="store_true")
    p.add_argument(
        "--cost", type=int, default=0, help="instead: N interleaved rounds of steps and preflight calls"
    )
    p.add_argument("--batch", type=int, default=None, help="with --cost: sequences per micro-batch")
    p.add_argument("--microbatches", type=int, default=None, help="with --cost: micro-batches per step")
    p.add_argument("--scan", action="store_true", help="instead: every group's estimate at every step")
    p.add_argument(
        "--jitter-seeds",
        type=int,
        default=1,
        metavar="K",
        help="each case under K seeds of the noise's jitter (moves.JITTER_SEED): the loss's noise in a bf16 "
        "forward is one draw, and the zoo with one seed is one draw per case",
    )
    p.add_argument(
        "--after-screening",
        action="store_true",
        help="the loss-level probe after the module-local screening (check.AFTER_SCREENING, off by default)",
    )
    args = p.parse_args()
    if args.after_screening:
        from maingrad.hooks.preflight import check as check_module

        check_module.AFTER_SCREENING = True
    names: list[str] = []
    for c in args.cases:
        names += [x.name for x in ZOO] if c == "zoo" else [x.name for x in BUGS] if c == "bugs" else [c]
    unknown = [n for n in names if n not in CASES]
    if unknown or args.list:
        say("cases:", " ".join(CASES))
        sys.exit(2 if unknown else 0)
    setup_distributed()
    import megatron.core
    import transformer_engine

    say(f"megatron-core {megatron.core.__version__}; TE {transformer_engine.__version__}; torch {torch.__version__}; "
        f"{torch.cuda.get_device_name(0)}")  # fmt: skip
    if args.scan:
        scans = []
        for n in names:
            try:
                scans.append(scan(CASES[n]))
            except Exception:  # noqa: BLE001 - a diagnostic: the next case still runs
                traceback.print_exc(limit=6)
            if args.json:
                with open(args.json, "w", encoding="utf-8") as handle:
                    json.dump(scans, handle, indent=1, default=str)
        torch.distributed.destroy_process_group()
        return
    if args.cost:
        costs = [cost(CASES[n], args.cost, args.batch, args.microbatches) for n in names]
        if args.json:
            with open(args.json, "w", encoding="utf-8") as handle:
                json.dump(costs, handle, indent=1, default=str)
        torch.distributed.destroy_process_group()
        return
    from maingrad.hooks.preflight import moves

    base = moves.JITTER_SEED
    results = []
    for k in range(args.jitter_seeds):
        moves.JITTER_SEED = base + 100003 * k
        for n in names:
            results.append(run_case(CASES[n], args))
            results[-1]["jitter_seed"] = moves.JITTER_SEED
            if args.json:
                with open(args.json, "w", encoding="utf-8") as handle:
                    json.dump(results, handle, indent=1, default=str)
    moves.JITTER_SEED = base
    grades: dict[str, int] = {}
    for r in results:
        grades[r["grade"]] = grades.get(r["grade"], 0) + 1
    say("ZOO SUMMARY", json.dumps(grades))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
