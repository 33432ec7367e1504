"""The comparison at the end of a preflight call: every device-side number to the host at once, then each
parameter's verdicts from the runs (`judge.py` names the patterns) with the finite differences' laid over
them; the repeat's verdict where one was run; the module-local summary."""

from __future__ import annotations

import math
from itertools import islice
from typing import TYPE_CHECKING, Any

import torch

from maingrad.contracts.anomalies import PREFLIGHT_ANOMALIES
from maingrad.hooks.preflight import judge, local
from maingrad.hooks.preflight.measure import E_MAX

if TYPE_CHECKING:
    from maingrad.hooks.preflight.check import Check


def local_summary(check: Check) -> dict[str, Any]:
    """What the module-local finite differences judged, and why the others were not (each weight once)."""
    if not check.local_fd.on:
        return {"on": False}
    judged = sorted(check.local_fd.verdicts)
    counts: dict[str, int] = {}
    for i in judged:
        counts[check.local_fd.verdicts[i].verdict] = counts.get(check.local_fd.verdicts[i].verdict, 0) + 1
    seen = set(judged)
    not_judged: dict[str, int] = {}
    for reason, indexes in sorted(check.local_fd.not_judged.items()):
        left = indexes - seen
        seen |= left
        if left:
            not_judged[reason] = len(left)
    outside = [i for i in range(len(check.entries)) if i not in seen]
    if outside:
        not_judged["not in a probed module (or no gradient to compare)"] = len(outside)
    out: dict[str, Any] = {"on": True, "judged": len(judged), "verdicts": counts, "not_judged": not_judged}
    own = _own_classes(check, [i for i in range(len(check.entries)) if i not in check.local_fd.verdicts])
    if own:
        out["own_classes"] = own
    if check.local_fd.declared:  # the caller's classes, taken on its word (and their reruns' reproduction)
        out["declared"] = [cls.__qualname__ for cls in check.local_fd.declared]
    if check.local_fd.errors:
        out["errors"] = list(check.local_fd.errors)
    if check.local_fd.escapes:  # a few examples: the weight and the function that used it outside
        out["used_outside"] = {
            check.entries[i].name: how for i, how in islice(sorted(check.local_fd.escapes.items()), 3)
        }
    return out


def _own_classes(check: Check, indexes: list[int]) -> dict[str, int]:
    """Of these weights (those without a module-local verdict: judged by the loss alone): how many sit directly
    in a module that is not probed, of a class from outside torch, Transformer Engine and megatron-core, that
    holds no child with parameters (a fork's own norm-and-linear module), by class, most first: the candidates
    for `module_fd_classes`."""
    counts: dict[str, int] = {}
    for i in indexes:
        owner = check.owners.get(id(check.entries[i].raw_param))
        if (
            owner is None
            or owner is check.model
            or type(owner).__module__.startswith(local.ORIGINS)
            or local.probed_kind(owner, check.local_fd.declared) is not None
        ):
            continue
        if local.holds_parameter_children(owner):
            continue
        name = type(owner).__qualname__
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def judge_repeat(check: Check, suspects: list[int], host: dict[str, list[float | None]]) -> None:
    """Where a verdict failed: a repeat of the first micro-batch that differs from its first run by more than
    half the tolerance makes the verdict nondeterminism (a stale buffer keeps its own verdict)."""
    for i in suspects:
        r = check.results[i]
        rep2, sa2 = host.get("rep2", [None] * (i + 1))[i], host.get("s0|s0", [None] * (i + 1))[i]
        if rep2 is None or sa2 is None:
            continue
        rep2, sa2 = max(rep2, 0.0), max(sa2, 0.0)
        r.rel_repeat = math.sqrt(rep2 / sa2) if sa2 > 0 else (0.0 if rep2 == 0 else math.inf)
        if r.rel_repeat > r.tolerance / 2 and "grad_stale" not in r.anomalies:
            r.anomalies = ["grad_nondeterministic"]
            r.notes = [
                f"the first micro-batch repeated from the same state and random state differs by {r.rel_repeat:.3g}"
            ]


