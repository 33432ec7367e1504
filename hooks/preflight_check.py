"""`maingrad.hooks.preflight()`: prove, on the user's own model and wrapper, that every parameter's gradient is
the sum of its micro-batches' gradients, before the long job.

    result = maingrad.hooks.preflight(model, run_microbatch, batches, loss_fn=loss_fn)
    print(result)          # table, worst first; result.ok, result.to_dict(), result.records()

`run_microbatch(model, batch)` is the training code's own forward and backward of one micro-batch (it calls
`loss.backward()`; its return value is used only when `loss_fn` is missing); `loss_fn(model, batch)` returns
the same loss without backward (for the finite differences); `batches` gives micro-batches A and B (one is
enough; an iterator is advanced by two). The model must already be wrapped (Megatron-FSDP, Megatron DDP,
torch FSDP2, or none); the gradients judged are the ones the optimizer would read after the wrapper's grad
sync (`preflight_wrappers.py`).

Two independent laws, per parameter:
- Linearity of accumulation, on the optimizer's gradient G: runs "A", "B" and "A then B", each from zeroed
  buffers and the same random state. G(A,B) = G(A) + G(B) passes; G(A,B) = G(B) is `grad_overwritten`;
  G(A,B) = 0 (or G(A) alone) `grad_lost`. Where any verdict fails, "A" runs again: a repeat that differs is
  `grad_nondeterministic` (and nothing else is claimed for that parameter). With one batch, "A twice" =
  2 G(A) instead.
- Agreement with an independent estimate: a constant error (TE's `BasicLinear` returning main_grad as the
  autograd gradient doubles it) keeps linearity, so each parameter group's gradient is compared with finite
  differences of the loss of A along the group's own reported gradient (preflight's copy of it, below):
  L(w+d) - L(w) against <G, d> (d rounded to the dtype the forward computes with first, |d| = `fd_eps` x |w|
  per parameter), and where that disagrees, the
  central (L(w+d) - L(w-d)) / 2, which has no second-order term, decides. A factor outside [1/(1+r), 1+r] is
  `grad_scaled`; a zero gradient where the loss changes is `grad_lost`. Groups: one per fused-wgrad kind and
  parent module type (attention's TE linears, an MLP's fused ops, the experts), one for everything plain
  autograd computes.

Tolerances come from the dtypes: linearity within 8 units of round-off of the least precise of the gradient's
and the parameter's dtypes (bf16: 3.1%, fp32: 4.8e-7, at least 4e-6); finite differences judged only above the
loss's round-off (the compute dtype's unit / 64 of the loss) and within r = `fd_rtol` (default 0.4: a factor
1.4 either way, so x2, x0.5 and x0 are far outside, while the worst error of a correct bf16 model measured on
the H200, 21% on a small GPT's embeddings and norms, is not).

The copy preflight compares with (G(A), then G(A) + G(B), minus G(A,B) in place) needs no more precision than
that tolerance: it is kept rounded to `copy_dtype`, the narrowest of bf16 and fp32 whose unit round-off u is at
most 1/8 of the tolerance (bf16 for an fp32 main_grad of bf16 parameters: half the bytes; fp32 parameters keep
an fp32 copy). Rounding G(A) moves each element by at most u of itself, rounding G(A) + G(B) by at most u of
that sum, and the last subtraction only scales the difference D by (1 +- u); so the measured |D| is off by at
most u (|G(A)| + |G(A) + G(B)| + |D|) <= u (sqrt(5) + r) sqrt(|G(A)|^2 + |G(B)|^2), i.e. the ratio r judged
moves by at most (sqrt(5) + r) u: under 2.3 of the 8 units where it matters. A correct model keeps passing
while its own round-off stays below 5.7 units (on the H200 it is below 1), an overwritten or lost gradient
(r = 0.7 to 1) stays far out, and a bug in a slice of one fused weight (one expert of 64: r = 0.06-0.08 in the
CPU test, tolerance 0.031) stays out by more than the rounding can move it. With one micro-batch
(2 G(A) - G(A,A)) the bound is (1 + r) u. The norms, the subsets (the fit and the repeat) and the zero test of
G(A,B) read the wrapper's own gradients, unrounded.

It leaves no trace: gradient buffers are zeroed through the wrapper's own API (a plain module gets its own
`.grad` tensors back), every weight it perturbs is restored bit for bit (and reinstalled through the wrapper,
also when the model raises between a perturbation and its restore), module buffers are copied back, every
random generator it knows of is set back to the state it found (`preflight_state.py`), no optimizer is touched
and no hook is registered. Each micro-batch starts from the
caller's random state, so dropout repeats exactly; randomness preflight cannot reset shows up as
`grad_nondeterministic`, never as an accumulation verdict.

Cost: four micro-batch forward+backward passes (two steps of two micro-batches; five when something fails) and
one forward pass per finite-difference group plus one for the base L(w) (and one more per group whose forward
difference disagrees). Without `loss_fn` the evaluations are run_microbatch calls and the base is what A alone
returned (the same call from the same state); with `loss_fn` the base is evaluated, since nothing shows that
run_microbatch's value is loss_fn's (a loss divided by the micro-batch count, or with an auxiliary loss added,
would shift every forward difference by the same amount and could make a x2 gradient look right). Memory: the
copy above (taken right after A, then the wrapper's own gradients are released) and, while the finite
differences run, one copy of the largest group's weights plus FD_CHUNK elements of scratch. The perturbations
are a few multi-tensor launches per FD_CHUNK elements, not about ten per parameter; gradient reads stay on the
device: three host syncs when it passes (the gradient and weight norms that size the perturbations, the
forward differences, the one comparison at the end), one more for central differences and one for the repeat
of A when something fails; never one per parameter. The wrapper's between-steps calls follow the training
loop: zero before a run only after a backward, start_param_sync only after the weights changed, an install
after every move of the weights. On the H200's 64-expert layer (bf16, fp32 main_grad, Megatron-FSDP): 574 MiB
above a training step's peak, 0.73x the 784 MiB of gradients; in full training steps (optimizer step
included) 3.35 of wall time when it passes and 3.80 when it fails, in steps without the optimizer 3.50 and
4.11 (medians of 50 rounds interleaved with steps, three runs), most of it the passes, the forwards and the
wrapper's own finish/install calls (docs/gpu-evidence.md section 7).
"""

from __future__ import annotations

import fnmatch
import math
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, cast

import torch

from maingrad.contracts.anomalies import ANOMALIES, PREFLIGHT_ANOMALIES
from maingrad.contracts.records import WHOLE_CALL, new_record, record_id
from maingrad.hooks.preflight_state import BufferState, RngPair, RngState
from maingrad.hooks.preflight_wrappers import Adapter, Entry, choose, normalize_name

SUBSET = 4096  # elements per parameter kept for the decomposition G(A,B) ~ a G(A) + b G(B) and the repeat
FD_CHUNK = 1 << 24  # elements moved per step of a finite-difference perturbation (64 MiB of fp32 scratch)
FIT_TOL = 0.15  # |a|, |b - 1| below this: "keeps the last micro-batch only"
FD_GROUPS: tuple[str, ...] = ("mechanism", "module_type", "param")
_DIGITS = re.compile(r"\d+")

