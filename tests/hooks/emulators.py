"""CPU stand-ins for the real contracts (see docs/gpu-evidence.md and the test beds' sources).

Written from megatron-core 0.18.2 / 0.19.2 (`TEGroupedMLP`, Megatron-FSDP) and Transformer Engine 2.20.2
(`te.ops.GroupedLinear`, `te.ops.Sequential`, `ops/_common.py`); behaviour reproduced, no code copied:

- `OpGroupedLinear`: TE op-fuser GroupedLinear. Its fused forward checks the FIRST weight only:
  no attribute -> RuntimeError("MAIN GRAD NOT FOUND"); None -> RuntimeError("MAIN GRAD IS NONE"). Backward
  does what `get_main_grad_from_param` does (refresh from get_main_grad() when `__fsdp_param__` is set,
  else raise if main_grad is missing/None), reads `overwrite_main_grad` AT BACKWARD (accumulate unless it is
  True), writes the wgrad into main_grad, and returns a dummy .grad with grad_added_to_main_grad=True where
  that attribute exists (None otherwise, so weight.grad stays None).
- `OpSequential`: te.ops.Sequential — hands its ops to a plain fuser object; the ops' module hooks never run.
- `GroupedLinear`: the TE GroupedLinear *module* (what TEGroupedLinear wraps): same wgrad semantics, but the
  overwrite flag is captured at FORWARD (ctx) and nothing is checked in forward.
- `GroupedMLP`: megatron-core TEGroupedMLP. Fused path: `_fused_ops` tuple (outside the module tree) built
  lazily on the first forward, op shells on "meta" adopting linear_fc1/linear_fc2's parameters, and a
  pre-forward hook on the Sequential replaying the children's pre-forward hooks as hook(submodule, None)
  (raising if one returns a value). `GroupedMLP019` (0.19.x) ends that hook with `_ensure_main_grad_for_fused_impl`
  (expose main_grad when None, then overwrite_main_grad=True where the attribute exists).
- `FusedMLPWithGroupedLinear`: megatron-core 0.19.x TEFusedMLPWithGroupedLinear. Fused path: `_fused_impl`
  tuple built on the first forward (GroupedLinear(num_groups=1) op shells adopting linear_fc1/linear_fc2's
  `weight0`), with a pre-forward hook on the Sequential replaying the pre-forward hooks of EVERY module of the container,
  itself included, as hook(submodule, ()) (or hook(submodule, (), {}) for with_kwargs hooks). It exposes
  nothing: the first fused forward under Megatron-FSDP fails (rule MG001's finding in 0.19.2).
- `MegatronFSDP`: Megatron-FSDP at world size 1. At wrap: grad_added_to_main_grad=False, __fsdp_param__=True,
  get_main_grad bound on every parameter (main_grad absent). get_main_grad() returns a view of the persistent
  fp32 buffer (no_shard, optim) or of a temporary bucket filled with NaN, like uninitialised memory
  (optim_grads, optim_grads_params), which every backward "reduce-scatters" into the persistent buffer before
  freeing it and resetting main_grad to None. Unshard hooks (pre-forward, prepend=True, with_kwargs=True;
  pre-backward for FSDP units) set grad_added_to_main_grad=False, __fsdp_param__=True and overwrite_main_grad:
    semantics="main":   at every unshard, True for optim_grads/optim_grads_params, False for no_shard/optim
                        (Megatron-LM main's behaviour, which the brief describes);
    semantics="0.19.2": True for every strategy except no_shard, whose unshard returns before setting it
                        (megatron_fsdp.py `all_gather_and_wait_parameters_ready`, and no_shard registers no
                        unshard hook at all).
  Post-accumulate-grad hooks do `_grad_acc` (skip when grad_added_to_main_grad, else copy/add .grad into
  main_grad). The forward swaps distributed Parameter objects back to raw ones and finish_grad_sync swaps
  them out again, as Megatron-FSDP does every step. zero_grad_buffer() zeroes the buffer and resets main_grad
  to None.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Sequence
from itertools import chain

import torch
import torch.nn.functional as F

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
SHARDED_GRADS = ("optim_grads", "optim_grads_params")


# ---------------------------------------------------------------------------------------------------------
# Transformer Engine stand-ins
# ---------------------------------------------------------------------------------------------------------
def get_main_grad_from_param(weight: torch.Tensor, label: str) -> torch.Tensor:
    """TE ops/_common.py semantics: refresh from FSDP, then require a real buffer."""
    if hasattr(weight, "__fsdp_param__"):
        weight.main_grad = weight.get_main_grad()
    if not hasattr(weight, "main_grad") or weight.main_grad is None:
        raise RuntimeError(
            f"{label} operation is configured with accumulate_into_main_grad=True, "
            "but weight parameter does not have a valid main_grad attribute"
        )
    return weight.main_grad


class _GroupedWgrad(torch.autograd.Function):
    """y_i = x_i W_i^T per group; backward writes dW_i into main_grad when fused (TE semantics)."""

    @staticmethod
    def forward(ctx, x, splits, fused, flag_at_forward, label, *weights):  # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.weights = weights
        ctx.splits = splits
        ctx.fused = fused
        ctx.label = label
        ctx.overwrite = (
            [getattr(w, "overwrite_main_grad", False) for w in weights] if flag_at_forward else None
        )
        outs = [xi @ w.t() for xi, w in zip(torch.split(x, list(splits)), weights, strict=True)]
        return torch.cat(outs)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        splits = list(ctx.splits)
        xs, dys = torch.split(x, splits), torch.split(dy, splits)
        dx = torch.cat([dyi @ w for dyi, w in zip(dys, ctx.weights, strict=True)])
        grads = []
        for index, (w, xi, dyi) in enumerate(zip(ctx.weights, xs, dys, strict=True)):
            dw = dyi.t().float() @ xi.float()
            if not ctx.fused:
                grads.append(dw.to(w.dtype))
                continue
            main_grad = get_main_grad_from_param(w, ctx.label)
            overwrite = (
                ctx.overwrite[index]
                if ctx.overwrite is not None
                else getattr(w, "overwrite_main_grad", False)
            )
            if overwrite:
                main_grad.copy_(dw)
            else:
                main_grad.add_(dw)
            if hasattr(w, "grad_added_to_main_grad"):
                w.grad_added_to_main_grad = True
                grads.append(torch.zeros_like(w))  # TE's dummy wgrad
            else:
                grads.append(None)
        return (dx, None, None, None, None, *grads)


def _init_weights(
    module: torch.nn.Module, num: int, out_features: int, in_features: int, device: str
) -> None:
    for index in range(num):
        weight = torch.empty(out_features, in_features, device=device)
        if device != "meta":
            torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        module.register_parameter(f"weight{index}", torch.nn.Parameter(weight))


class OpGroupedLinear(torch.nn.Module):
    """te.ops.GroupedLinear stand-in (a fusible op: `fuser_forward` is what the fuser calls)."""

    num_extra_inputs = 1  # split sizes

    def __init__(
        self,
        num_groups: int,
        in_features: int,
        out_features: int,
        *,
        accumulate_into_main_grad: bool = False,
        device: str = "cpu",
    ) -> None:
        super().__init__()
        self.num_groups = num_groups
        self._accumulate_into_main_grad = accumulate_into_main_grad
        _init_weights(self, num_groups, out_features, in_features, device)

    def fuser_forward(self, x: torch.Tensor, splits: Sequence[int]) -> torch.Tensor:
        weight_param = self.weight0
        if self._accumulate_into_main_grad:
            if not hasattr(weight_param, "main_grad"):
                raise RuntimeError("MAIN GRAD NOT FOUND")
            if weight_param.main_grad is None:
                raise RuntimeError("MAIN GRAD IS NONE")
        weights = [getattr(self, f"weight{i}") for i in range(self.num_groups)]
        return _GroupedWgrad.apply(
            x, tuple(splits), self._accumulate_into_main_grad, False, "GroupedLinear", *weights
        )

    def forward(self, x: torch.Tensor, splits: Sequence[int]) -> torch.Tensor:
        return _Fuser([self])(x, splits)  # a lone op runs through a one-op fuser; its own hooks do run


class OpSiLU(torch.nn.Module):
    num_extra_inputs = 0

    def fuser_forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x)


class _Fuser:
    """te.pytorch.ops.fuser.OperationFuser: a plain object calling the ops' fused implementations."""

    def __init__(self, ops: list[torch.nn.Module]) -> None:
        self.ops = ops

    def __call__(self, x: torch.Tensor, *extra: object) -> torch.Tensor:
        rest = list(extra)
        for op in self.ops:
            n = op.num_extra_inputs
            x = op.fuser_forward(x, *rest[:n])
            rest = rest[n:]
        return x


