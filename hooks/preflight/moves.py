"""How a loss-level probe moves the weights (`loss_fd.py`): along the reported gradient's copy, each weight by
a step times its own norm; along a random direction where the gradient is zero; or by a few units of
round-off (the noise). Also the change each move predicts, before any forward, for choosing the steps."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch

from maingrad.hooks.preflight.measure import (
    FOREACH_OPS,
    SUBSET,
    norm,
    norms,
    some,
    to_device,
    unit_roundoff,
)

if TYPE_CHECKING:
    from maingrad.hooks.preflight.check import Check

CANDIDATE_STEPS = [2.0**-k for k in range(4, 21)]  # where the first pair is chosen (largest first)
ZERO_FLOOR = 2.0**-3  # a zero-gradient weight's move per element at step 1, at least (`Moves.random`)
# elements of one temporary of the candidate steps' predicted changes (`Moves.rounded_gains`): 16 MiB of fp32
STEPS_CHUNK = 1 << 22
BATCH_STEPS_ON_CPU = False  # (the tests compare both ways on the CPU)
JITTER_SEED = 7919  # the noise's draws: weight i's signs come from a generator seeded JITTER_SEED + i


class Moves:
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
        self.jitter = Jitter(self)

    def restrict(self, indexes: list[int], directions: dict[int, torch.Tensor]) -> None:
        """Move only `indexes` from now on, along `directions` (copies of the gradient these moves were sized
        on: the copy itself has moved on); the noise's jitter moves the same weights."""
        self.directions = [directions.get(i) for i in range(len(self.directions))]
        self.nonzero = [i for i in indexes if i in self.nonzero_set and self.directions[i] is not None]
        self.nonzero_set = set(self.nonzero)

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
            # on an accelerator the candidate steps go a chunk at a time, as a batch dimension of one launch per
            # operation (a launch per step and operation is 150 launches per bucket); on the CPU one at a time,
            # whose temporaries stay in cache (batched, the CPU population's GPT took 40% longer per call).
            # Zero-padded elements move by nothing and add nothing
            batched = device.type != "cpu" or BATCH_STEPS_ON_CPU
            per = max(1, STEPS_CHUNK // (rows * SUBSET)) if batched else 1
            candidates = to_device(CANDIDATE_STEPS, device)[:, None, None]  # one transfer for every chunk
            for a in range(0, len(CANDIDATE_STEPS), per):
                steps = candidates[a : a + per]
                moved = (weights + steps * moves).to(wdtype).to(cdt).float() - start
                parts.append((moved * grads).sum(dim=2, dtype=torch.float64) * scale)  # [steps, rows]
                del moved
            pending.append(([i for i, _, _ in members], torch.cat(parts).T))  # [rows, steps]
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

    def along(self, step: float) -> Along:
        return Along(self, step)

    def random(self, step: float) -> Callable[[int, torch.Tensor], torch.Tensor]:
        """Zero reported gradient: along the weights themselves (radial: no dilution by sqrt(numel)) plus a
        random +-1 part (a scale-invariant weight moves the loss only off the radial direction). A weight near
        zero (a bias initialised to 0) has no norm to scale by: it moves by at least ZERO_FLOOR per element
        at step 1, so that at the largest step (2^-2) its move passes through a bf16 forward's rounding of
        activations of order 1 (2^-7 per element there read `unused` for a BatchNorm bias that mattered)."""

        def delta(i: int, t: torch.Tensor) -> torch.Tensor:
            size = max(self.tnorm[i], math.sqrt(t.numel()) * ZERO_FLOOR)
            gen = torch.Generator(device=t.device).manual_seed(1009 + i)
            d = torch.randint(0, 2, t.shape, generator=gen, device=t.device).float() * 2 - 1
            d = d * (size / math.sqrt(max(t.numel(), 1)) / 2) + t.float()
            return d * (step * size / torch.linalg.vector_norm(d).clamp_min(1e-30))

        return delta


class Jitter:
    """The noise's move: +-2 units of round-off of each element, signs seeded per weight (the same at + and
    -), computed in the weight's own dtype: (0 or 4u) - 2u is exact, and so is its product with |t| (a power
    of two)."""

    def __init__(self, moves: Moves) -> None:
        self.moves = moves
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, i: int, t: torch.Tensor) -> torch.Tensor:
        return self.many([i], [t])[0]

    def many(self, indexes: list[int], targets: list[torch.Tensor]) -> list[torch.Tensor]:
        """The moves of several weights: the same draws and the same exact products as one at a time, in
        multi-tensor launches per unit of round-off (for small weights one launch each would dominate)."""
        check = self.moves.check
        draws: list[torch.Tensor] = []
        by_unit: dict[float, list[int]] = {}
        for k, (i, t) in enumerate(zip(indexes, targets, strict=True)):
            gen = self._generators.get(t.device)
            if gen is None:
                gen = self._generators[t.device] = torch.Generator(device=t.device)
            gen.manual_seed(JITTER_SEED + i)
            draws.append(torch.randint(0, 2, t.shape, generator=gen, device=t.device, dtype=t.dtype))
            by_unit.setdefault(unit_roundoff(check.adapter.compute_dtype(check.entries[i])), []).append(k)
        for u, ks in by_unit.items():
            ds = [draws[k] for k in ks]
            FOREACH_OPS._foreach_mul_(ds, 4 * u)
            FOREACH_OPS._foreach_sub_(ds, 2 * u)
            FOREACH_OPS._foreach_mul_(ds, FOREACH_OPS._foreach_abs([targets[k] for k in ks]))
        return draws


class Along:
    """The move along the reported gradient at one step: weight i moves by factor(i) x its gradient copy
    (`LossFD.evaluate` adds it in place, without an fp32 temporary of the whole parameter)."""

    def __init__(self, moves: Moves, step: float) -> None:
        self.moves = moves
        self.step = step

    def factor(self, i: int, t: torch.Tensor) -> float:
        return self.step * self.moves.mult[i] * self.moves.size(i, t) / self.moves.gnorm[i]

    def __call__(self, i: int, t: torch.Tensor) -> torch.Tensor:
        g = cast(torch.Tensor, self.moves.directions[i])
        return g.float().view(t.shape) * self.factor(i, t)
