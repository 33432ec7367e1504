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

Runs (each from zeroed buffers, every micro-batch from the caller's random state):
1. every micro-batch alone, in order ("singles" g_1 .. g_N): N backward passes;
2. all of them accumulated in an order rotated by one against the singles (2, 3, .., N, 1): N passes. The
   rotation puts every micro-batch at a different position and global backward count than in its single, so
   no error tied to the position, to the backward count modulo any period, or to a stale previous step lines
   up. G(sequence) must equal the sum of the singles within 8 units of round-off (`judge.py` names the
   pattern where it does not); the buffer read right after each zeroing must be zero (`grad_stale`);
3. only where a verdict failed: the first micro-batch again, to tell nondeterminism from a bug (1 pass).
With one micro-batch the sequence is (A, A) against 2 G(A).

Finite differences (`measure.py` for the estimate): on the first micro-batch's loss, along its reported
gradient, per group (one per fused-wgrad kind, one for plain autograd), central
differences at two steps that must agree within the measured noise (the first pair of steps chosen from the
measured noise and the predicted change, so that rounding stays a small part of the error bar); a group
whose factor differs from 1 by
more than its error bar is bisected (one half evaluated, the other inferred from the parent by linearity of
the derivative) down to the parameters responsible; parameters whose reported gradient is zero are probed
along a random direction in their own subspace (bisected the same way where the loss moves). Cost: 2 loss
forwards for the noise + 4 for the combined probe of all groups, + 2 per further step, + 4 per bisection split.

Module-local finite differences (`local.py`; module_fd=True): the weights of Linear-like modules that the loss
bounds loosely are judged on their own module's output, rerun inside the backward of the second micro-batch's
single (screening, weights of a module moved together) and of the sequence (each weight alone where a set
deviated or bounded a weight loosely, in the last single's micro-batch; zero gradients along random
directions, in every micro-batch). No pass is added: 2 module reruns per screened call (1 where its only
moved weight is one weight), 2 per re-judged weight, 2 per zero-gradient weight and micro-batch.

Memory: one copy of the gradients (G(first), then the sum of the singles, minus G(sequence) in place) rounded
to the narrowest of bf16 and fp32 whose unit round-off is at most 1/8 of the linearity tolerance; the subsets
(4096 elements per parameter and run); while a probe moves its weights, a copy of them and fp32 scratch of one
parameter. Nothing is left behind: weights restored bit for bit (and reinstalled through the wrapper, also on
an error), buffers and random state put back, gradients zeroed through the wrapper (a plain module gets its own
`.grad` tensors back), no hook registered, no optimizer touched.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from itertools import islice
from typing import Any, cast

import torch

from maingrad.contracts.anomalies import PREFLIGHT_ANOMALIES
from maingrad.hooks.preflight import judge, local
from maingrad.hooks.preflight.measure import (
    E_MAX,
    FD_CHUNK,
    STEP0,
    STEP_MAX,
    SUBSET,
    Z_MOVE,
    ZERO_STEP0,
    Dist,
    Estimate,
    Stats,
    Subsets,
    chunks,
    copies,
    copy_dtype,
    flat,
    foreach_add_,
    foreach_copy_,
    foreach_mul_,
    foreach_sub_,
    fused_kinds,
    judge_levels,
    leaf_pattern,
    norm,
    norms,
    some,
    stack_to_host,
    to_device,
    unit_roundoff,
)
from maingrad.hooks.preflight.result import ParamResult, PreflightResult, Probe
from maingrad.hooks.preflight.state import (
    BufferState,
    RngPair,
    RngState,
    StepStart,
    fp8_state_pairs,
    fp8_tensors,
)
from maingrad.hooks.preflight.wrappers import Adapter, Entry, choose

# the fit-by-position verdicts whose residual can rule out run-to-run noise (0/1 patterns: a random scale per
# backward would have to be about 1 to make them, while any other coefficient could be such a scale), and the
# fewest subset elements for that, per direction of the fit (N singles and the sequence)
NOT_NOISE_IF_FITTED = frozenset({"grad_overwritten", "grad_lost"})
FIT_DIM = 16

RunMicrobatch = Callable[[torch.nn.Module, Any], Any]
LossFn = Callable[[torch.nn.Module, Any], Any]
FD_GROUPS: tuple[str, ...] = ("mechanism", "module_type", "param")
MAX_MICROBATCHES = 16  # taken from an iterator at most (a list must not be longer: say so, never cut it)
MIN_DISTINCT = 3
FP8_FD_RTOL = 0.25  # 4 units of e4m3's round-off: an FP8 weight's factor within 1.25 is not judged
NOISE_SHARE = 4  # the first pair's smaller step: noise at most E_MAX / NOISE_SHARE of the predicted change
CANDIDATE_STEPS = [2.0**-k for k in range(4, 21)]  # where the first pair is chosen (largest first)
_TORCH: Any = torch  # torch's multi-tensor `_foreach_*` ops are not in its exported names
SMALL_MOVE = 1 << 16  # weights up to this many elements move and are predicted with multi-tensor launches
# verdicts that already account for a module-local deviation (or are the same finding)
LOCAL_EXPLAINED = frozenset(
    {
        "grad_lost",
        "grad_scaled",
        "grad_inconsistent",
        "grad_overwritten",
        "grad_stale",
        "grad_nondeterministic",
    }
)
UNRELIABLE_SPLITS = 2  # a group with no reliable estimate is split this many times before "inconclusive"
UNSURE = 0.5  # a screened set is judged again where one of its weights could hide a factor of 1.5 or 0.5
BOUND_ENOUGH = 0.25  # a weight the loss-level probe bounds within x1.25 is not screened on its module


class _Node:
    """A probe while it is being measured: its parameters, levels step -> (C, P), and bisection links."""

    def __init__(self, probe: Probe, indexes: list[int], tol: float) -> None:
        self.probe = probe
        self.indexes = indexes
        self.tol = tol
        # the groups a combined probe holds (it is split along them first)
        self.parts: list[tuple[str, list[int]]] = []
        self.halvings = 0  # splits of a group's own parameters above this node (not of a combined probe)
        self.levels: dict[float, tuple[float, float]] = {}
        self.parent: _Node | None = None
        self.sibling: _Node | None = None
        self.inferred: set[float] = set()  # steps whose levels are the parent's minus the sibling's
        # an ancestor's reliable estimate is within a single parameter's tolerance: each weight here is bounded
        # by it (`resolution`), so where this probe's own estimate does not check itself that bound stands
        self.bounded = False

    @property
    def zero(self) -> bool:
        return self.probe.zero_gradient


class _Moves:
    """How a probe moves its weights: along the (copied) reported gradient, each weight by `step` x its own
    norm; along its weights plus a random part where the reported gradient is zero; or by two units of
    round-off with random signs (the noise). Sizes come from one host transfer of the norms."""

    def __init__(self, check: Check) -> None:
        self.check = check
        self.directions = list(check.copy)
        n = len(self.directions)
        present = [i for i, f in enumerate(self.directions) if f is not None]
        values: list[float] = []
        if present:
            targets = [check.adapter.target(check.entries[i]) for i in present]
            values = norms(some(self.directions, present) + targets).double().cpu().tolist()
        check.syncs += 1
        self.gnorm, self.tnorm = [0.0] * n, [0.0] * n
        for j, i in enumerate(present):
            self.gnorm[i], self.tnorm[i] = values[j], values[len(present) + j]
        for i, f in enumerate(self.directions):
            if f is None:
                self.tnorm[i] = float(norm(check.adapter.target(check.entries[i])))
        self.nonzero = [i for i in present if self.gnorm[i] > 0 and math.isfinite(self.gnorm[i])]
        self.nonzero_set = set(self.nonzero)
        # per weight, a power of two: its group's step over the combined probe's step (1 where groups are probed
        # alone); every probe that holds the weight moves it by the same multiple, so a half inferred as the
        # parent minus its sibling is the half's own measurement
        self.mult = [1.0] * n
        self._generators: dict[torch.device, torch.Generator] = {}

    def size(self, i: int, t: torch.Tensor) -> float:
        """|move| per unit step: the weights' norm (at least sqrt(numel) x 2^-7, for weights initialised to 0)."""
        return max(self.tnorm[i], math.sqrt(t.numel()) * 2.0**-7)

    def rounded_gains(self, groups: list[list[int]]) -> tuple[list[list[float]], dict[int, list[float]]]:
        """Per group and CANDIDATE_STEPS step: the predicted change <G, move> with each move rounded as the
        forward will see it, estimated on each weight's subset (scaled up by numel / subset size); and the
        same per weight (its share of a probe). One host transfer."""
        check = self.check
        if not groups:
            return [], {}
        # the subsets of every weight, as rows of one matrix per (device, weight dtype, compute dtype): a few
        # launches per candidate step instead of a dozen per weight
        buckets: dict[
            tuple[torch.device, torch.dtype, torch.dtype], list[tuple[int, torch.Tensor, torch.Tensor]]
        ]
        buckets = {}
        factors: dict[int, tuple[float, float]] = {}
        for i in dict.fromkeys(i for indexes in groups for i in indexes):
            e = check.entries[i]
            t = check.adapter.target(e)
            off, stride, count = check.subsets.pick(i, t.numel())
            if count <= 0:
                continue
            w = t.detach().reshape(-1)[off::stride][:count]
            gs = cast(torch.Tensor, self.directions[i]).reshape(-1)[off::stride][:count]
            buckets.setdefault((w.device, w.dtype, check.adapter.compute_dtype(e)), []).append((i, w, gs))
            factors[i] = (self.size(i, t) / self.gnorm[i], t.numel() / count)
        pending: list[tuple[list[int], torch.Tensor]] = []
        for (device, wdtype, cdt), members in buckets.items():
            rows = len(members)
            spans = tuple((r, w.numel()) for r, (_, w, _) in enumerate(members))
            index = check.subsets.positions(device, spans)
            weights = torch.zeros(rows, SUBSET, device=device)
            grads = torch.zeros(rows, SUBSET, device=device)
            weights.view(-1).index_copy_(0, index, torch.cat([w for _, w, _ in members]).float())
            grads.view(-1).index_copy_(0, index, torch.cat([g.float() for _, _, g in members]))
            c = to_device([factors[i][0] for i, _, _ in members], device)[:, None]
            scale = to_device([factors[i][1] for i, _, _ in members], device, torch.float64)
            moves = grads * c
            start = weights.to(wdtype).to(cdt).float()
            parts = []
            for step in CANDIDATE_STEPS:  # zero-padded elements move by nothing and add nothing
                moved = (weights + step * moves).to(wdtype).to(cdt).float() - start
                parts.append((moved * grads).sum(dim=1, dtype=torch.float64) * scale)
            pending.append(([i for i, _, _ in members], torch.stack(parts, 1)))  # [rows, steps]
        if not pending:
            return [[0.0] * len(CANDIDATE_STEPS) for _ in groups], {}
        device = pending[0][1].device
        values = check.dist.sum_stats(torch.cat([m.to(device) for _, m in pending]))
        host = cast(list[list[float]], values.cpu().tolist())
        owners = [i for members, _ in pending for i in members]
        per_weight = dict(zip(owners, host, strict=True))
        totals: list[list[float]] = []
        for indexes in groups:
            known = [per_weight[i] for i in indexes if i in per_weight]
            totals.append(
                [float(sum(col)) for col in zip(*known, strict=True)]
                if known
                else [0.0] * len(CANDIDATE_STEPS)
            )
        return totals, per_weight

    def along(self, step: float) -> _Along:
        return _Along(self, step)

    def random(self, step: float) -> Callable[[int, torch.Tensor], torch.Tensor]:
        """Zero reported gradient: along the weights themselves (radial: no dilution by sqrt(numel)) plus a
        random +-1 part (a scale-invariant weight moves the loss only off the radial direction)."""

        def delta(i: int, t: torch.Tensor) -> torch.Tensor:
            gen = torch.Generator(device=t.device).manual_seed(1009 + i)
            d = torch.randint(0, 2, t.shape, generator=gen, device=t.device).float() * 2 - 1
            d = d * (self.tnorm[i] / math.sqrt(max(t.numel(), 1)) / 2) + t.float()
            return d * (step * self.size(i, t) / torch.linalg.vector_norm(d).clamp_min(1e-30))

        return delta

    def jitter(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """+-2 units of round-off of each element, signs seeded per weight (the same at + and -), computed in
        the weight's own dtype: (0 or 4u) - 2u is exact, and so is its product with |t| (a power of two)."""
        gen = self._generators.get(t.device)
        if gen is None:
            gen = self._generators[t.device] = torch.Generator(device=t.device)
        gen.manual_seed(7919 + i)
        u = unit_roundoff(self.check.adapter.compute_dtype(self.check.entries[i]))
        d = torch.randint(0, 2, t.shape, generator=gen, device=t.device, dtype=t.dtype)
        return d.mul_(4 * u).sub_(2 * u).mul_(t.abs())


class _Along:
    """The move along the reported gradient at one step: weight i moves by factor(i) x its gradient copy
    (`_evaluate` adds it in place, without an fp32 temporary of the whole parameter)."""

    def __init__(self, moves: _Moves, step: float) -> None:
        self.moves = moves
        self.step = step

    def factor(self, i: int, t: torch.Tensor) -> float:
        return self.step * self.moves.mult[i] * self.moves.size(i, t) / self.moves.gnorm[i]

    def __call__(self, i: int, t: torch.Tensor) -> torch.Tensor:
        g = cast(torch.Tensor, self.moves.directions[i])
        return g.float().view(t.shape) * self.factor(i, t)


class Check:
    """One preflight call: the runs, the finite differences and the bookkeeping of the wrapper's calls."""

    def __init__(
        self,
        model: torch.nn.Module,
        run_microbatch: RunMicrobatch,
        batches: list[Any],
        *,
        loss_fn: LossFn | None,
        adapter: Adapter,
        params: str | Sequence[str] | None,
        finite_differences: bool,
        fd_groups: str,
        fd_step: float | None,
        fd_rtol: float | None,
        rtol: float | None,
        rng_states: Sequence[RngPair],
        module_fd: bool = True,
    ) -> None:
        self.model = model
        self.run_microbatch = run_microbatch
        self.batches = batches
        self.loss_fn = loss_fn
        self.adapter = adapter
        self.finite_differences = finite_differences
        self.fd_groups = fd_groups
        self.fd_step = fd_step
        self.fd_rtol = fd_rtol
        self.rtol = rtol
        n = len(batches)
        self.order = (
            [*range(1, n), 0] if n > 1 else [0, 0]
        )  # the sequence, rotated by one against the singles
        entries = adapter.entries
        if params is not None:
            patterns = [params] if isinstance(params, str) else list(params)
            entries = [e for e in entries if any(fnmatch.fnmatchcase(e.name, pat) for pat in patterns)]
        self.entries: list[Entry] = entries
        self.passes = 0
        self.forwards = 0
        self.syncs = 0
        self.evaluations = 0
        self.rounds = 0
        self.timings: dict[str, float] = {}
        self.dist = Dist(sharded=adapter.sharded)
        kinds = fused_kinds(model)
        self.results = [self._result(e, kinds.get(e.name)) for e in entries]
        self.stats = Stats(len(entries), self.dist)
        self.subsets = Subsets(entries)
        self.present: dict[str, set[int]] = {}
        self.copy: list[torch.Tensor | None] = [None] * len(entries)
        self.copy_bytes = 0
        self.copy_dtypes: set[str] = set()
        # per parameter whose only failure is the fit by position: (its coefficients by micro-batch, the
        # singles' squared norm on its subset); the fit's residual decides whether the repeat is needed
        self.fits: dict[int, tuple[list[float], float]] = {}
        self.first_loss: Any = None
        self.probes: list[Probe] = []
        self.noise = 0.0
        fp8 = fp8_tensors(model)
        self.rng = RngState([*fp8_state_pairs(model, fp8), *rng_states])
        self.fp8_known = {id(t) for t in fp8}
        self.step_start = StepStart(model)
        self.owners = {id(p): m for m in model.modules() for p in m._parameters.values() if p is not None}
        self.fp8_entries: set[int] = set()  # parameters whose module computed in FP8 (known after a run)
        self.synced = False  # prepare() or commit() ran after the last change of the weights
        self.zeroed = False  # zero() ran after the last backward
        self.uninstalled = False  # weights moved or restored in place since the last commit()
        self.invisible = False  # no probe's perturbation ever moved the loss (set by fd())
        self.loss_level = 0.0
        self.loss_unit = unit_roundoff(torch.float32)
        self.zero_noise = 0.0
        self.residuals: list[float] = []  # |C - r P| at the accepted steps of reliable estimates
        self.fd_group_count = 0  # groups probed (the combined probe counts its groups)
        self.later: list[int] = []  # parameters with no gradient on the first micro-batch (probed by fd_rest)
        self.fd_batches = [0]  # the micro-batches whose summed loss the finite differences evaluate
        self.noise_measured = False
        self.step_mult: list[float] = []  # per parameter, the same (set by fd())
        # per parameter: its predicted change per candidate step; 1 + the relative error its probe could hide
        self.weight_gains: dict[int, list[float]] = {}
        self.resolution: dict[int, float] = {}
        # module-local finite differences (local.py): on a single process (a shard is not what a module computes
        # with), for the wrappers whose module tensors `Adapter.module_tensors` finds
        self.local_on = (
            finite_differences
            and module_fd
            and adapter.kind in ("plain", "megatron-ddp", "megatron-fsdp", "fsdp2")
            and self.dist.world == 1
            and len(batches) > 1
        )
        # entry index -> the tensor its module computes with (set after the first run: FSDP2 creates its
        # unsharded parameters at the first all-gather)
        self.local_params: dict[int, torch.Tensor] = {}
        self.local_weights: dict[int, int] = {}  # id(entry's raw parameter) -> entry index
        self.local_escapes: dict[int, str] = {}  # weights used outside their module's call: where
        self.local: dict[int, local.LocalVerdict] = {}  # per entry: the module-local verdict that judged it
        self.local_share: dict[int, float] = {}  # per entry: its share of its screened set's prediction
        self.local_suspects: list[int] = []  # weights of screened sets that deviated (judged alone next)
        # weights of screened sets bounded too loosely (judged again, weight by weight)
        self.local_unsure: list[int] = []
        self.local_deferred: list[int] = []  # zero-gradient weights left to the sequence's module reruns
        # the weights the sequence's reruns judge alone (set after the last single) and their predictions
        self.refine_plan: dict[int, local.Move] = {}
        self.refine_predicted: dict[int, torch.Tensor] = {}
        self.local_reruns = 0
        self.local_errors: list[str] = []
        self.local_not_judged: dict[str, set[int]] = {}
        self.sizes: list[float] = []  # per entry: |weights| (floored), from the first probe's norms
        self.gnorms: list[float] = []  # per entry: |G(first)|

    def _result(self, e: Entry, kind: str | None) -> ParamResult:
        module_type = f"{e.parent_type}/{e.owner_type}.{leaf_pattern(e.leaf)}"
        mechanism = kind or "autograd"
        if self.fd_groups == "param":
            group = e.name
        elif self.fd_groups == "module_type":
            group = f"{mechanism}:{module_type}"
        else:
            group = mechanism
        return ParamResult(
            name=e.name,
            module=e.module,
            leaf=e.leaf,
            module_type=module_type,
            mechanism_kind=mechanism,
            group=group,
            numel=int(e.opt_param.numel()),
        )

    def tolerance(self, i: int, grad_dtype: torch.dtype) -> float:
        """Linearity tolerance of parameter i: 8 units of round-off of the least precise of the gradient's,
        the compute and the optimizer parameter's dtypes (at least 4e-6), or the caller's rtol."""
        e = self.entries[i]
        u = max(
            unit_roundoff(grad_dtype),
            unit_roundoff(self.adapter.compute_dtype(e)),
            unit_roundoff(e.opt_param.dtype),
        )
        return self.rtol if self.rtol is not None else max(8 * u, 4e-6)

    def fd_tolerance(self, i: int) -> float:
        """How far a reported gradient may differ from the loss's derivative beyond the estimate's error bar:
        16 units of round-off of the compute dtype (the backward's own rounding), FP8_FD_RTOL for a weight of
        a module that computes in FP8 (its forward and backward GEMMs round operands to 3 or 2 mantissa bits),
        or the caller's fd_rtol."""
        if self.fd_rtol is not None:
            return self.fd_rtol
        if i in self.fp8_entries:
            return FP8_FD_RTOL
        return 16 * unit_roundoff(self.adapter.compute_dtype(self.entries[i]))

    def adopt_fp8_state(self) -> bool:
        """After the first run: TE creates its FP8 scaling state at a module's first FP8 forward, so a model that
        never ran one ran that micro-batch with fresh scales and left new ones. Fix the new state from now on
        and say whether the run must be repeated (every run must start from the same state). Also notes which
        parameters computed in FP8."""
        self.fp8_entries = {
            i
            for i, e in enumerate(self.entries)
            if getattr(self.owners.get(id(e.raw_param)), "fp8", False) is True
        }
        new = [t for t in fp8_tensors(self.model) if id(t) not in self.fp8_known]
        if not new:
            return False
        self.fp8_known.update(id(t) for t in new)
        self.rng.adopt(fp8_state_pairs(self.model))
        self.stats = Stats(len(self.entries), self.dist)
        self.subsets = Subsets(self.entries)
        self.present = {}
        self.copy = [None] * len(self.entries)
        self.copy_bytes = 0
        self.copy_dtypes = set()
        self.first_loss = None
        return True

    # -- the wrapper's calls ----------------------------------------------------------------------------------
    def _prepare(self) -> None:
        """The training loop's `start_param_sync()` after the weights changed (and before the first run)."""
        if not self.synced:
            self.adapter.prepare()
            self.synced = True

    def _commit(self) -> None:
        """Install weights moved in place (and prepare them for the next forward)."""
        self.adapter.commit()
        self.synced, self.uninstalled = True, False

    def _zero(self) -> None:
        """Zero the gradient buffers through the wrapper, unless nothing ran backward since they were zeroed."""
        if not self.zeroed:
            self.adapter.zero()
            self.zeroed = True

    def _microbatch(self, batch: Any) -> Any:
        self.rng.apply()
        self.zeroed = False
        loss = self.run_microbatch(self.model, batch)
        self.passes += 1
        return loss

    def host(self, keys: Sequence[str] | None = None) -> dict[str, list[float | None]]:
        self.syncs += 1
        return self.stats.host(keys)

    # -- runs -------------------------------------------------------------------------------------------------
    def _grads(self) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        for e in self.entries:
            g = self.adapter.grad(e)
            out.append(None if g is None else flat(g))
        return out

    def _run(
        self, key: str, which: Sequence[int], probe: local.LocalProbe | None = None
    ) -> list[torch.Tensor | None]:
        """Zero; read what the optimizer would see right after zeroing (must be nothing); run the micro-batches
        `which` from the saved random state each; finish the sync. Returns the wrapper's own flattened
        gradients (never kept past the next run); their squared norms and subsets are recorded under `key`."""
        self._prepare()
        self._zero()
        left = self._grads()
        stale = [i for i, f in enumerate(left) if f is not None]
        if stale:
            self.stats.add("stale2", stale, norms(some(left, stale)) ** 2)
            self.stats.add("stale_n", stale, torch.ones(len(stale)), shard_sum=False)
        del left
        self.step_start.begin()
        with probe.watching() if probe is not None else contextlib.nullcontext():
            for b in which:
                if probe is not None:
                    probe.current = b
                loss = self._microbatch(self.batches[b])
                if key == "s0" and self.loss_fn is None:
                    self.first_loss = loss.detach() if isinstance(loss, torch.Tensor) else loss
        self.adapter.finish()
        flats = self._grads()
        present = [i for i, f in enumerate(flats) if f is not None]
        self.present[key] = set(present)
        if present:
            self.stats.add(f"n:{key}", present, norms(some(flats, present)) ** 2)
        self.subsets.take(key, flats)
        return flats

    def first(self) -> None:
        """The first micro-batch alone; its gradient is copied (rounded) for the finite differences' directions
        and the sum of the singles, then the wrapper's own gradients are released."""
        flats = self._run("s0", [0])
        for i, f in enumerate(flats):
            if f is not None:
                self.results[i].dtype = str(f.dtype)
        idx = [i for i, f in enumerate(flats) if f is not None]
        live = some(flats, idx)
        views = copies(
            live, [copy_dtype(f.dtype, self.tolerance(i, f.dtype)) for i, f in zip(idx, live, strict=True)]
        )
        for i, view in zip(idx, views, strict=True):
            self.copy[i] = view
            self.copy_bytes += view.numel() * view.element_size()
            self.copy_dtypes.add(str(view.dtype))
        del flats, live
        self._zero()  # releases the wrapper's own G (Megatron-FSDP, plain .grad) while the weights move
        if self.local_on:
            self._find_local_tensors()

    def _local_start(self, i: int) -> torch.Tensor:
        """Weight i as its module computes with it (the start of a rerun's moves): the optimizer's target, cast
        to the module tensor's dtype where a wrapper casts it for the forward (FSDP2's param_dtype)."""
        t = self.adapter.target(self.entries[i])
        dtype = self.local_params[i].dtype
        return t if t.dtype == dtype else t.to(dtype)

    def _find_local_tensors(self) -> None:
        """The tensors the probed modules compute with, from the wrapper (after a run: FSDP2 creates its
        unsharded parameters at the first all-gather), and the modules holding them."""
        found = self.adapter.module_tensors()
        self.local_params = {}
        for i, e in enumerate(self.entries):
            owner, t = found.get(id(e.raw_param), (None, None))
            if t is None:
                continue
            if owner is not None:
                self.owners[id(e.raw_param)] = owner
            self.local_params[i] = t
        self.local_weights = {id(self.entries[i].raw_param): i for i in self.local_params}

    def singles(self) -> None:
        """The other micro-batches alone, each added into the copy (the sum of the singles, rounded once)."""
        last = len(self.batches) - 1
        for k in range(1, len(self.batches)):
            probe = self._screening() if k == 1 else None
            flats = self._run(f"s{k}", [k], probe)
            if probe is not None:
                self._judge_local(probe, flats, screening=True)
            adds: list[int] = []
            for i in self.present[f"s{k}"]:
                f = cast(torch.Tensor, flats[i])
                if self.copy[i] is None:
                    dtype = copy_dtype(f.dtype, self.tolerance(i, f.dtype))
                    self.copy[i] = f.to(dtype, copy=True)
                    self.copy_bytes += f.numel() * dtype.itemsize
                    self.copy_dtypes.add(str(dtype))
                else:
                    adds.append(i)
            if adds:  # one multi-tensor launch, not one add per parameter
                foreach_add_(some(self.copy, adds), some(flats, adds))
            if k == last:
                self._plan_refinement(flats, k)
            del flats

    def sequence(self) -> None:
        """All micro-batches accumulated in the rotated order, subtracted from the sum of the singles in place."""
        copy = self.copy
        held = [i for i, c in enumerate(copy) if c is not None]
        if len(self.batches) == 1 and held:
            foreach_mul_(some(copy, held), 2.0)  # (A, A) against 2 G(A)
        probe = self._refinement()
        flats = self._run("seq", self.order, probe)
        if probe is not None:
            self._judge_local(probe, copy, screening=False, predicted=self.refine_predicted)
        self.refine_plan, self.refine_predicted = {}, {}
        both = [i for i in self.present["seq"] if copy[i] is not None]
        if both:
            cs = some(copy, both)
            foreach_sub_(cs, some(flats, both))
            self.stats.add("d2", both, norms(cs) ** 2)
        only_seq = [i for i in self.present["seq"] if copy[i] is None]
        if only_seq:
            self.stats.add("d2", only_seq, norms(some(flats, only_seq)) ** 2)
        gone = [i for i in held if i not in self.present["seq"]]
        if gone:  # a gradient that vanished in the sequence counts as zero there
            self.stats.add("d2", gone, norms(some(copy, gone)) ** 2)
            self.stats.add("n:seq", gone, torch.zeros(len(gone)))
            self.present["seq"].update(gone)
        del flats
        self.copy = [None] * len(copy)
        keys = [f"s{k}" for k in range(len(self.batches))] + ["seq"]
        self.subsets.gram(self.stats, keys)

    def needs_repeat(self, suspects: list[int]) -> list[int]:
        """The failing parameters whose evidence run-to-run noise could explain: the ones the repeat decides.

        An overwritten or lost gradient named by the fit by position alone, whose residual |G(seq) - sum_k c_k
        G(k)| on the subset is below an eighth of the linearity tolerance of the singles' norm, is not noise:
        runs that differ by d (relative) leave about d of each run outside the span of the singles (on a subset
        of at least FIT_DIM elements per direction: N singles and the sequence), and the repeat calls a
        difference above half the tolerance nondeterminism. A random scale per backward stays inside the span,
        but would have to be near -1 or 0 to make those 0/1 coefficients. Those skip the repeat (one
        forward+backward less on the failing path); every other failing verdict, a coefficient tied to the
        backward count included, gets it."""
        keys = [f"s{k}" for k in range(len(self.batches))] + ["seq"]
        fitted = {
            i: [*self.fits[i][0], -1.0]
            for i in suspects
            if i in self.fits
            and min(self.results[i].numel, SUBSET) >= FIT_DIM * len(keys)
            and set(self.results[i].anomalies) <= NOT_NOISE_IF_FITTED
        }
        if not fitted:
            return suspects
        self.subsets.residual2(self.stats, "fit_res2", keys, fitted)
        column = self.host(["fit_res2"])["fit_res2"]
        left = []
        for i in suspects:
            res2 = column[i]
            if i not in fitted or res2 is None or not self.fits[i][1] > 0:
                left.append(i)
                continue
            r = self.results[i]
            r.fit_residual = math.sqrt(max(res2, 0.0) / self.fits[i][1])
            if not r.fit_residual <= r.tolerance / 8:
                left.append(i)
        return left

    def repeat(self, suspects: list[int]) -> dict[str, list[float | None]]:
        """The first micro-batch again from zeroed buffers, compared with its first run on the subset."""
        self._run("r", [0])
        self.subsets.distance2(self.stats, "rep2", "r", "s0", suspects)
        self.subsets.gram(self.stats, ["s0"], only=suspects)
        return self.host()

    # -- loss evaluations ---------------------------------------------------------------------------------------
    def _loss(self, batch: Any) -> torch.Tensor:
        self.step_start.begin()  # the weights moved: a new step's FP8 cast
        if self.loss_fn is not None:
            self.rng.apply()
            self.forwards += 1
            with torch.no_grad():
                loss = self.loss_fn(self.model, batch)
        else:
            self._prepare()
            self._zero()
            loss = self._microbatch(batch)
            self.adapter.finish()
        if loss is None:
            raise ValueError(
                "finite differences need the loss: pass loss_fn=, or return the loss from run_microbatch"
            )
        if not isinstance(loss, torch.Tensor):
            loss = torch.tensor(float(loss))
        self.loss_unit = max(self.loss_unit, unit_roundoff(loss.dtype))  # a bf16 loss is quantized to it
        return self.dist.mean_loss(loss)

    def _evaluate(
        self,
        indexes: Sequence[int],
        delta: Callable[[int, torch.Tensor], torch.Tensor],
        grads: list[torch.Tensor | None],
        sign: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Loss of the first micro-batch with each weight i of `indexes` moved by sign x delta(i, weight), and
        <G, the move as the forward computes with it (rounded to the compute dtype)>; the weights are restored
        bit for bit before returning (installed by the next commit)."""
        adapter = self.adapter
        targets = [adapter.target(self.entries[i]) for i in indexes]
        with torch.no_grad():
            saved = copies(targets)
        parts: list[torch.Tensor] = []
        try:
            self.synced, self.uninstalled = False, True  # the weights move from here on
            with torch.no_grad():
                batched: dict[tuple[torch.device, torch.dtype, torch.dtype], list[tuple[int, int]]] = {}
                same: dict[
                    tuple[torch.device, torch.dtype, torch.dtype],
                    list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                ] = {}
                for j, (i, t) in enumerate(zip(indexes, targets, strict=True)):
                    g = grads[i]
                    if (
                        isinstance(delta, _Along)
                        and g is not None
                        and g.numel() == t.numel() <= SMALL_MOVE
                        and adapter.compute_dtype(self.entries[i]) == t.dtype
                    ):
                        batched.setdefault((t.device, t.dtype, g.dtype), []).append((j, i))
                done = {j for members in batched.values() for j, _ in members}
                for members in batched.values():
                    self._move_small(members, targets, grads, cast(_Along, delta), sign)
                for j, (i, t, old) in enumerate(zip(indexes, targets, saved, strict=True)):
                    g = grads[i]
                    if j not in done:  # (the small ones moved above)
                        if isinstance(delta, _Along) and g is not None and g.numel() == t.numel():
                            t.add_(g.view(t.shape), alpha=sign * delta.factor(i, t))
                        else:
                            d = delta(i, t)
                            t.add_(d, alpha=sign)
                            del d
                    if g is None:
                        continue
                    cdt = adapter.compute_dtype(self.entries[i])
                    if cdt == t.dtype:
                        same.setdefault((t.device, t.dtype, g.dtype), []).append((t, old, g.view(t.shape)))
                        continue
                    moved = (t.to(cdt).float() - old.to(cdt).float()).reshape(-1)
                    parts.append(torch.sum(moved * g, dtype=torch.float32))
                    del moved
                for (_, dtype, _), items in same.items():
                    parts += self._predictions(items, dtype)
            self._commit()
            loss = self._loss(self.batches[self.fd_batches[0]])
            for b in self.fd_batches[1:]:
                loss = loss + self._loss(self.batches[b])
            self.evaluations += 1
        finally:
            with torch.no_grad():
                foreach_copy_(targets, saved)
            self.synced, self.uninstalled = False, True  # restored, installed by the next commit
        device = loss.device
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for part in parts:
            by_kind.setdefault((part.device, part.dtype), []).append(part)
        pred = torch.zeros((), device=device, dtype=torch.float64)
        for kind in by_kind.values():  # one stack per kind, summed in fp64 (not one cast per weight)
            pred = pred + torch.stack(kind).to(device=device, dtype=torch.float64).sum()
        return loss, pred

    def _move_small(
        self,
        members: list[tuple[int, int]],
        targets: list[torch.Tensor],
        grads: list[torch.Tensor | None],
        delta: _Along,
        sign: float,
    ) -> None:
        """Small weights of one device and dtype (biases, norms: most of a model's parameters, a sliver of its
        elements) moved with multi-tensor launches instead of one add per weight, and the same moves (their
        predictions go with the others', `_predictions`). (The noise's jitter stays per weight: its draw is the
        noise estimate's one sample.)"""
        ts = [targets[j] for j, _ in members]
        gs = [cast(torch.Tensor, grads[i]).view(targets[j].shape) for j, i in members]
        factors = [sign * delta.factor(i, targets[j]) for j, i in members]
        # t + factor x g x 1, rounded once (as t.add_(g, alpha=factor)): the same moves as one weight at a time
        ones = torch.ones(sum(t.numel() for t in ts), device=ts[0].device, dtype=gs[0].dtype)
        units = [p.view(t.shape) for p, t in zip(ones.split([t.numel() for t in ts]), ts, strict=True)]
        _TORCH._foreach_addcmul_(ts, gs, units, factors)

    @staticmethod
    def _predictions(
        items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], dtype: torch.dtype
    ) -> list[torch.Tensor]:
        """<G, move> summed over weights (moved, saved start, gradient) of one dtype the forward computes in,
        a group of up to 2 x FD_CHUNK elements at a time (bounded scratch): multi-tensor launches instead of
        three per weight. Two nearby numbers of one format differ by a number of that format (Sterbenz): the
        move as the forward sees it, in the weight's own dtype, without fp32 copies of both. Accumulated in
        fp32 (a tree reduction) unless the model is fp64: an fp64 sum would first cast the whole product."""
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        out: list[torch.Tensor] = []
        for group in chunks(
            list(range(len(items))), [items[k][0].numel() for k in range(len(items))], 2 * FD_CHUNK
        ):
            moved = _TORCH._foreach_sub([items[k][0] for k in group], [items[k][1] for k in group])
            products = _TORCH._foreach_mul(moved, [items[k][2] for k in group])
            del moved
            flat = (
                products[0].reshape(-1)
                if len(products) == 1
                else torch.cat([p.reshape(-1) for p in products])
            )
            del products
            out.append(flat.sum(dtype=acc))
        return out

    # -- finite differences -------------------------------------------------------------------------------------
    def fd(self) -> None:
        """The probes on the first micro-batch's loss, along its gradient: one combined probe of every group
        (each group moved at its own step, scaled to a comparable share of the predicted change), split into
        the groups and then bisected where an estimate deviates; one host transfer per round. Parameters
        whose gradient is zero on that micro-batch wait for `fd_rest`."""
        moves = _Moves(self)
        self.step_mult = moves.mult
        self.gnorms = list(moves.gnorm)
        self.sizes = [moves.size(i, e.raw_param) for i, e in enumerate(self.entries)]
        usable = [i for i in range(len(self.entries)) if math.isfinite(moves.gnorm[i])]  # else no direction
        self.later = [i for i in usable if not moves.gnorm[i] > 0.0]
        now = [i for i in usable if moves.gnorm[i] > 0.0]
        roots = self._probe(moves, now, [], "")
        self._check_visible(roots)

    def fd_rest(self) -> None:
        """After the singles, the parameters with no gradient on the first micro-batch, on the loss summed over
        every micro-batch: along the sum of the singles where that is not zero (an expert that got tokens
        only in a later micro-batch), along a random direction where it is (`lost` when that loss moves,
        `unused` only when it does not: an expert idle in one micro-batch is not unused)."""
        if not self.later:
            return
        n = len(self.batches)
        self.fd_batches = list(range(n))
        # a sum of n losses: its noise is measured again (below) where the weights allow; its round-off and
        # the residuals of the first micro-batch's estimates scale with n
        self.noise *= n
        self.loss_level *= n
        self.residuals = [r * n for r in self.residuals]
        self.noise_measured = False
        moves = _Moves(self)
        self.step_mult = moves.mult
        usable = [i for i in self.later if math.isfinite(moves.gnorm[i])]
        nonzero = [i for i in usable if moves.gnorm[i] > 0.0]
        zero = [i for i in usable if not moves.gnorm[i] > 0.0]
        if self.local_on:  # the sequence's module reruns judge these first (no loss forwards)
            self.local_deferred = [
                i
                for i in zero
                if id(self.entries[i].raw_param) in self.local_weights
                and local.probed_kind(self.owners.get(id(self.entries[i].raw_param))) is not None
            ]
            zero = [i for i in zero if i not in set(self.local_deferred)]
        self._probe(moves, nonzero, zero, " (all micro-batches)" if n > 1 else "")

    def fd_left(self) -> None:
        """Zero-gradient weights the module reruns left without a verdict: on the loss, along random directions."""
        left = [i for i in self.local_deferred if i not in self.local]
        if not left:
            return
        moves = _Moves(self)
        self.step_mult = moves.mult
        n = len(self.batches)
        self._probe(moves, [], left, " (all micro-batches)" if n > 1 else "")

    # -- module-local finite differences (local.py) -------------------------------------------------------------
    def _local_floor(self, indexes: Sequence[int]) -> float:
        """A correct gradient's deviation beyond the rounding error bar: 4 units of round-off of the compute
        dtype (the backward's own GEMM rounding), at least 2^-10; the caller's fd_rtol where given."""
        if self.fd_rtol is not None:
            return self.fd_rtol
        u = max(unit_roundoff(self.adapter.compute_dtype(self.entries[i])) for i in indexes)
        return max(4 * u, 2.0**-10)

    def _screening(self) -> local.LocalProbe | None:
        """Every probed module's weights moved together along the first micro-batch's gradient (the copy, still
        G(first) here), each weight at a step that gives it a comparable share of its module's change,
        measured on the second micro-batch's backward. Weights the loss-level probe already bounds within a
        factor 1 +- BOUND_ENOUGH (a large share of its change: an embedding, an output layer) are left where
        they are: the module reruns cost about a forward where they are all needed."""
        if not (self.local_on and self.gnorms):
            return None
        by_owner: dict[int, list[int]] = {}
        for i in self.local_weights.values():
            g = self.gnorms[i]
            if self.copy[i] is None or not (g > 0 and math.isfinite(g)):
                continue
            bound = self.resolution.get(i)
            if bound is not None and bound - 1 < BOUND_ENOUGH:  # the loss-level probe already bounds it
                reason = f"bounded within x{1 + BOUND_ENOUGH:g} by the loss-level probe"
                self.local_not_judged.setdefault(reason, set()).add(i)
                continue
            owner = self.owners.get(id(self.entries[i].raw_param))
            by_owner.setdefault(id(owner), []).append(i)
        plan: dict[int, local.Move] = {}
        gnorm = dict(enumerate(self.gnorms))
        for members in by_owner.values():
            eps = self._balanced(members, gnorm)
            for i in members:
                plan[i] = local.Move(h=eps[i] * self.sizes[i] / self.gnorms[i], direction=self.copy[i])
        if not plan:
            return None
        return local.LocalProbe(self.model, self.local_params, plan, one_sided=True)

    def _plan_refinement(self, flats: list[torch.Tensor | None], k: int) -> None:
        """After the last single (the copy now the sum of the singles, S): the moves of the weights to judge
        alone, along S, and their predictions <reported single k, the move>, so that the sequence reruns their
        modules only in micro-batch k's backward (the same true gradient as in its single: the weights and
        random state are the same) instead of in every micro-batch's. A weight whose single k is zero (an
        expert that got no tokens there) is measured in every micro-batch of the sequence, against S."""
        if not self.local_on:
            return
        wanted = [
            i for i in dict.fromkeys((*self.local_suspects, *self.local_unsure)) if self.copy[i] is not None
        ]
        if not wanted:
            return
        own = [i for i in wanted if flats[i] is not None]
        values = norms(some(self.copy, wanted) + some(flats, own)).double().cpu().tolist()
        self.syncs += 1
        gnorm = dict(zip(wanted, values[: len(wanted)], strict=True))
        single = dict(zip(own, values[len(wanted) :], strict=True))
        for i in wanted:
            if not (gnorm[i] > 0 and math.isfinite(gnorm[i])):
                continue
            h = local.EPS_BIG * self.sizes[i] / gnorm[i]
            f = flats[i]
            if f is not None and single.get(i, 0.0) > 0 and math.isfinite(single[i]):
                move = local.Move(h=h, direction=self.copy[i], label="", only=k)
                self.refine_predicted[i] = local.prediction(self._local_start(i), move, f)
            else:
                move = local.Move(h=h, direction=self.copy[i], label="")
            self.refine_plan[i] = move

    def _refinement(self) -> local.LocalProbe | None:
        """In the sequence's backwards, each weight alone: those of a screened set that deviated, and those of
        a set the screening could not bound well (its micro-batch's gradient nearly orthogonal to the first
        one's, or a weight's share too small), along the sum of the singles (`_plan_refinement`); and the
        weights whose reported gradient is zero on every micro-batch, along random directions (their module's
        output must not move): one by one where a module has a few, together where it has many."""
        if not self.local_on or not (self.refine_plan or self.local_deferred):
            return None
        plan: dict[int, local.Move] = dict(self.refine_plan)
        zero_by_owner: dict[int, list[int]] = {}
        for i in self.local_deferred:
            zero_by_owner.setdefault(id(self.owners.get(id(self.entries[i].raw_param))), []).append(i)
        for members in zero_by_owner.values():
            # a few (an expert's weights) one by one, so a lost one is named; many (idle experts) together
            label = "" if len(members) <= local.EACH_MAX else "zero"
            for i in members:
                plan[i] = local.Move(
                    h=local.EPS_BIG * self.sizes[i], direction=None, seed=1009 * (i + 1), label=label
                )
        if not plan:
            return None
        return local.LocalProbe(self.model, self.local_params, plan)

    def _balanced(self, members: list[int], gnorm: dict[int, float]) -> dict[int, float]:
        """Relative steps for weights moved together. The change a weight predicts at relative step eps is about
        eps x |w| x |G|; the module is linear in each weight, so a larger step only makes the output's rounding
        a smaller part of the change: the weight with the smallest change moves by EPS_BIG, the others less, each
        to a comparable change (never below EPS_FLOOR, where a bf16 weight stops moving)."""
        mags = {i: self.sizes[i] * gnorm[i] for i in members}
        low = min(mags.values())
        return {i: min(max(local.EPS_BIG * low / mags[i], local.EPS_FLOOR), local.EPS_BIG) for i in members}

    def _local_sets(self, probe: local.LocalProbe) -> list[tuple[tuple[int, ...], list[tuple[int, ...]]]]:
        """The sets of weights to judge: the reruns' sets, merged where they share a weight (a tied one); a set
        holding a weight one of whose calls could not be measured is left out (its weights noted, with why)."""
        for i in probe.plan:
            if i in probe.escaped:
                self.local_escapes.setdefault(i, probe.escaped[i])
                self.local_not_judged.setdefault("used outside its module's call", set()).add(i)
            elif i in probe.failed:
                self.local_not_judged.setdefault("its module could not be rerun", set()).add(i)
        parent: dict[int, int] = {}

        def find(i: int) -> int:
            while parent.setdefault(i, i) != i:
                i = parent[i]
            return i

        for key in probe.sums:
            for i in key[1:]:
                parent[find(i)] = find(key[0])
        components: dict[int, list[tuple[int, ...]]] = {}
        for key in probe.sums:
            components.setdefault(find(key[0]), []).append(key)
        sets = []
        for keys in components.values():
            members = tuple(sorted({i for key in keys for i in key}))
            if len({n for key in keys for n in probe.sums[key].sides}) > 1:
                # some calls against the forward's own output, others central: no one move to predict with
                self.local_not_judged.setdefault("its module could not be rerun", set()).update(members)
                continue
            if all(probe.complete(i) for i in members):
                sets.append((members, keys))
        return sets

    def _judge_local(
        self,
        probe: local.LocalProbe,
        reported: list[torch.Tensor | None],
        screening: bool,
        predicted: dict[int, torch.Tensor] | None = None,
    ) -> None:
        """Compare, per set of weights moved together, the reruns' <dy, y+ - y-> with <reported gradient, the
        move> (`predicted` where it was computed earlier, else from `reported`); one host transfer."""
        self.local_reruns += probe.reruns
        self.local_errors += probe.errors[: max(0, 3 - len(self.local_errors))]
        sets = self._local_sets(probe)
        if not sets:
            return
        values: list[torch.Tensor] = []
        preds: dict[int, int] = {}
        starts: list[int] = []
        for members, keys in sets:
            starts.append(len(values))
            values.append(torch.stack([v for key in keys for v in probe.sums[key].measured]).sum())
            values.append(torch.stack([v for key in keys for v in probe.sums[key].variance]).sum())
            sides = {n for key in keys for n in probe.sums[key].sides}
            for i in members:
                g = reported[i]
                move = probe.plan[i]
                if g is None or move.direction is None:
                    continue
                preds[i] = len(values)
                early = predicted.get(i) if predicted else None
                values.append(
                    early
                    if early is not None
                    else local.prediction(self._local_start(i), move, g, sides=min(sides))
                )
        host = stack_to_host(values)
        self.syncs += 1
        for (members, _), at in zip(sets, starts, strict=True):
            measured, variance = host[at], host[at + 1]
            p = {i: host[preds[i]] for i in members if i in preds}
            zero = all(probe.plan[i].direction is None for i in members)
            floor = self._local_floor(members)
            verdict = local.judge(members, sum(p.values()), measured, variance, floor, zero)
            if verdict.verdict == "deviates":
                if screening:
                    self.local_suspects.extend(members)
                continue  # (in the refinement a set is never a deviating one: deviating weights go alone)
            if verdict.verdict == "moves" and len(members) > 1:
                continue  # one of them lost its gradient: left to the loss-level probes (fd_left)
            total = sum(abs(v) for v in p.values())
            shares = {i: abs(p.get(i, 0.0)) / total if total > 0 else 0.0 for i in members}
            loose: list[
                int
            ] = []  # judged again in the sequence, weight by weight, along the aligned direction
            if screening and verdict.verdict == "unknown":
                loose = list(members)
            elif screening and verdict.verdict == "ok" and len(members) > 1:
                # the set passed: a weight with a share s is bounded within 1 + band / s; only those bounded
                # more loosely than x(1 + UNSURE) are judged again (the others keep the set's verdict)
                band = floor + (verdict.error or 0.0)
                loose = [i for i in members if shares[i] <= 0 or band / shares[i] >= UNSURE]
            self.local_unsure.extend(loose)
            if verdict.verdict == "unknown":
                if not screening:
                    self.local_not_judged.setdefault("below the output's rounding", set()).update(members)
                continue
            for i in members:
                if i not in loose:
                    self.local[i] = verdict
                    self.local_share[i] = shares[i]

    def apply_local(self) -> None:
        """The module-local verdicts over the loss-level ones: a failure is a failure; an ok bounds what the
        parameter could hide more tightly than a shared loss probe (fd_resolution: the tighter of the two)."""
        kind = self.adapter.kind
        for i, v in self.local.items():
            r = self.results[i]
            where = f"module {self.entries[i].module or '(root)'}"
            if v.verdict == "unused":
                if r.fd_probe is None or r.unused or r.inconclusive:
                    r.fd_probe, r.unused, r.inconclusive = where, True, False
                    r.notes = [n for n in r.notes if not n.startswith("finite differences:")]
                continue
            r.fd_local = v.ratio if v.verdict != "moves" else 0.0
            r.fd_local_error = v.error
            if v.verdict == "ok":
                band = self._local_floor(v.indexes) + (v.error or 0.0)
                share = self.local_share.get(i, 0.0) if len(v.indexes) > 1 else 1.0
                if share > 0:
                    bound = 1 + band / share
                    r.fd_resolution = bound if r.fd_resolution is None else min(r.fd_resolution, bound)
                if r.fd_probe is None or r.inconclusive:
                    r.fd_probe, r.fd_scale, r.fd_error = where, v.ratio, v.error
                    r.inconclusive, r.unused = False, False
                    r.notes = [n for n in r.notes if not n.startswith("finite differences:")]
                continue
            verdict = {"moves": "lost", "lost": "lost", "scaled": "scaled", "wrong": "wrong"}[v.verdict]
            scale = 0.0 if verdict == "lost" else v.ratio
            r.fd_probe, r.fd_scale, r.fd_error = where, scale, v.error
            r.inconclusive = r.unused = False
            r.notes = [n for n in r.notes if not n.startswith("finite differences:")]
            # the singles the comparison sums were themselves off where the accumulation verdicts name a pattern
            # (the backward count, the position, a stale or overwritten buffer): that verdict says it
            if not set(r.anomalies) & LOCAL_EXPLAINED:
                judge.fd_verdict(r, verdict, scale, kind)
                r.anomalies = sorted(dict.fromkeys(r.anomalies), key=PREFLIGHT_ANOMALIES.index)

    def _probe(self, moves: _Moves, nonzero: list[int], zero: list[int], suffix: str) -> list[_Node]:
        """Probe `nonzero` along the gradient copy and `zero` along random directions until every probe has
        a verdict; the root probes."""
        groups: dict[tuple[str, bool], list[int]] = {}
        for i in nonzero:
            groups.setdefault((self.results[i].group, False), []).append(i)
        for i in zero:
            groups.setdefault((self.results[i].group, True), []).append(i)
        parts = [(key + suffix, indexes) for (key, z), indexes in groups.items() if not z]
        self.fd_group_count += len(groups)
        roots: list[_Node] = []
        if len(parts) > 1:
            root = self._node(
                f"all {len(parts)} groups{suffix}", [i for _, idx in parts for i in idx], False, 0
            )
            root.parts = parts
            roots.append(root)
        else:
            roots += [self._node(key, indexes, False, 0) for key, indexes in parts]
        for (key, z), indexes in groups.items():
            if z:
                roots.append(self._node(key + " (zero gradient)" + suffix, indexes, True, 0))
        if (parts or zero) and moves.nonzero and not self.noise_measured:
            self._round(moves, [], True)  # the noise first: it sets the first steps
        requests: list[tuple[_Node, float]] = []
        first = self._first_steps(parts, moves)
        for node in roots:
            s0 = ZERO_STEP0 if node.zero else first
            requests += [(node, s0), (node, s0 / 2)]
        waiting: list[_Node] = []
        while requests:
            touched = self._round(moves, requests, False)
            requests = []
            for node in touched:
                if node.zero:
                    waiting.append(node)  # judged once the nonzero probes have measured the noise
                    continue
                requests += self._judge(node, self.noise)
            if waiting and not any(not node.zero for node, _ in requests):
                self.zero_noise = self._zero_noise()
                for node in waiting:
                    requests += self._judge(node, self.zero_noise)
                waiting = []
        return roots

    def _first_steps(self, parts: list[tuple[str, list[int]]], moves: _Moves) -> float:
        """The larger step of the first pair, with each group's multiplier set in `moves.mult`.

        A group's own step is the caller's fd_step, else twice the smallest power of two at which the measured
        noise is at most E_MAX / NOISE_SHARE of its predicted change. Truncation grows with the step and
        rounding shrinks, so the smallest step where rounding is small enough is where two steps most often
        agree at once (on the H200, the 541M GPT's three groups each agreed at their first pair). The predicted
        change is estimated before any forward on each weight's subset, with the move rounded to the dtype the
        forward computes in: in bf16 most elements of a small move round to nothing, so the change is far
        below step x |w| x |g| there. With an fp32 (or wider) forward, rounding allows tiny steps; a group's
        step stays at least STEP0 there, where the estimate is more precise.

        The groups are then probed together: each group's step is lowered (by powers of two, never below the
        noise condition of the smallest group's change) until its predicted change is within 2x of the
        smallest group's, so that a group off by x2 moves the combined ratio by a third or more of that, not
        by its share of a change another group dominates; the multipliers make every later probe of a group
        move it exactly as the combined one did."""
        if not parts:
            return STEP0
        if self.fd_step is not None:
            return self.fd_step
        gains, per_weight = moves.rounded_gains(
            [[i for i in idx if i in moves.nonzero_set] for _, idx in parts]
        )
        self.weight_gains.update(per_weight)
        self.syncs += 1
        threshold = max(self.noise, self._floor()) * NOISE_SHARE / E_MAX
        chosen: list[int] = []  # per group, an index into CANDIDATE_STEPS (larger step: smaller index)
        for (_, indexes), gain in zip(parts, gains, strict=True):
            # the change grows with the step: the steps above the threshold are the larger ones
            ok = [k for k, g in enumerate(gain) if abs(g) >= threshold]
            k = max(ok[-1] - 1, 0) if ok else 0
            wide = all(
                unit_roundoff(self.adapter.compute_dtype(self.entries[i])) <= 2.0**-20 for i in indexes
            )
            if wide:
                k = min(k, CANDIDATE_STEPS.index(STEP0))
            chosen.append(k)
        smallest = min(abs(g[k]) for g, k in zip(gains, chosen, strict=True))
        for j, gain in enumerate(gains):
            while chosen[j] + 1 < len(CANDIDATE_STEPS) and abs(gain[chosen[j]]) > 2 * smallest:
                if abs(gain[chosen[j] + 1]) < max(smallest / 2, threshold):
                    break
                chosen[j] += 1
        top = min(chosen)
        for (_, indexes), k in zip(parts, chosen, strict=True):
            for i in indexes:
                moves.mult[i] = CANDIDATE_STEPS[k] / CANDIDATE_STEPS[top]
        return min(CANDIDATE_STEPS[top], STEP_MAX)

    def _round(self, moves: _Moves, requests: list[tuple[_Node, float]], first: bool) -> list[_Node]:
        """Evaluate every requested (probe, step) at +- the step (and, in the first round, the noise), install
        the restored weights once, bring the numbers to the host in one transfer; the probes touched."""
        pending: list[tuple[_Node, float, torch.Tensor, torch.Tensor]] = []
        noise_parts: list[torch.Tensor] = []
        if first and moves.nonzero:
            plus, pp = self._evaluate(moves.nonzero, moves.jitter, moves.directions, 1.0)
            minus, pm = self._evaluate(moves.nonzero, moves.jitter, moves.directions, -1.0)
            noise_parts = [(plus - minus) / 2, (plus + minus) / 2, (pp - pm) / 2]
        for node, step in requests:
            if step in node.inferred:
                continue
            maker = moves.random(step) if node.zero else moves.along(step)
            lp, pp = self._evaluate(node.indexes, maker, moves.directions, 1.0)
            lm, pm = self._evaluate(node.indexes, maker, moves.directions, -1.0)
            pending.append((node, step, (lp.double() - lm.double()) / 2, (pp - pm) / 2))
        self._commit()  # the restored weights, installed once per round
        self.rounds += 1
        cs, ps = self._to_host(
            [c for _, _, c, _ in pending] + noise_parts[:2], [p for _, _, _, p in pending] + noise_parts[2:]
        )
        if first and noise_parts:
            self.noise_measured = True
            c_j, l_mean, p_j = cs[len(pending)], cs[len(pending) + 1], ps[len(pending)]
            self.loss_level = l_mean
            self.noise = max(2 * abs(c_j - p_j), self._floor())
        touched: list[_Node] = []
        for j, (node, step, _, _) in enumerate(pending):
            node.levels[step] = (cs[j], ps[j])
            if node not in touched:
                touched.append(node)
        for node, _ in requests:
            if node.inferred and node not in touched:
                parent, sibling = cast(_Node, node.parent), cast(_Node, node.sibling)
                for step in sorted(node.inferred):
                    if step in parent.levels and step in sibling.levels:
                        pc, pp_ = parent.levels[step]
                        sc, sp = sibling.levels[step]
                        node.levels[step] = (pc - sc, pp_ - sp)
                node.inferred = set()
                touched.append(node)
        return touched

    def _judge(self, node: _Node, noise: float) -> list[tuple[_Node, float]]:
        levels = [(s, c, p) for s, (c, p) in node.levels.items()]
        est = judge_levels(levels, noise, node.zero, self._floor())
        node.probe.levels = sorted(levels, reverse=True)
        node.probe.noise = noise
        if est.next_step is not None:
            return [(node, est.next_step)]
        if not node.zero and est.reliable and est.ratio is not None and est.pair is not None:
            r = est.ratio
            self.residuals += [
                abs(node.levels[s][0] - r * node.levels[s][1]) for s in est.pair if s in node.levels
            ]
        return self._finish(node, est)

    def _floor(self) -> float:
        """The loss's own round-off: 8 units of fp32, or 2 units of the loss's dtype where that is coarser
        (a bf16 loss moves in steps of its unit: a central difference is off by up to one)."""
        return max(8 * unit_roundoff(torch.float32), 2 * self.loss_unit) * abs(self.loss_level)

    def _zero_noise(self) -> float:
        """The noise zero-gradient probes are judged against: the jitter's, or what the reliable estimates
        show (the largest residual of their accepted steps) where that is smaller; never below the loss's
        own fp32 round-off."""
        floor = self._floor()
        if self.residuals:
            return max(min(self.noise, 2 * max(self.residuals)), floor)
        return max(self.noise, floor)

    def _node(self, key: str, indexes: list[int], zero: bool, depth: int) -> _Node:
        probe = Probe(key=key, names=[self.entries[i].name for i in indexes], zero_gradient=zero, depth=depth)
        probe.unit = max(unit_roundoff(self.adapter.compute_dtype(self.entries[i])) for i in indexes)
        probe.method = "central, random direction" if zero else "central, two steps"
        self.probes.append(probe)
        return _Node(probe, indexes, max(self.fd_tolerance(i) for i in indexes))

    def _to_host(self, cs: list[torch.Tensor], ps: list[torch.Tensor]) -> tuple[list[float], list[float]]:
        """Loss changes (already averaged over ranks) and predictions (summed over shards): one transfer."""
        self.syncs += 1
        if not cs and not ps:
            return [], []
        device = (cs or ps)[0].device
        c = (
            torch.stack([x.to(device).double().reshape(()) for x in cs])
            if cs
            else torch.zeros(0, device=device)
        )
        p = (
            torch.stack([x.to(device).double().reshape(()) for x in ps])
            if ps
            else torch.zeros(0, device=device)
        )
        p = self.dist.sum_stats(p)
        values = torch.cat([c, p]).cpu().tolist()
        return values[: len(cs)], values[len(cs) :]

    def _finish(self, node: _Node, est: Estimate) -> list[tuple[_Node, float]]:
        """The probe's verdict from its estimate, or its split into two halves (returned: their requests)."""
        probe = node.probe
        probe.error = est.error
        probe.step = est.step
        mults = {self.step_mult[i] for i in node.indexes} if self.step_mult and not node.zero else set()
        if est.step is not None and len(mults) == 1:
            probe.step = est.step * mults.pop()  # the step the group's own weights moved by
        multi = len(node.indexes) > 1
        if node.zero:
            probe.scale = 0.0 if est.moves else None
            if est.moves:
                return self._split(node, est) if multi else self._set(node, "lost")
            if est.moves is False:
                return self._set(node, "unused")
            probe.reason = est.reason
            return self._set(node, "inconclusive")
        if est.ratio is None:
            probe.reason = est.reason
            return self._unsure(node)
        r, err = est.ratio, cast(float, est.error)
        probe.scale = 1 / r if r != 0 else math.inf
        ltol = math.log1p(node.tol)
        if not (r > 0 and math.isfinite(r)):
            if est.reliable or est.off:
                probe.reason = f"true / reported {r:.3g}: the reported gradient points the wrong way"
                return self._split(node, est) if multi else self._set(node, "wrong")
            probe.reason = est.reason
            if multi and not node.bounded and (len(node.parts) > 1 or node.halvings < UNRELIABLE_SPLITS):
                return self._split(node, est)
            return self._unsure(node)
        dev = abs(math.log(r))
        if est.reliable:
            # exact blame: a group deviating by more than one error bar is bisected; a parameter alone is judged
            # at three error bars plus the dtype's tolerance
            if multi:
                # a deviation within a quarter of the dtype's tolerance is the backward's own rounding (a
                # correct bf16 GPT deviates by up to 1%), not a parameter hidden by the group
                band = max(err, ltol / 4)
                if dev <= band + 1e-9:
                    self._resolve(node, cast(float, est.step), band)
                    return self._set(node, "ok")
                if dev <= ltol + 3 * err:  # what a parameter alone would pass: its weights are bounded by it
                    self._resolve(node, cast(float, est.step), ltol + 3 * err)
                    return self._split(node, est, bounded=True)
                return self._split(node, est)
            if dev <= ltol + 3 * err:
                self.resolution[node.indexes[0]] = 1 + ltol + 3 * err
                return self._set(node, "ok")
        elif not est.off:  # never a verdict from an estimate that did not check itself
            probe.reason = est.reason
            # smaller parts may be linear at a larger step (not needed where a group above bounds them)
            if multi and not node.bounded and (len(node.parts) > 1 or node.halvings < UNRELIABLE_SPLITS):
                return self._split(node, est)
            return self._unsure(node)
        if multi:
            return self._split(node, est)
        scale = 1 / r
        return self._set(node, "scaled" if 0 < scale <= 64 else "wrong")

    def _resolve(self, node: _Node, step: float, band: float) -> None:
        """For each parameter of a passing probe of several: the largest factor on its gradient the probe could
        have passed. A parameter whose reported gradient is f x the true one, carrying a share s of the probe's
        predicted change, moves the probe's log-ratio by about (f - 1) s; the probe passed within `band`, so
        |f - 1| <= band / s could hide: 1 + band / s (s estimated on the subsets at the accepted step). None
        where the share is unknown. A weight carrying 1% of a probe whose band is 2% could be off x3 unseen:
        the verdict says so instead of a plain ok."""
        gains: dict[int, float] = {}
        for i in node.indexes:
            row = self.weight_gains.get(i)
            level = -math.log2(step * (self.step_mult[i] if self.step_mult else 1.0)) - 4
            k = round(level)
            if row is None or not (0 <= k < len(row)) or abs(level - k) > 1e-6:
                return
            gains[i] = abs(row[k])
        total = sum(gains.values())
        for i in node.indexes:
            share = gains[i] / total if total > 0 else 0.0
            if share > 0:
                self.resolution[i] = 1 + band / share

    def _unsure(self, node: _Node) -> list[tuple[_Node, float]]:
        """No estimate of its own that checks itself: `inconclusive`, unless a group above it passed within a
        single parameter's tolerance, whose bound on each weight (fd_resolution, from its shares) then stands
        as the verdict: `ok` within that bound (a loose one is listed as weakly checked), not a claim more."""
        if node.bounded:
            node.probe.reason = (
                f"bounded by a group above it ({node.probe.reason})" if node.probe.reason else ""
            )
            return self._set(node, "ok")
        return self._set(node, "inconclusive")

    def _set(self, node: _Node, verdict: str) -> list[tuple[_Node, float]]:
        node.probe.verdict = verdict
        return []

    def _split(self, node: _Node, est: Estimate, bounded: bool = False) -> list[tuple[_Node, float]]:
        """Two halves: a combined probe's groups in two sets (down to one group each), a group's parameters in
        two halves. The first half is evaluated at the parent's two accepted steps, the second inferred from
        the parent minus the first (the directional derivative is linear in the direction)."""
        node.probe.verdict = "split"
        key, depth, zero = node.probe.key, node.probe.depth + 1, node.zero
        if len(node.parts) > 1:
            half = len(node.parts) // 2
            sets = [node.parts[:half], node.parts[half:]]
            keys = [
                p[0][0] if len(p) == 1 else f"{key}[{depth}{ab}] ({len(p)} groups)"
                for p, ab in zip(sets, "ab", strict=True)
            ]
            left = self._node(keys[0], [i for _, idx in sets[0] for i in idx], zero, depth)
            right = self._node(keys[1], [i for _, idx in sets[1] for i in idx], zero, depth)
            left.parts, right.parts = sets
            left.halvings = right.halvings = node.halvings
        else:
            half = len(node.indexes) // 2
            left = self._node(f"{key}[{depth}a]", node.indexes[:half], zero, depth)
            right = self._node(f"{key}[{depth}b]", node.indexes[half:], zero, depth)
            left.halvings = right.halvings = node.halvings + 1
        left.parent = right.parent = node
        left.bounded = right.bounded = bounded or node.bounded
        left.sibling, right.sibling = right, left
        steps = est.pair or (cast(float, est.step) * 2, cast(float, est.step))
        right.inferred = set(steps)
        return [(left, steps[0]), (left, steps[1]), (right, steps[0])]

    def _check_visible(self, roots: list[_Node]) -> None:
        probed = [n for n in roots if not n.zero and n.levels]
        threshold = Z_MOVE * max(self.noise, 1e-30)
        self.invisible = bool(probed) and all(
            all(abs(c) <= threshold and abs(p) > threshold for c, p in n.levels.values()) for n in probed
        )

    def apply_fd(self) -> None:
        """Each parameter takes the verdict of the deepest finished probe that holds it."""
        by_name = {e.name: i for i, e in enumerate(self.entries)}
        kind = self.adapter.kind
        for probe in self.probes:  # created parents first, so the deepest probe is the last to write
            if probe.verdict in ("split", "not judged"):
                continue
            for name in probe.names:
                r = self.results[by_name[name]]
                r.fd_probe = probe.key if len(probe.names) > 1 else name
                r.fd_scale = probe.scale
                r.fd_error = probe.error
                r.fd_step = probe.step
                r.unused = probe.verdict == "unused"
                r.fd_resolution = self.resolution.get(by_name[name]) if probe.verdict == "ok" else None
                r.inconclusive = probe.verdict == "inconclusive"
                if r.inconclusive:
                    r.notes = [f"finite differences: {probe.reason}"]
        for probe in self.probes:
            if probe.verdict in ("lost", "scaled", "wrong"):
                for name in probe.names:
                    judge.fd_verdict(self.results[by_name[name]], probe.verdict, probe.scale, kind)


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
        (module-local finite differences, `local.py`; where the loss-level probe bounds a weight loosely). rtol: linearity tolerance (default from the dtypes). rng_states: extra (get_state, set_state)
        pairs to reset before every micro-batch. sinks, run, rank, commit: as for install(); label: a name.
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
    buffers = BufferState(check.model)
    adapter.save_user_grads()
    error = tb = None
    tolerances: dict[str, Any] = {}
    clock = started
    timings = check.timings
    check.invisible = False

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
        if check.finite_differences:
            check.fd()
            lap("finite_differences")
        check.singles()
        lap("runs")
        if check.finite_differences:
            check.fd_rest()
            lap("finite_differences")
        check.sequence()
        lap("runs")
        if check.finite_differences:
            check.fd_left()
            lap("finite_differences")
        tolerances = _classify(check)
        suspects = check.needs_repeat([i for i, r in enumerate(check.results) if r.anomalies and r.finite])
        lap("comparison")
        if suspects:
            _judge_repeat(check, suspects, check.repeat(suspects))
            lap("runs")
    except Exception as exc:  # noqa: BLE001 - the model's failure is the result, not a crash of the caller
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500]
        tb = traceback.format_exc(limit=12)
    finally:
        check.copy = []
        if check.uninstalled:  # interrupted between a restore and its install
            try:
                check._commit()
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
    if error is None and check.invisible:
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
    depth = max((p.depth for p in check.probes), default=0)
    cost = {
        "seconds": seconds,
        "microbatch_passes": check.passes,
        "forward_passes": check.forwards,
        "loss_evaluations": check.evaluations,
        "fd_groups": check.fd_group_count,
        "fd_probes": len(check.probes),
        "fd_rounds": check.rounds,
        "bisection_depth": depth,
        "params": len(check.entries),
        "microbatches": len(check.batches),
        "host_syncs": check.syncs,
        "module_reruns": check.local_reruns,
        "copy_bytes": check.copy_bytes,
        "seconds_by_part": {k: round(v, 4) for k, v in timings.items()},
    }
    return PreflightResult(
        wrapper=adapter.label,
        wrapper_kind=adapter.kind,
        strategy=adapter.strategy,
        status=status,
        params=check.results if tolerances else [],
        groups=check.probes,
        cost=cost,
        tolerances=tolerances,
        error=error,
        error_traceback=tb,
        microbatches=len(check.batches),
        sequence=list(check.order),
        fixes=judge.fixes_for(adapter.kind),
        local=_local_summary(check),
    )


def _local_summary(check: Check) -> dict[str, Any]:
    """What the module-local finite differences judged, and why the others were not (each weight once)."""
    if not check.local_on:
        return {"on": False}
    judged = sorted(check.local)
    counts: dict[str, int] = {}
    for i in judged:
        counts[check.local[i].verdict] = counts.get(check.local[i].verdict, 0) + 1
    seen = set(judged)
    not_judged: dict[str, int] = {}
    for reason, indexes in sorted(check.local_not_judged.items()):
        left = indexes - seen
        seen |= left
        if left:
            not_judged[reason] = len(left)
    outside = [i for i in range(len(check.entries)) if i not in seen]
    if outside:
        not_judged["not in a probed module (or no gradient to compare)"] = len(outside)
    out: dict[str, Any] = {"on": True, "judged": len(judged), "verdicts": counts, "not_judged": not_judged}
    if check.local_errors:
        out["errors"] = list(check.local_errors)
    if check.local_escapes:  # a few examples: the weight and the function that used it outside
        out["used_outside"] = {
            check.entries[i].name: how for i, how in islice(sorted(check.local_escapes.items()), 3)
        }
    return out


def _judge_repeat(check: Check, suspects: list[int], host: dict[str, list[float | None]]) -> None:
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


def _classify(check: Check) -> dict[str, Any]:
    """The one comparison at the end: every device-side number goes to the host at once."""
    host = check.host()
    n = len(check.batches)
    kind = check.adapter.kind
    for e, r in zip(check.entries, check.results, strict=True):
        flag = getattr(e.raw_param, "overwrite_main_grad", None)
        r.overwrite_main_grad = flag if isinstance(flag, bool) else None
        r.has_main_grad = hasattr(e.raw_param, "main_grad")
        r.is_fsdp_param = hasattr(e.raw_param, "__fsdp_param__")
    check.apply_fd()  # the notes read the flags
    tol_used: list[float] = []

    def get(key: str, i: int) -> float | None:
        column = host.get(key)
        return None if column is None else column[i]

    singles = [f"s{k}" for k in range(n)]
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
                judge.accumulation_verdict(r, by_position, expected, math.sqrt(seq2), den, tol, kind)
                if alone:  # the fit's coefficients by micro-batch (zero where the verdict found G(seq) zero)
                    by_batch = list(coeffs) if r.fit is not None and coeffs is not None else [0.0] * n
                    check.fits[i] = (by_batch, sum(gram[k][k] for k in range(n)))
        elif seq2 > 0 and d2 > 0:
            r.anomalies.append("grad_inconsistent")
            r.notes.append("the sequence has a gradient where every micro-batch alone has none")
        r.anomalies = sorted(dict.fromkeys(r.anomalies), key=PREFLIGHT_ANOMALIES.index)
        if r.anomalies:
            r.inconclusive = False
    check.apply_local()  # after the accumulation verdicts: a pattern they name explains a local deviation
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
        "fd_noise": check.noise,
        "fd_zero_noise": check.zero_noise,
        "repeat": "the first micro-batch is repeated only where a failed verdict could be run-to-run noise (not "
        "where the fit by position leaves a residual below tolerance/8)",
        "copy_dtypes": sorted(check.copy_dtypes),
    }


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