class Sequential(torch.nn.Module):
    """te.ops.Sequential stand-in: its ops never see their own forward hooks."""

    def __init__(self, *ops: torch.nn.Module) -> None:
        super().__init__()
        self._module_groups = None
        for index, op in enumerate(ops):
            self.add_module(str(index), op)

    def forward(self, x: torch.Tensor, *extra: object) -> torch.Tensor:
        if self._module_groups is None:
            self._module_groups = [_Fuser(list(self._modules.values()))]
        return self._module_groups[0](x, *extra)


OpSequential = Sequential  # named "Sequential" like te.ops.Sequential, which duck-typed discovery matches


class GroupedLinear(torch.nn.Module):
    """TE GroupedLinear module (TEGroupedLinear) stand-in: fused wgrad, flag captured at forward."""

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        *,
        fuse_wgrad_accumulation: bool = True,
        device: str = "cpu",
    ) -> None:
        super().__init__()
        self.num_gemms = num_gemms
        self.in_features = in_features
        self.out_features = out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        _init_weights(self, num_gemms, out_features, in_features, device)

    def forward(self, x: torch.Tensor, splits: Sequence[int]) -> torch.Tensor:
        weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        if not self.fuse_wgrad_accumulation:  # plain autograd: the reference path
            return torch.cat(
                [xi @ w.t() for xi, w in zip(torch.split(x, list(splits)), weights, strict=True)]
            )
        return _GroupedWgrad.apply(x, tuple(splits), True, True, "GroupedLinear", *weights)


