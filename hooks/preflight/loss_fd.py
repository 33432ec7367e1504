"""Finite differences on the loss (`measure.py` for the estimate): central differences of the first
micro-batch's loss along its reported gradient, at two steps that must agree within the measured noise, per
group, bisected down to the parameters responsible where a group deviates; zero gradients along random
directions. `LossFD` keeps the probes' state (the noise, the probe tree, each weight's bound) and moves the
weights through its `Check` (`check.py`), which owns the runs, the wrapper's calls and the loss evaluation;
how a probe moves the weights is `moves.py`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import torch

from maingrad.hooks.preflight import judge
from maingrad.hooks.preflight.measure import (
    E_MAX,
    FD_CHUNK,
    FOREACH_OPS,
    STEP0,
    STEP_MAX,
    Z_MOVE,
    ZERO_STEP0,
    Estimate,
    chunks,
    contradicted,
    copies,
    finer,
    finest,
    foreach_copy_,
    judge_levels,
    noise_shown,
    refuting,
    shaped,
    some,
    unit_roundoff,
)
from maingrad.hooks.preflight.moves import CANDIDATE_STEPS, Along, Jitter, Moves
from maingrad.hooks.preflight.result import Probe

if TYPE_CHECKING:
    from maingrad.hooks.preflight.check import Check

NOISE_SHARE = 4  # the first pair's smaller step: noise at most E_MAX / NOISE_SHARE of the predicted change
SMALL_MOVE = 1 << 16  # weights up to this many elements move and are predicted with multi-tensor launches
# a weight's product with its gradient is written straight into the prediction's buffer from this many elements
# (a launch of its own; below it the copy of its product costs the device less than the launch costs the host)
PREDICT_IN_PLACE = 1 << 22
# a group's halves may pass on a deviation spread over the group (`LossFD._spread_band`) only where a weight alone
# may deviate by at least this (bf16 and coarser: 16 units of round-off). In fp32 a group's small deviation is
# the trace of one weight off: bisected on, it grows to that weight (the CPU population's fp32 ViT, LSTM and
# Perceiver biases x2 and x0.5 were named only so)
SPREAD_TOL = 2.0**-5
# compute dtypes with a unit round-off of at least this (bf16, fp16, fp8) make the loss's noise a draw of the
# forward's rounding, which the jitter pair measures once; levels below a pair may raise it (`_judge`). In fp32 the
# draw was the same for every jitter seed on the CPU population, and what levels below a pair show is a kink's
# (a ReLU near 0) departure from the pair's average slope, not noise
DRAWN_NOISE_UNIT = 2.0**-12
WRITTEN_NOTE = (
    "the forward writes this parameter in place (an Embedding's max_norm renormalises the rows it looks up): the "
    "loss is not a function of the weight its gradient is for, so the finite differences cannot judge it (the "
    "accumulation checks still ran); preflight leaves it as the forward wrote it, as a training step would"
)
UNRELIABLE_SPLITS = 2  # a group with no reliable estimate is split this many times before "inconclusive"


def unused_bound(probe: Probe) -> str:
    """What `unused` rests on: the loss unchanged bit for bit at every step, up to the largest move (a loss that
    moved within its noise is `inconclusive` instead, `measure._judge_zero`), with the loss's noise, which an
    effect can stay below and still round to nothing in the loss."""
    top = max(s for s, _, _ in probe.levels)
    return (
        f"unused: the loss did not change, bit for bit, with these weights moved by up to {top:g} of their norm "
        f"(its noise {probe.noise or 0.0:.3g}); an effect that rounds to nothing in the loss is not seen"
    )


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
        # a half of a group split although it deviated by no more than a parameter alone may (`_finish`): that
        # group's log-ratio (`LossFD._spread_band`)
        self.spread: float | None = None
        # judged again once nothing else is measured: its sibling's estimate never came (`_spread_band`)
        self.waited = False
        self.refuting = False  # a step that could only refute its blame was requested (`measure.refuting`)

    @property
    def zero(self) -> bool:
        return self.probe.zero_gradient

    def triples(self) -> list[tuple[float, float, float]]:
        """(step, C, P) of every level measured or inferred so far."""
        return [(s, c, p) for s, (c, p) in self.levels.items()]


class _Moving:
    """The weights one probe moves, worked out once for all its evaluations in a round (two signs, often two
    steps): the tensors to move, one copy of where they start (every evaluation moves from it, so every
    evaluation starts from the same weights bit for bit), which small weights move and are predicted together
    with multi-tensor launches, and each weight's gradient viewed in its shape. Rebuilt per evaluation, this was a
    copy of every moved weight (a GB on a 541M bf16 GPT, whose probe moves them all) and a few hundred launches
    and views each time.

    A large weight's move is written from the copy (`torch.add(start, move, out=weight)`: the same rounding as
    restoring it and adding in place), so the weights stay moved between evaluations and are restored once, by
    `restore()`, when the probe is done: a restore per evaluation read and wrote every moved weight again."""

    def __init__(self, check: Check, indexes: Sequence[int], grads: Sequence[torch.Tensor | None]) -> None:
        self.check = check
        adapter = check.adapter
        self.indexes = list(indexes)
        self.targets = [adapter.target(check.entries[i]) for i in self.indexes]
        with torch.no_grad():
            self.saved = copies(self.targets)
        # per weight: its gradient in its shape where the shapes agree (moved along it in place), else None
        self.grads: list[torch.Tensor | None] = []
        # small weights moved along the gradient together, per (device, dtype, gradient dtype): the weights, their
        # gradients, ones to multiply by (`_foreach_addcmul_` takes one factor per tensor) and (j, i) per weight
        self.small_along: list[
            tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[tuple[int, int]]]
        ]
        self.small_along = []
        batched: dict[tuple[torch.device, torch.dtype, torch.dtype], list[tuple[int, int]]] = {}
        # <G, move> per weight: in its own dtype (`LossFD._predictions`, by device and dtypes), or widened to the
        # dtype the forward computes in where that differs
        same: dict[
            tuple[torch.device, torch.dtype, torch.dtype],
            list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        ]
        same = {}
        self.widened: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype]] = []
        for j, (i, t, old) in enumerate(zip(self.indexes, self.targets, self.saved, strict=True)):
            g = grads[i]
            self.grads.append(g.view(t.shape) if g is not None and g.numel() == t.numel() else None)
            if g is None:
                continue
            cdt = adapter.compute_dtype(check.entries[i])
            if g.numel() == t.numel() <= SMALL_MOVE and cdt == t.dtype:
                batched.setdefault((t.device, t.dtype, g.dtype), []).append((j, i))
            if cdt == t.dtype:
                same.setdefault((t.device, t.dtype, g.dtype), []).append((t, old, g.view(t.shape)))
            else:
                self.widened.append((t, old, g, cdt))
        for members in batched.values():
            ts = [self.targets[j] for j, _ in members]
            gs = [cast(torch.Tensor, self.grads[j]) for j, _ in members]
            ones = torch.ones(sum(t.numel() for t in ts), device=ts[0].device, dtype=gs[0].dtype)
            self.small_along.append((ts, gs, shaped(ones, ts), members))
        self.small_along_set = frozenset(j for _, _, _, members in self.small_along for j, _ in members)
        self.same = [(dtype, items) for (_, dtype, _), items in same.items()]
        # the noise's small weights, in pieces whose draws' scratch is bounded
        small = [j for j, t in enumerate(self.targets) if t.numel() <= SMALL_MOVE]
        self.small_set = frozenset(small)
        self.small_pieces = chunks(small, [self.targets[j].numel() for j in small], FD_CHUNK)
        self.draws: list[torch.Tensor] = []  # the noise's draws for them, where they fit in one piece
        # moved in place from their restored start: the small weights (multi-tensor launches) and tensor
        # subclasses (a quantized weight's in-place add is its own; `out=` is not defined for it)
        self.in_place = sorted(
            self.small_set | {j for j, t in enumerate(self.targets) if type(t) is not torch.Tensor}
        )
        self.in_place_set = frozenset(self.in_place)
        self.moved = False  # whether the weights hold an evaluation's move (`restore`)

    def restore(self) -> None:
        """The weights back to the copy, bit for bit (installed by the check's next commit)."""
        if self.moved:
            with torch.no_grad():
                foreach_copy_(self.targets, self.saved)
            self.moved = False
            self.check.synced, self.check.uninstalled = False, True

    def restore_in_place(self) -> None:
        """The weights moved in place back to the copy before they move again (the others are written from it)."""
        if self.moved and self.in_place:
            foreach_copy_([self.targets[j] for j in self.in_place], [self.saved[j] for j in self.in_place])


class LossFD:
    """The loss-level finite differences of one preflight call: its probes, the measured noise and what each
    weight's probe could hide."""

    def __init__(self, check: Check) -> None:
        self.check = check
        self.index = {e.name: i for i, e in enumerate(check.entries)}  # a probe names its parameters
        self.evaluations = 0
        self.rounds = 0
        self.probes: list[Probe] = []
        # halves waiting for their sibling's estimate (`_spread_band`), with their own
        self.deferred: list[tuple[_Node, Estimate]] = []
        self.noise = 0.0
        # the jitter pair's draw of it: the zero-gradient probes and the visibility check keep it where levels
        # below a pair raised `noise` (`_judge`), as before that raise existed
        self.drawn = 0.0
        self.noise_raises = 0  # raises of `noise` by what levels below a pair showed (`_judge`)
        self.invisible = False  # no probe's perturbation ever moved the loss (set by probe_first())
        self.loss_level = 0.0
        self.zero_noise = 0.0
        self.residuals: list[float] = []  # |C - r P| at the accepted steps of reliable estimates
        self.fd_group_count = 0  # groups probed (the combined probe counts its groups)
        self.later: list[int] = []  # parameters with no gradient on the first micro-batch (probe_rest)
        self.fd_batches = [0]  # the micro-batches whose summed loss the finite differences evaluate
        self.noise_measured = False
        self.step_mult: list[float] = []  # per parameter, its step multiplier (`Moves.mult`) in the last pass
        # per parameter: its predicted change per candidate step; 1 + the relative error its probe could hide
        self.weight_gains: dict[int, list[float]] = {}
        self.resolution: dict[int, float] = {}
        self.sizes: list[float] = []  # per entry: |weights| (floored), from the first run's norms (`measure`)
        self.gnorms: list[float] = []  # per entry: |G(first)|
        self.now: list[int] = []  # parameters with a gradient on the first micro-batch
        self.first_moves: Moves | None = None
        # copies of G(first) for a probe on the first micro-batch's loss that runs after the next single
        self.held: dict[int, torch.Tensor] = {}
        # probes (indexes into `probes`) along the sum of the singles, on every micro-batch's loss: their blames
        # wait for the accumulation verdicts (`apply_summed`)
        self.summed: set[int] = set()
        self.summed_blames: list[tuple[int, str, float | None]] = []
        self.unreliable_splits = UNRELIABLE_SPLITS
        self.anchored: list[int] = []  # the anchors a probe on the first micro-batch's loss moved
        self.first_params = 0  # weights the probe on the first micro-batch's loss moved, and their elements
        self.first_elements = 0

    def evaluate(
        self, moving: _Moving, delta: Callable[[int, torch.Tensor], torch.Tensor], sign: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Loss of the first micro-batch with each weight i of `moving` moved from its start by sign x delta(i,
        start), and <G, the move as the forward computes with it (rounded to the compute dtype)>. The weights stay
        moved: the caller restores them with `moving.restore()` (here only where the evaluation fails)."""
        targets, saved = moving.targets, moving.saved
        parts: list[torch.Tensor] = []
        try:
            self.check.synced, self.check.uninstalled = False, True  # the weights move from here on
            with torch.no_grad():
                moving.restore_in_place()  # (the others are written from their start below)
                moving.moved = True
                done: frozenset[int] = frozenset()
                if isinstance(delta, Along):
                    for ts, gs, units, members in moving.small_along:
                        factors = [sign * delta.factor(i, targets[j]) for j, i in members]
                        # t + factor x g x 1: t.add_(g, alpha=factor)'s move up to the last bit (that one fuses
                        # the multiply-add); the predictions read the move as made
                        FOREACH_OPS._foreach_addcmul_(ts, gs, units, factors)
                    done = moving.small_along_set
                if isinstance(delta, Jitter):  # the noise's moves of the small weights, batched likewise
                    for piece in moving.small_pieces:  # the draws' scratch bounded
                        # (the same at + and -: kept for the other sign where they fit in one piece)
                        draws = moving.draws or delta.many(
                            [moving.indexes[j] for j in piece], [saved[j] for j in piece]
                        )
                        FOREACH_OPS._foreach_add_([targets[j] for j in piece], draws, alpha=sign)
                        if len(moving.small_pieces) == 1:
                            moving.draws = draws
                        del draws
                    done = moving.small_set
                for j, (i, t, old, g) in enumerate(
                    zip(moving.indexes, targets, saved, moving.grads, strict=True)
                ):
                    if j in done:  # (the small ones moved above)
                        continue
                    if isinstance(delta, Along) and g is not None:
                        step, alpha = g, sign * delta.factor(i, t)
                    else:
                        step, alpha = delta(i, old), sign
                    if j in moving.in_place_set:  # from the restored start
                        t.add_(step, alpha=alpha)
                    else:
                        torch.add(old, step, alpha=alpha, out=t)
                    del step
                for t, old, flat_g, cdt in moving.widened:
                    moved = (t.to(cdt).float() - old.to(cdt).float()).reshape(-1)
                    parts.append(torch.sum(moved * flat_g, dtype=torch.float32))
                    del moved
                for dtype, items in moving.same:
                    parts += self._predictions(items, dtype)
            self.check.commit()
            loss = self.check.loss(self.check.batches[self.fd_batches[0]])
            for b in self.fd_batches[1:]:
                loss = loss + self.check.loss(self.check.batches[b])
            self.evaluations += 1
        except BaseException:
            moving.restore()
            raise
        device = loss.device
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for part in parts:
            by_kind.setdefault((part.device, part.dtype), []).append(part)
        pred = torch.zeros((), device=device, dtype=torch.float64)
        for kind in by_kind.values():  # one stack per kind, summed in fp64 (not one cast per weight)
            pred = pred + torch.stack(kind).to(device=device, dtype=torch.float64).sum()
        return loss, pred

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
            moved = FOREACH_OPS._foreach_sub([items[k][0] for k in group], [items[k][1] for k in group])
            grads = [items[k][2] for k in group]
            big = [k for k, m in enumerate(moved) if m.numel() >= PREDICT_IN_PLACE]
            if len(group) == 1 or not big:
                products = FOREACH_OPS._foreach_mul(moved, grads)
                flat = (
                    products[0].reshape(-1)
                    if len(products) == 1
                    else torch.cat([p.reshape(-1) for p in products])
                )
                del products
            else:
                # the products written into one buffer (a big weight's in place, the others' with one
                # multi-tensor launch and copied): the sum of their concatenation, without concatenating
                flat = torch.empty(
                    sum(m.numel() for m in moved),
                    dtype=torch.result_type(moved[0], grads[0]),
                    device=moved[0].device,
                )
                views = shaped(flat, moved)
                for k in big:
                    torch.mul(moved[k], grads[k], out=views[k])
                rest = [k for k in range(len(moved)) if k not in big]
                if rest:
                    foreach_copy_(
                        [views[k] for k in rest],
                        FOREACH_OPS._foreach_mul([moved[k] for k in rest], [grads[k] for k in rest]),
                    )
            del moved
            out.append(flat.sum(dtype=acc))
        return out

    def measure(self) -> None:
        """After the first run: the norms of its gradient (the copy) and of the weights, one host transfer;
        they size every move of the module-local screening and of the probe on the first micro-batch's loss.
        Parameters whose gradient is zero on that micro-batch wait for `probe_rest`."""
        moves = self.first_moves = Moves(self.check)
        self.gnorms = list(moves.gnorm)
        self.sizes = [moves.size(i, e.raw_param) for i, e in enumerate(self.check.entries)]
        usable = [  # else no direction, or a weight the forward writes (`Check.written`)
            i
            for i in range(len(self.check.entries))
            if math.isfinite(moves.gnorm[i]) and i not in self.check.written
        ]
        self.later = [i for i in usable if not moves.gnorm[i] > 0.0]
        self.now = [i for i in usable if moves.gnorm[i] > 0.0]

    def keep(self, indexes: list[int]) -> None:
        """Copies of the first micro-batch's gradient (the copy, before the next single is added into it) of the
        weights the probe on the first micro-batch's loss will move after that single (`probe_first`)."""
        copy = self.check.copy
        held = [i for i in indexes if copy[i] is not None]
        self.held = dict(zip(held, copies(some(copy, held)), strict=True))

    def probe_first(self, indexes: list[int] | None = None, anchors: Sequence[int] = ()) -> None:
        """The probes on the first micro-batch's loss, along its gradient: one combined probe of every group
        (each group moved at its own step, scaled to a comparable share of the predicted change), split into
        the groups and then bisected where an estimate deviates; one host transfer per round. `indexes`: only
        these weights, along the copies `keep` made (run after the module-local screening: the weights it
        judged are not moved, `Check.loss_level`); default every weight with a gradient there, along the copy
        (run right after the first micro-batch).

        Weights of `indexes` with no verdict of their own module that end `inconclusive` (small weights alone
        in a bf16 loss: no two steps agree) are probed again together with `anchors` (weights their module
        judged `ok`, with copies kept too): a probe whose change the anchors carry checks itself, and bounds
        each weight by its share, as the probe of every weight does where it runs first."""
        if self.first_moves is None:
            self.measure()
        moves = cast(Moves, self.first_moves)
        now = self.now
        if indexes is not None:
            moves.restrict([*indexes, *anchors], self.held)
            now = [i for i in indexes if i in moves.nonzero_set]
        self.step_mult = moves.mult
        self.first_params = len(now)
        self.first_elements = sum(self.check.results[i].numel for i in now)
        try:
            # (a group with no reliable estimate is not halved here where anchors can take its weights)
            self.unreliable_splits = 0 if anchors else UNRELIABLE_SPLITS
            roots = self._probe(moves, now, [], "")
            self.unreliable_splits = UNRELIABLE_SPLITS
            local = self.check.local_fd.verdicts
            verdicts = self.final_verdicts()
            open_ = [i for i in now if verdicts.get(i) == "inconclusive" and i not in local]
            anchored = [i for i in anchors if i in moves.nonzero_set]
            if open_ and anchored:
                self.anchored = anchored
                moves.mult = self.step_mult = [1.0] * len(moves.mult)
                self.first_params += len(anchored)
                self.first_elements += sum(self.check.results[i].numel for i in anchored)
                roots += self._probe(moves, [*open_, *anchored], [], " (anchored)")
        finally:
            self.held = {}
            self.unreliable_splits = UNRELIABLE_SPLITS
        self._check_visible(roots)

    def final_verdicts(self) -> dict[int, str]:
        """Per parameter, the verdict of the last finished probe that holds it (as `apply` lays them)."""
        out: dict[int, str] = {}
        for probe in self.probes:
            if probe.verdict not in ("split", "not judged"):
                for name in probe.names:
                    out[self.index[name]] = probe.verdict
        return out

    def blamed(self) -> set[int]:
        """The parameters a finished probe blames (lost, scaled, wrong)."""
        return {
            self.index[name]
            for probe in self.probes
            if probe.verdict in ("lost", "scaled", "wrong")
            for name in probe.names
        }

    def probe_rest(self) -> None:
        """After the singles, the parameters with no gradient on the first micro-batch, on the loss summed over
        every micro-batch: along the sum of the singles where that is not zero (an expert that got tokens
        only in a later micro-batch), along a random direction where it is (`lost` when that loss moves,
        `unused` only when it does not: an expert idle in one micro-batch is not unused)."""
        if not self.later:
            return
        n = len(self.check.batches)
        self.fd_batches = list(range(n))
        # a sum of n losses: its noise is measured again (below) where the weights allow; its round-off and
        # the residuals of the first micro-batch's estimates scale with n
        self.noise *= n
        self.drawn *= n
        self.loss_level *= n
        self.residuals = [r * n for r in self.residuals]
        self.noise_measured = False
        moves = Moves(self.check)
        self.step_mult = moves.mult
        usable = [i for i in self.later if math.isfinite(moves.gnorm[i])]
        nonzero = [i for i in usable if moves.gnorm[i] > 0.0]
        zero = [i for i in usable if not moves.gnorm[i] > 0.0]
        zero = self.check.local_fd.defer(zero)  # the sequence's module reruns judge these first
        start = len(self.probes)
        self._probe(moves, nonzero, zero, " (all micro-batches)" if n > 1 else "")
        self.summed.update(range(start, len(self.probes)))

    def probe_left(self) -> None:
        """Zero-gradient weights the module reruns left without a verdict: on the loss, along random directions."""
        left = self.check.local_fd.left()
        if not left:
            return
        moves = Moves(self.check)
        self.step_mult = moves.mult
        n = len(self.check.batches)
        start = len(self.probes)
        self._probe(moves, [], left, " (all micro-batches)" if n > 1 else "")
        self.summed.update(range(start, len(self.probes)))

    def _probe(self, moves: Moves, nonzero: list[int], zero: list[int], suffix: str) -> list[_Node]:
        """Probe `nonzero` along the gradient copy and `zero` along random directions until every probe has
        a verdict; the root probes."""
        groups: dict[tuple[str, bool], list[int]] = {}
        for i in nonzero:
            groups.setdefault((self.check.results[i].group, False), []).append(i)
        for i in zero:
            groups.setdefault((self.check.results[i].group, True), []).append(i)
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
            # halves waiting for their sibling's estimate (`_spread_band`): judged again after each round, and
            # without it once nothing else is to be measured
            again, self.deferred = self.deferred, []
            for node, est in again:
                node.waited = not requests
                requests += self._finish(node, est)
            if waiting and not any(not node.zero for node, _ in requests):
                self.zero_noise = self._zero_noise()
                for node in waiting:
                    requests += self._judge(node, self.zero_noise)
                waiting = []
        return roots

    def _first_steps(self, parts: list[tuple[str, list[int]]], moves: Moves) -> float:
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
        if self.check.fd_step is not None:
            return self.check.fd_step
        gains, per_weight = moves.rounded_gains(
            [[i for i in idx if i in moves.nonzero_set] for _, idx in parts]
        )
        self.weight_gains.update(per_weight)
        self.check.syncs += 1
        threshold = max(self.noise, self._floor()) * NOISE_SHARE / E_MAX
        chosen: list[int] = []  # per group, an index into CANDIDATE_STEPS (larger step: smaller index)
        for (_, indexes), gain in zip(parts, gains, strict=True):
            # the change grows with the step: the steps above the threshold are the larger ones
            ok = [k for k, g in enumerate(gain) if abs(g) >= threshold]
            k = max(ok[-1] - 1, 0) if ok else 0
            wide = all(
                unit_roundoff(self.check.adapter.compute_dtype(self.check.entries[i])) <= 2.0**-20
                for i in indexes
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

    def _round(self, moves: Moves, requests: list[tuple[_Node, float]], first: bool) -> list[_Node]:
        """Evaluate every requested (probe, step) at +- the step (and, in the first round, the noise), install
        the restored weights once, bring the numbers to the host in one transfer; the probes touched."""
        pending: list[tuple[_Node, float, torch.Tensor, torch.Tensor]] = []
        noise_parts: list[torch.Tensor] = []
        if first and moves.nonzero:
            moving = _Moving(self.check, moves.nonzero, moves.directions)
            try:
                plus, pp = self.evaluate(moving, moves.jitter, 1.0)
                minus, pm = self.evaluate(moving, moves.jitter, -1.0)
            finally:
                moving.restore()
            del moving
            noise_parts = [(plus - minus) / 2, (plus + minus) / 2, (pp - pm) / 2]
        held: tuple[_Node, _Moving] | None = None  # a probe's weights, while its requests follow each other
        try:
            for node, step in requests:
                if step in node.inferred:
                    continue
                if held is None or held[0] is not node:
                    if held is not None:
                        held[1].restore()
                    held = None  # (its copy released before the next one is made)
                    held = (node, _Moving(self.check, node.indexes, moves.directions))
                maker = moves.random(step) if node.zero else moves.along(step)
                lp, pp = self.evaluate(held[1], maker, 1.0)
                lm, pm = self.evaluate(held[1], maker, -1.0)
                pending.append((node, step, (lp.double() - lm.double()) / 2, (pp - pm) / 2))
        finally:
            if held is not None:
                held[1].restore()
        held = None
        self.check.commit()  # the restored weights, installed once per round
        self.rounds += 1
        cs, ps = self._to_host(
            [c for _, _, c, _ in pending] + noise_parts[:2], [p for _, _, _, p in pending] + noise_parts[2:]
        )
        if first and noise_parts:
            self.noise_measured = True
            c_j, l_mean, p_j = cs[len(pending)], cs[len(pending) + 1], ps[len(pending)]
            self.loss_level = l_mean
            self.noise = self.drawn = max(2 * abs(c_j - p_j), self._floor())
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
        levels = node.triples()
        est = judge_levels(levels, noise, node.zero, self._floor())
        for _ in levels:  # (each pass raises the noise: a pass per level at most)
            shown = noise_shown(levels, est) if not node.zero and node.probe.unit >= DRAWN_NOISE_UNIT else 0.0
            if not shown > noise:
                break
            # the levels below its pair show more noise than was measured: the measure was a low draw, and this
            # estimate's error bar (and every later one's) rests on the noise these levels show
            noise = self.noise = shown
            self.noise_raises += 1
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
        return max(8 * unit_roundoff(torch.float32), 2 * self.check.loss_unit) * abs(self.loss_level)

    def _zero_noise(self) -> float:
        """The noise zero-gradient probes are judged against: the jitter's, or what the reliable estimates
        show (the largest residual of their accepted steps) where that is smaller; never below the loss's
        own fp32 round-off."""
        floor = self._floor()
        if self.residuals:
            return max(min(self.drawn, 2 * max(self.residuals)), floor)
        return max(self.drawn, floor)

    def _node(self, key: str, indexes: list[int], zero: bool, depth: int) -> _Node:
        probe = Probe(
            key=key, names=[self.check.entries[i].name for i in indexes], zero_gradient=zero, depth=depth
        )
        probe.unit = max(
            unit_roundoff(self.check.adapter.compute_dtype(self.check.entries[i])) for i in indexes
        )
        probe.method = "central, random direction" if zero else "central, two steps"
        self.probes.append(probe)
        return _Node(probe, indexes, max(self.check.fd_tolerance(i) for i in indexes))

    def _to_host(self, cs: list[torch.Tensor], ps: list[torch.Tensor]) -> tuple[list[float], list[float]]:
        """Loss changes (already averaged over ranks) and predictions (summed over shards): one transfer."""
        self.check.syncs += 1
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
        p = self.check.dist.sum_stats(p)
        values = torch.cat([c, p]).cpu().tolist()
        return values[: len(cs)], values[len(cs) :]

    def _finish(self, node: _Node, est: Estimate, confirmed: bool = False) -> list[tuple[_Node, float]]:
        """The probe's verdict from its estimate, or its split into two halves (returned: their requests).
        A parameter alone is blamed only on the estimate nearest the point (`finest`), once no smaller step
        can be measured (`finer`); `confirmed`: that estimate."""
        probe = node.probe
        probe.error = est.error
        probe.step = est.step
        mults = {self.step_mult[i] for i in node.indexes} if self.step_mult and not node.zero else set()
        if est.step is not None and len(mults) == 1:
            probe.step = est.step * mults.pop()  # the step the group's own weights moved by
        multi = len(node.indexes) > 1
        if node.zero:
            return self._finish_zero(node, est)
        if est.ratio is None:
            probe.reason = est.reason
            return self._unsure(node)
        r, err = est.ratio, cast(float, est.error)
        probe.scale = 1 / r if r != 0 else math.inf
        ltol = math.log1p(node.tol)
        if not (r > 0 and math.isfinite(r)):
            if (est.reliable or est.off) and (multi or self._may_blame(node, est)):
                probe.reason = f"true / reported {r:.3g}: the reported gradient points the wrong way"
                return self._split(node, est) if multi else self._set(node, "wrong")
            probe.reason = probe.reason if est.reliable else est.reason  # (reliable: why it was contradicted)
            if multi and not node.bounded and (len(node.parts) > 1 or node.halvings < self.unreliable_splits):
                return self._split(node, est)
            return self._unsure(node)
        dev = abs(math.log(r))
        if est.reliable:
            # exact blame: a group deviating by more than one error bar is bisected; a parameter alone is judged
            # at three error bars plus the dtype's tolerance
            if multi:
                # a deviation within a quarter of the dtype's tolerance is the backward's own rounding (a
                # correct bf16 GPT deviates by up to 1%), not a parameter hidden by the group; nor, in a half
                # of a group, a deviation spread over the group's weights (`_spread_band`)
                spread = self._spread_band(node, err)
                if spread is None and dev <= ltol + 3 * err:  # its sibling's estimate is not in yet
                    self.deferred.append((node, est))
                    return []
                band = max(err, ltol / 4, spread or 0.0)
                if dev <= band + 1e-9:
                    self._resolve(node, cast(float, est.step), band + err)
                    return self._set(node, "ok")
                if dev <= ltol + 3 * err:  # what a parameter alone would pass: its weights are bounded by it
                    self._resolve(node, cast(float, est.step), ltol + 4 * err)
                    return self._split(node, est, bounded=True)
                return self._split(node, est)
            if dev <= ltol + 3 * err:
                self.resolution[node.indexes[0]] = judge.hidden_factor(ltol + 4 * err, 1.0)
                return self._set(node, "ok")
        elif not est.off:  # never a verdict from an estimate that did not check itself
            probe.reason = est.reason
            # smaller parts may be linear at a larger step (not needed where a group above bounds them)
            if multi and not node.bounded and (len(node.parts) > 1 or node.halvings < self.unreliable_splits):
                return self._split(node, est)
            return self._unsure(node)
        if multi:
            return self._split(node, est)
        if est.reliable and not confirmed:  # a blame: confirmed at the smallest steps the noise allows
            return self._confirm(node, est)
        if not self._may_blame(node, est):
            return self._unsure(node)
        scale = 1 / r
        return self._set(node, "scaled" if 0 < scale <= 64 else "wrong")

    def _finish_zero(self, node: _Node, est: Estimate) -> list[tuple[_Node, float]]:
        """A zero-gradient probe's verdict: `lost` where the loss moves (a group: bisected to the weights
        responsible), `unused` where it stayed bit for bit, else `inconclusive` (a group whose loss moved within
        its noise: bisected first, so that the weights the forward never reads are still `unused`)."""
        multi = len(node.indexes) > 1
        node.probe.scale = 0.0 if est.moves else None
        if est.moves:
            return self._split(node, est) if multi else self._set(node, "lost")
        if est.moves is False:
            return self._set(node, "unused")
        node.probe.reason = est.reason
        if multi and est.pair is not None:
            return self._split(node, est)
        return self._set(node, "inconclusive")

    def _confirm(self, node: _Node, est: Estimate) -> list[tuple[_Node, float]]:
        """A parameter's blame: the next smaller step the noise allows (`finer`), else once a step where only
        the blame's own predicted change stands above the noise (`refuting`); then the verdict on the estimate
        nearest the point (`finest`)."""
        levels = node.triples()
        noise = node.probe.noise or 0.0
        smaller = finer(levels, noise, self._floor())
        if smaller is None and not node.refuting:
            smaller = refuting(levels, est, noise, self._floor())
            node.refuting = smaller is not None
        if smaller is not None:
            return [(node, smaller)]
        fine = finest(levels, noise, self._floor())
        return self._finish(node, fine if fine is not None else est, confirmed=True)

    def _may_blame(self, node: _Node, est: Estimate) -> bool:
        """Whether the estimate may blame the probe's one parameter: no smaller step contradicts it
        (`_contradicted`), and, where the module-local check judged the parameter `ok` (on its module's
        output, to a few units of round-off), it checks itself (two steps agreeing), not only consistently
        off (a bf16 loss at the steps a small weight needs). Else the reason goes to the probe."""
        if self._contradicted(node, est):
            return False
        v = self.check.local_fd.verdicts.get(node.indexes[0])
        if est.reliable or v is None or v.verdict != "ok":
            return True
        ratio = f"{est.ratio:.3g}" if est.ratio is not None else "?"
        why = f" ({est.reason})" if est.reason else ""
        node.probe.reason = (
            f"true / reported {ratio} without two steps agreeing{why}; its own module judged it ok"
        )
        return False

    def _contradicted(self, node: _Node, est: Estimate) -> bool:
        """Whether a smaller step contradicts the estimate a parameter would be blamed on (`contradicted`);
        the reason goes to the probe."""
        levels = node.triples()
        why = contradicted(levels, est, node.probe.noise or 0.0, self._floor())
        if why is not None:
            node.probe.reason = why
        return why is not None

    def _resolve(self, node: _Node, step: float, band: float) -> None:
        """For each parameter of a passing probe of several: the factors on its gradient the probe could have
        passed (`judge.hidden_factor`: `band` bounds the probe's true log-ratio, the weight's share s of its
        predicted change is estimated on the subsets at the accepted step). None where the share is unknown.
        A weight carrying 1% of a probe whose band is 2% could be off x3 unseen: the verdict says so instead
        of a plain ok."""
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
                self.resolution[i] = judge.hidden_factor(band, share)

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

    def _spread_band(self, node: _Node, err: float) -> float | None:
        """For a half of a group split within a parameter's tolerance (`_Node.spread`): the deviation it may
        show and pass, where the group's deviation is spread over its weights rather than made by one of
        them. One weight off concentrates the deviation in its half: that half deviates by about the group's
        over its share of the group's change, the other half less than the group. So a half passes at the
        group's |log r| + 2 of its own error bars where its sibling's estimate checks itself and agrees with
        the group's (within 2 of the sibling's error bars); else 0 (bisected on, as before). On the H200 the
        small bf16 weights of a correct GPT (biases, norms) deviated together by 2-10% in the probe that runs
        after the module-local screening, and bisecting that to single weights cost 70 loss evaluations for
        the same ok. None: the sibling's estimate still waits for a step (the node is judged again after the
        next round, `_probe`)."""
        sibling = node.sibling
        if node.spread is None or sibling is None or not sibling.levels or sibling.zero:
            return 0.0
        est = judge_levels(sibling.triples(), self.noise, False, self._floor())
        r = est.ratio
        if est.next_step is not None and not node.waited:
            return None
        if est.next_step is not None or not est.reliable or r is None or est.error is None:
            return 0.0
        if not (r > 0 and math.isfinite(r)) or abs(math.log(r) - node.spread) > 2 * est.error:
            return 0.0
        return abs(node.spread) + 2 * err

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
        if (
            bounded
            and node.tol >= SPREAD_TOL
            and est.ratio is not None
            and est.ratio > 0
            and math.isfinite(est.ratio)
        ):
            left.spread = right.spread = math.log(est.ratio)
        left.sibling, right.sibling = right, left
        steps = est.pair or (cast(float, est.step) * 2, cast(float, est.step))
        right.inferred = set(steps)
        return [(left, steps[0]), (left, steps[1]), (right, steps[0])]

    def _check_visible(self, roots: list[_Node]) -> None:
        probed = [n for n in roots if not n.zero and n.levels]
        threshold = Z_MOVE * max(self.drawn, 1e-30)
        self.invisible = bool(probed) and all(
            all(abs(c) <= threshold and abs(p) > threshold for c, p in n.levels.values()) for n in probed
        )

    def apply(self) -> None:
        """Each parameter takes the verdict of the deepest finished probe that holds it; a weight the forward
        writes is not probed, and says why."""
        kind = self.check.adapter.kind
        for i in sorted(self.check.written) if self.check.finite_differences else ():
            r = self.check.results[i]
            r.inconclusive = True
            r.notes = [WRITTEN_NOTE]
        for probe in self.probes:  # created parents first, so the deepest probe is the last to write
            if probe.verdict in ("split", "not judged"):
                continue
            for name in probe.names:
                r = self.check.results[self.index[name]]
                r.fd_probe = probe.key if len(probe.names) > 1 else name
                r.fd_scale = probe.scale
                r.fd_error = probe.error
                r.fd_step = probe.step
                r.unused = probe.verdict == "unused"
                r.fd_resolution = self.resolution.get(self.index[name]) if probe.verdict == "ok" else None
                r.inconclusive = probe.verdict == "inconclusive"
                if r.inconclusive:
                    r.notes = [f"finite differences: {probe.reason}"]
                elif r.unused and probe.levels:
                    r.notes = [unused_bound(probe)]
        self.summed_blames = []
        for k, probe in enumerate(self.probes):
            if probe.verdict in ("lost", "scaled", "wrong"):
                for name in probe.names:
                    if k in self.summed:
                        self.summed_blames.append((self.index[name], probe.verdict, probe.scale))
                    else:
                        judge.fd_verdict(
                            self.check.results[self.index[name]], probe.verdict, probe.scale, kind
                        )

    def apply_summed(self) -> None:
        """The blames of the probes along the sum of the singles, after the accumulation verdicts: where those
        already name what is wrong with the parameter (a pattern by position or backward count, a stale or
        overwritten buffer), the sum of the singles carries that error and its factor is not a finding of its
        own (as a module-local deviation, `LocalFD.apply`)."""
        kind = self.check.adapter.kind
        for i, verdict, scale in self.summed_blames:
            r = self.check.results[i]
            if not r.anomalies:
                judge.fd_verdict(r, verdict, scale, kind)
