"""Mode, run id, rank and commit resolution, including the environment overrides a launcher sets.

- MAINGRAD_HOOKS=off|observe|check|fix overrides the mode passed to install() (switch without code changes).
- MAINGRAD_COMMIT: commit recorded in every record when install(commit=...) is not given.
- MAINGRAD_RUN: run id shared by all ranks (else torchrun's TORCHELASTIC_RUN_ID, else a local id).
- RANK (torchrun) or torch.distributed's rank when initialized: the record's rank.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Mapping

from maingrad.hooks.errors import MainGradHooksWarning

HOOK_MODES: tuple[str, ...] = ("off", "observe", "check", "fix")
ENV_MODE = "MAINGRAD_HOOKS"


def resolve_mode(mode: str, env: Mapping[str, str] | None = None) -> str:
    """The effective mode: a valid MAINGRAD_HOOKS wins over the argument; an invalid one warns."""
    if mode not in HOOK_MODES:
        raise ValueError(f"mode must be one of {HOOK_MODES}, got {mode!r}")
    env = os.environ if env is None else env
    override = env.get(ENV_MODE)
    if override is None or not override.strip():
        return mode
    value = override.strip().lower()
    if value not in HOOK_MODES:
        warnings.warn(
            f"{ENV_MODE}={override!r} is not one of {HOOK_MODES}; using mode {mode!r}",
            MainGradHooksWarning,
            stacklevel=3,
        )
        return mode
    return value


def resolve_run(run: str | None, env: Mapping[str, str] | None = None) -> str:
    if run:
        return run
    env = os.environ if env is None else env
    for key in ("MAINGRAD_RUN", "TORCHELASTIC_RUN_ID"):
        value = env.get(key)
        if value and value != "none":
            return value
    return f"run-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"


def resolve_rank(rank: int | None, env: Mapping[str, str] | None = None) -> int:
    if rank is not None:
        return int(rank)
    env = os.environ if env is None else env
    value = env.get("RANK")
    if value is not None and value.strip().isdigit():
        return int(value)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # noqa: BLE001 - no distributed support: single process
        pass
    return 0


def resolve_commit(commit: str | None, env: Mapping[str, str] | None = None) -> str | None:
    if commit:
        return commit
    env = os.environ if env is None else env
    return env.get("MAINGRAD_COMMIT") or None
