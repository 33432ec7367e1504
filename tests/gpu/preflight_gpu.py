"""maingrad.hooks.preflight on the real stack: megatron-core models under Megatron-FSDP / Megatron DDP, one GPU.

Run on a GPU machine with Transformer Engine and megatron-core importable (recipe: docs/gpu-evidence.md ("Setting up the GPU machine");
megatron-core 0.19.2 from its wheel, Megatron-LM main as a source tree of `megatron/core`):

    PYTHONPATH=/tmp/mg:/tmp/site:/tmp/mc19:tests/gpu/stub python3 tests/gpu/preflight_gpu.py \
        --json out.json moe/optim_grads_params/fusion moe/no_shard/fusion ...

A case is MODEL/WRAPPER/FUSION:
  MODEL   moe          one-layer MoE TransformerBlock, TE spec (4 experts, top-2, SwiGLU, RMSNorm, bf16), experts
                       as TE GroupedLinear modules (use_transformer_engine_op_fuser=False)
          moe-opfuser  the same with the experts' TE op-fuser path (TEGroupedMLP._fused_ops)
          dense-fused  one dense layer, TE spec with use_te_op_fuser=True: megatron-core's TEFusedMLP (BasicLinear ops)
          dense-te     one dense layer, TE spec, TE modules
          gpt-local    GPTModel, one layer on the local spec (Megatron's own Column/RowParallelLinear) + output_layer,
                       in Float16Module (bf16); needs the apex stub (tests/gpu/stub) on PYTHONPATH and a process
                       without NVTE_FLASH_ATTN / NVTE_FUSED_ATTN (LanguageModule rejects them): run it on its own
  WRAPPER a Megatron-FSDP strategy (no_shard, optim, optim_grads, optim_grads_params), ddp (Megatron DDP) or
          ddp-distopt (Megatron DDP with the distributed optimizer)
  FUSION  fusion (gradient_accumulation_fusion=True) or nofusion
3 micro-batches (A, B, C: preflight needs 3 distinct ones to rule out periodic errors), data-parallel size 1. Output: each case's preflight table, a one-line verdict per case
(which parameters preflight named, per anomaly), and --json FILE with every result's to_dict().
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

if "gpt-local" not in " ".join(sys.argv):
    os.environ.setdefault("NVTE_FLASH_ATTN", "0")  # plain PyTorch attention: nothing else to build or tune
    os.environ.setdefault("NVTE_FUSED_ATTN", "0")
os.environ.setdefault(
    "NVTE_CUTEDSL_FUSED_GROUPED_MLP", "1"
)  # megatron-core 0.19 builds TEGroupedMLP's fused path
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29571")
os.environ.setdefault("PYTHONUNBUFFERED", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from mcore_parts import FSDP_STRATEGIES, gpt_model, wrap  # noqa: E402

MODELS = ("moe", "moe-opfuser", "dense-fused", "dense-te", "gpt-local")
WRAPPERS = (*FSDP_STRATEGIES, "ddp", "ddp-distopt")
S, BATCH, H, E, FFN, VOCAB = 128, 2, 256, 4, 256, 1024


def say(*args: object) -> None:
    print(*args, flush=True)


# -- models (the configurations tests/gpu/mcore_hooks.py and the accumulation probes proved on the H200) --------
def config(model: str, fusion: bool, *, experts: int = E, hidden: int = H, ffn: int = FFN):
    from megatron.core.transformer.transformer_config import TransformerConfig

    common = dict(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=4,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        gradient_accumulation_fusion=fusion,
    )
    if model == "gpt-local":
        return TransformerConfig(**common, ffn_hidden_size=4 * hidden, masked_softmax_fusion=False)
    common |= dict(gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm")
    if model.startswith("dense"):
        return TransformerConfig(
            **common, ffn_hidden_size=2 * hidden, use_transformer_engine_op_fuser=(model == "dense-fused")
        )
    return TransformerConfig(
        **common,
        ffn_hidden_size=2 * hidden,
        num_moe_experts=experts,
        moe_router_topk=2,
        moe_ffn_hidden_size=ffn,
        moe_grouped_gemm=True,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        use_transformer_engine_op_fuser=(model == "moe-opfuser"),
    )


def network(model: str, cfg, seed: int = 1234) -> torch.nn.Module:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    if model == "gpt-local":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.module import Float16Module

        net = gpt_model(cfg, get_gpt_layer_local_spec(), vocab=VOCAB, seq=S, tied=False)
        return Float16Module(cfg, net)  # as Megatron-LM's training loop does for bf16
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_block import TransformerBlock

    if model.startswith("dense"):
        spec = get_gpt_layer_with_transformer_engine_spec(use_te_op_fuser=(model == "dense-fused"))
    else:
        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=cfg.num_moe_experts, moe_grouped_gemm=True
        )

    class Net(MegatronModule):
        def __init__(self, config):
            super().__init__(config=config)
            self.decoder = TransformerBlock(config=config, spec=spec)

        def forward(self, x):
            out = self.decoder(hidden_states=x, attention_mask=None)
            return out[0] if isinstance(out, tuple) else out

    return Net(cfg).cuda()


# -- data and the training code's own micro-batch ---------------------------------------------------------------
def batches(model: str, *, hidden: int = H, seq: int = S, batch: int = BATCH) -> list:
    g = torch.Generator(device="cuda").manual_seed(99)
    if model == "gpt-local":
        pos = torch.arange(seq, device="cuda").unsqueeze(0).expand(batch, seq).contiguous()
        return [
            (
                torch.randint(0, VOCAB, (batch, seq), device="cuda", generator=g),
                pos,
                torch.randint(0, VOCAB, (batch, seq), device="cuda", generator=g),
            )
            for _ in range(3)
        ]
    shape = (seq, batch, hidden)
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
    target = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
    return [(x, target), (torch.roll(x, shifts=1, dims=0), target), (torch.roll(x, shifts=2, dims=0), target)]


def loss_fn(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    if len(batch) == 3:
        ids, pos, labels = batch
        logits = model(ids, pos, None)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
    x, target = batch
    return ((model(x).float() - target.float()) ** 2).mean()


def run_microbatch(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    loss = loss_fn(model, batch)
    loss.backward()
    return loss.detach()


# -- one case ---------------------------------------------------------------------------------------------------
def named(result) -> dict[str, list[str]]:
    """anomaly -> the parameters preflight named for it (short names)."""
    out: dict[str, list[str]] = {}
    for p in result.params:
        for code in p.anomalies:
            out.setdefault(code, []).append(p.name.split("layers.0.")[-1])
    return out


def run_case(case: str, args: argparse.Namespace) -> dict:
    from maingrad.hooks import preflight

    model_name, wrapper, fusion = case.split("/")
    if model_name not in MODELS or wrapper not in WRAPPERS or fusion not in ("fusion", "nofusion"):
        raise SystemExit(
            f"bad case {case!r}: MODEL/WRAPPER/FUSION with MODEL in {MODELS}, WRAPPER in {WRAPPERS}"
        )
    out: dict = {"case": case, "tag": args.tag}
    t0 = time.time()
    try:
        cfg = config(model_name, fusion == "fusion")
        net = network(model_name, cfg)
        model = wrap(cfg, net, wrapper)
        data = batches(model_name)
        sinks = [f"jsonl:{args.records}/{args.tag}-{case.replace('/', '-')}.jsonl"] if args.records else []
        kwargs = dict(loss_fn=loss_fn, label=f"{args.tag} {case}", run=f"preflight-{args.tag}", sinks=sinks)
        torch.cuda.synchronize()
        result = preflight(model, run_microbatch, data, **kwargs)
        torch.cuda.synchronize()
        say(result.table())
        if result.error_traceback:
            say(result.error_traceback)
        out |= {"status": result.status, "named": named(result), "result": result.to_dict()}
        if args.fd_detail and result.status != "error":
            detail = preflight(model, run_microbatch, data, loss_fn=loss_fn, fd_groups="module_type")
            out["fd_module_type"] = [(g.key, g.scale, g.verdict) for g in detail.groups]
            say(
                "  finite differences per module type: "
                + "; ".join(f"{k} {s if s is None else round(s, 3)} {v}" for k, s, v in out["fd_module_type"])
            )
        del model, net
    except Exception as exc:  # noqa: BLE001 - the table reports it
        out |= {"status": "driver-error", "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
        traceback.print_exc(limit=8)
    out["seconds"] = round(time.time() - t0, 1)
    verdict = "; ".join(f"{code}: {', '.join(names)}" for code, names in out.get("named", {}).items()) or "-"
    say(f"VERDICT [{args.tag}] {case}: {out['status']} ({out['seconds']} s) | {verdict}")
    torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cases", nargs="+")
    p.add_argument("--json", default=None)
    p.add_argument("--records", default=None, help="directory for the preflight records (JSONL)")
    p.add_argument("--tag", default=os.environ.get("TAG", "gpu"))
    p.add_argument("--fd-detail", action="store_true", help="also run the finite differences per module type")
    args = p.parse_args()
    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    import megatron.core
    import transformer_engine
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    say(
        f"[{args.tag}] megatron-core {megatron.core.__version__} ({os.path.dirname(megatron.core.__file__)}); "
        f"TE {transformer_engine.__version__}; torch {torch.__version__}; {torch.cuda.get_device_name(0)}"
    )
    results = [run_case(case, args) for case in args.cases]
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=1, default=str)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
