"""The numbers preflight measures, kept on the device until one transfer: gradient copies and norms, the
subsets the decomposition is fitted on, and the self-checking finite-difference estimate (`judge_levels`,
pure arithmetic on the host).

The estimate. Along a direction d (the reported gradient of a set of parameters, each parameter moved by
`step` x the norm of its weights; or a random direction where the reported gradient is zero) the loss's
central difference C(s) = (L(w + s d) - L(w - s d)) / 2 is compared with the predicted P(s) = <G, the move the
forward computed with>. r(s) = C(s) / P(s) is the true-over-reported ratio at step s. Central differences
have no second-order term; their third-order error shrinks 4x per halving of s while rounding noise grows 2x,
so two adjacent steps that agree are in the linear region and above the noise: the estimate's error bar is
|r(s) - r(s/2)| + noise / |P(s)| + noise / |P(s/2)|, with the loss's rounding noise measured (a central
difference along a random perturbation of two units of round-off of every weight, minus its prediction).
Where two steps disagree, the step halves (while the noise stays below the bar) or doubles (where the noise
dominates); where no pair agrees the verdict is `inconclusive` with the reason, unless even the loose
estimate is off by more than three error bars.
"""

from __future__ import annotations

import math
import re
from collections.abc import Container, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from maingrad.hooks.preflight.wrappers import Entry, normalize_name

SUBSET = 4096  # elements per parameter kept for the decomposition G(seq) ~ sum c_k G(k) and the repeat
FD_CHUNK = 1 << 24  # elements moved per step of a finite-difference perturbation (64 MiB of fp32 scratch)
_DIGITS = re.compile(r"\d+")
FOREACH_OPS: Any = torch  # torch's multi-tensor `_foreach_*` ops are not in its exported names


def foreach_copy_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """dst[k].copy_(src[k]) for every k, in a few multi-tensor launches."""
    FOREACH_OPS._foreach_copy_(list(dst), list(src))


def foreach_add_(tensors: Sequence[torch.Tensor], other: Sequence[torch.Tensor]) -> None:
    FOREACH_OPS._foreach_add_(list(tensors), list(other))


def foreach_mul_(tensors: Sequence[torch.Tensor], factor: float) -> None:
    FOREACH_OPS._foreach_mul_(list(tensors), factor)


def foreach_sub_(tensors: Sequence[torch.Tensor], other: Sequence[torch.Tensor]) -> None:
    FOREACH_OPS._foreach_sub_(list(tensors), list(other))


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the distance from 1 to the next representable number."""
    if dtype.is_floating_point:
        return float(torch.finfo(dtype).eps) / 2
    return 0.0


def copy_dtype(grad_dtype: torch.dtype, tolerance: float) -> torch.dtype:
    """The dtype preflight keeps its copy of a gradient in: the narrowest of bf16 and fp32 (both with fp32's
    exponent range, so nothing a finite fp32 norm allows overflows) whose unit round-off is at most 1/8 of the
    linearity tolerance, else the gradient's own dtype. With the default tolerance (8 units of the least
    precise of the gradient's and parameter's dtypes) an fp32 main_grad of bf16 parameters is kept in bf16."""
    if not grad_dtype.is_floating_point:
        return grad_dtype
    for dtype in (torch.bfloat16, torch.float32):
        if dtype.itemsize < grad_dtype.itemsize and 8 * unit_roundoff(dtype) <= tolerance:
            return dtype
    return grad_dtype


def leaf_pattern(leaf: str) -> str:
    return _DIGITS.sub("#", leaf)


def fused_kinds(model: torch.nn.Module) -> dict[str, str]:
    """normalized parameter name -> fused-wgrad kind, from maingrad.hooks discovery (empty on any failure)."""
    try:
        from maingrad.hooks.discovery import discover

        specs = discover(model)
    except Exception:  # noqa: BLE001 - discovery is an aid for grouping, never a reason to fail
        return {}
    path_of = {id(m): normalize_name(p) for p, m in model.named_modules()}
    out: dict[str, str] = {}
    for spec in specs:
        for slot in spec.slots:
            if not slot.wgrad:
                continue
            owner = path_of.get(id(slot.owner))
            if owner is None:
                continue
            out[f"{owner}.{slot.name}" if owner else slot.name] = spec.kind
    return out


def flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1)


def norm(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t.float())


def to_device(
    values: Sequence[float], device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A small host list on `device` without waiting for the device: a plain copy of pageable memory to a GPU
    waits for every queued kernel (a stall of the launch pipeline per index or factor list); a pinned buffer
    copies asynchronously (the host allocator keeps it until the copy has run)."""
    return host_to(torch.tensor(values, dtype=dtype), device)


