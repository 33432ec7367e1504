"""Anomaly codes: what a runtime record's `anomaly` field may say, what each means and how to fix it.

The hooks set them, `check` mode raises on the fatal ones, the service counts them in the gate and the
dashboard shows their meaning: all read this one table. Standard library only (the hooks import it on the
training process's start-up path).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Anomaly:
    """One anomaly code.

    `summary` says what the record observed; `fatal` anomalies make TE (or the GEMM) fail, so `check` mode
    raises `MainGradContractError` for them before TE does; `remedy` is the generic fix (the hooks refine it
    for the parameter at hand where they can, see `remedy()`).
    """

    code: str
    summary: str
    fatal: bool
    remedy: str


_EXPOSE = (
    "expose main_grad before the fused forward: call maingrad.hooks.install(model) (mode 'fix') after wrapping "
    "the model with Megatron-FSDP, or maingrad.hooks.expose_main_grad(module) in a pre-forward hook; "
    "megatron-core >= 0.19 does this itself for TEGroupedMLP"
)
_WRAP = (
    "the parameter has no main_grad and no get_main_grad(): wrap the model with Megatron DistributedDataParallel "
    "or Megatron-FSDP before the first forward, or build this module without fused wgrad accumulation "
    "(gradient_accumulation_fusion / accumulate_into_main_grad = False)"
)

ANOMALIES: dict[str, Anomaly] = {
    a.code: a
    for a in (
        Anomaly(
            "main_grad_missing",
            "no main_grad attribute where the fused path needs one (TE: 'MAIN GRAD NOT FOUND')",
            True,
            _EXPOSE,
        ),
        Anomaly(
            "main_grad_none",
            "main_grad is None where the fused path needs a buffer (Megatron-FSDP resets it after every "
            "gradient reduction; TE: 'MAIN GRAD IS NONE')",
            True,
            _EXPOSE,
        ),
        Anomaly(
            "main_grad_not_tensor",
            "main_grad is set to something that is not a tensor",
            True,
            "assign a tensor to main_grad (or leave it to get_main_grad()); never a placeholder value",
        ),
        Anomaly(
            "get_main_grad_failed",
            "fix mode called get_main_grad() and it raised or returned a non-tensor",
            True,
            _EXPOSE,
        ),
        Anomaly(
            "main_grad_shape_mismatch",
            "main_grad's element count differs from the parameter's (the GEMM output view fails or writes "
            "out of place)",
            True,
            "main_grad must be this parameter's gradient-buffer view with the same number of elements",
        ),
        Anomaly(
            "param_missing",
            "the instrumented parameter slot is gone or None (parameter removed or replaced by None)",
            False,
            "install the hooks after the model's parameters are final (after wrapping), or re-install them",
        ),
        Anomaly(
            "flag_not_bool",
            "overwrite_main_grad or grad_added_to_main_grad holds a non-bool (a tensor flag would be "
            "truth-tested by TE and sync the device, or be ambiguous)",
            False,
            "set overwrite_main_grad / grad_added_to_main_grad to Python bools only",
        ),
        Anomaly(
            "overwrite_discards_microbatch",
            "backward only: overwrite_main_grad is True in micro-batch >= 1 while main_grad is the persistent "
            "accumulation buffer, so the fused wgrad overwrites what earlier micro-batches accumulated. Known "
            "exactly under Megatron-FSDP (the parameter's gradient buffer `_gbuf` is not sharded: "
            "no_shard/optim, or any strategy at data-parallel size 1); elsewhere a heuristic: this "
            "micro-batch's forward found main_grad still holding the buffer the previous backward wrote",
            False,
            "set overwrite_main_grad only where the gradient buffer is sharded (Megatron-LM #6773 does this for "
            "one-rank groups); until then use no_shard, or install the hooks with overwrite_policy='keep'",
        ),
        Anomaly(
            "hook_error",
            "maingrad's own hook code raised; the record says what it could, training went on",
            False,
            "report it with the record: it is a maingrad bug",
        ),
        # -- verdicts of maingrad.hooks.preflight (phase "preflight"): the gradient the optimizer would see --
        Anomaly(
            "grad_overwritten",
            "preflight: with two micro-batches the optimizer's gradient equals the last micro-batch's alone "
            "(G(A,B) = G(B)): a fused wgrad path overwrites main_grad instead of accumulating into it",
            False,
            "where Megatron-FSDP sets overwrite_main_grad=True on an unsharded gradient buffer (data-parallel "
            "size 1, or `optim` before Megatron-LM #6357): use no_shard or a megatron-core with Megatron-LM "
            "#6773; where the path ignores the flag (megatron-core tensor_parallel/layers.py Megatron-FSDP "
            "branch): accumulate into main_grad unless overwrite_main_grad is True, or train with "
            "gradient_accumulation_fusion=False",
        ),
        Anomaly(
            "grad_scaled",
            "preflight: the optimizer's gradient is a constant multiple (not 1) of the true gradient, "
            "measured against central finite differences of the loss",
            False,
            "a fused path both wrote main_grad and returned a gradient the wrapper added again (TE BasicLinear "
            "with overwrite_main_grad=True returns main_grad as the autograd gradient): set "
            "grad_added_to_main_grad=True and return a dummy gradient, or avoid overwrite_main_grad=True on an "
            "unsharded buffer; check loss scaling and the data-parallel gradient averaging",
        ),
        Anomaly(
            "grad_lost",
            "preflight: the optimizer's gradient is zero (or drops micro-batches) although the loss depends "
            "on the parameter",
            False,
            "the fused wgrad went to a buffer the optimizer never reads (a stale or None main_grad skipped by a "
            "guard, or grad_added_to_main_grad set without writing): write into the buffer get_main_grad() "
            "returns at backward",
        ),
        Anomaly(
            "grad_nondeterministic",
            "preflight: repeating the same micro-batch from the same state and RNG gives a different gradient, "
            "so accumulation could not be judged",
            False,
            "make the forward and backward repeatable for the check: randomness from a generator preflight "
            "does not reset (pass it in rng_states=), state that changes every call, or nondeterministic "
            "kernels (torch.use_deterministic_algorithms)",
        ),
        Anomaly(
            "grad_stale",
            "preflight: the gradient buffer still holds an earlier step's gradient after the wrapper zeroed it, "
            "so every step adds the previous steps' gradients",
            False,
            "zero every buffer the optimizer reads between steps (the wrapper's zero_grad_buffer() must reach "
            "this parameter's main_grad, e.g. a main_grad replaced by a tensor outside the gradient buffer)",
        ),
        Anomaly(
            "grad_inconsistent",
            "preflight: the optimizer's gradient neither accumulates its micro-batches nor keeps one of them, "
            "or disagrees with the finite-difference estimate by something other than a constant factor",
            False,
            "read the preflight table's numbers for this parameter; compare with gradient_accumulation_fusion="
            "False, which the wrapper accumulates through autograd",
        ),
        Anomaly(
            "grad_not_finite",
            "preflight: the optimizer's gradient holds NaN or Inf (e.g. a gradient bucket nothing wrote)",
            False,
            "find the path that leaves the buffer unwritten or overflows; the loss itself was finite",
        ),
        Anomaly(
            "preflight_error",
            "preflight could not finish: the user's micro-batch (or the wrapper) raised; the record's param "
            "is '*'",
            False,
            "run the micro-batch outside preflight to see the error; a 'MAIN GRAD NOT FOUND' here is the "
            "main_grad_missing anomaly: expose main_grad (maingrad.hooks.install(model))",
        ),
    )
}

# The verdict codes of maingrad.hooks.preflight, worst first (its table sorts by this order).
PREFLIGHT_ANOMALIES: tuple[str, ...] = (
    "preflight_error",
    "grad_not_finite",
    "grad_nondeterministic",
    "grad_lost",
    "grad_overwritten",
    "grad_stale",
    "grad_scaled",
    "grad_inconsistent",
)

# Anomalies that make TE (or the GEMM) fail: `check` mode raises MainGradContractError for these.
FATAL_ANOMALIES: frozenset[str] = frozenset(code for code, a in ANOMALIES.items() if a.fatal)


def remedy(code: str, *, has_get_main_grad: bool = True) -> str:
    """The fix for `code`; a parameter with neither main_grad nor get_main_grad() needs a wrapper, not an
    exposure."""
    anomaly = ANOMALIES.get(code)
    if anomaly is None:
        return code
    if anomaly.remedy is _EXPOSE and not has_get_main_grad:
        return _WRAP
    return anomaly.remedy
