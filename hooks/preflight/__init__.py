"""maingrad.hooks.preflight: the pre-training check of the gradients a wrapped model's optimizer would see.

    result = maingrad.hooks.preflight(model, run_microbatch, batches, loss_fn=loss_fn)

Modules: `run` (`preflight()`, `preflight_from_env()`: the order of the parts and what is put back), `check`
(one call's state, the wrapper's calls and the runs), `loss_fd` and `moves` (finite differences on the loss:
the probes, and how they move the weights), `local_fd` and `local` (finite differences on a module's own
output: the plan and verdicts, and the reruns inside a backward), `classify` (the comparison at the end),
`measure` (device-side numbers and the self-checking estimate), `judge` (verdicts and the wrapper-specific
lines), `result` (what is returned and its forms), `wrappers` (one adapter per data-parallel wrapper),
`state` (randomness and buffers put back), `cli` (`maingrad preflight`).

`maingrad.hooks.preflight` names both this package and the function: the package is callable (it forwards
to `run.preflight`), so `maingrad.hooks.preflight(model, ...)` works whichever of the two an import left
under that name. Nothing heavy is imported here: `maingrad preflight --show` and the CLI's registration
load no torch.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from maingrad.hooks.preflight.result import ParamResult as ParamResult
    from maingrad.hooks.preflight.result import PreflightResult as PreflightResult
    from maingrad.hooks.preflight.result import Probe as Probe
    from maingrad.hooks.preflight.run import PreflightFailed as PreflightFailed
    from maingrad.hooks.preflight.run import preflight as preflight
    from maingrad.hooks.preflight.run import preflight_from_env as preflight_from_env

_LAZY = {
    "preflight": "run",
    "preflight_from_env": "run",
    "PreflightFailed": "run",
    "PreflightResult": "result",
    "ParamResult": "result",
    "Probe": "result",
}

__all__ = ["ParamResult", "PreflightFailed", "PreflightResult", "Probe", "preflight", "preflight_from_env"]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module_name}"), name)


class _CallablePackage(types.ModuleType):
    """The package object, callable as the `preflight()` function it is named after."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from maingrad.hooks.preflight.run import preflight as function

        return function(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
