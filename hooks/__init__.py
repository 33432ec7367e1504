"""maingrad.hooks: runtime exposure of main_grad and per-call records (imports only torch and the stdlib).

    handle = maingrad.hooks.install(model)   # after wrapping with DDP / Megatron-FSDP
    ...; handle.step(); ...; print(handle.summary()); handle.remove()

    print(maingrad.hooks.preflight(model, run_microbatch, batches, loss_fn=loss_fn))  # once, before training

Attributes load lazily, so `import maingrad.hooks` (and the `maingrad` CLI) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what a user's type checker sees; at run time the names load lazily (__getattr__)
    from maingrad.contracts.anomalies import ANOMALIES as ANOMALIES
    from maingrad.contracts.records import FIELDS as FIELDS
    from maingrad.contracts.records import SCHEMA_VERSION as SCHEMA_VERSION
    from maingrad.contracts.records import validate as validate_record  # noqa: F401
    from maingrad.hooks.api import Handle as Handle
    from maingrad.hooks.api import install as install
    from maingrad.hooks.api import watch as watch
    from maingrad.hooks.errors import MainGradContractError as MainGradContractError
    from maingrad.hooks.errors import MainGradHooksWarning as MainGradHooksWarning
    from maingrad.hooks.expose import expose_main_grad as expose_main_grad
    from maingrad.hooks.preflight.result import ParamResult as ParamResult
    from maingrad.hooks.preflight.result import PreflightResult as PreflightResult
    from maingrad.hooks.preflight.run import PreflightFailed as PreflightFailed
    from maingrad.hooks.preflight.run import preflight as preflight
    from maingrad.hooks.preflight.run import preflight_from_env as preflight_from_env
    from maingrad.hooks.sinks import HttpSink as HttpSink
    from maingrad.hooks.sinks import JsonlSink as JsonlSink
    from maingrad.hooks.sinks import MemorySink as MemorySink
    from maingrad.hooks.sinks import Sink as Sink
    from maingrad.hooks.summary import ModuleSummary as ModuleSummary
    from maingrad.hooks.summary import Summary as Summary
    from maingrad.hooks.summary import summarize_records as summarize_records

_EXPORTS: dict[str, str] = {
    "install": "api",
    "watch": "api",
    "Handle": "api",
    "expose_main_grad": "expose",
    "MainGradContractError": "errors",
    "MainGradHooksWarning": "errors",
    "Summary": "summary",
    "ModuleSummary": "summary",
    "summarize_records": "summary",
    "MemorySink": "sinks",
    "JsonlSink": "sinks",
    "HttpSink": "sinks",
    "Sink": "sinks",
    "ANOMALIES": "maingrad.contracts.anomalies",
    "FIELDS": "maingrad.contracts.records",
    "SCHEMA_VERSION": "maingrad.contracts.records",
    "validate_record": "maingrad.contracts.records",
    "preflight": "preflight",  # the package, callable as the function (see hooks/preflight/__init__.py)
    "preflight_from_env": "preflight.run",
    "PreflightResult": "preflight.result",
    "PreflightFailed": "preflight.run",
    "ParamResult": "preflight.result",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'maingrad.hooks' has no attribute {name!r}")
    full = module_name if module_name.startswith("maingrad.") else f"{__name__}.{module_name}"
    module = importlib.import_module(full)
    if name == "preflight":
        value = module  # importing the package binds it here anyway; it is callable as preflight()
    else:
        value = getattr(module, "validate" if name == "validate_record" else name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