RunMicrobatch = Callable[[torch.nn.Module, Any], Any]


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


# ---------------------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------------------
@dataclass
class ParamResult:
    """What preflight measured and concluded for one parameter."""

    name: str
    module: str
    leaf: str
    module_type: str  # "<parent class>/<owner class>.<leaf, digits as #>"
    mechanism_kind: str  # fused-wgrad kind from maingrad.hooks discovery, or "autograd"
    group: str  # finite-difference group
    dtype: str | None = None
    shape: list[int] | None = None
    device: str | None = None
    numel: int = 0
    overwrite_main_grad: bool | None = None
    has_main_grad: bool = False
    is_fsdp_param: bool = False
    norm_a: float = 0.0
    norm_b: float | None = None
    rel_repeat: float | None = None  # |G(A) again - G(A)| / |G(A)| (subset)
    rel_sum: float | None = None  # |G(A,B) - G(A) - G(B)| / sqrt(|G(A)|^2 + |G(B)|^2)
    fit: tuple[float, float] | None = None  # G(A,B) ~ a G(A) + b G(B) on the subset
    rel_twice: float | None = None  # one batch: |G(A,A) - 2 G(A)| / |2 G(A)|
    fd_scale: float | None = None  # reported / finite-difference, of the parameter's group
    finite: bool = True
    tolerance: float = 0.0
    anomalies: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.anomalies

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items()}
        out["fit"] = list(self.fit) if self.fit is not None else None
        return out


@dataclass
class FdGroup:
    key: str
    names: list[str]
    zero_gradient: bool  # probed along a random direction because the reported gradient is 0
    fd: float | None = None  # (L(w+d) - L(w-d)) / 2
    predicted: float | None = None  # <G, d>
    loss: float | None = None
    floor: float | None = None  # below this a loss difference is round-off
    scale: float | None = None
    verdict: str = "not judged"
    method: str = "-"  # "forward" (L(w+d) - L(w)) or "central" ((L(w+d) - L(w-d)) / 2)
    unit: float = 0.0  # unit round-off of the group's compute dtype


@dataclass
class PreflightResult:
    """Verdicts per parameter, the finite-difference groups, the cost, and the table / JSON / records forms."""

    wrapper: str
    strategy: str | None
    status: str  # "pass" | "fail" | "error"
    params: list[ParamResult]
    groups: list[FdGroup]
    cost: dict[str, Any]
    tolerances: dict[str, Any]
    error: str | None = None
    error_traceback: str | None = None
    label: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "pass"

    @property
    def failing(self) -> list[ParamResult]:
        return [p for p in self.params if p.anomalies]

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "status": self.status,
            "wrapper": self.wrapper,
            "strategy": self.strategy,
            "error": self.error,
            "cost": self.cost,
            "tolerances": self.tolerances,
            "summary": self.summary_rows(),
            "groups": [vars(g) for g in self.groups],
            "params": [p.to_dict() for p in self.params],
        }

    # -- table ------------------------------------------------------------------------------------------------
    def summary_rows(self) -> list[dict[str, Any]]:
        """One row per (verdict, module type): count, examples, worst numbers, mechanism and fix; worst first."""
        rows: dict[tuple[str, str, str], dict[str, Any]] = {}
        for p in self.params:
            verdict = "+".join(p.anomalies) if p.anomalies else "ok"
            key = (verdict, p.module_type, p.mechanism_kind)
            row = rows.get(key)
            if row is None:
                row = rows[key] = {
                    "verdict": verdict,
                    "module_type": p.module_type,
                    "path": p.mechanism_kind,
                    "count": 0,
                    "examples": [],
                    "measured": "",
                    "mechanism": "",
                    "fix": "",
                    "_worst": -1.0,
                }
            row["count"] += 1
            if len(row["examples"]) < 3:
                row["examples"].append(p.name)
            badness = _badness(p)
            if badness > row["_worst"]:
                row["_worst"] = badness
                row["measured"] = _measured(p)
                row["mechanism"] = "; ".join(p.notes)
                row["fix"] = ANOMALIES[p.anomalies[0]].remedy if p.anomalies else ""
        order = {code: i for i, code in enumerate(PREFLIGHT_ANOMALIES)}

        def rank(row: dict[str, Any]) -> tuple[int, int, str]:
            first = row["verdict"].split("+")[0]
            return (order.get(first, len(order)), -row["count"], row["module_type"])

        out = sorted(rows.values(), key=rank)
        for row in out:
            del row["_worst"]
        return out

    def table(self) -> str:
        """The human form: failing module types worst first (mechanism per row), the passing ones in one line,
        the finite-difference factors per group, and each failing code's fix once."""
        head = (
            f"maingrad preflight{f' [{self.label}]' if self.label else ''}: {self.status.upper()} - "
            f"{self.wrapper}{f' ({self.strategy})' if self.strategy else ''}: "
            f"{len(self.failing)} of {len(self.params)} parameters fail"
        )
        lines = [head]
        if self.error:
            lines.append(f"  error: {self.error}")
        cost = self.cost
        lines.append(
            f"  cost: {cost.get('microbatch_passes', 0)} forward+backward passes, "
            f"{cost.get('forward_passes', 0)} forward passes, {cost.get('seconds', 0.0):.2f} s"
        )
        rows = self.summary_rows()
        bad = [row for row in rows if row["verdict"] != "ok"]
        good = [row for row in rows if row["verdict"] == "ok"]
        if bad:
            lines.append(f"  {'verdict':<30} {'n':>4}  {'module type':<52} measured (worst)")
        for row in bad:
            lines.append(
                f"  {row['verdict']:<30} {row['count']:>4}  {row['module_type'][:52]:<52} {row['measured']}"
            )
            lines.append(f"      e.g. {', '.join(row['examples'])} [{row['path']}]")
            if row["mechanism"]:
                lines.append(f"      likely: {row['mechanism']}")
        if good:
            count = sum(row["count"] for row in good)
            lines.append(f"  {'ok':<30} {count:>4}  ({len(good)} module types)")
        judged = [g for g in self.groups if g.scale is not None or g.verdict != "not judged"]
        if judged:
            lines.append("  finite differences, reported / estimated per group:")
            for g in judged:
                scale = "-" if g.scale is None else f"{g.scale:.3f}"
                lines.append(f"    {scale:>8}  {g.verdict:<10} {g.key} ({len(g.names)} params)")
        codes = list(dict.fromkeys(code for p in self.failing for code in p.anomalies))
        if self.status == "error":
            codes.insert(0, "preflight_error")
        if codes:
            lines.append("  fix:")
            lines.extend(f"    {code}: {ANOMALIES[code].remedy}" for code in codes)
        return "\n".join(lines)

    __str__ = table

    # -- records ------------------------------------------------------------------------------------------------
    def records(
        self, *, run: str, rank: int = 0, commit: str | None = None, t_ns: int | None = None
    ) -> list[dict[str, Any]]:
        """Records of the runtime schema (phase "preflight", mode "check"): one per failing parameter and
        anomaly, and one for the whole check (param "*": anomaly `preflight_error` when it could not finish,
        else none) so a passing preflight shows on the dashboard too."""
        t_ns = time.time_ns() if t_ns is None else t_ns
        out: list[dict[str, Any]] = []

        def add(**fields: Any) -> None:
            base: dict[str, Any] = {
                "id": record_id(run, rank, f"preflight-{len(out)}"),
                "run": run,
                "rank": rank,
                "step": 0,
                "phase": "preflight",
                "module": "*",
                "param": WHOLE_CALL,
                "mode": "check",
                "commit": commit,
                "t_ns": t_ns,
            }
            out.append(new_record(**{**base, **fields}))

        add(module=f"preflight:{self.wrapper}" + (f":{self.strategy}" if self.strategy else ""),
            anomaly="preflight_error" if self.status == "error" else None)  # fmt: skip
        for p in self.params:
            for code in p.anomalies:
                add(
                    module=p.module or "*",
                    param=p.leaf or p.name,
                    has_main_grad=p.has_main_grad,
                    dtype=p.dtype,
                    shape=p.shape,
                    device=p.device,
                    overwrite_main_grad=p.overwrite_main_grad,
                    is_fsdp_param=p.is_fsdp_param,
                    anomaly=code,
                )
        return out