def classify(check: Check) -> dict[str, Any]:
    """The one comparison at the end: every device-side number goes to the host at once."""
    host = check.host()
    n = len(check.batches)
    kind = check.adapter.kind
    for e, r in zip(check.entries, check.results, strict=True):
        flag = getattr(e.raw_param, "overwrite_main_grad", None)
        r.overwrite_main_grad = flag if isinstance(flag, bool) else None
        r.has_main_grad = hasattr(e.raw_param, "main_grad")
        r.is_fsdp_param = hasattr(e.raw_param, "__fsdp_param__")
    check.loss_fd.apply()  # the notes read the flags
    tol_used: list[float] = []

    def get(key: str, i: int) -> float | None:
        column = host.get(key)
        return None if column is None else column[i]

    singles = [f"s{k}" for k in range(n)]
    drifted: list[int] = []  # inconclusive: the sequence differs by the buffers' drift alone
    for i, (e, r) in enumerate(zip(check.entries, check.results, strict=True)):
        r.dtype = r.dtype or str(e.opt_param.dtype)
        r.shape = list(e.opt_param.shape)
        r.device = str(e.opt_param.device)
        grad_dtype = getattr(torch, r.dtype.replace("torch.", ""), e.opt_param.dtype)
        tol = check.tolerance(i, grad_dtype)
        r.tolerance = tol
        r.fd_tolerance = check.fd_tolerance(i)
        norms2 = [get(f"n:{k}", i) for k in singles]
        raw_values = [*norms2, get("n:seq", i), get("d2", i), get("stale2", i)]
        r.finite = all(math.isfinite(x) for x in raw_values if x is not None)
        if not r.finite:
            r.anomalies = ["grad_not_finite"]
            r.notes = ["NaN/Inf in the optimizer's gradient: a buffer nothing wrote, or an overflow"]
            r.inconclusive = r.unused = False
            continue
        single2 = [max(x or 0.0, 0.0) for x in norms2]
        seq2 = max(get("n:seq", i) or 0.0, 0.0)
        d2 = max(get("d2", i) or 0.0, 0.0)
        r.norm_a = math.sqrt(single2[0])
        r.norm_b = math.sqrt(single2[1]) if n > 1 else None
        tol_used.append(tol)
        stale2 = max(get("stale2", i) or 0.0, 0.0)
        scale_ref = math.sqrt(max(single2)) if max(single2) > 0 else 0.0
        if stale2 > 0:
            r.stale = math.sqrt(stale2) / scale_ref if scale_ref > 0 else math.inf
            if r.stale > tol:
                r.anomalies.append("grad_stale")
                r.notes.append(
                    "the buffer the optimizer reads is not zero right after the wrapper's zeroing: every step "
                    "adds the earlier steps' gradients"
                )
        den = math.sqrt(sum(single2[b] for b in check.order))
        if den > 0:
            r.rel_sum = math.sqrt(d2) / den
            if n == 1:
                r.rel_twice = r.rel_sum
            if r.rel_sum > tol and "grad_stale" not in r.anomalies:
                gram = [[get(f"{singles[min(a, b)]}|{singles[max(a, b)]}", i) or 0.0 for b in range(n)]
                        for a in range(n)]  # fmt: skip
                rhs = [get(f"{s}|seq", i) or 0.0 for s in singles]
                coeffs = judge.solve(gram, rhs)
                by_position = None if coeffs is None else [coeffs[b] for b in check.order[: max(n, 1)]]
                if n == 1 and coeffs is not None:
                    by_position = [coeffs[0]]
                expected = [2.0] if n == 1 else [1.0] * n
                alone = not r.anomalies
                judge.accumulation_verdict(
                    r, by_position, expected, math.sqrt(seq2), den, tol, kind, sorted(check.stateful)
                )
                if r.inconclusive and not r.anomalies:  # the buffers' drift (a module-local ok keeps it)
                    drifted.append(i)
                if alone:  # the fit's coefficients by micro-batch (zero where the verdict found G(seq) zero)
                    by_batch = list(coeffs) if r.fit is not None and coeffs is not None else [0.0] * n
                    check.fits[i] = (by_batch, sum(gram[k][k] for k in range(n)))
        elif seq2 > 0 and d2 > 0:
            r.anomalies.append("grad_inconsistent")
            r.notes.append("the sequence has a gradient where every micro-batch alone has none")
        r.anomalies = sorted(dict.fromkeys(r.anomalies), key=PREFLIGHT_ANOMALIES.index)
        if r.anomalies:
            r.inconclusive = False
    check.loss_fd.apply_summed()  # after the accumulation verdicts, as the module-local ones
    check.local_fd.apply()  # after the accumulation verdicts: a pattern they name explains a local deviation
    for i in drifted:
        check.results[i].inconclusive = not check.results[i].anomalies
    return {
        "linearity": (
            "8 x unit round-off of the least precise of gradient, compute and parameter dtypes (at least 4e-6)"
            if check.rtol is None
            else f"rtol={check.rtol}"
        ),
        "linearity_max": max(tol_used) if tol_used else None,
        "fd": "central differences at two steps agreeing within the error bar "
        f"(at most {E_MAX}); beyond the bar a factor may differ from 1 by "
        + (
            "16 x unit round-off of the compute dtype"
            if check.fd_rtol is None
            else f"fd_rtol={check.fd_rtol}"
        ),
        "fd_first_step": check.fd_step if check.fd_step is not None else "from the noise",
        "fd_noise": check.loss_fd.noise,
        "fd_noise_drawn": check.loss_fd.drawn,
        "fd_zero_noise": check.loss_fd.zero_noise,
        "repeat": "the first micro-batch is repeated only where a failed verdict could be run-to-run noise (not "
        "where the fit by position leaves a residual below tolerance/8)",
        "copy_dtypes": sorted(check.copy_dtypes),
    }