# ---------------------------------------------------------------------------------------------------------
# megatron-core TEGroupedMLP stand-in
# ---------------------------------------------------------------------------------------------------------
class GroupedMLP(torch.nn.Module):
    """TEGroupedMLP: FC1 -> SiLU -> FC2 over experts; fused path kept in the `_fused_ops` tuple."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        ffn: int,
        *,
        fused: bool = True,
        fuse_wgrad_accumulation: bool = True,
    ) -> None:
        super().__init__()
        self.linear_fc1 = GroupedLinear(
            num_experts, hidden, ffn, fuse_wgrad_accumulation=fuse_wgrad_accumulation
        )
        self.linear_fc2 = GroupedLinear(
            num_experts, ffn, hidden, fuse_wgrad_accumulation=fuse_wgrad_accumulation
        )
        self._with_fused_impl = fused
        self._fused_ops: tuple[torch.nn.Module] | None = None

    def _make_fused_ops(self) -> torch.nn.Module:
        ops = []
        for linear in (self.linear_fc1, self.linear_fc2):
            op = OpGroupedLinear(
                linear.num_gemms,
                linear.in_features,
                linear.out_features,
                accumulate_into_main_grad=linear.fuse_wgrad_accumulation,
                device="meta",
            )
            for index in range(linear.num_gemms):  # adopt the real parameters (0.18.2: setattr)
                setattr(op, f"weight{index}", getattr(linear, f"weight{index}"))
            ops.append(op)
        sequential = Sequential(ops[0], OpSiLU(), ops[1])
        sequential.register_forward_pre_hook(self._make_fused_impl_pre_forward_hook())
        return sequential

    def _make_fused_impl_pre_forward_hook(self):
        def forward_pre_hook(module, *_):
            for submodule in chain(self.linear_fc1.modules(), self.linear_fc2.modules()):
                for hook in submodule._forward_pre_hooks.values():
                    if hook(submodule, None) is not None:
                        raise RuntimeError(
                            f"Applying a fused implementation for {type(self).__name__}, but a "
                            f"{type(submodule).__name__} submodule has a pre-forward hook that modifies the input"
                        )
            ensure = getattr(self, "_ensure_main_grad_for_fused_impl", None)  # megatron-core >= 0.19 only
            if ensure is not None:
                ensure()

        return forward_pre_hook

    def forward(self, x: torch.Tensor, tokens_per_expert: Sequence[int]) -> tuple[torch.Tensor, None]:
        if self._with_fused_impl:
            if self._fused_ops is None:
                self._fused_ops = (self._make_fused_ops(),)
            (ops,) = self._fused_ops
            return ops(x, tokens_per_expert, tokens_per_expert), None
        h = F.silu(self.linear_fc1(x, tokens_per_expert))
        return self.linear_fc2(h, tokens_per_expert), None


class GroupedMLP019(GroupedMLP):
    """megatron-core 0.19.x TEGroupedMLP: the fused pre-forward hook ends with `_ensure_main_grad_for_fused_impl`."""

    @staticmethod
    def _ensure_main_grad(linear_module: torch.nn.Module) -> None:
        """megatron-core 0.19's exposure: main_grad from get_main_grad when None, then force overwrite."""
        if not getattr(linear_module, "fuse_wgrad_accumulation", False):
            return
        for param in linear_module.parameters(recurse=False):
            get_main_grad = getattr(param, "get_main_grad", None)
            if get_main_grad is not None and getattr(param, "main_grad", None) is None:
                param.main_grad = get_main_grad()
            if hasattr(param, "overwrite_main_grad"):
                param.overwrite_main_grad = True

    def _ensure_main_grad_for_fused_impl(self) -> None:
        self._ensure_main_grad(self.linear_fc1)
        self._ensure_main_grad(self.linear_fc2)


class GroupedMLPMaingradFixed(GroupedMLP):
    """megatron-core 0.18.2 TEGroupedMLP after `maingrad fix` (MG001): the fused pre-forward hook ends with the
    added `_expose_main_grad_for_fused_ops`, which exposes main_grad and leaves overwrite_main_grad alone."""

    def _expose_main_grad_for_fused_ops(self) -> None:
        for linear in (self.linear_fc1, self.linear_fc2):
            if not getattr(linear, "fuse_wgrad_accumulation", False):
                continue
            for param in linear.parameters(recurse=False):
                get_main_grad = getattr(param, "get_main_grad", None)
                if get_main_grad is not None and getattr(param, "main_grad", None) is None:
                    param.main_grad = get_main_grad()

    _ensure_main_grad_for_fused_impl = _expose_main_grad_for_fused_ops