def _badness(p: ParamResult) -> float:
    values = [p.rel_sum or 0.0, p.rel_twice or 0.0, p.rel_repeat or 0.0]
    if p.fd_scale is not None:
        values.append(abs(math.log(abs(p.fd_scale))) if p.fd_scale not in (0.0,) else 99.0)
    return max(values) + (100.0 if not p.finite else 0.0)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _measured(p: ParamResult) -> str:
    parts = []
    if not p.finite:
        parts.append("non-finite gradient")
    if p.rel_repeat:
        parts.append(f"repeat differs {_fmt(p.rel_repeat)}")
    if p.rel_sum is not None:
        parts.append(f"|G(A,B)-G(A)-G(B)| {_fmt(p.rel_sum)}")
    if p.fit is not None:
        parts.append(f"G(A,B) = {p.fit[0]:.2f} G(A) + {p.fit[1]:.2f} G(B)")
    if p.rel_twice is not None:
        parts.append(f"|G(A,A)-2G(A)| {_fmt(p.rel_twice)}")
    if p.fd_scale is not None:
        parts.append(f"reported/estimated x{p.fd_scale:.3g}")
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------
def _leaf_pattern(leaf: str) -> str:
    return _DIGITS.sub("#", leaf)


def _fused_kinds(model: torch.nn.Module) -> dict[str, str]:
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


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1)


def _norm(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t.float())


def _stack_to_host(values: list[torch.Tensor]) -> list[float]:
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


class _Dist:
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


class _Stats:
    """Device-side numbers per key and parameter, sent to the host in one transfer per device: the one
    comparison at the end needs no per-parameter round trip."""

    def __init__(self, n: int, dist: _Dist) -> None:
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


class _Subsets:
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
        """Flat positions in a run's matrix of the (row, count) spans, in order."""
        index = self._index.get((device, spans))
        if index is None:
            starts = torch.tensor([row * SUBSET for row, _ in spans], dtype=torch.long)
            counts = torch.tensor([count for _, count in spans], dtype=torch.long)
            first = torch.cumsum(counts, 0) - counts  # where each span starts in the concatenation
            within = torch.arange(int(counts.sum())) - torch.repeat_interleave(first, counts)
            index = (torch.repeat_interleave(starts, counts) + within).to(device)
            self._index[(device, spans)] = index
        return index

    def dots(
        self, stats: _Stats, pairs: Sequence[tuple[str, str, str]], only: Sequence[int] | None = None
    ) -> None:
        """stats[name] = <key1 row, key2 row> for every parameter (or those in `only`)."""
        for device, rows in self.rows.items():
            select = rows if only is None else [i for i in rows if i in set(only)]
            if not select:
                continue
            index = torch.tensor([self.row_of[i] for i in select], device=device)
            for name, k1, k2 in pairs:
                a = self.mats[k1][device].index_select(0, index)
                b = a if k2 == k1 else self.mats[k2][device].index_select(0, index)
                values = ((a - b) ** 2).sum(1) if name == "rep2" else (a * b).sum(1)
                stats.add(name, select, values)


def _copies(tensors: list[torch.Tensor], dtypes: Sequence[torch.dtype] | None = None) -> list[torch.Tensor]:
    """Copies of `tensors` (exact, or rounded to nearest in `dtypes`, one per tensor), as views of one buffer
    per device and dtype (one allocation and one multi-tensor copy each, instead of one clone per tensor)."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    kinds: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for j, t in enumerate(tensors):
        kinds.setdefault((t.device, t.dtype if dtypes is None else dtypes[j]), []).append(j)
    for (device, dtype), members in kinds.items():
        like = [tensors[j] for j in members]
        shaped = _shaped(torch.empty(sum(t.numel() for t in like), dtype=dtype, device=device), like)
        torch._foreach_copy_(shaped, like)
        for v, j in zip(shaped, members, strict=True):
            out[j] = v
    return cast(list[torch.Tensor], out)


def _shaped(buffer: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive pieces of a flat buffer, each viewed in the shape of the tensor it stands beside."""
    pieces = buffer.split([t.numel() for t in like])
    return [p.view(t.shape) for p, t in zip(pieces, like, strict=True)]


def _chunks(items: list[int], counts: list[int], limit: int) -> list[list[int]]:
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


def _some(tensors: Sequence[torch.Tensor | None], indexes: Sequence[int]) -> list[torch.Tensor]:
    """The tensors at `indexes`, which the caller knows are present."""
    return [cast(torch.Tensor, tensors[i]) for i in indexes]


def _floats(host: dict[str, list[float | None]]) -> dict[str, list[float]]:
    """Host numbers whose every slot was filled (NaN marks a slot that was not)."""
    return {k: [math.nan if v is None else v for v in column] for k, column in host.items()}


