"""Errors and warnings raised by maingrad.hooks (no torch import: the CLI loads this module cheaply)."""

from __future__ import annotations


class MainGradContractError(RuntimeError):
    """A fused-wgrad parameter breaks the main_grad contract; raised by `check` mode before TE would fail.

    Carries the instrumented module's path, the parameter's name relative to it, the problem (an anomaly
    name from `maingrad.hooks.records.ANOMALIES`) and the remedy, so the message is actionable on its own.
    """

    def __init__(
        self, module: str, param: str, problem: str, remedy: str, *, phase: str = "forward", others: int = 0
    ) -> None:
        self.module = module
        self.param = param
        self.problem = problem
        self.remedy = remedy
        self.phase = phase
        self.others = others
        where = f"{module or '(root)'}: parameter {param!r}"
        more = f" (and {others} more parameter{'s' if others != 1 else ''} of this module)" if others else ""
        super().__init__(
            f"maingrad: {where}{more} violates the main_grad contract at {phase}: {problem} "
            f"({_EXPLAIN.get(problem, problem)}). Remedy: {remedy}"
        )


class MainGradHooksWarning(UserWarning):
    """Something about how the hooks were installed makes their results unreliable (e.g. model not wrapped)."""


_EXPLAIN = {
    "main_grad_missing": "the parameter has no main_grad attribute; TE's fused op-fuser forward raises "
    "'MAIN GRAD NOT FOUND'",
    "main_grad_none": "main_grad is None (Megatron-FSDP resets it after every gradient reduction); TE's fused "
    "op-fuser forward raises 'MAIN GRAD IS NONE'",
    "main_grad_not_tensor": "main_grad is set but is not a tensor",
    "get_main_grad_failed": "get_main_grad() raised or returned something that is not a tensor",
    "main_grad_shape_mismatch": "main_grad has a different number of elements than the parameter",
}
