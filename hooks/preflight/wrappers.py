"""How preflight reaches the gradients the optimizer would see, one small adapter per data-parallel wrapper.

Each adapter answers four questions through the wrapper's own API, so preflight tests the real path and
leaves the wrapper in a state it knows: how to zero the gradient buffers, how to finish the gradient sync,
where the optimizer reads each parameter's gradient, and which tensor to perturb so that the next forward
computes with the perturbed weights (for the finite-difference estimate). Chosen by duck typing; nothing
here imports megatron-core or Transformer Engine.

| wrapper | zero | finish | gradient read | perturbed tensor |
|---|---|---|---|---|
| Megatron-FSDP (`param_and_grad_buffer.optimizer_named_parameters`) | `zero_grad_buffer()` | `finish_grad_sync()` | the optimizer parameter's `.grad` (local shard) | its local main weight, then `install_optimized_model_weights()` |
| Megatron DDP (`zero_grad_buffer` + `finish_grad_sync`) | `zero_grad_buffer()` | `finish_grad_sync()` | `param.main_grad` (`.grad` where absent) | the module parameter |
| torch FSDP2 (DTensor parameters) | `.grad = None` | nothing (reduce-scatter runs in backward) | `.grad.to_local()` | the local shard, then `reshard()` |
| plain module, torch DDP | `.grad = None` | nothing | `.grad` | the parameter |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

WRAPPERS: tuple[str, ...] = ("megatron-fsdp", "megatron-ddp", "fsdp2", "plain")


def normalize_name(name: str) -> str:
    """A parameter or module name without the wrappers' leading `module.` segments (DDP, Megatron-FSDP,
    Float16Module each add one), so the wrapper's and the module tree's names match."""
    while name.startswith("module."):
        name = name[len("module.") :]
    return "" if name == "module" else name


def _local(tensor: Any) -> Any:
    """The local shard of a DTensor (its `_local_tensor`, the storage `to_local()` returns a view of, without
    `to_local()`'s autograd call: 5-7 us each on a CPU, per parameter and run); anything else unchanged."""
    local = getattr(tensor, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _is_dtensor(tensor: Any) -> bool:
    return callable(getattr(tensor, "to_local", None)) and hasattr(tensor, "_local_tensor")


@dataclass
class Entry:
    """One parameter as preflight sees it: the optimizer's name and tensors plus where it lives in the model."""

    name: str  # normalized qualified name
    module: str  # normalized path of the module that owns it
    leaf: str  # attribute name in that module
    owner_type: str  # class name of the owning module ("?" when the name does not resolve)
    parent_type: str  # class name of the owner's parent module
    opt_param: torch.Tensor  # what the optimizer steps (may be a DTensor)
    raw_param: torch.Tensor  # the module's parameter (flags such as overwrite_main_grad live here)


class Adapter:
    """Plain modules (and torch DDP): `.grad` is what the optimizer reads; nothing to finish."""

    label = "plain"
    kind = "plain"  # one of WRAPPERS: selects the wrapper-specific "likely" and "fix" lines
    # a run's forward writing a parameter in place shows in its version counter (`Check.written`): the wrappers
    # below write the module's parameters themselves (all-gathers, installs), so there it would show always
    tracks_writes = True

    def __init__(self, model: torch.nn.Module) -> None:
        self.model: Any = model  # duck-typed: the wrapper's own methods (zero_grad_buffer, ...) are called
        self.entries = self._entries()
        self._saved_grads: list[Any] | None = None

    # -- discovery -------------------------------------------------------------------------------------------
    def _named(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """(name, optimizer tensor, module parameter) of every trainable parameter."""
        return [(n, p, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def _entries(self) -> list[Entry]:
        modules = {normalize_name(path): module for path, module in self.model.named_modules()}
        out = []
        for name, opt_param, raw_param in self._named():
            norm = normalize_name(name)
            owner_path, _, leaf = norm.rpartition(".")
            owner = modules.get(owner_path)
            parent_path = owner_path.rpartition(".")[0]
            parent = modules.get(parent_path) if owner_path else None
            out.append(
                Entry(
                    name=norm,
                    module=owner_path,
                    leaf=leaf,
                    owner_type=type(owner).__name__ if owner is not None else "?",
                    parent_type=type(parent).__name__ if parent is not None else "-",
                    opt_param=opt_param,
                    raw_param=raw_param,
                )
            )
        return out

    @property
    def strategy(self) -> str | None:
        return None

    @property
    def sharded(self) -> bool:
        """Each data-parallel rank reads only its shard of the gradient (so norms add up across ranks)."""
        return False

    def prepare(self) -> None:
        """Before each run of micro-batches: what the training loop does between optimizer steps."""

    # -- gradients -------------------------------------------------------------------------------------------
    def save_user_grads(self) -> None:
        """Keep references to the gradients the user had (no copy): preflight sets fresh ones."""
        self._saved_grads = [e.opt_param.grad for e in self.entries]

    def restore_user_grads(self) -> bool:
        """Put the user's gradients back where the wrapper allows it; True when done."""
        if self._saved_grads is None:
            return False
        for entry, grad in zip(self.entries, self._saved_grads, strict=True):
            entry.opt_param.grad = grad
        return True

    def zero(self) -> None:
        for entry in self.entries:
            entry.opt_param.grad = None

    def finish(self) -> None:
        pass

    def grad(self, entry: Entry) -> torch.Tensor | None:
        grad = entry.opt_param.grad
        return None if grad is None else _local(grad)

    # -- weights ---------------------------------------------------------------------------------------------
    def target(self, entry: Entry) -> torch.Tensor:
        """The tensor to perturb in place so that the next forward sees the change."""
        return _local(entry.opt_param).data

    def compute_dtype(self, entry: Entry) -> torch.dtype:
        """The dtype the forward computes with (the perturbation is rounded to it)."""
        return entry.raw_param.dtype

    def commit(self) -> None:
        """Make in-place edits of the targets visible to the next forward."""

    def module_tensors(self) -> dict[int, tuple[torch.nn.Module | None, torch.Tensor]]:
        """Per entry (by id of its raw parameter): the module holding the parameter (None where its path does
        not resolve) and the tensor its forward computes with, where that tensor holds the same elements as the
        gradient the optimizer reads (what the module-local finite differences move and compare); here the
        module's parameter itself, unless it is sharded (Megatron DDP; Megatron-FSDP, which puts the module's
        own parameter back for the forward and the backward and keeps it whole on a single rank)."""
        modules = {normalize_name(path): module for path, module in self.model.named_modules()}
        return {
            id(e.raw_param): (modules.get(e.module), e.raw_param)
            for e in self.entries
            if not _is_dtensor(e.raw_param) and e.raw_param.numel() == e.opt_param.numel()
        }


class Fsdp2Adapter(Adapter):
    """torch FSDP2 (`fully_shard`): DTensor parameters; gradients are reduce-scattered inside backward."""

    label = "torch FSDP2"
    kind = "fsdp2"
    tracks_writes = False

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self._by_sharded: dict[int, Any] | None = None

    @property
    def sharded(self) -> bool:
        return True

    def commit(self) -> None:
        """Reshard every FSDP module: a module left unsharded (the root after backward) keeps computing with
        its unsharded copy, so a perturbed shard is seen only after the next all-gather."""
        for module in self.model.modules():
            reshard = getattr(module, "reshard", None)
            if callable(reshard) and type(module).__name__.startswith("FSDP"):
                reshard()

    prepare = commit

    def _fsdp_params(self) -> dict[int, Any]:
        """FSDP2's per-parameter state (FSDPParam), by id of the sharded parameter, from each module's FSDP
        state (read once: the objects live as long as the wrapping); empty where a torch keeps it differently
        (then nothing below uses it)."""
        if self._by_sharded is not None:
            return self._by_sharded
        out: dict[int, Any] = {}
        for module in self.model.modules():
            state: Any = getattr(module, "_get_fsdp_state", None)
            try:
                group = getattr(state(), "_fsdp_param_group", None) if callable(state) else None
            except Exception:  # noqa: BLE001 - not an FSDP2 module after all
                group = None
            for fp in getattr(group, "fsdp_params", None) or []:
                out[id(getattr(fp, "sharded_param", None))] = fp
        self._by_sharded = out
        return out

    def compute_dtype(self, entry: Entry) -> torch.dtype:
        """The mixed-precision policy's param_dtype (the all-gathered copy the forward computes with), else the
        parameter's own dtype."""
        dtype = getattr(self._fsdp_params().get(id(entry.raw_param)), "param_dtype", None)
        return dtype if isinstance(dtype, torch.dtype) else entry.raw_param.dtype

    def module_tensors(self) -> dict[int, tuple[torch.nn.Module | None, torch.Tensor]]:
        """The unsharded parameter FSDP2 registers on the module for its forward and backward (one object per
        parameter, created at the first all-gather and refilled by every later one), where it exists yet and
        has the sharded parameter's elements (a single rank: the shard is the whole tensor). A torch whose
        state looks different gives none (the weights are then judged by the loss only, and the summary says
        why)."""
        by_id = {id(e.raw_param): i for i, e in enumerate(self.entries)}
        out: dict[int, tuple[torch.nn.Module | None, torch.Tensor]] = {}
        for key, fp in self._fsdp_params().items():
            i = by_id.get(key)
            unsharded = getattr(fp, "_unsharded_param", None)
            owner = getattr(getattr(fp, "_module_info", None), "module", None)
            if i is None or not isinstance(unsharded, torch.Tensor) or not isinstance(owner, torch.nn.Module):
                continue
            if unsharded.numel() == _local(self.entries[i].opt_param).numel():
                out[key] = (owner, unsharded)
        return out


class MegatronDdpAdapter(Adapter):
    """Megatron DDP: the gradient lives in `param.main_grad` (a view of the contiguous grad buffer)."""

    label = "Megatron DDP"
    kind = "megatron-ddp"
    tracks_writes = False

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)

    @property
    def strategy(self) -> str | None:
        config = getattr(self.model, "ddp_config", None)
        if config is None:
            return None
        return (
            "distributed optimizer"
            if getattr(config, "use_distributed_optimizer", False)
            else "no distributed optimizer"
        )

    def save_user_grads(self) -> None:
        self._saved_grads = None  # the buffer is the wrapper's: zeroed through its API, not restored

    def zero(self) -> None:
        self.model.zero_grad_buffer()
        for entry in self.entries:
            if not hasattr(entry.raw_param, "main_grad"):
                entry.raw_param.grad = None

    def finish(self) -> None:
        self.model.finish_grad_sync()

    def grad(self, entry: Entry) -> torch.Tensor | None:
        main_grad = getattr(entry.raw_param, "main_grad", None)
        if isinstance(main_grad, torch.Tensor):
            return main_grad
        return super().grad(entry)


class MegatronFsdpAdapter(Adapter):
    """Megatron-FSDP: the optimizer's parameters are `param_and_grad_buffer.optimizer_named_parameters`
    (main weights, possibly DTensor shards) whose `.grad` `finish_grad_sync()` fills from the gradient buffer;
    the module's own parameters (`orig_param`) carry the flags. Weights are perturbed where the optimizer
    writes them and installed with `install_optimized_model_weights()`, as after `optimizer.step()`."""

    label = "Megatron-FSDP"
    kind = "megatron-fsdp"
    tracks_writes = False

    def _named(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        out = []
        for name, param in self.model.param_and_grad_buffer.optimizer_named_parameters:
            raw = getattr(param, "orig_param", param)
            if getattr(raw, "requires_grad", True):
                out.append((name, param, raw))
        return out

    @property
    def strategy(self) -> str | None:
        for obj in (self.model, getattr(self.model, "module", None)):
            config = getattr(obj, "ddp_config", None)
            value = getattr(config, "data_parallel_sharding_strategy", None)
            if isinstance(value, str):
                return value
        value = getattr(self.model, "strategy", None)  # the CPU emulator
        return value if isinstance(value, str) else None

    @property
    def sharded(self) -> bool:
        return self.strategy != "no_shard"

    def save_user_grads(self) -> None:
        self._saved_grads = None

    def prepare(self) -> None:
        """As the training loop after `optimizer.step()`: start the parameter all-gather for the next forward."""
        sync = getattr(self.model, "start_param_sync", None)
        if callable(sync):
            sync()

    def zero(self) -> None:
        self.model.zero_grad_buffer()

    def finish(self) -> None:
        self.model.finish_grad_sync()

    def _installer(self) -> Callable[[], object] | None:
        for obj in (self.model, getattr(self.model, "module", None)):
            install = getattr(obj, "install_optimized_model_weights", None)
            if callable(install):
                return install
        return None

    def commit(self) -> None:
        install = self._installer()
        if install is not None:
            install()
        self.prepare()


def choose(model: torch.nn.Module, wrapper: str | Adapter = "auto") -> Adapter:
    """The adapter for `model`: by name (`WRAPPERS`), an Adapter instance, or "auto" (duck typing)."""
    if isinstance(wrapper, Adapter):
        return wrapper
    if wrapper == "auto":
        buffer = getattr(model, "param_and_grad_buffer", None)
        has_api = callable(getattr(model, "zero_grad_buffer", None)) and callable(
            getattr(model, "finish_grad_sync", None)
        )
        if has_api and hasattr(buffer, "optimizer_named_parameters"):
            wrapper = "megatron-fsdp"
        elif has_api:
            wrapper = "megatron-ddp"
        elif any(_is_dtensor(p) for p in model.parameters()):
            wrapper = "fsdp2"
        else:
            wrapper = "plain"
    classes = {
        "megatron-fsdp": MegatronFsdpAdapter,
        "megatron-ddp": MegatronDdpAdapter,
        "fsdp2": Fsdp2Adapter,
        "plain": Adapter,
    }
    cls = classes.get(wrapper) if isinstance(wrapper, str) else None
    if cls is None:
        raise ValueError(f"wrapper must be 'auto', one of {WRAPPERS} or an Adapter, got {wrapper!r}")
    if cls is MegatronFsdpAdapter and not hasattr(
        getattr(model, "param_and_grad_buffer", None), "optimizer_named_parameters"
    ):
        raise ValueError(
            "wrapper='megatron-fsdp' needs model.param_and_grad_buffer.optimizer_named_parameters"
        )
    if cls is MegatronDdpAdapter and not callable(getattr(model, "finish_grad_sync", None)):
        raise ValueError("wrapper='megatron-ddp' needs model.zero_grad_buffer() and model.finish_grad_sync()")
    return cls(model)
