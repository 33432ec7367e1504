"""Errors and warnings raised by maingrad.hooks (no torch import: the CLI loads this module cheaply)."""

from __future__ import annotations

from maingrad.contracts.anomalies import ANOMALIES


class MainGradContractError(RuntimeError):
    """A fused-wgrad parameter breaks the main_grad contract; raised by `check` mode before TE would fail.

    Carries the instrumented module's path, the parameter's name relative to it, the problem (an anomaly
    code from `maingrad.contracts.anomalies`) and the remedy, so the message is actionable on its own.
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
            f"({_summary(problem)}). Remedy: {remedy}"
        )


class MainGradHooksWarning(UserWarning):
    """Something about how the hooks were installed makes their results unreliable (e.g. model not wrapped)."""


def _summary(problem: str) -> str:
    anomaly = ANOMALIES.get(problem)
    return anomaly.summary if anomaly is not None else problem