class FusedMLPWithGroupedLinear(torch.nn.Module):
    """TEFusedMLPWithGroupedLinear: FC1 -> SiLU -> FC2 as one-group GroupedLinear ops in `_fused_impl`."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        ffn: int,
        *,
        fused: bool = True,
        fuse_wgrad_accumulation: bool = True,
    ) -> None:
        super().__init__()
        del num_experts  # a dense MLP: one group over every token
        self.linear_fc1 = GroupedLinear(1, hidden, ffn, fuse_wgrad_accumulation=fuse_wgrad_accumulation)
        self.linear_fc2 = GroupedLinear(1, ffn, hidden, fuse_wgrad_accumulation=fuse_wgrad_accumulation)
        self._with_fused_impl = fused
        self._fused_impl: tuple[torch.nn.Module] | None = None

    def _make_fused_impl(self) -> torch.nn.Module:
        ops = []
        for linear in (self.linear_fc1, self.linear_fc2):
            op = OpGroupedLinear(
                1,
                linear.in_features,
                linear.out_features,
                accumulate_into_main_grad=linear.fuse_wgrad_accumulation,
                device="meta",
            )
            op.weight0 = linear.weight0
            ops.append(op)
        fused_impl = Sequential(ops[0], OpSiLU(), ops[1])
        self._register_hooks_on_fused_impl(fused_impl)
        return fused_impl

    def _register_hooks_on_fused_impl(self, fused_impl: torch.nn.Module) -> None:
        hooks = [
            (sub, hook, hook_id in sub._forward_pre_hooks_with_kwargs)
            for sub in self.modules()
            for hook_id, hook in sub._forward_pre_hooks.items()
        ]

        def forward_pre_hook(module, *_):
            for sub, hook, with_kwargs in hooks:
                ret = hook(sub, (), {}) if with_kwargs else hook(sub, ())
                if ret is not None:
                    raise RuntimeError(f"{type(sub).__name__} has a pre-forward hook that modifies the input")

        fused_impl.register_forward_pre_hook(forward_pre_hook)

    def forward(self, x: torch.Tensor, tokens_per_expert: Sequence[int]) -> tuple[torch.Tensor, None]:
        tokens = (x.shape[0],)
        if self._with_fused_impl:
            if self._fused_impl is None:
                self._fused_impl = (self._make_fused_impl(),)
            return self._fused_impl[0](x, tokens, tokens), None
        return self.linear_fc2(F.silu(self.linear_fc1(x, tokens)), tokens), None


class MoELayer(torch.nn.Module):
    """A plain projection (not fused) feeding the experts, so ordinary parameters flow through FSDP too."""

    def __init__(
        self, num_experts: int, hidden: int, ffn: int, *, version: str = "0.18.2", **mlp_kwargs: object
    ) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)
        if version == "0.19.2-dense":
            mlp_class: type[torch.nn.Module] = FusedMLPWithGroupedLinear
        elif version.startswith("0.19"):
            mlp_class = GroupedMLP019
        elif version.endswith("+maingrad-fix"):
            mlp_class = GroupedMLPMaingradFixed
        else:
            mlp_class = GroupedMLP
        self.experts = mlp_class(num_experts, hidden, ffn, **mlp_kwargs)

    def forward(self, x: torch.Tensor, tokens_per_expert: Sequence[int]) -> torch.Tensor:
        out, _ = self.experts(self.proj(x), tokens_per_expert)
        return out


# ---------------------------------------------------------------------------------------------------------
# Megatron-FSDP stand-in (world size 1)
# ---------------------------------------------------------------------------------------------------------
def _set_module_param(root: torch.nn.Module, name: str, param: torch.nn.Parameter) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = root.get_submodule(owner_name) if owner_name else root
    owner._parameters[leaf] = param


class MegatronFSDP(torch.nn.Module):
    def __init__(
        self,
        module: torch.nn.Module,
        strategy: str = "optim_grads_params",
        *,
        semantics: str = "main",
        unit_types: tuple[type, ...] = (MoELayer,),
        swap_params: bool = True,
        data_parallel_size: int = 2,
    ) -> None:
        super().__init__()
        if strategy not in STRATEGIES:
            raise ValueError(strategy)
        if semantics not in ("main", "0.19.2", "6773"):
            raise ValueError(semantics)
        self.module = module
        self.strategy = strategy
        self.semantics = semantics
        # Megatron-FSDP shards the gradient buffer only when the data-parallel group has more than one rank;
        # at size 1 every strategy accumulates into the persistent buffer (what the H200 runs measured).
        self.sharded_grads = strategy in SHARDED_GRADS and data_parallel_size > 1
        self.swap_params = swap_params
        self.names = [n for n, p in module.named_parameters() if p.requires_grad]
        self.raw = dict(module.named_parameters())
        sizes = [self.raw[n].numel() for n in self.names]
        self.offsets = dict(zip(self.names, [sum(sizes[:i]) for i in range(len(sizes))], strict=True))
        self.grad_data = torch.zeros(sum(sizes), dtype=torch.float32)  # persistent (sharded at ws>1)
        self.bucket: torch.Tensor | None = None  # temporary un-sharded bucket (sharded-grad strategies)
        self.get_main_grad_calls = 0
        for name in self.names:
            param = self.raw[name]
            param.grad_added_to_main_grad = False
            param.__fsdp_param__ = True
            param.get_main_grad = types.MethodType(self._main_grad_getter(name), param)
            # Megatron-FSDP's per-parameter gradient buffer; sharded here as at data-parallel size >= 2
            param._gbuf = types.SimpleNamespace(is_data_distributed=self.sharded_grads)
            param.register_post_accumulate_grad_hook(self._grad_acc)
        self.units = unit_types if strategy == "optim_grads_params" else ()
        self._register_unshard_hooks()
        # "distributed" stand-ins the module holds between finish_grad_sync and the next forward
        self.dist = {n: torch.nn.Parameter(self.raw[n].detach()) for n in self.names}
        for param in self.dist.values():
            param.__fsdp_param__ = True
        self.is_dist = False
        self._replace(self.dist)
        # the optimizer's view (Megatron-FSDP `param_and_grad_buffer.optimizer_named_parameters`): the
        # distributed parameters, whose .grad finish_grad_sync() points at the gradient buffer
        for name, param in self.dist.items():
            param.orig_param = self.raw[name]
        self.param_and_grad_buffer = types.SimpleNamespace(optimizer_named_parameters=list(self.dist.items()))
        self.installs = 0

    # -- grad buffer ------------------------------------------------------------------------------------
    def _main_grad_getter(self, name: str):
        fsdp = self

        def get_main_grad(param: torch.Tensor) -> torch.Tensor:
            fsdp.get_main_grad_calls += 1
            start, numel = fsdp.offsets[name], param.numel()
            if fsdp.sharded_grads:
                if fsdp.bucket is None:
                    fsdp.bucket = torch.full_like(fsdp.grad_data, float("nan"))
                data = fsdp.bucket
            else:
                data = fsdp.grad_data
            return data[start : start + numel].view(param.shape)

        return get_main_grad

    def _grad_acc(self, param: torch.Tensor) -> None:
        if self.sharded_grads:
            if not param.grad_added_to_main_grad:
                param.main_grad = param.get_main_grad()
                if param.grad is not None:
                    param.main_grad.copy_(param.grad)
                    param.grad = None
                else:
                    param.main_grad.zero_()
        elif not param.grad_added_to_main_grad and param.grad is not None:
            param.main_grad = param.get_main_grad()
            param.main_grad.add_(param.grad)
            param.grad = None
        if param.grad_added_to_main_grad and param.grad is not None:
            param.grad = None
        param.grad_added_to_main_grad = False

    def _reset_main_grads(self) -> None:
        for param in self.raw.values():
            if hasattr(param, "main_grad"):
                param.main_grad = None

    def _root_post_backward(self) -> None:
        if self.sharded_grads and self.bucket is not None:  # reduce-scatter (ws 1: add) and free the bucket
            self.grad_data.add_(self.bucket)
            self.bucket = None
            self._reset_main_grads()

    # -- unshard hooks ----------------------------------------------------------------------------------
    def _overwrite_value(self) -> bool | None:
        if self.semantics == "main":  # Megatron-LM main d98e8a64: by strategy, whatever the group size
            return self.strategy in SHARDED_GRADS
        if self.semantics == "6773":  # Megatron-LM #6773: only where the buffer is really sharded
            return self.sharded_grads
        return None if self.strategy == "no_shard" else True

    def _unshard(self, params: list[torch.Tensor], phase: str) -> None:
        value = self._overwrite_value()
        for param in params:
            param.grad_added_to_main_grad = False
            param.__fsdp_param__ = True
            if value is not None:
                param.overwrite_main_grad = value

    def _register_unshard_hooks(self) -> None:
        if self.semantics == "0.19.2" and self.strategy == "no_shard":
            return  # Megatron-FSDP 0.19.2 registers no unshard hook for no_shard
        fsdp = self
        in_unit: set[int] = set()
        for module in self.module.modules():
            if id(module) in in_unit:
                continue
            if isinstance(module, self.units):
                in_unit.update(id(m) for m in module.modules())

                def unit_pre(mod, *unused):
                    fsdp._unshard(list(mod.parameters()), "forward")

                def unit_post(mod, args, output):
                    if torch.is_grad_enabled() and output.requires_grad:
                        output.register_hook(
                            lambda grad, mod=mod: fsdp._unshard(list(mod.parameters()), "backward")
                        )

                module.register_forward_pre_hook(unit_pre, prepend=True, with_kwargs=True)
                module.register_forward_hook(unit_post)
            elif module._parameters:

                def pre(mod, *unused):
                    fsdp._unshard([p for p in mod._parameters.values() if p is not None], "forward")

                module.register_forward_pre_hook(pre, prepend=True, with_kwargs=True)

    # -- parameter swaps ----------------------------------------------------------------------------------
    def _replace(self, params: dict[str, torch.nn.Parameter]) -> None:
        if not self.swap_params:
            return
        for name in self.names:
            _set_module_param(self.module, name, params[name])
        self.is_dist = params is self.dist

    # -- training API ---------------------------------------------------------------------------------
    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        self._replace(self.raw)
        out = self.module(*args, **kwargs)
        if torch.is_grad_enabled() and out.requires_grad:
            engine = torch.autograd.Variable._execution_engine
            out.register_hook(lambda grad: engine.queue_callback(self._root_post_backward))
        return out

    def zero_grad_buffer(self) -> None:
        for param in self.raw.values():
            param.grad_added_to_main_grad = False
        self.grad_data.zero_()
        self._reset_main_grads()
        for param in self.dist.values():
            param.grad = None

    def finish_grad_sync(self) -> None:
        if not self.sharded_grads:  # all-reduce (ws 1: nothing to do), then the buckets are reset
            self._reset_main_grads()
        self._replace(self.dist)
        for name, param in self.dist.items():
            param.grad = self.grad_data[self.offsets[name] : self.offsets[name] + param.numel()].view(
                param.shape
            )

    def install_optimized_model_weights(self) -> None:
        """Main weights -> model weights (here the same storage: counted, so tests see it called)."""
        self.installs += 1

    def grads(self) -> dict[str, torch.Tensor]:
        return {
            n: self.grad_data[self.offsets[n] : self.offsets[n] + self.raw[n].numel()]
            .view(self.raw[n].shape)
            .clone()
            for n in self.names
        }

    def sgd(self, lr: float) -> None:
        with torch.no_grad():
            for name, grad in self.grads().items():
                self.raw[name].sub_(lr * grad)


class MainWeightsFSDP(MegatronFSDP):
    """The Megatron-FSDP emulator with fp32 main weights as the optimizer's parameters (their .grad the fp32
    buffer), copied into the bf16 module weights by install_optimized_model_weights(); counts its calls."""

    def __init__(self, module: torch.nn.Module, strategy: str, **kwargs) -> None:
        super().__init__(module, strategy, unit_types=(), data_parallel_size=1, **kwargs)
        self.dist = {n: torch.nn.Parameter(self.raw[n].detach().float()) for n in self.names}
        for name, param in self.dist.items():
            param.__fsdp_param__ = True
            param.orig_param = self.raw[name]
        self._replace(self.dist)
        self.param_and_grad_buffer = types.SimpleNamespace(optimizer_named_parameters=list(self.dist.items()))
        self.calls: list[str] = []

    def _to_model_weights(self) -> None:
        with torch.no_grad():
            for name in self.names:
                self.raw[name].copy_(self.dist[name])

    def install_optimized_model_weights(self) -> None:
        super().install_optimized_model_weights()
        self.calls.append("install")
        self._to_model_weights()

    def zero_grad_buffer(self) -> None:
        self.calls.append("zero")
        super().zero_grad_buffer()

    def finish_grad_sync(self) -> None:
        self.calls.append("finish")
        super().finish_grad_sync()

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        self.calls.append("forward")
        return super().forward(*args, **kwargs)

    def _root_post_backward(self) -> None:
        self.calls.append("backward")
        super()._root_post_backward()


# ---------------------------------------------------------------------------------------------------------
# Training harness
# ---------------------------------------------------------------------------------------------------------
E, H, FFN = 4, 8, 12
SPLITS = (5, 0, 3, 8)  # expert 1 gets no token


def make_layer(*, seed: int = 0, fused: bool = True, fuse: bool = True, version: str = "0.18.2") -> MoELayer:
    torch.manual_seed(seed)
    return MoELayer(E, H, FFN, fused=fused, fuse_wgrad_accumulation=fuse, version=version)


def batches(steps: int, microbatches: int, seed: int = 7) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(SPLITS)
    return [
        [
            (torch.randn(tokens, H, generator=gen), torch.randn(tokens, H, generator=gen))
            for _ in range(microbatches)
        ]
        for _ in range(steps)
    ]


def reference_run(
    data, lr: float = 0.1, seed: int = 0, version: str = "0.18.2"
) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """Plain autograd, no fusion, no wrapper: gradients summed over micro-batches, SGD per step."""
    layer = make_layer(seed=seed, fused=False, fuse=False, version=version)
    grads, losses = [], []
    for step_data in data:
        layer.zero_grad(set_to_none=True)
        for x, target in step_data:
            loss = ((layer(x, SPLITS) - target) ** 2).mean()
            loss.backward()
        grads.append({n: p.grad.detach().clone() for n, p in layer.named_parameters()})
        losses.append(loss.item())
        with torch.no_grad():
            for p in layer.parameters():
                p.sub_(lr * p.grad)
    return grads, losses


def fsdp_run(
    model: MegatronFSDP, data, lr: float = 0.1, on_step=None
) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """zero_grad_buffer -> micro-batches fwd/bwd -> finish_grad_sync -> SGD, like mcore_repro.py."""
    grads, losses = [], []
    for step_data in data:
        model.zero_grad_buffer()
        for x, target in step_data:
            loss = ((model(x, SPLITS) - target) ** 2).mean()
            loss.backward()
        model.finish_grad_sync()
        grads.append(model.grads())
        losses.append(loss.item())
        model.sgd(lr)
        if on_step is not None:
            on_step()
    return grads, losses


def assert_grads_equal(got: list[dict], ref: list[dict]) -> None:
    """Per step, the same parameters with gradients equal to the reference's (fp32 round-off)."""
    assert len(got) == len(ref)
    for step, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert set(g) == set(r)
        for name in r:
            torch.testing.assert_close(g[name], r[name], rtol=1e-5, atol=1e-6, msg=f"step {step} {name}")


