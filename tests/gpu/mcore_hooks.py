"""maingrad.hooks on the real stack: megatron-core TEGroupedMLP (TE op-fuser path) under Megatron-FSDP.

Run on a GPU machine with Transformer Engine and megatron-core importable (recipe: docs/gpu-evidence.md ("Setting up the GPU machine")):

    PYTHONPATH=/tmp/mg:/tmp/site:/tmp/mc18 python3 tests/gpu/mcore_hooks.py
    PYTHONPATH=/tmp/mg:/tmp/site:/tmp/mc19 python3 tests/gpu/mcore_hooks.py --strategy optim --mb 2
    torchrun --nproc-per-node 2 tests/gpu/mcore_hooks.py --strategy optim_grads   # world size from torchrun

Cases (--cases, default: fused hooks check nonfused, plus shipped when megatron-core has its own fix):
  fused     fused path, no hooks                      -> expected to fail (MAIN GRAD NOT FOUND)
  hooks     fused path + maingrad.hooks.install(model, mode=--mode, overwrite_policy=--policy) -> trains
  check     fused path + install(model, mode="check") -> expected MainGradContractError before TE
  shipped   fused path as shipped (0.19+ exposes main_grad itself) + hooks in observe mode (records flags)
  nonfused  use_transformer_engine_op_fuser=False (TE GroupedLinear modules, still fusing wgrad into main_grad)
  plain     nonfused and gradient_accumulation_fusion=False: autograd .grad, accumulated by Megatron-FSDP itself.
            The reference for lost micro-batches: the nonfused path reads overwrite_main_grad too, so when a
            flag makes the fused backward overwrite an earlier micro-batch, nonfused loses it the same way.
--mlp dense-grouped (megatron-core >= 0.19) builds a dense layer whose MLP is TEFusedMLPWithGroupedLinear
(`use_grouped_gemm_for_dense_mlp` + `use_transformer_engine_op_fuser`; rule MG001's remaining finding in 0.19.2)
instead of the MoE block. That class always quantizes (MXFP8 by default, which an H200 cannot run), so its
`_recipe` is set to FP8 current scaling before the first forward; the main_grad check in TE's GroupedLinear
`fuser_forward` comes before any quantization, so the recipe does not change what is tested. Its references
(nonfused, plain) run in bf16, so their gradient differences include FP8 rounding.
--mlp shared-grouped: the MoE block with a shared expert; "fused" there means FusedSharedExpertMLP
(`use_grouped_gemm_for_shared_expert`, the other 0.19.2 MG001 finding; its FP8 recipe is likewise set to current
scaling), the routed experts run TE's GroupedLinear modules in every case.
On megatron-core >= 0.19 its own TEGroupedMLP._ensure_main_grad is replaced by a no-op for fused/hooks/check
(--keep-upstream leaves it), so the hooks are what fixes the path. Every case builds a one-layer MoE
TransformerBlock (E experts, top-2, SwiGLU, bf16, gradient_accumulation_fusion=True) wrapped in Megatron-FSDP
and runs --steps steps of zero_grad_buffer -> --mb x (forward, backward) -> finish_grad_sync -> SGD.

After the hooks case (--sync, default on) one more step runs under torch.cuda.set_sync_debug_mode("warn")
with every sync warning's Python stack captured (a sync is ours when a maingrad/hooks frame is on it), the
installed hook bodies are called directly under set_sync_debug_mode("error"), and one full step is tried
under "error" (Megatron's token dispatcher is expected to sync; the table says where it raised).
Output: a compact table on rank 0; --json FILE writes the results; --records DIR writes the hooks' records
as JSONL (one file per case and rank); --http URL (with --project/--token) sends them to `maingrad serve`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

os.environ.setdefault("NVTE_FLASH_ATTN", "0")  # plain PyTorch attention: nothing else to build or tune
os.environ.setdefault("NVTE_FUSED_ATTN", "0")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
os.environ.setdefault(
    "NVTE_CUTEDSL_FUSED_GROUPED_MLP", "1"
)  # megatron-core 0.19 takes the fused path only then
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29547")
os.environ.setdefault("PYTHONUNBUFFERED", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
HOOKS_DIR = str(Path(__file__).resolve().parents[2] / "hooks")


def log(*args: object) -> None:
    if RANK == 0:
        print(*args, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cases",
        nargs="+",
        default=None,
        choices=["fused", "hooks", "check", "shipped", "nonfused", "plain"],
    )
    p.add_argument("--strategy", default=env("STRATEGY", "optim_grads_params"), choices=STRATEGIES)
    p.add_argument("--mb", type=int, default=int(env("MB", "2")), help="micro-batches per step")
    p.add_argument("--steps", type=int, default=int(env("STEPS", "2")))
    p.add_argument("--policy", default=env("POLICY", "keep"), choices=["keep", "force_true"])
    p.add_argument("--mode", default=env("MODE", "fix"), choices=["fix", "observe", "check"])
    p.add_argument(
        "--keep-upstream", action="store_true", help="do not disable megatron-core 0.19's exposure"
    )
    p.add_argument("--no-sync", dest="sync", action="store_false", help="skip the sync-debug checks")
    p.add_argument("--per-param", action="store_true", help="print every parameter's difference")
    p.add_argument("--mlp", default=env("MLP", "moe"), choices=["moe", "dense-grouped", "shared-grouped"])
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--json", default=None, help="write results as JSON here (rank 0)")
    p.add_argument("--records", default=None, help="directory for the hooks' JSONL records")
    p.add_argument("--http", default=env("MAINGRAD_URL"), help="maingrad service URL for the HTTP sink")
    p.add_argument("--project", default=env("MAINGRAD_PROJECT", "maingrad-gpu"))
    p.add_argument("--token", default=env("MAINGRAD_TOKEN"))
    p.add_argument("--commit", default=env("MAINGRAD_COMMIT"))
    p.add_argument("--run", default=env("MAINGRAD_RUN"))
    return p.parse_args(argv)


# -- megatron setup (the calls examples/mcore_repro.py proved on the H200) ------------------------------
def make_config(args: argparse.Namespace, fused: bool, fusion: bool = True):
    from megatron.core.transformer.transformer_config import TransformerConfig

    if args.mlp == "dense-grouped":
        layer = {"ffn_hidden_size": args.ffn, "use_grouped_gemm_for_dense_mlp": True}
    else:
        layer = {}
        if args.mlp == "shared-grouped":
            layer = {
                "moe_shared_expert_intermediate_size": args.ffn,
                "use_grouped_gemm_for_shared_expert": fused,
                "moe_shared_expert_glu_interleave_size": 32 if fused else None,
            }
            fused = False  # the routed experts: TE GroupedLinear modules
        layer |= {
            "ffn_hidden_size": 2 * args.hidden,
            "num_moe_experts": args.experts,
            "moe_router_topk": 2,
            "moe_ffn_hidden_size": args.ffn,
            "moe_grouped_gemm": True,
            "moe_token_dispatcher_type": "alltoall",
            "moe_router_load_balancing_type": "none",
            "moe_aux_loss_coeff": 0.0,
        }
    return TransformerConfig(
        num_layers=1,
        hidden_size=args.hidden,
        num_attention_heads=4,
        **layer,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        normalization="RMSNorm",
        bf16=True,
        params_dtype=torch.bfloat16,
        gradient_accumulation_fusion=fusion,
        use_transformer_engine_op_fuser=fused,
    )


def make_ddp_config(strategy: str):
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=strategy,
        grad_reduce_in_fp32=True,
        # Megatron-LM main (after 0.19.2) rejects the sharded-gradient strategies without overlapped reduction
        overlap_grad_reduce=strategy in ("optim_grads", "optim_grads_params"),
        overlap_param_gather=False,
        use_distributed_optimizer=True,
    )


def build(args: argparse.Namespace, fused: bool, fusion: bool = True, seed: int = 1234):
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_block import TransformerBlock

    class Net(MegatronModule):
        def __init__(self, config):
            super().__init__(config=config)
            if args.mlp == "dense-grouped":
                spec = get_gpt_layer_with_transformer_engine_spec(
                    use_te_op_fuser=fused, use_grouped_gemm_for_dense_mlp=True
                )
            else:
                spec = get_gpt_layer_with_transformer_engine_spec(
                    num_experts=args.experts, moe_grouped_gemm=True
                )
            self.decoder = TransformerBlock(config=config, spec=spec)

        def forward(self, x):
            out = self.decoder(hidden_states=x, attention_mask=None)
            return out[0] if isinstance(out, tuple) else out

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    cfg = make_config(args, fused, fusion)
    net = Net(cfg).cuda()
    if args.mlp == "dense-grouped":
        from transformer_engine.common.recipe import Float8CurrentScaling

        for module in net.modules():
            if type(module).__name__ == "TEFusedMLPWithGroupedLinear":
                module._recipe = Float8CurrentScaling()  # read (once) by its forward; MXFP8 needs SM100
    if args.mlp == "shared-grouped":
        from transformer_engine.common.recipe import Float8CurrentScaling

        for module in net.modules():
            if type(module).__name__ == "FusedSharedExpertMLP":
                module._fused_grouped_swiglu_recipe = Float8CurrentScaling()
    return FullyShardedDataParallel(config=cfg, ddp_config=make_ddp_config(args.strategy), module=net)


def grouped_mlp_class():
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    return TEGroupedMLP


def has_upstream_fix() -> bool:
    return "_ensure_main_grad" in grouped_mlp_class().__dict__


class UpstreamFixDisabled:
    """Replace megatron-core 0.19's TEGroupedMLP._ensure_main_grad by a no-op while active."""

    def __init__(self, active: bool) -> None:
        self.active = active and has_upstream_fix()
        self.saved = None

    def __enter__(self) -> UpstreamFixDisabled:
        if self.active:
            cls = grouped_mlp_class()
            self.saved = cls.__dict__["_ensure_main_grad"]
            cls._ensure_main_grad = staticmethod(lambda linear_module: None)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            grouped_mlp_class()._ensure_main_grad = self.saved


