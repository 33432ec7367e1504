"""`maingrad.hooks.preflight`: prove, on the user's own model and wrapper, that every parameter's gradient is
the sum of its micro-batches' gradients, before the long job.

    result = maingrad.hooks.preflight(model, run_microbatch, batches, loss_fn=loss_fn)
    print(result)          # table, worst first; result.ok, result.to_dict(), result.records()

`run_microbatch(model, batch)` is the training code's own forward and backward of one micro-batch (it calls
`loss.backward()`; its return value is ignored unless `loss_fn` is missing); `loss_fn(model, batch)` returns
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
  autograd gradient doubles it) keeps linearity, so each parameter group's gradient is compared with central
  finite differences of the loss of A along the group's own reported gradient, (L(w+d) - L(w-d)) / 2 against
  <G, d>, d rounded to the dtype the forward computes with first. A factor outside 1 +- `fd_rtol` is
  `grad_scaled`; a zero gradient where the loss changes is `grad_lost`. Groups: one per fused-wgrad kind and
  parent module type (attention's TE linears, an MLP's fused ops, the experts), one for everything plain
  autograd computes.

Tolerances come from the dtypes: linearity within 8 units of round-off of the least precise of the gradient's
and the parameter's dtypes (bf16: 3.1%, fp32: 4.8e-7, at least 4e-6); finite differences judged only above the
loss's round-off (the compute dtype's unit / 64 of the loss) and within `fd_rtol` (default 25%, so x2 and x0
are far outside and router jitter is not).

It leaves no trace: gradient buffers are zeroed through the wrapper's own API (a plain module gets its own
`.grad` tensors back), every weight it perturbs is restored bit for bit (and reinstalled through the wrapper),
module buffers are copied back, every random generator it knows of is set back to the state it found
(`preflight_state.py`), no optimizer is touched and no hook is registered. Each micro-batch starts from the
caller's random state, so dropout repeats exactly; randomness preflight cannot reset shows up as
`grad_nondeterministic`, never as an accumulation verdict.

Cost: four micro-batch forward+backward passes (two steps of two micro-batches; five when something fails) and
two forward passes per finite-difference group. Memory: one copy of the gradients (G(A), then G(A) + G(B)),
or, while the finite differences run before it is taken, one copy of the largest group's weights. Gradient
reads stay on the device: two host syncs (the gradient and weight norms that size the perturbations, and the
one comparison at the end), three when something failed and A is repeated.
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
from typing import Any

import torch

from maingrad.contracts.anomalies import ANOMALIES, PREFLIGHT_ANOMALIES
from maingrad.contracts.records import SCHEMA_VERSION, WHOLE_CALL
from maingrad.hooks.preflight_state import BufferState, RngPair, RngState
from maingrad.hooks.preflight_wrappers import Adapter, Entry, choose, normalize_name

SUBSET = 4096  # elements per parameter kept for the decomposition G(A,B) ~ a G(A) + b G(B) and the repeat
FIT_TOL = 0.15  # |a|, |b - 1| below this: "keeps the last micro-batch only"
FD_GROUPS: tuple[str, ...] = ("mechanism", "module_type", "param")
_DIGITS = re.compile(r"\d+")

RunMicrobatch = Callable[[torch.nn.Module, Any], Any]


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the distance from 1 to the next representable number."""
    if dtype.is_floating_point:
        return float(torch.finfo(dtype).eps) / 2
    return 0.0


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
            rec = {
                "schema": SCHEMA_VERSION,
                "id": f"{run}:{rank}:preflight-{len(out)}",
                "run": run,
                "rank": rank,
                "step": 0,
                "microbatch": 0,
                "phase": "preflight",
                "module": "*",
                "param": WHOLE_CALL,
                "has_main_grad": False,
                "main_grad_is_none": None,
                "dtype": None,
                "shape": None,
                "device": None,
                "data_ptr": None,
                "overwrite_main_grad": None,
                "grad_added_to_main_grad": None,
                "is_fsdp_param": False,
                "action": "none",
                "anomaly": None,
                "mode": "check",
                "commit": commit,
                "t_ns": t_ns,
            }
            rec.update(fields)
            out.append(rec)

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