def hooked_run_matches(model: MegatronFSDP, handle, data, ref_grads: list[dict], ref_losses: list[float]):
    """Train `model` under `handle`'s hooks: the reference run's gradients and losses (fp32 round-off) and a
    clean summary. Returns the summary's one module."""
    import pytest

    grads, losses = fsdp_run(model, data, on_step=handle.step)
    assert_grads_equal(grads, ref_grads)
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    summary = handle.summary()
    assert summary.ok, summary.table()
    (module,) = summary.modules
    return module


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for name, ref in b.items():
        got = a[name]
        worst = max(worst, ((got - ref).norm() / (ref.norm() + 1e-12)).item())
    return worst


# ---------------------------------------------------------------------------------------------------------
# Fused wgrad paths for preflight (dense layers), each written from the code it stands for
# ---------------------------------------------------------------------------------------------------------
class _DenseWgrad(torch.autograd.Function):
    """y = x W^T; backward runs `path(weight, dw)`, which returns what autograd gets as the weight gradient."""

    @staticmethod
    def forward(ctx, x, weight, path):  # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.weight = weight  # the Parameter object itself: the paths read and set its attributes
        ctx.path = path
        return x @ weight.t()

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        weight = ctx.weight
        dw = dy.reshape(-1, dy.shape[-1]).t().float() @ x.reshape(-1, x.shape[-1]).float()
        return dy @ weight, ctx.path(weight, dw), None