# -- training --------------------------------------------------------------------------------------------
def make_data(args: argparse.Namespace):
    g = torch.Generator(device="cuda").manual_seed(99 + RANK)
    shape = (args.seq, args.batch, args.hidden)
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
    target = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
    # micro-batch m: the sequence rolled by m (different tokens per position, same target)
    return [torch.roll(x, shifts=m, dims=0) for m in range(args.mb)], target


def train_step(model, micro_inputs, target) -> float:
    model.zero_grad_buffer()
    loss = None
    for xm in micro_inputs:
        out = model(xm)
        loss = ((out.float() - target.float()) ** 2).mean()
        loss.backward()
    model.finish_grad_sync()
    return loss


def local_grads(model) -> dict[str, torch.Tensor]:
    grads = {}
    for name, param in model.param_and_grad_buffer.optimizer_named_parameters:
        grad = param.grad
        if grad is None:
            continue
        grad = grad.to_local() if hasattr(grad, "to_local") else grad
        grads[name] = grad.detach().float().reshape(-1).clone()
    return grads


def apply_sgd(model, optimizer_holder: dict, lr: float) -> None:
    if "opt" not in optimizer_holder:
        params = [p for _, p in model.param_and_grad_buffer.optimizer_named_parameters]
        optimizer_holder["opt"] = torch.optim.SGD(params, lr=lr)
    optimizer_holder["opt"].step()
    model.module.install_optimized_model_weights()  # what Megatron's DistributedOptimizer does after a step
    model.start_param_sync()


