"""`maingrad.hooks.preflight()`: prove, on the user's own model and wrapper, that every parameter's gradient is
the sum of its micro-batches' gradients and equals the loss's derivative, before the long job.

    result = maingrad.hooks.preflight(model, run_microbatch, batches, loss_fn=loss_fn)
    print(result)          # table, worst first; result.ok, result.verdicts(), result.to_dict(), result.records()

`run_microbatch(model, batch)` is the training code's own forward and backward of one micro-batch;
`loss_fn(model, batch)` returns the same loss without backward (for the finite differences; without it they
call run_microbatch and read its return value). `batches`: every micro-batch of one step (all are used; at
least 3 distinct ones are needed to rule out periodic errors, fewer are run and named in a warning). The model
must already be wrapped (Megatron-FSDP, Megatron DDP, torch FSDP2, or none); the gradients judged are the
ones the optimizer would read after the wrapper's grad sync (`wrappers.py`).

Runs (`check.py`; each from zeroed gradient buffers and the caller's module buffers, every micro-batch from
the caller's random state):
1. every micro-batch alone, in order ("singles" g_1 .. g_N): N backward passes;
2. all of them accumulated in an order rotated by one against the singles (2, 3, .., N, 1): N passes. The
   rotation puts every micro-batch at a different position and global backward count than in its single, so
   no error tied to the position, to the backward count modulo any period, or to a stale previous step lines
   up. G(sequence) must equal the sum of the singles within 8 units of round-off (`judge.py` names the
   pattern where it does not); the buffer read right after each zeroing must be zero (`grad_stale`);
3. only where a failed verdict could be run-to-run noise (`Check.needs_repeat`): the first micro-batch
   again, to tell nondeterminism from a bug (1 pass).
With one micro-batch the sequence is (A, A) against 2 G(A).

Finite differences (`loss_fd.py`, `moves.py`; `measure.py` for the estimate): on the first micro-batch's loss,
along its reported gradient, per group (one per fused-wgrad kind, one for plain autograd), central differences
at two steps that must agree within the measured noise (the first pair of steps chosen from the measured noise
and the predicted change, so that rounding stays a small part of the error bar); a group whose factor differs
from 1 by more than its error bar is bisected (one half evaluated, the other inferred from the parent by
linearity of the derivative) down to the parameters responsible; parameters whose reported gradient is zero
are probed along a random direction in their own subspace (bisected the same way where the loss moves). Cost:
2 loss forwards for the noise + 4 for the combined probe of all groups, + 2 per further step, + 4 per
bisection split. On a CUDA device the first micro-batch's loss forward is captured as a CUDA graph after its
first evaluation and replayed for the probe's later ones, where the model allows it (`graphs.py`: a forward
that does not synchronise with the host, under a wrapper that keeps its parameters in place, without FP8, and
whose replay gives the eager loss bit for bit); `cuda_graphs=False` keeps every forward eager.

Module-local finite differences (`local_fd.py`, `local.py`; module_fd=True): the weights of Linear-like
modules are judged on their own module's output, rerun inside the backward of the second micro-batch's single
(screening, weights of a module moved together) and of the sequence (each weight alone where a set deviated or
bounded a weight loosely, in the last single's micro-batch; zero gradients along random directions, in every
micro-batch). No pass is added: 2 module reruns per screened call (1 where its only moved weight is one
weight), 2 per re-judged weight, 2 per zero-gradient weight and micro-batch. Where they run, the probe on the
first micro-batch's loss waits for the screening (`Check.plan_loss_level`) and moves only the weights it did
not judge `ok` and the small ones (biases, norms: through them the loss checks the gradient each module's
output received), along copies of G(first) kept from before the second single; weights that leaves
inconclusive without a module-local verdict are probed again with anchors (weights judged `ok`); where the
weights the screening cannot judge would need more than a quarter of the copy, or there is no small weight,
the probe runs first and moves every weight (the screening then skips weights it bounds within x1.25).

Memory: one copy of the gradients (G(first), then the sum of the singles, minus G(sequence) in place) rounded
to the narrowest of bf16 and fp32 whose unit round-off is at most 1/8 of the linearity tolerance; the subsets
(4096 elements per parameter and run); while a probe moves its weights, a copy of them and fp32 scratch of one
parameter. Nothing is left behind: weights restored bit for bit (and reinstalled through the wrapper, also on
an error), buffers and random state put back, gradients zeroed through the wrapper (a plain module gets its own
`.grad` tensors back), no hook registered, no optimizer touched.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Iterable, Sequence
from itertools import islice
from typing import Any

import torch

from maingrad.hooks.preflight import judge
from maingrad.hooks.preflight.check import Check, LossFn, RunMicrobatch
from maingrad.hooks.preflight.classify import classify, judge_repeat, local_summary
from maingrad.hooks.preflight.result import PreflightResult
from maingrad.hooks.preflight.state import RngPair
from maingrad.hooks.preflight.wrappers import Adapter, choose

FD_GROUPS: tuple[str, ...] = ("mechanism", "module_type", "param")
MAX_MICROBATCHES = 16  # taken from an iterator at most (a list must not be longer: say so, never cut it)
MIN_DISTINCT = 3


def preflight(
    model: torch.nn.Module,
    run_microbatch: RunMicrobatch,
    batches: Iterable[Any],
    *,
    loss_fn: LossFn | None = None,
    wrapper: str | Adapter = "auto",
    params: str | Sequence[str] | None = None,
    finite_differences: bool = True,
    fd_groups: str = "mechanism",
    fd_step: float | None = None,
    fd_rtol: float | None = None,
    module_fd: bool = True,
    module_fd_classes: Sequence[type[torch.nn.Module]] = (),
    cuda_graphs: bool = True,
    rtol: float | None = None,
    max_microbatches: int = MAX_MICROBATCHES,
    rng_states: Sequence[RngPair] = (),
    sinks: Sequence[Any] = (),
    run: str | None = None,
    rank: int | None = None,
    commit: str | None = None,
    label: str | None = None,
) -> PreflightResult:
    """Check gradient accumulation and the gradient itself on `model` (already wrapped), with the training
    code's own micro-batch.

    run_microbatch(model, batch): forward + backward of one micro-batch, as in training.
    batches: the micro-batches of one step, all of them used (a list longer than `max_microbatches` is an
    error, an iterator is read up to it); at least 3 distinct ones rule out periodic errors (fewer: a warning).
    loss_fn(model, batch): the loss without backward, for the finite differences (without it they call
    run_microbatch and read its return value: one backward more per evaluation).
    wrapper: "auto" (duck typing), "megatron-fsdp", "megatron-ddp", "fsdp2", "plain", or an Adapter.
    params: fnmatch patterns over parameter names (wrapper prefixes `module.` removed) to judge; default all.
    finite_differences: compare with the loss's derivative; fd_groups: "mechanism" (default), "module_type",
    "param" (the starting groups; deviating groups are bisected anyway); fd_step: the first relative step
    (default: from the measured noise and each group's predicted change);
    fd_rtol: accepted factor 1 + fd_rtol beyond the error bar (default 16 units of the compute dtype's
    round-off). module_fd: also judge the weights of Linear-like modules on their own module's output
    (module-local finite differences, `local.py`; where the loss-level probe bounds a weight loosely).
    module_fd_classes: your own module classes judged that way too (a fork's norm-and-linear module): each
    must compute its output from its inputs and its own parameters only, affine in each parameter or a
    product of two of them, with no randomness and nothing written (it is rerun inside the backward).
    cuda_graphs: replay the first micro-batch's loss forward from a CUDA graph after its first evaluation,
    where the model allows it (`graphs.py`: checked bit for bit against the eager forward; the result's
    cost["loss_graph"] says whether it did, or why not).
    rtol: linearity tolerance (default from the dtypes). rng_states: extra (get_state, set_state) pairs to
    reset before every micro-batch. sinks, run, rank, commit: as for install(); label: a name.
    Returns a PreflightResult; it never raises for what the model does (an exception from the micro-batch is
    the result's `error`), only for bad arguments.
    """
    from maingrad.hooks.records import RunMeta
    from maingrad.hooks.settings import resolve_commit, resolve_rank, resolve_run
    from maingrad.hooks.sinks import make_sink

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"preflight() needs a torch.nn.Module, got {type(model).__name__}")
    if not callable(run_microbatch):
        raise TypeError("run_microbatch must be callable as run_microbatch(model, batch)")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError("loss_fn must be callable as loss_fn(model, batch)")
    if fd_groups not in FD_GROUPS:
        raise ValueError(f"fd_groups must be one of {FD_GROUPS}, got {fd_groups!r}")
    if fd_step is not None and not (0.0 < fd_step < 1.0):
        raise ValueError("fd_step must be in (0, 1)")
    if fd_rtol is not None and not (fd_rtol > 0.0):
        raise ValueError("fd_rtol must be > 0")
    if rtol is not None and not (rtol > 0.0):
        raise ValueError("rtol must be > 0")
    declared = tuple(module_fd_classes)
    for cls in declared:
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise TypeError(f"module_fd_classes must hold torch.nn.Module subclasses, got {cls!r}")
    warnings: list[str] = []
    if isinstance(batches, Sequence):
        taken = list(batches)
        if len(taken) > max_microbatches:
            raise ValueError(
                f"preflight got {len(taken)} micro-batches, more than max_microbatches={max_microbatches}: "
                "pass fewer or raise max_microbatches (each costs three forward+backward passes)"
            )
    else:
        taken = list(islice(iter(batches), max_microbatches))
        if len(taken) == max_microbatches:
            warnings.append(
                f"took the first {max_microbatches} micro-batches of an iterator (max_microbatches); the "
                "training step may have more"
            )
    if not taken:
        raise ValueError("preflight needs at least one micro-batch in batches")
    distinct = len({id(b) for b in taken})
    if distinct < MIN_DISTINCT:
        warnings.append(
            f"only {distinct} distinct micro-batch{'es' if distinct != 1 else ''} given (at least "
            f"{MIN_DISTINCT} needed): an error of period {distinct + 1} or more in the backward count, or one "
            f"that only hits micro-batch {distinct + 1} and later, is not ruled out"
        )
    sink_objects = [make_sink(s) for s in sinks]
    adapter = choose(model, wrapper)
    check = Check(
        model,
        run_microbatch,
        taken,
        loss_fn=loss_fn,
        adapter=adapter,
        params=params,
        finite_differences=finite_differences,
        fd_groups=fd_groups,
        fd_step=fd_step,
        fd_rtol=fd_rtol,
        module_fd=module_fd,
        module_fd_classes=declared,
        cuda_graphs=cuda_graphs,
        rtol=rtol,
        rng_states=rng_states,
    )
    result = _execute(check)
    result.label = label
    result.warnings = warnings + result.warnings
    meta = RunMeta(run=resolve_run(run), rank=resolve_rank(rank), mode="check", commit=resolve_commit(commit))
    if sink_objects:
        records = result.records(run=meta.run, rank=meta.rank, commit=meta.commit)
        for sink in sink_objects:
            sink.open(meta)
            try:
                sink.emit(records)
            finally:
                sink.close()
    return result


def _execute(check: Check) -> PreflightResult:
    adapter = check.adapter
    started = time.perf_counter()
    buffers = check.buffers
    adapter.save_user_grads()
    error = tb = None
    tolerances: dict[str, Any] = {}
    clock = started
    timings = check.timings
    check.loss_fd.invisible = False

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[name] = timings.get(name, 0.0) + now - clock
        clock = now

    try:
        check.first()
        if check.adopt_fp8_state():
            check.first()  # from the FP8 scaling state the first run created, as every later run
        lap("runs")
        check.plan_loss_level()
        if check.finite_differences and not check.late:
            check.loss_fd.probe_first()
            check.graphs.release()  # (its memory pool before the runs that follow)
            lap("finite_differences")
        for k in range(1, len(check.batches)):
            check.single(k)
            lap("runs")
            if k == 1 and check.late:
                check.loss_fd.probe_first(check.fd_first, check.fd_anchors)
                check.graphs.release()
                check.upstream()
                lap("finite_differences")
        if check.finite_differences:
            check.loss_fd.probe_rest()
            lap("finite_differences")
        check.sequence()
        lap("runs")
        if check.finite_differences:
            check.loss_fd.probe_left()
            lap("finite_differences")
        tolerances = classify(check)
        suspects = check.needs_repeat([i for i, r in enumerate(check.results) if r.anomalies and r.finite])
        lap("comparison")
        if suspects:
            judge_repeat(check, suspects, check.repeat(suspects))
            lap("runs")
    except Exception as exc:  # noqa: BLE001 - the model's failure is the result, not a crash of the caller
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500]
        tb = traceback.format_exc(limit=12)
    finally:
        check.copy = []
        check.graphs.release()
        if check.uninstalled:  # interrupted between a restore and its install
            try:
                check.commit()
            except Exception as exc:  # noqa: BLE001
                error = error or f"reinstalling the weights failed: {type(exc).__name__}: {exc}"[:500]
        try:
            adapter.zero()
        except Exception as exc:  # noqa: BLE001
            error = error or f"zeroing the gradient buffers failed: {type(exc).__name__}: {exc}"[:500]
        adapter.restore_user_grads()
        buffers.restore()
        check.rng.apply()
        check.step_start.restore()
    if error is None and check.loss_fd.invisible:
        error = (
            "the finite-difference perturbations never changed the loss although the reported gradients say "
            f"they should: the forward does not compute with the tensors the {adapter.label} adapter perturbs "
            "(a cached copy of the weights?); run with finite_differences=False or pass a wrapper= Adapter"
        )
        for r in check.results:
            r.anomalies = [
                a for a in r.anomalies if a not in ("grad_scaled", "grad_inconsistent", "grad_lost")
            ]
            r.inconclusive = r.unused = False
    seconds = time.perf_counter() - started
    failing = any(r.anomalies for r in check.results)
    unsure = any(r.inconclusive for r in check.results)
    status = "error" if error else ("fail" if failing else ("inconclusive" if unsure else "pass"))
    depth = max((p.depth for p in check.loss_fd.probes), default=0)
    cost = {
        "seconds": seconds,
        "microbatch_passes": check.passes,
        "forward_passes": check.forwards,
        "loss_evaluations": check.loss_fd.evaluations,
        "fd_groups": check.loss_fd.fd_group_count,
        "fd_probes": len(check.loss_fd.probes),
        "fd_rounds": check.loss_fd.rounds,
        "fd_first_params": check.loss_fd.first_params,
        "fd_first_elements": check.loss_fd.first_elements,
        "bisection_depth": depth,
        # raises of the loss's noise above the jitter pair's draw by levels below a pair (loss_fd.LossFD._judge)
        "fd_noise_raised": check.loss_fd.noise_raises,
        "params": len(check.entries),
        "microbatches": len(check.batches),
        "host_syncs": check.syncs,
        "module_reruns": check.local_fd.reruns,
        # screened calls whose forward output was held for a one-sided rerun; those the bound on held bytes left central
        "module_outputs_held": check.local_fd.held_calls,
        "module_outputs_not_held": check.local_fd.unheld_calls,
        # loss forwards of the first micro-batch replayed from a CUDA graph (graphs.py), and why none were
        "loss_replays": check.graphs.replays,
        "loss_graph": check.graphs.summary(),
        "copy_bytes": check.copy_bytes,
        "seconds_by_part": {k: round(v, 4) for k, v in timings.items()},
    }
    return PreflightResult(
        wrapper=adapter.label,
        wrapper_kind=adapter.kind,
        strategy=adapter.strategy,
        status=status,
        params=check.results if tolerances else [],
        groups=check.loss_fd.probes,
        cost=cost,
        tolerances=tolerances,
        error=error,
        error_traceback=tb,
        microbatches=len(check.batches),
        sequence=list(check.order),
        fixes=judge.fixes_for(adapter.kind),
        local=local_summary(check),
    )


# ---------------------------------------------------------------------------------------------------------
# the driver form for training scripts
# ---------------------------------------------------------------------------------------------------------
ENV = "MAINGRAD_PREFLIGHT"  # off (default) | warn | on | only
ENV_JSON = "MAINGRAD_PREFLIGHT_JSON"  # write the result as JSON here ({rank} filled in)
ENV_SINKS = "MAINGRAD_PREFLIGHT_SINKS"  # comma-separated sinks: jsonl:PATH, an http(s) URL, memory
ENV_MODES: tuple[str, ...] = ("off", "warn", "on", "only")
_CALLS = {"preflight_from_env": 0}


class PreflightFailed(RuntimeError):
    """Raised by preflight_from_env() in mode "on" when the check failed: the job stops before training."""

    def __init__(self, result: PreflightResult) -> None:
        super().__init__(result.table())
        self.result = result


def preflight_from_env(
    model: torch.nn.Module,
    run_microbatch: RunMicrobatch,
    batches: Iterable[Any],
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> PreflightResult | None:
    """One line in a training script, switched from the environment (`maingrad preflight --script` sets it):

        maingrad.hooks.preflight_from_env(model, run_microbatch, batches, loss_fn=loss_fn)

    MAINGRAD_PREFLIGHT: "off"/unset does nothing (returns None, batches untouched); "warn" runs the check and
    prints the table on rank 0; "on" also raises PreflightFailed when it failed (not when only inconclusive);
    "only" exits the process with status 0 (pass), 1 (fail/error) or 3 (inconclusive) right after, so the script never trains. MAINGRAD_PREFLIGHT_JSON writes
    the result, MAINGRAD_PREFLIGHT_SINKS sends the records (with MAINGRAD_RUN / MAINGRAD_COMMIT /
    MAINGRAD_PROJECT / MAINGRAD_TOKEN as for install()). Call it after wrapping the model, before the first
    optimizer step.
    """
    import json
    import os

    env = dict(os.environ) if env is None else env
    mode = (env.get(ENV) or "off").strip().lower()
    if mode in ("", "0", "false", "no"):
        mode = "off"
    if mode in ("1", "true", "yes"):
        mode = "on"
    if mode not in ENV_MODES:
        raise ValueError(f"{ENV}={env.get(ENV)!r}: use one of {ENV_MODES}")
    if mode == "off":
        return None
    _CALLS["preflight_from_env"] += 1
    sinks = [s.strip() for s in (env.get(ENV_SINKS) or "").split(",") if s.strip()]
    result = preflight(model, run_microbatch, batches, sinks=[*kwargs.pop("sinks", ()), *sinks], **kwargs)
    from maingrad.hooks.settings import resolve_rank

    rank = resolve_rank(kwargs.get("rank"), env)
    path = env.get(ENV_JSON)
    if path:
        path = path.replace("{rank}", str(rank))
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(result.to_dict(), handle, indent=1, default=str)
    if rank == 0:
        print(result.table(), file=sys.stderr, flush=True)
        if result.error_traceback:
            print(result.error_traceback, file=sys.stderr, flush=True)
    if mode == "only":
        raise SystemExit(0 if result.ok else (3 if result.status == "inconclusive" else 1))
    if mode == "on" and result.failed:
        raise PreflightFailed(result)
    return result