def _subset(flat: torch.Tensor, name: str) -> torch.Tensor:
    """Up to SUBSET evenly spaced elements (a strided view: no index tensor), copied."""
    n = flat.numel()
    stride = max(1, n // SUBSET)
    offset = (sum(name.encode()) % stride) if stride > 1 else 0
    return flat[offset::stride][:SUBSET].detach().float().clone()


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1)


def _norm(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t.float())


def _stack_to_host(values: list[torch.Tensor]) -> list[float]:
    """One device->host transfer per device for a list of 0-dim tensors."""
    if not values:
        return []
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        by_device.setdefault(v.device, []).append(i)
    out = [0.0] * len(values)
    for indexes in by_device.values():
        host = torch.stack([values[i].double() for i in indexes]).cpu().tolist()
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
        self.timings: dict[str, float] = {}
        self.dist = _Dist(sharded=adapter.sharded)
        self.fd_values: list[tuple[FdGroup, torch.Tensor, torch.Tensor, torch.Tensor, float]] = []
        kinds = _fused_kinds(model)
        self.results = [self._result(e, kinds.get(e.name)) for e in entries]
        n = len(entries)
        # device-side numbers, one slot per parameter (None: no gradient there)
        self.st: dict[str, list[Any]] = {
            k: [None] * n for k in ("nA2", "nB2", "nAB2", "d2", "dl2", "subA", "subB", "subAB", "subR")
        }

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

    # -- running micro-batches ---------------------------------------------------------------------------------
    def _run(self, batches: Sequence[Any]) -> list[torch.Tensor | None]:
        """Zero, run the micro-batches from the saved random state each, finish the sync; the flattened
        gradients the optimizer would read (the wrapper's own tensors: never kept past the next run)."""
        self.adapter.prepare()
        self.adapter.zero()
        for batch in batches:
            self.rng.apply()
            self.run_microbatch(self.model, batch)
            self.passes += 1
        self.adapter.finish()
        out: list[torch.Tensor | None] = []
        for e in self.entries:
            g = self.adapter.grad(e)
            out.append(None if g is None else _flat(g))
        return out

    def _loss(self, batch: Any) -> torch.Tensor:
        self.rng.apply()
        if self.loss_fn is not None:
            self.forwards += 1
            with torch.no_grad():
                loss = self.loss_fn(self.model, batch)
        else:
            self.adapter.prepare()
            self.adapter.zero()
            loss = self.run_microbatch(self.model, batch)
            self.adapter.finish()
            self.passes += 1
            if loss is None:
                raise ValueError(
                    "finite differences need the loss: pass loss_fn=, or return the loss from run_microbatch"
                )
        if not isinstance(loss, torch.Tensor):
            loss = torch.tensor(float(loss))
        return self.dist.mean_loss(loss)

    def _subsets(self, key: str, flats: list[torch.Tensor | None]) -> None:
        for i, f in enumerate(flats):
            if f is not None:
                self.st[key][i] = _subset(f, self.entries[i].name)

    @staticmethod
    def _present(flats: list[torch.Tensor | None]) -> list[int]:
        return [i for i, f in enumerate(flats) if f is not None]

    # -- the laws ---------------------------------------------------------------------------------------------
    def run_a(self) -> list[torch.Tensor | None]:
        """Micro-batch A alone: a copy of G(A) (the one copy of the gradients preflight holds), its norms and
        subset; returns the wrapper's live G(A), the finite differences' directions."""
        flats = self._run([self.batches[0]])
        idx = self._present(flats)
        live = [flats[i] for i in idx]
        for i, norm in zip(idx, _norms(live), strict=True):
            self.st["nA2"][i] = norm * norm
            self.results[i].dtype = str(flats[i].dtype)
        self.copy: list[torch.Tensor | None] = [None] * len(flats)
        self._subsets("subA", flats)
        return flats

    def keep_copy(self, flats: list[torch.Tensor | None]) -> None:
        """The one copy of the gradients preflight holds: G(A), then G(A) + G(B). Taken after the finite
        differences (which perturb weights while the wrapper still holds G(A)), so the two never coexist."""
        idx = self._present(flats)
        live = [flats[i] for i in idx]
        for i, c in zip(idx, torch._foreach_mul(live, 1.0) if live else [], strict=True):
            self.copy[i] = c

    def run_rest(self) -> None:
        """B alone, then A and B together (one batch: A twice), each compared with the copy in place."""
        st, copy = self.st, self.copy
        b = self.batches[1] if len(self.batches) > 1 else None
        if b is not None:
            flats = self._run([b])
            idx = self._present(flats)
            for i, norm in zip(idx, _norms([flats[i] for i in idx]), strict=True):
                st["nB2"][i] = norm * norm
            self._subsets("subB", flats)
            for i in idx:
                if copy[i] is None:
                    copy[i] = flats[i].clone()
                else:
                    copy[i].add_(flats[i])  # G(A) + G(B)
            del flats
            flats = self._run([self.batches[0], b])
        else:
            flats = self._run([self.batches[0], self.batches[0]])
        idx = self._present(flats)
        for i, norm in zip(idx, _norms([flats[i] for i in idx]), strict=True):
            st["nAB2"][i] = norm * norm
        self._subsets("subAB", flats)
        both = [i for i in idx if copy[i] is not None]
        cs, fs = [copy[i] for i in both], [flats[i] for i in both]
        if both and b is not None:
            torch._foreach_sub_(cs, fs)  # G(A) + G(B) - G(A,B), in place: no second copy
            for i, norm in zip(both, _norms(cs), strict=True):
                st["d2"][i] = norm * norm
        elif both:
            torch._foreach_mul_(cs, 2.0)
            torch._foreach_sub_(cs, fs)  # 2 G(A) - G(A,A)
            for i, norm in zip(both, _norms(cs), strict=True):
                st["d2"][i] = norm * norm
            torch._foreach_add_(cs, fs)
            torch._foreach_mul_(cs, 0.5)
            torch._foreach_sub_(cs, fs)  # G(A) - G(A,A)
            for i, norm in zip(both, _norms(cs), strict=True):
                st["dl2"][i] = norm * norm
        for i, c in enumerate(copy):  # a gradient that vanished in the last run counts as zero there
            if c is not None and flats[i] is None:
                st["nAB2"][i] = torch.zeros((), device=c.device)
                norm = _norm(c)
                st["d2"][i] = norm * norm * (1 if b is not None else 4)
                st["dl2"][i] = norm * norm
        self.copy = []

    def repeat(self) -> None:
        """A again from zeroed buffers, compared with the first A on the subset (run only when some parameter
        failed accumulation: a repeat that differs by more than the tolerance is nondeterminism, not a bug)."""
        flats = self._run([self.batches[0]])
        self._subsets("subR", flats)

    def fd(self, grads: list[torch.Tensor | None], host: dict[str, list[float]]) -> list[FdGroup]:
        """Central finite differences of the loss of A, one pair of forwards per group."""
        groups: dict[tuple[str, bool], list[int]] = {}
        for i, r in enumerate(self.results):
            gnorm = host["gnorm"][i]
            if not math.isfinite(gnorm):
                continue  # a non-finite gradient has no direction to probe
            groups.setdefault((r.group, not gnorm > 0.0), []).append(i)
        out: list[FdGroup] = []
        for (key, zero), indexes in groups.items():
            group = FdGroup(key=key, names=[self.entries[i].name for i in indexes], zero_gradient=zero)
            out.append(group)
            plus, minus, pred = self._fd_pair(indexes, grads, zero, host)
            u = max(unit_roundoff(self.adapter.compute_dtype(self.entries[i])) for i in indexes)
            self.fd_values.append((group, plus, minus, pred, u))
        self.adapter.commit()  # the restored weights, installed once for all groups
        return out

    def _direction(
        self, i: int, grad: torch.Tensor | None, zero: bool, target: torch.Tensor, host
    ) -> torch.Tensor:
        """d for parameter i: along its reported gradient (random signs where that is 0), with norm fd_eps x
        the weight's norm (at least fd_eps x 2^-7 per element, for zero-initialised weights)."""
        size = max(host["tnorm"][i], math.sqrt(target.numel()) * 2.0**-7) * self.fd_eps
        if zero or grad is None:
            gen = torch.Generator(device=target.device).manual_seed(1009 + i)
            direction = torch.randint(0, 2, target.shape, generator=gen, device=target.device).float() * 2 - 1
            return direction * (size / math.sqrt(max(target.numel(), 1)))
        return grad.reshape(target.shape).float() * (size / host["gnorm"][i])

    def _fd_pair(
        self, indexes: list[int], grads: list[torch.Tensor | None], zero: bool, host: dict[str, list[float]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        adapter = self.adapter
        targets = [adapter.target(self.entries[i]) for i in indexes]
        saved = [t.clone() for t in targets]
        pred = torch.zeros((), dtype=torch.float64, device=targets[0].device)
        batch = self.batches[0]
        try:
            losses = []
            for sign in (1.0, -1.0):
                with torch.no_grad():
                    for i, t, orig in zip(indexes, targets, saved, strict=True):
                        g = grads[i]
                        d = self._direction(i, g, zero, t, host)
                        if sign < 0:
                            t.copy_(orig)
                        t.add_(d, alpha=sign)
                        del d
                        if g is not None:
                            cdt = adapter.compute_dtype(self.entries[i])
                            if cdt == t.dtype:
                                moved = t.float() - orig.float()
                            else:
                                moved = t.to(cdt).float() - orig.to(cdt).float()
                            contribution = torch.dot(g.reshape(-1).float(), moved.reshape(-1))
                            pred = pred + (sign / 2) * contribution.double().to(pred.device)
                            del moved
                adapter.commit()
                losses.append(self._loss(batch))
        finally:
            with torch.no_grad():
                torch._foreach_copy_(targets, saved)
        pred = self.dist.sum_stats(pred.reshape(1)).reshape(())
        return losses[0], losses[1], pred


def _norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 norms of many tensors in one multi-tensor launch per device and dtype."""
    if not tensors:
        return []
    try:
        return list(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    except (RuntimeError, TypeError):  # mixed devices/dtypes on an old torch
        return [_norm(t) for t in tensors]


def _and(a: Any, b: torch.Tensor) -> torch.Tensor:
    return b if a is None else a & b


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
    fd_rtol: float = 0.25,
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
    run_microbatch and read its return value: one backward more per evaluation).
    wrapper: "auto" (duck typing), "megatron-fsdp", "megatron-ddp", "fsdp2", "plain", or an Adapter.
    params: fnmatch patterns over parameter names (wrapper prefixes `module.` removed) to judge; default all.
    finite_differences: compare with the loss's central differences (the scale check); fd_groups: "mechanism"
    (default: one group per fused-wgrad module type, one for everything plain autograd computes), "module_type"
    (one per module type), "param" (one per parameter: the most forwards). fd_eps: the perturbation's norm
    relative to the weights'; fd_rtol: accepted relative disagreement. rtol: linearity tolerance (default from
    the dtypes). rng_states: extra (get_state, set_state) pairs to reset before every micro-batch.
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
    check.rng = RngState(check.rng_states)
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
        lap("runs")
        if (
            check.loss_fn is None
        ):  # the evaluations run backward into the wrapper's buffers: directions from the copy
            check.keep_copy(live)
            live = list(check.copy)
        if check.finite_differences:
            present = [i for i, f in enumerate(live) if f is not None]
            targets = [adapter.target(check.entries[i]) for i in present]
            norms = _norms([live[i] for i in present]) + _norms(targets)
            values = _stack_to_host(norms)  # sync 1: the finite differences' step sizes
            host = {"gnorm": [math.inf] * len(live), "tnorm": [0.0] * len(live)}
            for j, i in enumerate(present):
                host["gnorm"][i] = values[j]
                host["tnorm"][i] = values[len(present) + j]
            for i, f in enumerate(live):
                if f is None:
                    host["gnorm"][i] = 0.0
                    host["tnorm"][i] = float(_norm(adapter.target(check.entries[i])))
            groups = check.fd(live, host)
            lap("finite_differences")
        if check.loss_fn is not None:
            check.keep_copy(live)
        del live
        check.run_rest()
        lap("runs")
        tolerances = _classify(check, groups)  # sync 2
        suspects = [i for i, r in enumerate(check.results) if r.anomalies and r.finite]
        if suspects:
            check.repeat()
            lap("runs")
            _judge_repeat(check, suspects)  # sync 3, only when something failed
        lap("comparison")
    except Exception as exc:  # noqa: BLE001 - the model's failure is the result, not a crash of the caller
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500]
        tb = traceback.format_exc(limit=12)
    finally:
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


def _judge_repeat(check: _Preflight, suspects: list[int]) -> None:
    """Where a verdict failed: does a repeat of A differ from the first A by more than the tolerance?"""
    st = check.st
    values: list[torch.Tensor] = []
    rows = []
    for i in suspects:
        sa, sr = st["subA"][i], st["subR"][i]
        if sa is None or sr is None:
            continue
        values += [_norm(sr - sa) ** 2, _norm(sa) ** 2]
        rows.append(i)
    host = _stack_to_host(values)
    for j, i in enumerate(rows):
        r = check.results[i]
        rep2, sa2 = max(host[2 * j], 0.0), max(host[2 * j + 1], 0.0)
        r.rel_repeat = math.sqrt(rep2 / sa2) if sa2 > 0 else (0.0 if rep2 == 0 else math.inf)
        if r.rel_repeat > r.tolerance / 2:
            # the first A and its repeat differ: the verdicts rest on noise, not on a bug
            r.anomalies = ["grad_nondeterministic"]  # the finite differences rest on the same noise
            r.notes = [
                f"micro-batch A repeated from the same state and random state differs by {r.rel_repeat:.3g}"
            ]


def _perturbation_invisible(groups: list[FdGroup]) -> bool:
    """Every group with a reported gradient saw no loss change at all, while the gradient predicted one."""
    probed = [g for g in groups if not g.zero_gradient and g.fd is not None and g.floor is not None]
    return bool(probed) and all(
        abs(g.fd) <= 8 * g.floor and abs(g.predicted or 0.0) > 8 * g.floor for g in probed
    )


def _classify(check: _Preflight, groups: list[FdGroup]) -> dict[str, Any]:
    """The one comparison at the end: every device-side number goes to the host at once (sync 2)."""
    two = len(check.batches) > 1
    st = check.st
    values: list[torch.Tensor] = []

    def put(x: Any) -> int:
        """Index of x among the values sent to the host; None is sent as -1 (read back as 'absent')."""
        if isinstance(x, torch.Tensor):
            values.append(x.detach().reshape(()))
        else:
            values.append(torch.tensor(-1.0 if x is None else float(x)))
        return len(values) - 1

    idx: list[dict[str, int]] = []
    for i in range(len(check.entries)):
        sa, sb, sab = st["subA"][i], st["subB"][i], st["subAB"][i]
        row = {k: put(st[k][i]) for k in ("nA2", "nB2", "nAB2", "d2", "dl2")}
        if two and sa is not None and sb is not None and sab is not None:
            row["aa"] = put(torch.dot(sa, sa))
            row["bb"] = put(torch.dot(sb, sb))
            row["ab"] = put(torch.dot(sa, sb))
            row["xa"] = put(torch.dot(sab, sa))
            row["xb"] = put(torch.dot(sab, sb))
        idx.append(row)
    fd_index = [(g, put(plus), put(minus), put(pred), u) for g, plus, minus, pred, u in check.fd_values]
    if check.dist.world > 1 and check.dist.sharded:
        # squared norms and inner products of shards add up across ranks; the FD numbers are already global
        keys = [k for row in idx for k in row.values()]
        reduced = check.dist.sum_stats(torch.stack([values[k].double() for k in keys]))
        for j, k in enumerate(keys):
            values[k] = reduced[j]
    host = _stack_to_host(values)

    for group, ip, im, ipred, u in fd_index:
        _judge_fd(group, host[ip], host[im], host[ipred], u, check.fd_rtol)
    by_name = {name: g for g in groups for name in g.names}

    tol_used: list[float] = []
    for e, r, row in zip(check.entries, check.results, idx, strict=True):
        raw = e.raw_param
        r.dtype = r.dtype or str(e.opt_param.dtype)
        r.shape = list(e.opt_param.shape)
        r.device = str(e.opt_param.device)
        flag = getattr(raw, "overwrite_main_grad", None)
        r.overwrite_main_grad = flag if isinstance(flag, bool) else None
        r.has_main_grad = hasattr(raw, "main_grad")
        r.is_fsdp_param = hasattr(raw, "__fsdp_param__")
        grad_dtype = getattr(torch, r.dtype.replace("torch.", ""), e.opt_param.dtype)
        u = max(
            unit_roundoff(grad_dtype),
            unit_roundoff(check.adapter.compute_dtype(e)),
            unit_roundoff(e.opt_param.dtype),
        )
        tol = check.rtol if check.rtol is not None else max(8 * u, 4e-6)
        r.tolerance = tol
        raw_values = [host[row[k]] for k in ("nA2", "nB2", "nAB2", "d2", "dl2")]
        nA2, nB2, nAB2, d2, dl2 = (max(x, 0.0) for x in raw_values)
        r.norm_a = math.sqrt(nA2)
        # a NaN/Inf anywhere makes the norm non-finite
        r.finite = all(math.isfinite(x) for x in raw_values)
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
                    _accumulation_verdict(r, host, row, nAB2, den, tol)
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
        "repeat": "A is repeated only where accumulation failed; differing by more than half the tolerance "
        "there makes the verdict grad_nondeterministic",
        "fd_rtol": check.fd_rtol,
        "fd_eps": check.fd_eps,
        "fd_floor": "|loss| x unit round-off of the compute dtype / 64",
        "subset": SUBSET,
    }


def _judge_fd(group: FdGroup, plus: float, minus: float, pred: float, u: float, rtol: float) -> None:
    group.fd = (plus - minus) / 2
    group.predicted = pred
    group.loss = (plus + minus) / 2
    floor = abs(group.loss) * u / 64 + 1e-30
    group.floor = floor
    if not (math.isfinite(group.fd) and math.isfinite(pred)):
        group.verdict = "not finite"
        return
    if group.zero_gradient:
        lost = abs(group.fd) > 8 * floor
        group.verdict = "lost" if lost else "unused"
        group.scale = 0.0 if lost else None
        return
    if abs(group.fd) <= floor and abs(pred) <= floor:
        group.verdict = "no signal"
        return
    group.scale = pred / group.fd if group.fd != 0 else math.inf
    if abs(pred - group.fd) <= rtol * abs(group.fd) + 4 * floor:
        group.verdict = "ok"
    else:
        group.verdict = "scaled" if 0 < group.scale <= 64 else "wrong"


def _accumulation_verdict(
    r: ParamResult, host: list[float], row: dict[str, int], nAB2: float, den: float, tol: float
) -> None:
    if math.sqrt(nAB2) <= tol * den:
        r.anomalies.append("grad_lost")
        r.notes.append("G(A,B) is zero: the micro-batches' gradients never reached the optimizer")
        return
    if "aa" not in row:
        r.anomalies.append("grad_inconsistent")
        return
    aa, bb, ab, xa, xb = (host[row[k]] for k in ("aa", "bb", "ab", "xa", "xb"))
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
_CALLS = {"run_from_env": 0}


class PreflightFailed(RuntimeError):
    """Raised by run_from_env() in mode "on" when the check failed: the job stops before training."""

    def __init__(self, result: PreflightResult) -> None:
        super().__init__(result.table())
        self.result = result


def run_from_env(
    model: torch.nn.Module,
    run_microbatch: RunMicrobatch,
    batches: Iterable[Any],
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> PreflightResult | None:
    """One line in a training script, switched from the environment (`maingrad preflight --script` sets it):

        maingrad.hooks.preflight.run_from_env(model, run_microbatch, [batch_a, batch_b], loss_fn=loss_fn)

    MAINGRAD_PREFLIGHT: "off"/unset does nothing (returns None, batches untouched); "warn" runs the check and
    prints the table on rank 0; "on" also raises PreflightFailed when it failed; "only" exits the process with
    status 0 (pass) or 1 (fail/error) right after, so the script never trains. MAINGRAD_PREFLIGHT_JSON writes
    the result, MAINGRAD_PREFLIGHT_SINKS sends the records (with MAINGRAD_RUN / MAINGRAD_COMMIT /
    MAINGRAD_PROJECT / MAINGRAD_TOKEN as for install()). Call it after wrapping the model, before the first
    optimizer step.
    """
    import json
    import os
    import sys

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
    _CALLS["run_from_env"] += 1
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


class _CallableModule(type(sys.modules[__name__])):  # type: ignore[misc]
    """`maingrad.hooks.preflight` is both this module and the function: importing the submodule rebinds the
    package attribute to the module, so the module itself must be callable as preflight(...)."""

    def __call__(self, *args: Any, **kwargs: Any) -> PreflightResult:
        return preflight(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