def short_error(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = ""
    for frame in reversed(frames):
        if "maingrad" not in frame.filename or "/hooks/" in frame.filename:
            where = f" at {_short_path(frame.filename)}:{frame.lineno}"
            break
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:400]}{where}"


def _short_path(path: str) -> str:
    for marker in ("/site-packages/", "/tmp/site/", "/tmp/mc18/", "/tmp/mc19/", "/tmp/mg/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def make_sinks(args: argparse.Namespace, case: str) -> list:
    from maingrad.hooks import HttpSink, JsonlSink

    sinks: list = []
    if args.records:
        sinks.append(JsonlSink(Path(args.records) / f"{case}.jsonl"))
    if args.http:
        sinks.append(HttpSink(args.http, args.project, token=args.token, close_timeout=30))
    return sinks


def run_case(args: argparse.Namespace, case: str) -> dict:
    from maingrad.hooks import install

    fused = case not in ("nonfused", "plain")
    fusion = case != "plain"
    hooks_mode = {"hooks": args.mode, "check": "check", "shipped": "observe"}.get(case)
    disable = case in ("fused", "hooks", "check") and not args.keep_upstream
    result: dict = {"case": case, "ok": False, "error": None, "losses": [], "grads": [], "hooks": None}
    log(
        f"\n===== {case}: fused={fused} hooks={hooks_mode} upstream_fix_disabled={disable and has_upstream_fix()}"
    )
    t0 = time.time()
    handle = None
    with UpstreamFixDisabled(disable):
        try:
            model = build(args, fused, fusion)
            if hooks_mode is not None:
                run_id = f"{args.run or 'gpu'}-{case}-{args.strategy}-mb{args.mb}"
                handle = install(
                    model,
                    hooks_mode,
                    overwrite_policy=args.policy,
                    sinks=make_sinks(args, case),
                    run=run_id,
                    commit=args.commit,
                )
                log(f"  instrumented: {handle.targets}")
            micro_inputs, target = make_data(args)
            holder: dict = {}
            for step in range(args.steps):
                loss = train_step(model, micro_inputs, target)
                torch.cuda.synchronize()
                result["losses"].append(loss.item())
                result["grads"].append(local_grads(model))
                apply_sgd(model, holder, args.lr)
                if handle is not None:
                    handle.step()
                log(f"  step {step}: loss {result['losses'][-1]:.6f}  grads {len(result['grads'][-1])}")
            result["ok"] = True
            if case == "hooks" and args.sync:
                result["sync"] = sync_checks(args, model, handle, micro_inputs, target)
        except Exception as exc:  # noqa: BLE001 - the table reports it
            result["error"] = short_error(exc)
            result["error_type"] = type(exc).__name__
            log(f"  raised {result['error']}")
        finally:
            torch.cuda.synchronize()
            if handle is not None:
                result["hooks"] = hooks_report(handle)
                handle.remove()
                result["hooks"]["sinks"] = [s.stats() for s in handle.sinks]
    result["seconds"] = round(time.time() - t0, 1)
    return result


def hooks_report(handle) -> dict:
    from maingrad.hooks import summarize_records

    summary = handle.summary()
    records = handle.records()
    seen = summarize_records(records)
    flags: dict[str, dict[str, int]] = {}
    for module in seen.modules:
        for phase, counts in module.overwrite_seen.items():
            bucket = flags.setdefault(phase, {})
            for key, value in counts.items():
                bucket[key] = bucket.get(key, 0) + value
    return {
        "mode": handle.mode,
        "targets": handle.targets,
        "exposed": sum(m.exposed for m in summary.modules),
        "raised": sum(m.raised for m in summary.modules),
        "forward_calls": sum(m.forward_calls for m in summary.modules),
        "backward_calls": sum(m.backward_calls for m in summary.modules),
        "anomalies": summary.anomalies,
        "internal_errors": summary.internal_errors,
        "last_error": summary.last_error,
        "overwrite_seen": flags,
        "table": summary.table(),
    }


# -- no device sync from the hooks -------------------------------------------------------------------------
def sync_checks(args, model, handle, micro_inputs, target) -> dict:
    report: dict = {}
    # 1. a full step under "warn", every sync warning's Python stack kept
    events: list[list[str]] = []
    original = warnings.showwarning

    def capture(message, category, filename, lineno, file=None, line=None):
        if "sync" in str(message).lower():
            events.append([f.filename for f in traceback.extract_stack()[:-1]] + [filename])

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = capture
        torch.cuda.set_sync_debug_mode("warn")
        try:
            train_step(model, micro_inputs, target)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = original
    torch.cuda.synchronize()
    handle.step()  # a step boundary: micro-batch counters restart
    ours = [e for e in events if any(f.startswith(HOOKS_DIR) or "/maingrad/hooks/" in f for f in e)]
    report["warn_step_sync_events"] = len(events)
    report["warn_step_sync_events_in_hooks"] = len(ours)
    report["warn_step_first_sync_site"] = _short_path(events[0][-1]) if events else None
    # 2. every installed hook body called directly under "error", mid-step (parameters unsharded, main_grad
    #    exposed: the state the hooks run in), forward and backward inspections with records
    before = handle.summary()
    errors_before, anomalies_before = before.internal_errors, dict(before.anomalies)
    model.zero_grad_buffer()
    loss = ((model(micro_inputs[0]).float() - target.float()) ** 2).mean()
    calls = 0
    torch.cuda.set_sync_debug_mode("error")
    try:
        for site in handle._sites:
            site._inspect(0, 0, True, None)  # forward body
            site._inspect(1, 0, True, None)  # backward body
            calls += 2
    except Exception as exc:  # noqa: BLE001 - only a check-mode contract error can get here
        report["error_mode_exception"] = short_error(exc)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    loss.backward()
    model.finish_grad_sync()
    torch.cuda.synchronize()
    handle.step()
    after = handle.summary()
    report["error_mode_hook_calls"] = calls
    report["error_mode_new_internal_errors"] = after.internal_errors - errors_before
    report["error_mode_new_anomalies"] = {
        k: v - anomalies_before.get(k, 0)
        for k, v in after.anomalies.items()
        if v != anomalies_before.get(k, 0)
    }
    report["error_mode_last_error"] = after.last_error if after.internal_errors > errors_before else None
    # 3. a full step under "error" (Megatron's dispatcher is expected to sync; report where)
    torch.cuda.set_sync_debug_mode("error")
    try:
        train_step(model, micro_inputs, target)
        report["error_step"] = "completed without any device sync"
    except Exception as exc:  # noqa: BLE001
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/hooks/" not in f.filename]
        tb_all = traceback.extract_tb(exc.__traceback__)
        in_hooks = any("/hooks/" in f.filename and "maingrad" in f.filename for f in tb_all[-2:])
        site = f"{_short_path(frames[-1].filename)}:{frames[-1].lineno}" if frames else "?"
        report["error_step"] = f"raised {type(exc).__name__} at {site}" + (
            " (inside hooks!)" if in_hooks else ""
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    return report


# -- comparison and output ---------------------------------------------------------------------------------
def compare(result: dict, reference: dict) -> dict:
    if not (result["ok"] and reference["ok"]):
        return {}
    worst, worst_name, loss_rel = 0.0, None, 0.0
    per_param: dict[str, float] = {}
    for got, ref in zip(result["grads"], reference["grads"], strict=False):
        for name, g_ref in ref.items():
            g = got.get(name)
            if g is None or g.numel() != g_ref.numel():
                return {"max_rel": float("inf"), "worst": f"{name} missing/mismatched"}
            rel = ((g - g_ref).norm() / (g_ref.norm() + 1e-12)).item()
            short = name.split("layers.0.")[-1]
            per_param[short] = max(per_param.get(short, 0.0), rel)
            if rel > worst:
                worst, worst_name = rel, name
    for la, lb in zip(result["losses"], reference["losses"], strict=False):
        loss_rel = max(loss_rel, abs(la - lb) / (abs(lb) + 1e-12))
    values = torch.tensor([worst, loss_rel], device="cuda", dtype=torch.float64)
    if torch.distributed.is_initialized() and WORLD > 1:
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
    return {
        "max_rel": values[0].item(),
        "loss_rel": values[1].item(),
        "worst": (worst_name or "").split("layers.0.")[-1],
        "per_param": per_param,
    }


def flags_text(hooks: dict | None, phase: str) -> str:
    if not hooks or phase not in hooks["overwrite_seen"]:
        return "-"
    return ",".join(f"{k[0].upper()}{v}" for k, v in sorted(hooks["overwrite_seen"][phase].items()))


def print_table(args, versions: dict, results: list[dict]) -> None:
    log(
        f"\nmaingrad hooks on megatron-core {versions['megatron_core']} + TE {versions['transformer_engine']}, "
        f"torch {versions['torch']}, {versions['device']}; strategy={args.strategy} mb={args.mb} "
        f"steps={args.steps} world={WORLD} policy={args.policy} mlp={args.mlp}"
    )
    header = (
        "case",
        "result",
        "loss[last]",
        "rel_vs_nonfused",
        "rel_vs_plain",
        "loss_rel",
        "exposed",
        "anomalies",
        "ow@fwd",
        "ow@bwd",
    )
    rows = [header]
    for r in results:
        cmp = r.get("compare", {})
        plain = r.get("compare_plain", {})
        hooks = r.get("hooks")
        anomalies = ",".join(f"{k}={v}" for k, v in sorted((hooks or {}).get("anomalies", {}).items())) or "-"
        rows.append(
            (
                r["case"],
                "OK" if r["ok"] else "FAIL",
                f"{r['losses'][-1]:.6f}" if r["losses"] else "-",
                f"{cmp['max_rel']:.2e}" if "max_rel" in cmp else ("ref" if r["case"] == "nonfused" else "-"),
                f"{plain['max_rel']:.2e}" if "max_rel" in plain else ("ref" if r["case"] == "plain" else "-"),
                f"{(plain or cmp)['loss_rel']:.1e}" if "loss_rel" in (plain or cmp) else "-",
                str(hooks["exposed"]) if hooks else "-",
                anomalies if hooks else "-",
                flags_text(hooks, "forward"),
                flags_text(hooks, "backward"),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        log("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    for r in results:
        for key in ("compare", "compare_plain"):
            if r.get(key, {}).get("worst"):
                log(f"  {r['case']} {key}: worst {r[key]['worst']} ({r[key]['max_rel']:.2e})")
            if args.per_param and r.get(key, {}).get("per_param"):
                rels = ", ".join(f"{n} {v:.2e}" for n, v in sorted(r[key]["per_param"].items()))
                log(f"  {r['case']} {key} per parameter: {rels}")
        if r["error"]:
            log(f"  {r['case']}: {r['error']}")
        if r.get("sync"):
            log(f"  {r['case']} sync: {json.dumps(r['sync'])}")
        if r.get("hooks") and r["hooks"].get("sinks"):
            log(f"  {r['case']} sinks: {json.dumps(r['hooks']['sinks'])}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.cuda.set_device(LOCAL_RANK)
    torch.distributed.init_process_group("nccl", rank=RANK, world_size=WORLD)
    import megatron.core
    import transformer_engine
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1
    )
    versions = {
        "megatron_core": megatron.core.__version__,
        "transformer_engine": transformer_engine.__version__,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(LOCAL_RANK),
        "upstream_fix": has_upstream_fix(),
    }
    shipped = ["shipped"] if has_upstream_fix() and args.mlp == "moe" else []
    cases = args.cases or ["fused", "hooks", "check", *shipped, "nonfused", "plain"]
    results = [run_case(args, case) for case in cases]
    nonfused = next((r for r in results if r["case"] == "nonfused"), None)
    plain = next((r for r in results if r["case"] == "plain"), None)
    for r in results:
        if nonfused is not None and r is not nonfused and r is not plain:
            r["compare"] = compare(r, nonfused)
        if plain is not None and r is not plain:
            r["compare_plain"] = compare(r, plain)
    print_table(args, versions, results)
    if args.json and RANK == 0:
        out = {
            "versions": versions,
            "args": vars(args),
            "world": WORLD,
            "cases": {
                r["case"]: {k: v for k, v in r.items() if k != "grads" and not (k == "hooks" and v is None)}
                for r in results
            },
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