class _FusedDense(torch.nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features))
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def path(self, weight: torch.Tensor, dw: torch.Tensor) -> torch.Tensor | None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DenseWgrad.apply(x, self.weight, self.path)


def _dummy_or_none(weight: torch.Tensor) -> torch.Tensor | None:
    """TE / megatron-core after a fused wgrad: flag it for the wrapper's grad hook and hand autograd a dummy."""
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        return torch.zeros_like(weight)
    return None


class TELinear(_FusedDense):
    """TE `Linear(fuse_wgrad_accumulation=True)`: accumulates into main_grad unless overwrite_main_grad is True
    (read at forward into ctx in TE; here at backward, the same within a micro-batch)."""

    fuse_wgrad_accumulation = True

    def path(self, weight, dw):
        main_grad = get_main_grad_from_param(weight, "Linear")
        if getattr(weight, "overwrite_main_grad", False):
            main_grad.copy_(dw)
        else:
            main_grad.add_(dw)
        return _dummy_or_none(weight)


class BasicLinear(_FusedDense):
    """TE 2.20 op-fuser `BasicLinear(accumulate_into_main_grad=True)` (ops/basic/basic_linear.py): with
    overwrite_main_grad=True it writes the wgrad into main_grad and returns main_grad itself as the autograd
    gradient without setting grad_added_to_main_grad, so a wrapper that accumulates `.grad` into an unsharded
    main_grad adds it a second time (2x); otherwise it accumulates and returns a dummy."""

    _accumulate_into_main_grad = True

    def path(self, weight, dw):
        main_grad = get_main_grad_from_param(weight, "BasicLinear")
        if getattr(weight, "overwrite_main_grad", False):
            main_grad.copy_(dw)
            return main_grad
        main_grad.add_(dw)
        return _dummy_or_none(weight)


