"""From preflight's numbers to verdicts, and the "likely" / "fix" lines for the wrapper that was found.

The accumulation law: G(sequence) must equal the sum of the singles' gradients (each micro-batch alone from
zeroed buffers). Where it does not, G(sequence) is fitted as sum_k c_k g_k over the singles (on each
parameter's subset), and the coefficients by position say what happened: only the last one kept is an
overwrite, only the first is a lost gradient, anything else (x0.5 on every second backward, one position
scaled) is `grad_inconsistent` with the coefficients in the note. Standard library only (host numbers).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from maingrad.hooks.preflight.result import ParamResult

FIT_TOL = 0.15  # |c_k - expected| below this: the coefficient is what the named pattern says


def hidden_factor(band: float, share: float) -> float:
    """1 + X: what a passing comparison leaves open on one weight, as the symmetric band x(1 - X) .. x(1 + X)
    of factors f = reported / true gradient it could not tell from 1 (math.inf: no factor above 1 ruled out).

    `band`: the most the true |log(reported / true)| of the whole set can be given the verdict (the accepted
    deviation plus the estimate's own error bar); `share`: the weight's part of the set's predicted change,
    which is computed with the reported gradient. Off by f, with the others right, the weight moves the set's
    ratio to 1 / (1 - share (1 - 1/f)), so the comparison passes f from 1 / (1 + c) up to 1 / (1 - a), where
    a = (1 - e^-band) / share and c = (e^band - 1) / share; above a = 1 every f > 1 passes. (The linear
    reading, 1 + band / share, is short by about a factor f: band / share = 0.63 leaves x2.7 open, not
    x1.63.)"""
    if not share > 0:
        return math.inf
    a = -math.expm1(-band) / share
    if a >= 1:
        return math.inf
    c = math.expm1(band) / share
    return 1 + max(a / (1 - a), c / (1 + c))


# -- wrapper-specific fix lines (anomaly code -> wrapper kind -> text); the generic remedy elsewhere ----------------
_FIXES: dict[str, dict[str, str]] = {
    "grad_overwritten": {
        "megatron-fsdp": (
            "where Megatron-FSDP sets overwrite_main_grad=True on an unsharded gradient buffer (data-parallel size "
            "1, or `optim` before Megatron-LM #6357): use no_shard or a megatron-core with Megatron-LM #6773; "
            "where the path ignores the flag (megatron-core tensor_parallel/layers.py Megatron-FSDP branch): "
            "accumulate into main_grad unless overwrite_main_grad is True, or train with "
            "gradient_accumulation_fusion=False"
        ),
        "megatron-ddp": (
            "Megatron DDP's main_grad is the persistent gradient buffer: the fused wgrad must accumulate into it "
            "(wgrad_gemm_accum / main_grad.add_), never write it with out= or copy_; check that nothing sets "
            "overwrite_main_grad=True under DDP"
        ),
        "fsdp2": (
            "the gradient path replaces .grad instead of adding to it between micro-batches: accumulate "
            "(grad += ...) or let autograd accumulate; check reshard_after_backward / set_requires_gradient_sync"
        ),
        "plain": (
            "the gradient path replaces .grad instead of adding to it: let autograd accumulate, or add into "
            "the existing .grad"
        ),
    },
    "grad_lost": {
        "megatron-fsdp": (
            "the fused wgrad went to a buffer the optimizer never reads (a None main_grad skipped by a guard, or "
            "grad_added_to_main_grad set without writing): write into the buffer get_main_grad() returns at "
            "backward"
        ),
        "megatron-ddp": (
            "the weight gradient never reaches param.main_grad: a custom autograd function returning None (or a "
            "dummy with grad_added_to_main_grad=True) without writing main_grad, or a micro-batch skipped by "
            "no_sync / a hook; write the wgrad into main_grad or return it to autograd"
        ),
        "fsdp2": (
            "the weight gradient never reaches .grad: a custom autograd function returning None for the weight, "
            "or a micro-batch dropped by a hook; return the weight gradient from backward"
        ),
        "plain": (
            "the weight gradient never reaches .grad: a custom autograd function returning None for the weight "
            "(or a detached weight), or a micro-batch dropped by a hook; return the weight gradient from backward"
        ),
    },
    "grad_scaled": {
        "megatron-fsdp": (
            "a fused path both wrote main_grad and returned a gradient the wrapper added again (TE BasicLinear "
            "with overwrite_main_grad=True returns main_grad as the autograd gradient): set "
            "grad_added_to_main_grad=True and return a dummy gradient, or avoid overwrite_main_grad=True on an "
            "unsharded buffer; else check loss scaling and the gradient averaging"
        ),
        "megatron-ddp": (
            "the gradient reaches main_grad twice or scaled: a fused wgrad that accumulates into main_grad and "
            "also returns the gradient without grad_added_to_main_grad=True, or a wrong loss scale / "
            "calculate_per_token_loss / gradient_scaling_factor; return a dummy with grad_added_to_main_grad=True"
        ),
        "fsdp2": (
            "the gradient is scaled: a hook or custom backward multiplying it, or the loss / reduce-scatter "
            "averaging (set_gradient_divide_factor) not matching the loss"
        ),
        "plain": (
            "the gradient is scaled: a hook or custom backward multiplying it (e.g. a weight used twice whose "
            "backward adds its gradient twice), or a loss scale not undone"
        ),
    },
    "grad_stale": {
        "megatron-fsdp": (
            "zero_grad_buffer() did not reach this parameter's gradient: its main_grad / .grad is a tensor "
            "outside the gradient buffer, or set by a hook after zeroing; keep main_grad a view of the buffer"
        ),
        "megatron-ddp": (
            "zero_grad_buffer() did not reach this parameter's main_grad: it was replaced by a tensor outside "
            "the contiguous gradient buffer; keep main_grad a view of the buffer (or zero it in your loop)"
        ),
        "fsdp2": "zero the gradients between steps (optimizer.zero_grad(set_to_none=True)) for every parameter",
        "plain": "zero the gradients between steps (optimizer.zero_grad(set_to_none=True)) for every parameter",
    },
    "grad_inconsistent": {
        "megatron-fsdp": (
            "the coefficients by position in the table say which micro-batches the optimizer gets and how: a "
            "hook or fused path that depends on the backward count (e.g. a counter toggling "
            "overwrite_main_grad); compare with gradient_accumulation_fusion=False"
        ),
        "megatron-ddp": (
            "the coefficients by position in the table say which micro-batches reach main_grad and how: a hook "
            "or fused path that depends on the backward count or on no_sync; compare with "
            "gradient_accumulation_fusion=False"
        ),
        "fsdp2": (
            "the coefficients by position say which micro-batches reach .grad and how: a hook depending on the "
            "backward count, or set_requires_gradient_sync toggled inside the accumulation"
        ),
        "plain": (
            "the coefficients by position say which micro-batches reach .grad and how: a hook or custom "
            "backward that depends on the backward count or keeps state between calls"
        ),
    },
}


def fixes_for(kind: str) -> dict[str, str]:
    """anomaly code -> fix line for this wrapper kind (codes without a specific line use the generic remedy)."""
    return {code: by_kind[kind] for code, by_kind in _FIXES.items() if kind in by_kind}


def overwrite_note(r: ParamResult, kind: str) -> str:
    if kind == "megatron-fsdp":
        if r.overwrite_main_grad is True:
            return (
                "overwrite_main_grad is True while main_grad is the persistent (unsharded) buffer: the fused "
                "wgrad overwrites the earlier micro-batch"
            )
        if r.mechanism_kind == "megatron_linear":
            return (
                "Megatron's linear writes the wgrad with out=main_grad (megatron-core tensor_parallel/layers.py, "
                f"Megatron-FSDP branch) whatever overwrite_main_grad says (here {r.overwrite_main_grad})"
            )
    if kind == "megatron-ddp":
        flag = " (overwrite_main_grad=True under DDP)" if r.overwrite_main_grad is True else ""
        return (
            "the fused wgrad writes main_grad instead of adding to it"
            + flag
            + ": each micro-batch replaces the "
            "earlier ones in DDP's persistent buffer"
        )
    target = "main_grad" if r.has_main_grad else ".grad"
    return f"the gradient path replaces {target} instead of adding to it"


def scale_note(r: ParamResult, scale: float, kind: str) -> str:
    if kind == "megatron-fsdp" and abs(scale - 2) <= 0.3 and r.overwrite_main_grad is True:
        return (
            "x2 with overwrite_main_grad=True: the fused op returned main_grad as the autograd gradient and the "
            "wrapper added it into main_grad again (TE op-fuser BasicLinear)"
        )
    if kind == "megatron-ddp" and abs(scale - 2) <= 0.3:
        return (
            "x2 under DDP: the gradient reached main_grad twice (a fused wgrad that accumulates and also "
            "returns it to autograd without grad_added_to_main_grad=True)"
        )
    return f"the optimizer's gradient is {scale:.3g} x the finite-difference estimate"


def lost_note(kind: str, module: bool = False) -> str:
    """`module`: found on the parameter's module output (`local_fd.py`), which moves to first order in the loss
    (dotted with the gradient its backward handed it) even where the loss itself rounds the change away."""
    where = {"megatron-fsdp": "main_grad / the optimizer's .grad", "megatron-ddp": "main_grad"}.get(
        kind, ".grad"
    )
    moves = (
        "its module's output moves along this parameter, against the gradient the backward handed that output"
        if module
        else "the loss moves along this parameter"
    )
    return f"the reported gradient is zero but {moves}: its gradient never reached {where}"


def solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Least squares' normal equations by Gaussian elimination with partial pivoting; None when singular."""
    n = len(rhs)
    a = [row[:] + [rhs[i]] for i, row in enumerate(matrix)]
    scale = max((abs(a[i][i]) for i in range(n)), default=0.0)
    if not scale > 0:
        return None
    for col in range(n):
        pivot = max(range(col, n), key=lambda i: abs(a[i][col]))
        if abs(a[pivot][col]) <= 1e-9 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for i in range(col + 1, n):
            f = a[i][col] / a[col][col]
            for j in range(col, n + 1):
                a[i][j] -= f * a[col][j]
    out = [0.0] * n
    for i in range(n - 1, -1, -1):
        out[i] = (a[i][n] - sum(a[i][j] * out[j] for j in range(i + 1, n))) / a[i][i]
    return out


def accumulation_verdict(
    r: ParamResult,
    coeffs: Sequence[float] | None,
    expected: Sequence[float],
    seq_norm: float,
    den: float,
    tol: float,
    kind: str,
    stateful: Sequence[str] = (),
) -> None:
    """The verdict where G(sequence) differs from the sum of the singles. `coeffs`: the fit by position in the
    sequence (None when the singles are parallel on the subset); `expected`: what each coefficient should be
    (1 each; 2 for the one micro-batch run twice); `stateful`: buffers the runs wrote. Where no coefficient is
    off and the forward writes buffers, the difference can be their drift between the sequence's micro-batches
    (each single starts from the caller's buffers): `inconclusive`, not a pattern of the gradient path."""
    if seq_norm <= tol * den:
        r.anomalies.append("grad_lost")
        r.notes.append("G(sequence) is zero: the micro-batches' gradients never reached the optimizer")
        return
    if coeffs is None:
        r.anomalies.append("grad_inconsistent")
        r.notes.append("the micro-batches' gradients are parallel on the subset: cannot tell which were kept")
        return
    r.fit = tuple(coeffs)
    n = len(coeffs)
    near = [abs(c - e) <= FIT_TOL * max(e, 1.0) for c, e in zip(coeffs, expected, strict=True)]
    zero = [abs(c) <= FIT_TOL for c in coeffs]
    text = ", ".join(f"{c:.2f}" for c in coeffs)
    if n == 1:  # one micro-batch run twice: c = 2 expected
        c = coeffs[0]
        if abs(c - 1) <= FIT_TOL:
            r.anomalies.append("grad_overwritten")
            r.notes.append(overwrite_note(r, kind))
        else:
            r.anomalies.append("grad_inconsistent")
            r.notes.append(f"G(A, A) = {c:.2f} G(A), expected 2")
        return
    if all(zero[:-1]) and abs(coeffs[-1] - 1) <= FIT_TOL:
        r.anomalies.append("grad_overwritten")
        r.notes.append(overwrite_note(r, kind))
    elif abs(coeffs[0] - 1) <= FIT_TOL and all(zero[1:]):
        r.anomalies.append("grad_lost")
        r.notes.append(
            "only the first micro-batch of the sequence reached the optimizer: the later ones were dropped"
        )
    elif all(zero[:-1]):
        r.anomalies.append("grad_overwritten")
        r.notes.append(
            f"only the last micro-batch survives, x{coeffs[-1]:.2f} (coefficients by position: {text})"
        )
    else:
        bad = [k + 1 for k in range(n) if not near[k]]
        if not bad and stateful:
            r.inconclusive = True
            written = ", ".join(list(stateful)[:3])
            r.notes.append(
                "G(sequence) differs from the sum of the singles with every coefficient near 1 "
                f"(c = {text}): the forward writes buffers ({written}), which the sequence's later "
                "micro-batches may compute with, as in training, while each single starts from the caller's"
            )
            return
        r.anomalies.append("grad_inconsistent")
        r.notes.append(
            f"G(sequence) = sum of c_k x the k-th micro-batch's gradient with c = {text} by position "
            f"(expected 1): positions {bad} differ, e.g. a hook or path tied to the backward count"
        )


def fd_verdict(r: ParamResult, verdict: str, scale: float | None, kind: str) -> None:
    """The finite-difference verdict of the probe that judged this parameter."""
    if verdict == "lost":
        r.anomalies.append("grad_lost")
        r.notes.append(lost_note(kind, module=(r.fd_probe or "").startswith("module ")))
    elif verdict == "scaled" and scale is not None:
        r.anomalies.append("grad_scaled")
        r.notes.append(scale_note(r, scale, kind))
    elif verdict == "wrong":
        r.anomalies.append("grad_inconsistent")
        value = "-" if scale is None or not math.isfinite(scale) else f"{scale:.3g}"
        r.notes.append(f"reported / estimated along the reported gradient: {value} (not a positive factor)")
