"""maingrad.hooks: runtime exposure of main_grad and per-call records (imports only torch and the stdlib).

    handle = maingrad.hooks.install(model)   # after wrapping with DDP / Megatron-FSDP
    ...; handle.step(); ...; print(handle.summary()); handle.remove()

    print(maingrad.hooks.preflight(model, run_microbatch, [batch_a, batch_b], loss_fn=loss_fn))  # once, before

Attributes load lazily, so `import maingrad.hooks` (and the `maingrad` CLI) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

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
    "preflight": "preflight_check",
    "preflight_from_env": "preflight_check",
    "PreflightResult": "preflight_check",
    "PreflightFailed": "preflight_check",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'maingrad.hooks' has no attribute {name!r}")
    module = importlib.import_module(module_name if "." in module_name else f"{__name__}.{module_name}")
    value = getattr(module, "validate" if name == "validate_record" else name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