class ColumnParallelLinear(_FusedDense):
    """megatron-core `LinearWithGradAccumulationAndAsyncCommunication` with gradient_accumulation_fusion
    (tensor_parallel/layers.py): the Megatron-FSDP branch (`__fsdp_param__`) refreshes main_grad and writes
    the wgrad GEMM with out=main_grad, i.e. overwrites whatever overwrite_main_grad says; the DDP branch calls
    apex's wgrad_gemm_accum kernel (accumulates)."""

    gradient_accumulation_fusion = True

    def path(self, weight, dw):
        if hasattr(weight, "__fsdp_param__"):
            weight.main_grad = weight.get_main_grad()
            weight.main_grad.copy_(dw)
        else:
            weight.main_grad.add_(dw)
        return _dummy_or_none(weight)


class GuardedLinear(_FusedDense):
    """A fused path that skips the write when main_grad is None (`if w.main_grad is not None:`) instead of
    refreshing it from get_main_grad(): under Megatron-FSDP, where main_grad is None after every
    zero_grad_buffer(), the weight gradient is lost."""

    fuse_wgrad_accumulation = True

    def path(self, weight, dw):
        main_grad = getattr(weight, "main_grad", None)
        if main_grad is not None:
            main_grad.add_(dw)
        return _dummy_or_none(weight)