def host_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` (see `to_device`)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def stack_to_host(values: list[torch.Tensor]) -> list[float]:
    """One device->host transfer per device and dtype for a list of 0-dim tensors."""
    out = [0.0] * len(values)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, v in enumerate(values):
        groups.setdefault((v.device, v.dtype), []).append(i)
    for indexes in groups.values():
        host = torch.stack([values[i].reshape(()) for i in indexes]).double().cpu().tolist()
        for i, v in zip(indexes, host, strict=True):
            out[i] = float(v)
    return out


class Dist:
    """Data-parallel reductions of preflight's own numbers (identity in a single process)."""

    def __init__(self, sharded: bool) -> None:
        self.world = 1
        self.sharded = sharded
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self.world = torch.distributed.get_world_size()

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        loss = loss.detach().float().reshape(())
        if self.world > 1:
            loss = loss.clone()
            torch.distributed.all_reduce(loss)
            loss = loss / self.world
        return loss

    def sum_stats(self, values: torch.Tensor) -> torch.Tensor:
        """Squared norms and inner products over shards add up; replicated gradients are already whole."""
        if self.world > 1 and self.sharded:
            values = values.clone()
            torch.distributed.all_reduce(values)
        return values


class Stats:
    """Device-side numbers per key and parameter, sent to the host in one transfer per device: the one
    comparison at the end needs no per-parameter round trip."""

    def __init__(self, n: int, dist: Dist) -> None:
        self.n = n
        self.dist = dist
        self.chunks: list[tuple[str, list[int], torch.Tensor, bool]] = []

    def add(self, key: str, indices: Sequence[int], values: torch.Tensor, *, shard_sum: bool = True) -> None:
        """values[j] belongs to parameter indices[j]; shard_sum: add it up across data-parallel shards."""
        if len(indices):
            self.chunks.append((key, list(indices), values.detach().reshape(-1).float(), shard_sum))

    def host(self, keys: Sequence[str] | None = None) -> dict[str, list[float | None]]:
        """The numbers under `keys` (default: all), in one transfer per device; they leave the device side."""
        out: dict[str, list[float | None]] = {}
        by_device: dict[torch.device, list[tuple[str, list[int], torch.Tensor, bool]]] = {}
        taken = [c for c in self.chunks if keys is None or c[0] in keys]
        self.chunks = [c for c in self.chunks if not (keys is None or c[0] in keys)]
        for chunk in taken:
            out.setdefault(chunk[0], [None] * self.n)
            by_device.setdefault(chunk[2].device, []).append(chunk)
        for chunks in by_device.values():
            summed = torch.cat([c[2] for c in chunks if c[3]] or [torch.zeros(0, device=chunks[0][2].device)])
            summed = self.dist.sum_stats(summed)
            whole = torch.cat([c[2] for c in chunks if not c[3]] or [torch.zeros(0, device=summed.device)])
            values = torch.cat([summed, whole]).double().cpu().tolist()
            pos = 0
            for key, indices, _, _ in [c for c in chunks if c[3]] + [c for c in chunks if not c[3]]:
                column = out[key]
                for i in indices:
                    column[i] = values[pos]
                    pos += 1
        return out


class Subsets:
    """Up to SUBSET evenly spaced elements of each parameter's gradient, as the rows of one matrix per device
    and run: the decomposition G(A,B) ~ a G(A) + b G(B) and the repeat of A become a few batched reductions."""

    def __init__(self, entries: list[Entry]) -> None:
        self.rows: dict[torch.device, list[int]] = {}
        for i, e in enumerate(entries):
            self.rows.setdefault(e.opt_param.device, []).append(i)
        self.row_of = {i: r for rows in self.rows.values() for r, i in enumerate(rows)}
        self.names = [e.name for e in entries]
        self.mats: dict[str, dict[torch.device, torch.Tensor]] = {}
        self._picks: dict[tuple[int, int], tuple[int, int, int]] = {}
        self._index: dict[tuple[torch.device, tuple[tuple[int, int], ...]], torch.Tensor] = {}

    def pick(self, i: int, n: int) -> tuple[int, int, int]:
        """(offset, stride, count) of parameter i's subset of its n gradient elements."""
        key = (i, n)
        if key not in self._picks:
            stride = max(1, n // SUBSET)
            offset = (sum(self.names[i].encode()) % stride) if stride > 1 else 0
            self._picks[key] = (offset, stride, min(SUBSET, max(0, n - offset + stride - 1) // stride))
        return self._picks[key]

    def take(self, key: str, flats: list[torch.Tensor | None]) -> None:
        """Every subset of this run into its row: one strided view per parameter, then one concatenation and
        one indexed copy per device (the positions cached per set of present parameters)."""
        mats = self.mats[key] = {}
        for device, rows in self.rows.items():
            mat = mats[device] = torch.zeros(len(rows), SUBSET, device=device)
            picks: list[torch.Tensor] = []
            spans: list[tuple[int, int]] = []
            for i in rows:
                f = flats[i]
                if f is None:
                    continue
                offset, stride, count = self.pick(i, f.numel())
                picks.append(f[offset : offset + stride * count : stride])
                spans.append((self.row_of[i], count))
            if picks:
                values = torch.cat(picks).to(mat.dtype)
                mat.view(-1).index_copy_(0, self.positions(device, tuple(spans)), values)

    def positions(self, device: torch.device, spans: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """Flat positions in a run's matrix of the (row, count) spans, in order: element j of the concatenation,
        in span k, goes to row_k x SUBSET + (j - first_k). Formed on the device from one small transfer (2 values
        per span; repeat_interleave with its output size known does not wait for the device), not on the host
        (a host index of every subset element, pinned and copied, cost milliseconds per call on the H200)."""
        index = self._index.get((device, spans))
        if index is None:
            counts = [count for _, count in spans]
            total, offsets, first = sum(counts), [], 0
            for (row, _), count in zip(spans, counts, strict=True):
                offsets.append(row * SUBSET - first)
                first += count
            small = to_device(offsets + counts, device, torch.long)
            index = torch.repeat_interleave(small[: len(spans)], small[len(spans) :], output_size=total)
            index += torch.arange(total, device=device)
            self._index[(device, spans)] = index
        return index

    def _stacked(
        self, keys: Sequence[str], wanted: Container[int] | None
    ) -> Iterator[tuple[list[int], torch.Tensor]]:
        """Per device, the parameters (those in `wanted`, default all) and their rows of every key:
        [P, K, SUBSET]."""
        for device, rows in self.rows.items():
            select = rows if wanted is None else [i for i in rows if i in wanted]
            if select:
                index = to_device([self.row_of[i] for i in select], device, torch.long)
                yield select, torch.stack([self.mats[k][device].index_select(0, index) for k in keys], 1)

    def gram(self, stats: Stats, keys: Sequence[str], only: Sequence[int] | None = None) -> None:
        """stats["keyA|keyB"] = <keyA row, keyB row> for every pair of `keys` (A before B, and A with itself),
        for every parameter (or those in `only`): one batched matrix product per device."""
        for select, stack in self._stacked(keys, None if only is None else set(only)):
            products = torch.bmm(stack, stack.transpose(1, 2))  # [P, K, K]
            for a, ka in enumerate(keys):
                for b in range(a, len(keys)):
                    stats.add(f"{ka}|{keys[b]}", select, products[:, a, b])

    def distance2(self, stats: Stats, name: str, k1: str, k2: str, only: Sequence[int]) -> None:
        """stats[name] = |key1 row - key2 row|^2 (the repeat's difference, without cancellation)."""
        self.residual2(stats, name, [k1, k2], dict.fromkeys(only, (1.0, -1.0)))

    def residual2(
        self, stats: Stats, name: str, keys: Sequence[str], coeffs: Mapping[int, Sequence[float]]
    ) -> None:
        """stats[name] = |sum_k coeffs[i][k] x row of keys[k]|^2 for each parameter i of `coeffs` (the fit's
        residual on the subset, formed on the device: from the Gram entries it would cancel in fp32)."""
        for select, stack in self._stacked(keys, coeffs):
            c = to_device([v for i in select for v in coeffs[i]], stack.device).view(
                len(select), len(keys), 1
            )
            res = (stack * c).sum(1)
            stats.add(name, select, (res * res).sum(1))


def copies(tensors: list[torch.Tensor], dtypes: Sequence[torch.dtype] | None = None) -> list[torch.Tensor]:
    """Copies of `tensors` (exact, or rounded to nearest in `dtypes`, one per tensor), as views of one buffer
    per device and dtype (one allocation and one multi-tensor copy each, instead of one clone per tensor)."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    kinds: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for j, t in enumerate(tensors):
        kinds.setdefault((t.device, t.dtype if dtypes is None else dtypes[j]), []).append(j)
    for (device, dtype), members in kinds.items():
        like = [tensors[j] for j in members]
        views = shaped(torch.empty(sum(t.numel() for t in like), dtype=dtype, device=device), like)
        foreach_copy_(views, like)
        for v, j in zip(views, members, strict=True):
            out[j] = v
    return cast(list[torch.Tensor], out)


def shaped(buffer: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive pieces of a flat buffer, each viewed in the shape of the tensor it stands beside."""
    pieces = buffer.split([t.numel() for t in like])
    return [p.view(t.shape) for p, t in zip(pieces, like, strict=True)]


def chunks(items: list[int], counts: list[int], limit: int) -> list[list[int]]:
    """`items` in order, cut into runs whose counts add up to at most `limit` (an item over it alone)."""
    out: list[list[int]] = []
    total = 0
    for item, n in zip(items, counts, strict=True):
        if not out or total + n > limit:
            out.append([])
            total = 0
        out[-1].append(item)
        total += n
    return out


def some(tensors: Sequence[torch.Tensor | None], indexes: Sequence[int]) -> list[torch.Tensor]:
    """The tensors at `indexes`, which the caller knows are present."""
    return [cast(torch.Tensor, tensors[i]) for i in indexes]


def floats(host: dict[str, list[float | None]]) -> dict[str, list[float]]:
    """Host numbers whose every slot was filled (NaN marks a slot that was not)."""
    return {k: [math.nan if v is None else v for v in column] for k, column in host.items()}


def norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """fp32 norms of many tensors in one multi-tensor launch (stacked)."""
    if not tensors:
        return torch.zeros(0)
    norms: list[torch.Tensor]
    try:
        norms = list(FOREACH_OPS._foreach_norm(tensors, 2, dtype=torch.float32))
    except (RuntimeError, TypeError):  # mixed devices/dtypes on an old torch
        norms = [norm(t) for t in tensors]
    device = norms[0].device
    return torch.stack([n.to(device) for n in norms])


# ---------------------------------------------------------------------------------------------------------
# the check


# ---------------------------------------------------------------------------------------------------------
# the self-checking estimate (host arithmetic on the probes' levels)
# ---------------------------------------------------------------------------------------------------------
STEP0 = 2.0**-10  # first relative step along the reported gradient (then 2^-11; then halving or doubling)
STEP_MIN = 2.0**-22
STEP_MAX = 2.0**-4
ZERO_STEP0 = 2.0**-4  # first relative step along a random direction where the reported gradient is zero
ZERO_STEP_MAX = 2.0**-2
MAX_LEVELS = 7  # steps per probe at most
CONFIRM_LEVELS = 12  # with the steps that confirm a blame at smaller steps (`finer`)
E_MAX = 0.05  # a relative error bar at most this is a reliable estimate
OFF = 0.2  # "consistently off": every step's ratio beyond 1 +- OFF (after its noise), on the same side
OFF_SPREAD = 4.0  # "consistently off": the ratios at every step within this factor of each other
Z_MOVE = 4.0  # a loss change of more than Z_MOVE x the noise "moves"
REFUTE = 8.0  # a blame's own change at the step that could refute it, in noise units (`refuting`)


@dataclass
class Estimate:
    """What the levels of one probe say: a finished estimate, or the next step to evaluate."""

    next_step: float | None = None  # evaluate this step next (the estimate is not finished)
    ratio: float | None = None  # true / reported (r); the probe's scale is 1 / r
    error: float | None = None  # relative error bar of r
    step: float | None = None  # the accepted step
    pair: tuple[float, float] | None = None  # the two steps the estimate rests on (larger, smaller)
    reliable: bool = False
    off: bool = (
        False  # no step agreed, but at every step the ratio is off 1 by more than OFF beyond the noise
    )
    moves: bool | None = None  # zero-gradient probes: the loss moves along the direction
    reason: str = ""


def _fmt_step(s: float) -> str:
    return f"2^{math.log2(s):.0f}"


def _ratios(levels: Sequence[tuple[float, float, float]]) -> list[tuple[float, float, float]]:
    """(step, true / reported, predicted change) of the levels whose ratio is defined, largest step first."""
    return [
        (s, c / p, p)
        for s, c, p in sorted(levels, key=lambda level: -level[0])
        if p != 0.0 and math.isfinite(c) and math.isfinite(p)
    ]


def _pair_error(
    a: tuple[float, float, float], b: tuple[float, float, float], noise: float, floor: float
) -> float:
    """The relative error bar of the ratio at step b from the adjacent larger step a: their disagreement plus
    the noise (at least `floor`) over each predicted change."""
    (_, ra, pa), (_, rb, pb) = a, b
    return (abs(ra - rb) + max(noise, floor) / abs(pa) + max(noise, floor) / abs(pb)) / max(abs(rb), 1e-30)


def finest(levels: Sequence[tuple[float, float, float]], noise: float, floor: float = 0.0) -> Estimate | None:
    """The estimate of the two adjacent steps nearest the point that agree within E_MAX (the error bar as in
    `judge_levels`), or None. A blame rests on it, not on the pair with the smallest bar: a kink of the loss
    (a ReLU whose input is near 0) makes every pair of steps larger than its distance agree on an average
    slope; below it the central difference is the derivative again."""
    valid = _ratios(levels)[::-1]  # smallest steps first
    for b, a in zip(valid, valid[1:], strict=False):
        error = _pair_error(a, b, noise, floor)
        if error <= E_MAX and a[0] <= 2 * b[0]:
            return Estimate(ratio=b[1], error=error, step=b[0], pair=(a[0], b[0]), reliable=True)
    return None


def finer(levels: Sequence[tuple[float, float, float]], noise: float, floor: float = 0.0) -> float | None:
    """The next smaller step that could confirm a blame: half the smallest so far, where the loss's noise
    would still be at most E_MAX / 4 of the predicted change (extrapolated from that step), not below
    STEP_MIN, and at most CONFIRM_LEVELS steps in all. None where no smaller step can be measured."""
    usable = _ratios(levels)
    if not usable or len(levels) >= CONFIRM_LEVELS:
        return None
    step, _, predicted = usable[-1]
    if step / 2 < STEP_MIN or max(noise, floor) > (E_MAX / 4) * abs(predicted) / 2:
        return None
    return step / 2


def refuting(
    levels: Sequence[tuple[float, float, float]], est: Estimate, noise: float, floor: float = 0.0
) -> float | None:
    """A step that could refute a blame where `finer` has none: half the smaller step of the estimate's pair,
    where the reported gradient's predicted change is within the noise but the estimate's own, r x P, is still
    REFUTE x the noise (a reported gradient far smaller than the loss's change). A loss that changes in jumps
    (a router's top-k choice crossing a tie, token after token) can grow in proportion over two steps by
    chance; a line through zero it is not, and there `contradicted` says so. None where a level below the pair
    was measured already, or where r x P there would be within the noise."""
    if est.ratio is None or est.pair is None or not est.reliable or len(levels) >= CONFIRM_LEVELS:
        return None
    small = min(est.pair)
    if any(s < small for s, _, _ in levels):
        return None
    p = next((p for s, _, p in levels if s == small), 0.0)
    step = small / 2
    if step < STEP_MIN or abs(est.ratio * p) / 2 < REFUTE * max(noise, floor):
        return None
    return step


def _below_pair(
    levels: Sequence[tuple[float, float, float]], est: Estimate
) -> list[tuple[float, float, float]]:
    """The levels of a reliable estimate at steps below its pair (largest first), with a prediction and finite
    numbers: where truncation is smaller than at the pair, so what departs from r x P there is noise."""
    if est.ratio is None or est.pair is None or not est.reliable:
        return []
    small = min(est.pair)
    return [
        (s, c, p)
        for s, c, p in sorted(levels, reverse=True)
        if s < small and p != 0.0 and math.isfinite(c) and math.isfinite(p)
    ]


def contradicted(
    levels: Sequence[tuple[float, float, float]], est: Estimate, noise: float, floor: float = 0.0
) -> str | None:
    """Why a reliable estimate is no ground to blame a parameter: a level at a step below its pair, where
    truncation is smaller, whose loss change differs from the estimate's ratio x its predicted change by more
    than the loss's noise (3 x, at least `floor`) and the estimate's own error bar allow. Then the noise this
    probe sees is larger than measured (a bf16 forward's rounding of activations the move passes through),
    and two steps agreeing above it is no proof. None where every smaller step agrees."""
    below = _below_pair(levels, est)
    if est.ratio is None or not below:
        return None
    r, bar = est.ratio, max(noise, floor)
    for s, c, p in below:
        allowed = 3 * bar + (est.error or 0.0) * abs(r * p)
        if abs(c - r * p) > allowed:
            return (
                f"two steps agree on true / reported {r:.4g}, but at the smaller step {_fmt_step(s)} "
                f"the loss changed by {c:.3g} where that predicts {r * p:.3g} (noise {noise:.3g}): the "
                "noise along this direction is larger than measured"
            )
    return None


def noise_shown(levels: Sequence[tuple[float, float, float]], est: Estimate) -> float:
    """The loss's noise that the levels below a reliable estimate's pair show: twice the largest |C - r P| there
    beyond what the estimate's own error bar allows (the same scale as the measured noise, twice a central
    difference's departure from its prediction), 0.0 where no level lies below the pair. Truncation only
    shrinks below the pair, so what is left there is rounding. The measured noise is one draw (the jitter
    pair's): on the CPU population's bf16 models it varied up to 100x with the jitter's seed, and a low draw
    set steps where the rounding was 30x the draw; steps below the pair, measured while the probe looked for
    two that agree, show that."""
    below = _below_pair(levels, est)
    if est.ratio is None or not below:
        return 0.0
    r, err = est.ratio, est.error or 0.0
    return max(0.0, *(2 * (abs(c - r * p) - err * abs(r * p)) for _, c, p in below))


def judge_levels(
    levels: Sequence[tuple[float, float, float]], noise: float, zero: bool, floor: float = 0.0
) -> Estimate:
    """The estimate from (step, C, P) levels (central loss change, predicted change), `noise` the loss's
    rounding noise; or the next step to try. Pure arithmetic: the run loop evaluates what it asks for.

    Reliable: two adjacent steps agree within E_MAX counting the noise (|r_a - r_b| + noise / |P_a| +
    noise / |P_b|), or three adjacent steps spanning a factor 4 agree within E_MAX among themselves (the
    measured noise is an upper bound: a random move of every weight by two units of round-off changes the
    rounding of far more of the forward than a probe's move does); `floor` (the loss's own round-off) bounds
    every error bar from below."""
    by_step = sorted(levels, key=lambda level: -level[0])
    if zero:
        return _judge_zero(by_step, noise)
    valid = _ratios(by_step)
    candidates: list[tuple[float, float, float, tuple[float, float]]] = []  # (rel. error, r, step, pair)
    for a, b in zip(valid, valid[1:], strict=False):
        candidates.append((_pair_error(a, b, noise, floor), b[1], b[0], (a[0], b[0])))
    best_pair = min(candidates) if candidates else None
    for a, b, c in zip(valid, valid[1:], valid[2:], strict=False):
        rs = sorted((a[1], b[1], c[1]))
        quantum = floor / abs(a[2]) + floor / abs(b[2]) + floor / abs(c[2])
        spread = (rs[2] - rs[0] + quantum) / max(abs(rs[1]), 1e-30)
        if spread <= E_MAX and rs[0] > 0:
            candidates.append((spread, rs[1], b[0], (a[0], b[0])))
    best = min(candidates) if candidates else None
    if best is not None and best[0] <= E_MAX:
        return Estimate(ratio=best[1], error=best[0], step=best[2], pair=best[3], reliable=True)
    smallest, largest = by_step[-1], by_step[0]
    if len(by_step) < MAX_LEVELS:
        small_noise = noise / abs(smallest[2]) if smallest[2] else math.inf
        if 2 * small_noise <= 2 * E_MAX and smallest[0] / 2 >= STEP_MIN:
            return Estimate(next_step=smallest[0] / 2)  # closer to the linear region
        if largest[0] * 2 <= STEP_MAX:
            return Estimate(next_step=largest[0] * 2)  # rounding dominates: a larger change of the loss
    span = f"{_fmt_step(smallest[0])}..{_fmt_step(largest[0])}"
    if len(valid) >= 3:
        # Over steps spanning 4x and more, truncation shrinks 16x from the largest to the smallest: a correct
        # gradient cannot be off by more than OFF at every one of them unless rounding noise is that large,
        # which the noise term excludes.
        bars = [max(noise, floor) / abs(p) for _, _, p in valid]  # r's error from the loss's noise
        low = all(r + bar < 1 / (1 + OFF) for (_, r, _), bar in zip(valid, bars, strict=True))
        high = all(r - bar > 1 + OFF for (_, r, _), bar in zip(valid, bars, strict=True))
        # and the ratios tell one story: one sign, within a factor OFF_SPREAD of each other (noise that the
        # measured noise underestimates, seen on the H200 on probes of a few small biases, scatters them
        # over both signs and orders of magnitude)
        ratios = [r for _, r, _ in valid]
        consistent = (all(r > 0 for r in ratios) or all(r < 0 for r in ratios)) and max(
            abs(r) for r in ratios
        ) <= OFF_SPREAD * min(abs(r) for r in ratios)
        if (low or high) and consistent:
            rs = sorted(r for _, r, _ in valid)
            mid = rs[len(rs) // 2]
            return Estimate(
                ratio=mid,
                error=(rs[-1] - rs[0]) / max(abs(mid), 1e-30),
                step=smallest[0],
                pair=(valid[-2][0], valid[-1][0]),
                off=True,
                reason=(
                    "no two steps agree, but at every step the loss changes "
                    + ("less" if low else "more")
                    + f" than the reported gradient predicts by more than {OFF:g} (true / reported by step: "
                    + ", ".join(f"{r:.4g} at {_fmt_step(s)}" for s, r, _ in valid)
                    + ")"
                ),
            )
    if best_pair is None:
        return Estimate(reason=f"the moves rounded to nothing or the loss was not finite at steps {span}")
    rel, rb, sb, pair = best_pair
    return Estimate(
        ratio=rb,
        error=rel,
        step=sb,
        pair=pair,
        reason=(
            f"no steps between {span} agree within the error bar {E_MAX:g} (true / reported by step: "
            + ", ".join(f"{r:.4g} at {_fmt_step(s)}" for s, r, _ in valid)
            + f"; loss noise {noise:.3g}): nonlinear at the larger steps, rounding noise at the smaller"
        ),
    )


def _judge_zero(by_step: list[tuple[float, float, float]], noise: float) -> Estimate:
    """A zero reported gradient: does the loss move along a direction in the parameters' subspace? It moves
    when two steps change it in proportion to the step (a first-order change: same sign, ratio within 0.7-1.4
    of the steps' ratio), the larger by more than Z_MOVE x the noise and the smaller by more than half that;
    it does not when no step up to ZERO_STEP_MAX changes it by more than the noise."""
    threshold = Z_MOVE * noise
    for (sa, ca, _), (sb, cb, _) in zip(by_step, by_step[1:], strict=False):
        if not (math.isfinite(ca) and math.isfinite(cb)) or cb == 0.0:
            continue
        if abs(ca) > threshold and abs(cb) > threshold / 2:
            ratio = ca / (cb * sa / sb)
            if 0.7 <= ratio <= 1.4:
                return Estimate(
                    ratio=math.inf, error=abs(ratio - 1), step=sb, pair=(sa, sb), reliable=True, moves=True
                )
    for a, b, c in zip(by_step, by_step[1:], by_step[2:], strict=False):
        # three steps in proportion (each ratio within 0.7-1.4), the largest above the threshold: a line through
        # zero that three measurements agree on, where two would each be too close to the noise
        values = (a[1], b[1], c[1])
        if not all(math.isfinite(v) and v != 0.0 for v in values) or abs(a[1]) <= threshold:
            continue
        ratios = (a[1] / (b[1] * a[0] / b[0]), b[1] / (c[1] * b[0] / c[0]))
        if all(0.7 <= r <= 1.4 for r in ratios):
            error = max(abs(r - 1) for r in ratios)
            return Estimate(
                ratio=math.inf, error=error, step=b[0], pair=(a[0], b[0]), reliable=True, moves=True
            )
    largest, smallest = by_step[0], by_step[-1]
    if all(abs(c) <= noise for _, c, _ in by_step):
        if largest[0] * 4 <= ZERO_STEP_MAX and len(by_step) < MAX_LEVELS:
            return Estimate(next_step=largest[0] * 4)
        if all(c == 0.0 for _, c, _ in by_step):
            return Estimate(moves=False, reliable=True, step=largest[0])
        # the loss moved, within its noise: too little to tell from rounding, not nothing (a weight whose
        # gradient was dropped and whose whole effect stays within the noise read `unused` so); a weight the
        # forward never reads leaves the loss bit for bit where it was
        moved = max(abs(c) for _, c, _ in by_step)
        return Estimate(
            step=largest[0],
            pair=(largest[0], by_step[1][0]) if len(by_step) > 1 else None,
            reason=(
                f"the loss moved by up to {moved:.3g} with these weights moved by up to {largest[0]:g} of their "
                f"norm, within its noise {noise:.3g}: an effect that small is not told from rounding"
            ),
        )
    if len(by_step) < MAX_LEVELS:
        if largest[0] * 2 <= ZERO_STEP_MAX and abs(largest[1]) <= threshold:
            return Estimate(next_step=largest[0] * 2)  # a larger change above the noise
        if abs(smallest[1]) / 2 > threshold / 2:
            return Estimate(next_step=smallest[0] / 2)  # closer to the linear region
    changes = ", ".join(f"{c:.3g} at {_fmt_step(s)}" for s, c, _ in by_step)
    return Estimate(reason=f"the loss moves but not in proportion to the step ({changes}; noise {noise:.3g})")
