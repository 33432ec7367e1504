"""The main_grad exposure fix (megatron-core 0.19's `_ensure_main_grad`), usable without hooks.

Megatron-FSDP leaves `param.main_grad` absent until the first backward and sets it to None after every
gradient reduction; fused wgrad paths that read it in forward (TE's op-fuser GroupedLinear) then fail.
The fix assigns `param.main_grad = param.get_main_grad()` first. Its guards are upstream's: `is None` only
(a tensor is never truth-tested), `getattr(..., None)` so DDP parameters (no `get_main_grad`) are untouched.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

OVERWRITE_POLICIES: tuple[str, ...] = ("keep", "force_true")

_MISSING = object()


def check_policy(policy: str) -> str:
    if policy not in OVERWRITE_POLICIES:
        raise ValueError(f"overwrite_policy must be one of {OVERWRITE_POLICIES}, got {policy!r}")
    return policy


def expose_param(param: torch.Tensor) -> bool:
    """Set `param.main_grad` from `param.get_main_grad()` when absent or None; True when it did.

    Raises what `get_main_grad()` raises, and TypeError when it returns something that is not a tensor (a
    None returned here would silently keep the bug).
    """
    if getattr(param, "main_grad", None) is not None:
        return False
    get_main_grad = getattr(param, "get_main_grad", None)
    if get_main_grad is None:
        return False
    main_grad = get_main_grad()
    if not isinstance(main_grad, torch.Tensor):
        raise TypeError(f"get_main_grad() returned {type(main_grad).__name__}, not a tensor")
    param.main_grad = main_grad  # type: ignore[attr-defined]  # the attribute Megatron adds to parameters
    return True


def force_overwrite_true(param: torch.Tensor) -> bool:
    """Upstream 0.19's second step: `overwrite_main_grad = True` where the attribute exists. True if set."""
    if getattr(param, "overwrite_main_grad", _MISSING) is _MISSING:
        return False
    # Opt-in reproduction of upstream's forced overwrite (policy "force_true"); the default keeps the wrapper's.
    param.overwrite_main_grad = True  # type: ignore[attr-defined]  # maingrad: ignore[MG006]
    return True


def expose_main_grad(
    module_or_params: torch.nn.Module | Iterable[torch.Tensor], *, overwrite_policy: str = "keep"
) -> int:
    """Expose `main_grad` on every parameter of a module (recursively) or of an iterable; returns how many.

    Call it right before a fused-wgrad forward (after Megatron-FSDP's unshard), e.g. on
    `experts.linear_fc1` and `experts.linear_fc2`. Parameters that already have a `main_grad` buffer (all DDP
    parameters) and parameters without `get_main_grad` are left alone. `overwrite_policy="keep"` (default)
    leaves `overwrite_main_grad` as Megatron-FSDP set it for its sharding strategy; `"force_true"` sets it to
    True wherever the attribute exists, as megatron-core 0.19 does (see docs/hooks.md for when that is wrong).
    """
    check_policy(overwrite_policy)
    force = overwrite_policy == "force_true"
    if isinstance(module_or_params, torch.nn.Module):
        params: Iterable[torch.Tensor] = module_or_params.parameters()
    else:
        params = module_or_params
    exposed = 0
    for param in params:
        if param is None:
            continue
        if expose_param(param):
            exposed += 1
        if force:
            force_overwrite_true(param)
    return exposed