def _norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """fp32 norms of many tensors in one multi-tensor launch (stacked)."""
    if not tensors:
        return torch.zeros(0)
    norms: list[torch.Tensor]
    try:
        norms = list(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    except (RuntimeError, TypeError):  # mixed devices/dtypes on an old torch
        norms = [_norm(t) for t in tensors]
    device = norms[0].device
    return torch.stack([n.to(device) for n in norms])


# ---------------------------------------------------------------------------------------------------------
# the check
# ---------------------------------------------------------------------------------------------------------
class _Preflight:
    def __init__(
        self,
        model: torch.nn.Module,
        run_microbatch: RunMicrobatch,
        batches: list[Any],
        *,
        loss_fn: Callable[[torch.nn.Module, Any], Any] | None,
        adapter: Adapter,
        params: Sequence[str] | None,
        finite_differences: bool,
        fd_groups: str,
        fd_eps: float,
        fd_rtol: float,
        rtol: float | None,
        rng_states: Sequence[RngPair],
    ) -> None:
        self.model = model
        self.run_microbatch = run_microbatch
        self.batches = batches
        self.loss_fn = loss_fn
        self.adapter = adapter
        self.finite_differences = finite_differences
        self.fd_groups = fd_groups
        self.fd_eps = fd_eps
        self.fd_rtol = fd_rtol
        self.rtol = rtol
        self.rng_states = rng_states
        entries = adapter.entries
        if params is not None:
            patterns = [params] if isinstance(params, str) else list(params)
            entries = [e for e in entries if any(fnmatch.fnmatchcase(e.name, pat) for pat in patterns)]
        self.entries: list[Entry] = entries
        self.passes = 0
        self.forwards = 0
        self.syncs = 0
        self.timings: dict[str, float] = {}
        self.dist = _Dist(sharded=adapter.sharded)
        kinds = _fused_kinds(model)
        self.results = [self._result(e, kinds.get(e.name)) for e in entries]
        self.stats = _Stats(len(entries), self.dist)
        self.subsets = _Subsets(entries)
        self.present: dict[str, set[int]] = {}
        self.copy: list[torch.Tensor | None] = [None] * len(entries)
        self.copy_bytes = 0
        self.copy_dtypes: set[str] = set()
        self.first_loss: Any = None  # what run_microbatch returned for micro-batch A alone
        self.rng = RngState(rng_states)  # the caller's random state: every micro-batch starts from it
        # What the wrapper's between-steps calls already hold (see _prepare and _zero): nothing at the start,
        # since the caller's state is unknown.
        self.synced = False  # prepare() or commit() ran after the last change of the weights
        self.zeroed = False  # zero() ran after the last backward
        self.uninstalled = False  # weights moved or restored in place since the last commit()

    def _result(self, e: Entry, kind: str | None) -> ParamResult:
        module_type = f"{e.parent_type}/{e.owner_type}.{_leaf_pattern(e.leaf)}"
        mechanism = kind or "autograd"
        if self.fd_groups == "param":
            group = e.name
        elif self.fd_groups == "module_type":
            group = f"{mechanism}:{module_type}"
        elif kind is not None:  # "mechanism": one fused-wgrad kind inside one parent module type
            group = f"{mechanism}:{e.parent_type}"
        else:
            group = "autograd"
        return ParamResult(
            name=e.name,
            module=e.module,
            leaf=e.leaf,
            module_type=module_type,
            mechanism_kind=mechanism,
            group=group,
            numel=int(e.opt_param.numel()),
        )

    def host(self, keys: Sequence[str] | None = None) -> dict[str, list[float | None]]:
        self.syncs += 1
        return self.stats.host(keys)

    def tolerance(self, i: int, grad_dtype: torch.dtype) -> float:
        """The linearity tolerance of parameter i: 8 units of round-off of the least precise of the gradient's,
        the compute and the optimizer parameter's dtypes (at least 4e-6), or the caller's rtol."""
        e = self.entries[i]
        u = max(
            unit_roundoff(grad_dtype),
            unit_roundoff(self.adapter.compute_dtype(e)),
            unit_roundoff(e.opt_param.dtype),
        )
        return self.rtol if self.rtol is not None else max(8 * u, 4e-6)

    # -- the wrapper's calls ----------------------------------------------------------------------------------
    def _prepare(self) -> None:
        """The training loop's call after an optimizer step (Megatron-FSDP's `start_param_sync()`, the
        parameter all-gather), made only where the weights changed since the last one: before the first run
        (the caller's state is unknown) and, through `_commit`, after every install. Between runs with
        unchanged weights the training loop makes no such call either (nothing was stepped): the wrapper's own
        forward swaps the module's parameters back and gathers what it needs, so the same weights reach the
        forward. On the H200 this moves the gather into the forward rather than saving it (wall time unchanged
        within noise, docs/gpu-evidence.md section 7); what it buys is the loop's own call sequence, with one
        sync per change of the weights that tests can hold it to."""
        if not self.synced:
            self.adapter.prepare()
            self.synced = True

    def _commit(self) -> None:
        """Install weights moved in place (and prepare them for the next forward)."""
        self.adapter.commit()
        self.synced, self.uninstalled = True, False

    def _zero(self) -> None:
        """Zero the gradient buffers through the wrapper, unless nothing ran backward since they were zeroed
        (zeroing twice is zeroing once: the buffers, and Megatron's per-parameter `grad_added_to_main_grad`
        flags, end the same)."""
        if not self.zeroed:
            self.adapter.zero()
            self.zeroed = True

    def _microbatch(self, batch: Any) -> Any:
        """One of the training code's own forward+backward passes, from the caller's random state."""
        self.rng.apply()
        self.zeroed = False
        loss = self.run_microbatch(self.model, batch)
        self.passes += 1
        return loss

    # -- running micro-batches ---------------------------------------------------------------------------------
    def _run(self, key: str, batches: Sequence[Any]) -> list[torch.Tensor | None]:
        """Zero, run the micro-batches from the saved random state each, finish the sync; the flattened
        gradients the optimizer would read (the wrapper's own tensors: never kept past the next run), their
        squared norms and subset recorded under `key`."""
        self._prepare()
        self._zero()
        for batch in batches:
            loss = self._microbatch(batch)
            if key == "A" and self.loss_fn is None:  # the finite differences' base value
                self.first_loss = loss.detach() if isinstance(loss, torch.Tensor) else loss
        self.adapter.finish()
        flats: list[torch.Tensor | None] = []
        for e in self.entries:
            g = self.adapter.grad(e)
            flats.append(None if g is None else _flat(g))
        present = [i for i, f in enumerate(flats) if f is not None]
        self.present[key] = set(present)
        if present:
            self.stats.add(f"n{key}2", present, _norms(_some(flats, present)) ** 2)
        self.subsets.take(key, flats)
        return flats

    def _loss(self, batch: Any) -> torch.Tensor:
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
        return self._as_loss(loss)

    def _as_loss(self, loss: Any) -> torch.Tensor:
        if loss is None:
            raise ValueError(
                "finite differences need the loss: pass loss_fn=, or return the loss from run_microbatch"
            )
        if not isinstance(loss, torch.Tensor):
            loss = torch.tensor(float(loss))
        return self.dist.mean_loss(loss)

    # -- the laws ---------------------------------------------------------------------------------------------
    def run_a(self) -> list[torch.Tensor | None]:
        """Micro-batch A alone; returns the wrapper's live G(A), the finite differences' directions."""
        flats = self._run("A", [self.batches[0]])
        for i, f in enumerate(flats):
            if f is not None:
                self.results[i].dtype = str(f.dtype)
        return flats

    def copy_dtype(self, i: int, grad_dtype: torch.dtype) -> torch.dtype:
        return copy_dtype(grad_dtype, self.tolerance(i, grad_dtype))

    def keep_copy(self, flats: list[torch.Tensor | None]) -> None:
        """The one copy of the gradients preflight holds: G(A), then G(A) + G(B), rounded to `copy_dtype` (bf16
        for an fp32 main_grad of bf16 parameters: half the gradients' bytes), in one buffer per device and
        dtype. Taken right after A; the finite differences then move the weights along it while the wrapper's
        own gradients are released."""
        idx = [i for i, f in enumerate(flats) if f is not None]
        live = _some(flats, idx)
        views = _copies(live, [self.copy_dtype(i, f.dtype) for i, f in zip(idx, live, strict=True)])
        for i, view in zip(idx, views, strict=True):
            self.copy[i] = view
            self.copy_bytes += view.numel() * view.element_size()
            self.copy_dtypes.add(str(view.dtype))

    def run_rest(self) -> None:
        """B alone, then A and B together (one batch: A twice), each compared with the copy in place."""
        copy = self.copy
        b = self.batches[1] if len(self.batches) > 1 else None
        if b is not None:
            flats = self._run("B", [b])
            fresh = [i for i in self.present["B"] if copy[i] is None]
            for i in fresh:
                f = cast(torch.Tensor, flats[i])
                dtype = self.copy_dtype(i, f.dtype)
                copy[i] = f.to(dtype, copy=True)
                self.copy_bytes += f.numel() * dtype.itemsize
                self.copy_dtypes.add(str(dtype))
            both = [i for i in self.present["B"] if i not in fresh]
            if both:
                torch._foreach_add_(_some(copy, both), _some(flats, both))  # G(A) + G(B), rounded once
            del flats
            flats = self._run("AB", [self.batches[0], b])
        else:
            flats = self._run("AB", [self.batches[0], self.batches[0]])
        both = [i for i in self.present["AB"] if copy[i] is not None]
        cs, fs = _some(copy, both), _some(flats, both)
        if both and b is not None:
            torch._foreach_sub_(cs, fs)  # G(A) + G(B) - G(A,B), in place: no second copy
            self.stats.add("d2", both, _norms(cs) ** 2)
        elif both:
            torch._foreach_mul_(cs, 2.0)
            torch._foreach_sub_(cs, fs)  # 2 G(A) - G(A,A)
            self.stats.add("d2", both, _norms(cs) ** 2)
            torch._foreach_add_(cs, fs)
            torch._foreach_mul_(cs, 0.5)
            torch._foreach_sub_(cs, fs)  # G(A) - G(A,A)
            self.stats.add("dl2", both, _norms(cs) ** 2)
        gone = [i for i, c in enumerate(copy) if c is not None and i not in self.present["AB"]]
        if gone:  # a gradient that vanished in the last run counts as zero there
            norms2 = _norms(_some(copy, gone)) ** 2
            self.stats.add("nAB2", gone, torch.zeros_like(norms2))
            self.stats.add("d2", gone, norms2 * (1 if b is not None else 4))
            self.stats.add("dl2", gone, norms2)
            self.present["AB"].update(gone)
        self.copy = [None] * len(copy)
        if b is not None:
            self.subsets.dots(self.stats, [("aa", "A", "A"), ("bb", "B", "B"), ("ab", "A", "B"),
                                           ("xa", "AB", "A"), ("xb", "AB", "B")])  # fmt: skip

    def repeat(self, suspects: list[int]) -> dict[str, list[float | None]]:
        """A again from zeroed buffers, compared with the first A on the subset (only where a verdict failed:
        a repeat that differs by more than the tolerance is nondeterminism, not a bug)."""
        self._run("R", [self.batches[0]])
        self.subsets.dots(self.stats, [("rep2", "R", "A"), ("sa2", "A", "A")], only=suspects)
        return self.host()

    # -- finite differences -------------------------------------------------------------------------------------
    def fd(self, grads: list[torch.Tensor | None], sizes: dict[str, list[float]]) -> list[FdGroup]:
        """Finite differences of the loss of A, per group: forward differences against a shared base
        evaluation, and central differences (one more forward) wherever the forward one does not agree."""
        groups: dict[tuple[str, bool], list[int]] = {}
        for i, r in enumerate(self.results):
            gnorm = sizes["gnorm"][i]
            if not math.isfinite(gnorm):
                continue  # a non-finite gradient has no direction to probe
            groups.setdefault((r.group, not gnorm > 0.0), []).append(i)
        a = self.batches[0]
        if self.loss_fn is None and self.first_loss is not None:
            # run_microbatch is the loss: A alone ran it from these weights, zeroed buffers and random state,
            # exactly what evaluating the base would repeat
            base = self._as_loss(self.first_loss)
        else:
            base = self._loss(a)
        out: list[FdGroup] = []
        evaluations = []
        for (key, zero), indexes in groups.items():
            group = FdGroup(key=key, names=[self.entries[i].name for i in indexes], zero_gradient=zero)
            group.unit = max(unit_roundoff(self.adapter.compute_dtype(self.entries[i])) for i in indexes)
            out.append(group)
            evaluations.append((group, indexes, *self._fd_eval(indexes, grads, zero, sizes, 1.0)))
        self._commit()  # the restored weights, installed once for all groups
        for j, (_, _, loss, pred) in enumerate(evaluations):
            self.stats.add("fd_plus", [j], loss, shard_sum=False)
            self.stats.add("fd_pred_plus", [j], pred)
        self.stats.add("fd_base", [0], base, shard_sum=False)
        host = _floats(self.host(("fd_plus", "fd_pred_plus", "fd_base")))
        retry = []
        for j, (group, indexes, _, _) in enumerate(evaluations):
            base_loss = host["fd_base"][0]
            group.loss = base_loss
            _judge_fd(group, host["fd_plus"][j] - base_loss, host["fd_pred_plus"][j], self.fd_rtol, "forward")
            if group.verdict not in ("ok", "unused", "no signal"):
                retry.append((j, group, indexes))
        if retry:  # confirm with central differences: no second-order term
            for j, group, indexes in retry:
                loss, pred = self._fd_eval(indexes, grads, group.zero_gradient, sizes, -1.0)
                self.stats.add("fd_minus", [j], loss, shard_sum=False)
                self.stats.add("fd_pred_minus", [j], pred)
            self._commit()
            central = _floats(self.host(("fd_minus", "fd_pred_minus")))
            for j, group, _ in retry:
                fd = (host["fd_plus"][j] - central["fd_minus"][j]) / 2
                predicted = (host["fd_pred_plus"][j] - central["fd_pred_minus"][j]) / 2
                _judge_fd(group, fd, predicted, self.fd_rtol, "central")
        return out

    def _fd_eval(
        self, indexes: list[int], grads: list[torch.Tensor | None], zero: bool, sizes: dict, sign: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Loss of A with the group's weights moved by sign x d, and <G, the move the forward computed with>;
        the weights are restored (bit for bit, from one saved buffer per device and dtype) before returning,
        installed by the next commit."""
        adapter = self.adapter
        targets = [adapter.target(self.entries[i]) for i in indexes]
        with torch.no_grad():
            saved = _copies(targets)
        pred: torch.Tensor | None = None
        try:
            self.synced, self.uninstalled = False, True  # the weights move from here on
            with torch.no_grad():
                for j, i in enumerate(indexes):
                    g = grads[i]
                    if zero or g is None:  # a random +-1 direction
                        t = targets[j]
                        gen = torch.Generator(device=t.device).manual_seed(1009 + i)
                        d = torch.randint(0, 2, t.shape, generator=gen, device=t.device).float() * 2 - 1
                        t.add_(d, alpha=sign * self._step(i, t, sizes) / math.sqrt(max(t.numel(), 1)))
                        del d
                if not zero:
                    pred = self._move(indexes, targets, saved, grads, sizes, sign)
            self._commit()
            loss = self._loss(self.batches[0])
        finally:
            with torch.no_grad():
                torch._foreach_copy_(targets, saved)
            self.synced, self.uninstalled = False, True  # restored, installed by the next commit
        if pred is None:
            pred = torch.zeros((), device=targets[0].device)
        return loss, pred

    def _step(self, i: int, t: torch.Tensor, sizes: dict) -> float:
        """|d| for parameter i: fd_eps x its weights' norm (at least sqrt(numel) x 2^-7)."""
        return max(sizes["tnorm"][i], math.sqrt(t.numel()) * 2.0**-7) * self.fd_eps

    def _move(
        self,
        indexes: list[int],
        targets: list[torch.Tensor],
        saved: list[torch.Tensor],
        grads: list[torch.Tensor | None],
        sizes: dict,
        sign: float,
    ) -> torch.Tensor:
        """t_i += sign x |d_i| / |g_i| x g_i for the group's weights, and <G, the move rounded to the dtype the
        forward computes with>, as a few multi-tensor launches per FD_CHUNK elements instead of about ten
        launches per parameter; the scratch is at most FD_CHUNK elements in fp32 and in the compute dtype, viewed
        in each weight's shape (a strided weight that cannot be flattened is moved in place the same way)."""
        kinds: dict[tuple[torch.device, torch.dtype, torch.dtype], list[int]] = {}
        for j, i in enumerate(indexes):
            t = targets[j]
            kinds.setdefault((t.device, t.dtype, self.adapter.compute_dtype(self.entries[i])), []).append(j)
        parts: list[torch.Tensor] = []
        for (device, dtype, cdt), members in kinds.items():
            for chunk in _chunks(members, [targets[j].numel() for j in members], FD_CHUNK):
                ts, old = [targets[j] for j in chunk], [saved[j] for j in chunk]
                gs = [
                    cast(torch.Tensor, grads[indexes[j]]).view(t.shape)
                    for j, t in zip(chunk, ts, strict=True)
                ]
                alphas = [
                    sign * self._step(indexes[j], targets[j], sizes) / sizes["gnorm"][indexes[j]]
                    for j in chunk
                ]
                counts = [t.numel() for t in ts]
                scratch = torch.empty(sum(counts), dtype=torch.float32, device=device)
                moved = _shaped(scratch, ts)
                torch._foreach_copy_(moved, gs)
                torch._foreach_mul_(moved, alphas)
                torch._foreach_add_(ts, moved)  # the weights move (in their own dtype)
                if cdt == dtype:  # the move as the forward sees it: t' - t, in fp32
                    torch._foreach_copy_(moved, ts)
                    torch._foreach_sub_(moved, old)
                else:  # rounded to the compute dtype first: c(t') - c(t)
                    low = _shaped(torch.empty(sum(counts), dtype=cdt, device=device), ts)
                    torch._foreach_copy_(low, ts)
                    torch._foreach_copy_(moved, low)
                    torch._foreach_copy_(low, old)
                    torch._foreach_sub_(moved, low)
                    del low
                torch._foreach_mul_(moved, gs)
                parts.append(scratch.sum(dtype=torch.float64))
                del moved, scratch
        return torch.stack([p.to(parts[0].device) for p in parts]).sum()


def preflight(
    model: torch.nn.Module,
    run_microbatch: RunMicrobatch,
    batches: Iterable[Any],
    *,
    loss_fn: Callable[[torch.nn.Module, Any], Any] | None = None,
    wrapper: str | Adapter = "auto",
    params: str | Sequence[str] | None = None,
    finite_differences: bool = True,
    fd_groups: str = "mechanism",
    fd_eps: float = 2.0**-5,
    fd_rtol: float = 0.4,
    rtol: float | None = None,
    rng_states: Sequence[RngPair] = (),
    sinks: Sequence[Any] = (),
    run: str | None = None,
    rank: int | None = None,
    commit: str | None = None,
    label: str | None = None,
) -> PreflightResult:
    """Check gradient accumulation on `model` (already wrapped) with the training code's own micro-batch.

    run_microbatch(model, batch): forward + backward of one micro-batch, as in training.
    batches: micro-batches A and B (the first two are taken; one gives the "A twice" law instead).
    loss_fn(model, batch): the loss without backward, for the finite differences (without it they call
    run_microbatch and read its return value: one backward more per evaluation; the base value is then what
    micro-batch A alone returned).
    wrapper: "auto" (duck typing), "megatron-fsdp", "megatron-ddp", "fsdp2", "plain", or an Adapter.
    params: fnmatch patterns over parameter names (wrapper prefixes `module.` removed) to judge; default all.
    finite_differences: compare with the loss's central differences (the scale check); fd_groups: "mechanism"
    (default: one group per fused-wgrad module type, one for everything plain autograd computes), "module_type"
    (one per module type), "param" (one per parameter: the most forwards). fd_eps: the perturbation's norm
    relative to the weights'; fd_rtol: accepted factor 1 + fd_rtol either way between reported and estimated.
    rtol: linearity tolerance (default from the dtypes). rng_states: extra (get_state, set_state) pairs to reset
    before every micro-batch.
    sinks: maingrad.hooks sinks ("memory", "jsonl:PATH", a URL, objects) that get the records; run, rank,
    commit: as for install(). label: a name for the table.
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
    if not (0.0 < fd_eps < 1.0):
        raise ValueError("fd_eps must be in (0, 1)")
    if not (fd_rtol > 0.0):
        raise ValueError("fd_rtol must be > 0")
    if rtol is not None and not (rtol > 0.0):
        raise ValueError("rtol must be > 0")
    taken = list(islice(iter(batches), 2))
    if not taken:
        raise ValueError("preflight needs at least one micro-batch in batches")
    sink_objects = [make_sink(s) for s in sinks]
    adapter = choose(model, wrapper)
    check = _Preflight(
        model,
        run_microbatch,
        taken,
        loss_fn=loss_fn,
        adapter=adapter,
        params=params,
        finite_differences=finite_differences,
        fd_groups=fd_groups,
        fd_eps=fd_eps,
        fd_rtol=fd_rtol,
        rtol=rtol,
        rng_states=rng_states,
    )
    result = _execute(check)
    result.label = label
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


def _execute(check: _Preflight) -> PreflightResult:
    adapter = check.adapter
    model = check.model
    started = time.perf_counter()
    buffers = BufferState(model)
    adapter.save_user_grads()
    error = tb = None
    groups: list[FdGroup] = []
    tolerances: dict[str, Any] = {}
    clock = started
    timings = check.timings

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[name] = timings.get(name, 0.0) + now - clock
        clock = now

    try:
        live = check.run_a()
        check.keep_copy(live)  # the (rounded) copy of G(A): the finite differences' directions too
        del live
        check._zero()  # releases the wrapper's own G(A) (Megatron-FSDP, plain .grad) while the weights move
        lap("runs")
        if check.finite_differences:
            directions = list(check.copy)
            present = [i for i, f in enumerate(directions) if f is not None]
            values: list[float] = []
            if present:  # sync 1: the perturbations' sizes
                targets = [adapter.target(check.entries[i]) for i in present]
                values = _norms(_some(directions, present) + targets).double().cpu().tolist()
            check.syncs += 1
            n = len(directions)
            sizes = {"gnorm": [0.0] * n, "tnorm": [0.0] * n}
            for j, i in enumerate(present):
                sizes["gnorm"][i] = values[j]
                sizes["tnorm"][i] = values[len(present) + j]
            for i, f in enumerate(directions):
                if f is None:
                    sizes["tnorm"][i] = float(_norm(adapter.target(check.entries[i])))
            groups = check.fd(directions, sizes)
            del directions
            lap("finite_differences")
        check.run_rest()
        lap("runs")
        tolerances = _classify(check, groups)
        suspects = [i for i, r in enumerate(check.results) if r.anomalies and r.finite]
        if suspects:
            _judge_repeat(check, suspects, check.repeat(suspects))
            lap("runs")
        lap("comparison")
    except Exception as exc:  # noqa: BLE001 - the model's failure is the result, not a crash of the caller
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500]
        tb = traceback.format_exc(limit=12)
    finally:
        check.copy = []
        if check.uninstalled:  # interrupted between a restore and its install: the forward would compute
            try:  # with the perturbed weights until the caller's next optimizer step installs them
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
    if error is None and _perturbation_invisible(groups):
        error = (
            "the finite-difference perturbations never changed the loss although the reported gradients say "
            f"they should: the forward does not compute with the tensors the {adapter.label} adapter perturbs "
            "(a cached copy of the weights?); run with finite_differences=False or pass a wrapper= Adapter"
        )
        for r in check.results:
            r.anomalies = [a for a in r.anomalies if a not in ("grad_scaled", "grad_inconsistent")]
    seconds = time.perf_counter() - started
    failing = any(r.anomalies for r in check.results)
    status = "error" if error else ("fail" if failing else "pass")
    cost = {
        "seconds": seconds,
        "microbatch_passes": check.passes,
        "forward_passes": check.forwards,
        "fd_groups": len(groups),
        "params": len(check.entries),
        "host_syncs": check.syncs,
        "copy_bytes": check.copy_bytes,
        "seconds_by_part": {k: round(v, 4) for k, v in timings.items()},
    }
    return PreflightResult(
        wrapper=adapter.label,
        strategy=adapter.strategy,
        status=status,
        params=check.results if tolerances else [],
        groups=groups,
        cost=cost,
        tolerances=tolerances,
        error=error,
        error_traceback=tb,
    )


def _judge_repeat(check: _Preflight, suspects: list[int], host: dict[str, list[float | None]]) -> None:
    """Where a verdict failed: does a repeat of A differ from the first A by more than the tolerance?"""
    for i in suspects:
        r = check.results[i]
        rep2, sa2 = host.get("rep2", [None] * (i + 1))[i], host.get("sa2", [None] * (i + 1))[i]
        if rep2 is None or sa2 is None:
            continue
        rep2, sa2 = max(rep2, 0.0), max(sa2, 0.0)
        r.rel_repeat = math.sqrt(rep2 / sa2) if sa2 > 0 else (0.0 if rep2 == 0 else math.inf)
        if r.rel_repeat > r.tolerance / 2:
            # the first A and its repeat differ: the verdicts rest on noise, not on a bug
            r.anomalies = ["grad_nondeterministic"]
            r.notes = [
                f"micro-batch A repeated from the same state and random state differs by {r.rel_repeat:.3g}"
            ]


def _perturbation_invisible(groups: list[FdGroup]) -> bool:
    """Every group with a reported gradient saw no loss change at all, while the gradient predicted one."""
    probed = [g for g in groups if not g.zero_gradient and g.fd is not None and g.floor is not None]
    return bool(probed) and all(
        abs(g.fd or 0.0) <= 8 * (g.floor or 0.0) and abs(g.predicted or 0.0) > 8 * (g.floor or 0.0)
        for g in probed
    )


def _classify(check: _Preflight, groups: list[FdGroup]) -> dict[str, Any]:
    """The one comparison at the end: every device-side number goes to the host at once."""
    two = len(check.batches) > 1
    host = check.host()
    by_name = {name: g for g in groups for name in g.names}
    tol_used: list[float] = []

    def get(key: str, i: int) -> float | None:
        column = host.get(key)
        return None if column is None else column[i]

    for i, (e, r) in enumerate(zip(check.entries, check.results, strict=True)):
        raw = e.raw_param
        r.dtype = r.dtype or str(e.opt_param.dtype)
        r.shape = list(e.opt_param.shape)
        r.device = str(e.opt_param.device)
        flag = getattr(raw, "overwrite_main_grad", None)
        r.overwrite_main_grad = flag if isinstance(flag, bool) else None
        r.has_main_grad = hasattr(raw, "main_grad")
        r.is_fsdp_param = hasattr(raw, "__fsdp_param__")
        grad_dtype = getattr(torch, r.dtype.replace("torch.", ""), e.opt_param.dtype)
        tol = check.tolerance(i, grad_dtype)
        r.tolerance = tol
        raw_values = [get(k, i) for k in ("nA2", "nB2", "nAB2", "d2", "dl2")]
        nA2, nB2, nAB2, d2, dl2 = (max(x, 0.0) if x is not None else 0.0 for x in raw_values)
        r.norm_a = math.sqrt(nA2)
        r.finite = all(math.isfinite(x) for x in raw_values if x is not None)  # a NaN/Inf poisons the norm
        if not r.finite:
            r.anomalies.append("grad_not_finite")
            r.notes.append("NaN/Inf in the optimizer's gradient: a buffer nothing wrote, or an overflow")
            continue
        tol_used.append(tol)
        if two:
            r.norm_b = math.sqrt(nB2)
            den = math.sqrt(nA2 + nB2)
            if den > 0:
                r.rel_sum = math.sqrt(d2) / den
                if r.rel_sum > tol:
                    fit = [get(k, i) for k in ("aa", "bb", "ab", "xa", "xb")]
                    _accumulation_verdict(r, fit, nAB2, den, tol)
        else:
            den = math.sqrt(nA2)
            if den > 0:
                r.rel_twice = math.sqrt(d2) / (2 * den)
                if r.rel_twice > tol:
                    if math.sqrt(nAB2) <= tol * den:
                        r.anomalies.append("grad_lost")
                        r.notes.append(
                            "G(A,A) is zero: the micro-batches' gradients never reached the optimizer"
                        )
                    elif math.sqrt(dl2) <= 2 * tol * den:
                        r.anomalies.append("grad_overwritten")
                        r.notes.append(_overwrite_note(r))
                    else:
                        r.anomalies.append("grad_inconsistent")
                        r.notes.append(f"|G(A,A)| / |G(A)| = {math.sqrt(nAB2) / den:.3g}, expected 2")
        group = by_name.get(e.name)
        if group is not None and group.scale is not None:
            r.fd_scale = group.scale
            if group.verdict == "lost":
                r.anomalies.append("grad_lost")
                r.notes.append("the optimizer's gradient is zero but the loss changes along this parameter")
            elif group.verdict == "scaled":
                r.anomalies.append("grad_scaled")
                r.notes.append(_scale_note(r, group.scale))
            elif group.verdict == "wrong":
                r.anomalies.append("grad_inconsistent")
                r.notes.append(f"reported/estimated along the reported gradient: {group.scale:.3g}")
        r.anomalies = sorted(dict.fromkeys(r.anomalies), key=PREFLIGHT_ANOMALIES.index)
    return {
        "linearity": (
            "8 x unit round-off of the least precise of gradient and parameter dtypes (at least 4e-6)"
            if check.rtol is None
            else f"rtol={check.rtol}"
        ),
        "linearity_max": max(tol_used) if tol_used else None,
        "repeat": "A is repeated only where a verdict failed; differing there by more than half the tolerance "
        "makes the verdict grad_nondeterministic",
        "fd_rtol": check.fd_rtol,
        "fd_eps": check.fd_eps,
        "fd_floor": "|loss| x unit round-off of the compute dtype / 64",
        "fd_method": "forward differences, confirmed by central differences wherever they disagree",
        "subset": SUBSET,
        "copy": "G(A), then G(A) + G(B), kept rounded to the narrowest of bf16 and fp32 whose unit round-off is "
        "at most 1/8 of the tolerance: it moves |G(A,B) - G(A) - G(B)| / |(G(A), G(B))| by at most "
        "(sqrt(5) + that ratio) of its units",
        "copy_dtypes": sorted(check.copy_dtypes),
    }


def _judge_fd(group: FdGroup, fd: float, pred: float, rtol: float, method: str) -> None:
    group.fd = fd
    group.predicted = pred
    group.method = method
    floor = abs(group.loss or 0.0) * group.unit / 64 + 1e-30
    group.floor = floor
    group.scale = None
    if not (math.isfinite(fd) and math.isfinite(pred)):
        group.verdict = "not finite"
        return
    if group.zero_gradient:
        lost = abs(fd) > 8 * floor
        group.verdict = "lost" if lost else "unused"
        group.scale = 0.0 if lost else None
        return
    if abs(fd) <= floor and abs(pred) <= floor:
        group.verdict = "no signal"
        return
    group.scale = pred / fd if fd != 0 else math.inf
    # symmetric in the factor: reported within [estimate / (1 + rtol), estimate x (1 + rtol)], round-off aside
    low, high = sorted((fd / (1 + rtol), fd * (1 + rtol)))
    if low - 4 * floor <= pred <= high + 4 * floor:
        group.verdict = "ok"
    else:
        group.verdict = "scaled" if 0 < group.scale <= 64 else "wrong"


def _accumulation_verdict(
    r: ParamResult, fit: list[float | None], nAB2: float, den: float, tol: float
) -> None:
    if math.sqrt(nAB2) <= tol * den:
        r.anomalies.append("grad_lost")
        r.notes.append("G(A,B) is zero: the micro-batches' gradients never reached the optimizer")
        return
    if any(x is None for x in fit):
        r.anomalies.append("grad_inconsistent")
        return
    aa, bb, ab, xa, xb = (float(x) for x in fit)  # type: ignore[arg-type]
    det = aa * bb - ab * ab
    if not (aa > 0 and bb > 0) or det <= 1e-6 * aa * bb:
        r.anomalies.append("grad_inconsistent")
        r.notes.append("G(A) and G(B) are parallel on the subset: cannot tell which micro-batch was kept")
        return
    alpha = (xa * bb - xb * ab) / det
    beta = (xb * aa - xa * ab) / det
    r.fit = (alpha, beta)
    if abs(alpha) <= FIT_TOL and abs(beta - 1) <= FIT_TOL:
        r.anomalies.append("grad_overwritten")
        r.notes.append(_overwrite_note(r))
    elif abs(alpha - 1) <= FIT_TOL and abs(beta) <= FIT_TOL:
        r.anomalies.append("grad_lost")
        r.notes.append("G(A,B) = G(A): the later micro-batch's gradient was dropped")
    elif abs(alpha) <= FIT_TOL and abs(beta) > FIT_TOL:
        r.anomalies.append("grad_overwritten")
        r.notes.append(f"G(A,B) = {beta:.2f} G(B): only the last micro-batch survives, scaled")
    else:
        r.anomalies.append("grad_inconsistent")
        r.notes.append(f"G(A,B) = {alpha:.2f} G(A) + {beta:.2f} G(B)")


def _overwrite_note(r: ParamResult) -> str:
    if r.overwrite_main_grad is True:
        return (
            "overwrite_main_grad is True while main_grad is the persistent (unsharded) buffer: the fused wgrad "
            "overwrites the earlier micro-batch"
        )
    if r.mechanism_kind == "megatron_linear":
        return (
            "Megatron's linear writes the wgrad with out=main_grad (megatron-core tensor_parallel/layers.py, "
            f"Megatron-FSDP branch) whatever overwrite_main_grad says (here {r.overwrite_main_grad})"
        )
    return f"the gradient path replaces main_grad instead of adding to it (overwrite_main_grad={r.overwrite_main_grad})"


def _scale_note(r: ParamResult, scale: float) -> str:
    if abs(scale - 2) <= 0.3 and r.overwrite_main_grad is True:
        return (
            "x2 with overwrite_main_grad=True: the fused op returned main_grad as the autograd gradient and the "
            "wrapper added it into main_grad again (TE op-fuser BasicLinear)"
        )
    return f"the optimizer's gradient is {scale:.3g} x the finite-difference estimate"


def _result_from_dict(data: dict[str, Any]) -> PreflightResult:
    """A PreflightResult rebuilt from `to_dict()` output (for `maingrad preflight --show`)."""
    params = []
    fields = set(ParamResult.__dataclass_fields__)
    for p in data.get("params", []):
        kwargs = {k: v for k, v in p.items() if k in fields}
        if kwargs.get("fit") is not None:
            kwargs["fit"] = tuple(kwargs["fit"])
        params.append(ParamResult(**kwargs))
    group_fields = set(FdGroup.__dataclass_fields__)
    groups = [FdGroup(**{k: v for k, v in g.items() if k in group_fields}) for g in data.get("groups", [])]
    return PreflightResult(
        wrapper=data.get("wrapper", "?"),
        strategy=data.get("strategy"),
        status=data.get("status", "error"),
        params=params,
        groups=groups,
        cost=data.get("cost", {}),
        tolerances=data.get("tolerances", {}),
        error=data.get("error"),
        label=data.get("label"),
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

        maingrad.hooks.preflight_from_env(model, run_microbatch, [batch_a, batch_b], loss_fn=loss_fn)

    MAINGRAD_PREFLIGHT: "off"/unset does nothing (returns None, batches untouched); "warn" runs the check and
    prints the table on rank 0; "on" also raises PreflightFailed when it failed; "only" exits the process with
    status 0 (pass) or 1 (fail/error) right after, so the script never trains. MAINGRAD_PREFLIGHT_JSON writes
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
        raise SystemExit(0 if result.ok else 1)
    if mode == "on" and not result.ok:
        raise PreflightFailed(result)
    return result