class NoisyLinear(torch.nn.Linear):
    """Output noise from the module's own generator, which no RNG reset reaches: every call differs."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features)
        self.gen = torch.Generator().manual_seed(123)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y + 0.1 * torch.randn(y.shape, generator=self.gen)


FUSED_KINDS = {
    "te": TELinear,
    "basic": BasicLinear,
    "megatron": ColumnParallelLinear,
    "guarded": GuardedLinear,
}


class DenseBlock(torch.nn.Module):
    """plain Linear -> `middle` (the path under test) -> tanh -> plain Linear, with optional dropout (global RNG)
    and a BatchNorm (a buffer the forward updates)."""

    def __init__(
        self, middle: str = "te", hidden: int = 8, *, dropout: float = 0.0, norm: bool = False
    ) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(hidden, hidden)
        if middle == "noisy":
            self.mid: torch.nn.Module = NoisyLinear(hidden, hidden)
        elif middle == "plain":
            self.mid = torch.nn.Linear(hidden, hidden, bias=False)
        else:
            self.mid = FUSED_KINDS[middle](hidden, hidden)
        self.drop = torch.nn.Dropout(dropout)
        self.norm = torch.nn.BatchNorm1d(hidden) if norm else torch.nn.Identity()
        self.out = torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(torch.tanh(self.drop(self.mid(self.inp(x))))))


class MegatronDDP(torch.nn.Module):
    """Megatron DDP at world size 1: one fp32 buffer, `main_grad` views set at wrap, a post-accumulate hook that
    adds `.grad` into main_grad unless grad_added_to_main_grad, zero_grad_buffer/finish_grad_sync."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        params = [p for p in module.parameters() if p.requires_grad]
        self.grad_data = torch.zeros(sum(p.numel() for p in params))
        start = 0
        for param in params:
            param.main_grad = self.grad_data[start : start + param.numel()].view(param.shape)
            param.grad_added_to_main_grad = False
            param.register_post_accumulate_grad_hook(self._hook)
            start += param.numel()
        self.ddp_config = types.SimpleNamespace(use_distributed_optimizer=False)

    @staticmethod
    def _hook(param: torch.Tensor) -> None:
        if not param.grad_added_to_main_grad and param.grad is not None:
            param.main_grad.add_(param.grad)
        param.grad = None
        param.grad_added_to_main_grad = False

    def forward(self, *args: object) -> torch.Tensor:
        return self.module(*args)

    def zero_grad_buffer(self) -> None:
        self.grad_data.zero_()
        for param in self.module.parameters():
            param.grad_added_to_main_grad = False

    def finish_grad_sync(self) -> None:
        pass


def dense_batches(n: int = 2, hidden: int = 8, tokens: int = 16, seed: int = 5) -> list[tuple]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(tokens, hidden, generator=gen), torch.randn(tokens, hidden, generator=gen))
        for _ in range(n)
    ]


def mse_loss(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    x, target = batch
    return ((model(x) - target) ** 2).mean()


def fp32_mse_loss(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    """The bf16 models' loss in fp32: a bf16 loss moves in steps of 2^-8 of itself, too coarse for the
    finite differences of an 8-wide layer (they would be inconclusive, not wrong)."""
    x, target = batch
    return ((model(x).float() - target.float()) ** 2).mean()


def moe_loss(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    x, target = batch
    return ((model(x, SPLITS) - target) ** 2).mean()


def microbatch_of(
    loss_fn: Callable[[torch.nn.Module, tuple], torch.Tensor],
) -> Callable[[torch.nn.Module, tuple], torch.Tensor]:
    """The training code's micro-batch for preflight: forward and loss, backward, the loss's value."""

    def run_microbatch(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
        loss = loss_fn(model, batch)
        loss.backward()
        return loss.detach()

    return run_microbatch


mse_microbatch = microbatch_of(mse_loss)
fp32_mse_microbatch = microbatch_of(fp32_mse_loss)
moe_microbatch = microbatch_of(moe_loss)
