"""What `preflight()` returns: per-parameter verdicts, the finite-difference probes, the cost, and the table /
JSON / record forms (no torch: `maingrad preflight --show` rebuilds a result from its JSON)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from maingrad.contracts.anomalies import ANOMALIES, PREFLIGHT_ANOMALIES
from maingrad.contracts.records import WHOLE_CALL, new_record, record_id

# What a parameter's `verdict` can be besides an anomaly code (or several joined by "+"):
OK = "ok"  # every law held and the finite-difference estimate agrees within its error bar
UNUSED = (
    "unused"  # zero gradient and the loss unchanged bit for bit with the parameter moved (an expert with no
    # tokens); a loss that moves within its noise is inconclusive: an effect below the noise is not seen
)
INCONCLUSIVE = "inconclusive"  # the laws held but no step gave a reliable estimate: `notes` say why
VERDICTS: tuple[str, ...] = (OK, UNUSED, INCONCLUSIVE, *PREFLIGHT_ANOMALIES)
STATUSES: tuple[str, ...] = ("pass", "fail", "inconclusive", "error")


@dataclass
class ParamResult:
    """What preflight measured and concluded for one parameter."""

    name: str
    module: str
    leaf: str
    module_type: str  # "<parent class>/<owner class>.<leaf, digits as #>"
    mechanism_kind: str  # fused-wgrad kind from maingrad.hooks discovery, or "autograd"
    group: str  # the finite-difference group it starts in
    dtype: str | None = None
    shape: list[int] | None = None
    device: str | None = None
    numel: int = 0
    overwrite_main_grad: bool | None = None
    has_main_grad: bool = False
    is_fsdp_param: bool = False
    norm_a: float = 0.0  # |G| of the first micro-batch alone
    norm_b: float | None = None  # |G| of the second micro-batch alone (None with one)
    rel_repeat: float | None = (
        None  # |G(first again) - G(first)| / |G(first)| on the subset (only on failure)
    )
    rel_sum: float | None = None  # |G(sequence) - sum of the singles| / sqrt(sum of |single|^2)
    fit: tuple[float, ...] | None = None  # G(sequence) ~ sum_k c_k G(k-th micro-batch of the sequence)
    # |G(sequence) - the fit| / (sum_k |G(k)|^2)^1/2 on the subset (only for a failing fit; below tolerance / 8
    # run-to-run noise cannot explain the verdict, and the first micro-batch is not repeated)
    fit_residual: float | None = None
    rel_twice: float | None = None  # one micro-batch: rel_sum of (A, A) against 2 G(A)
    stale: float | None = None  # |G| read right after the wrapper zeroed the buffers, / |G(first)|
    fd_scale: float | None = None  # reported / estimated along the reported gradient (or 0 for a lost one)
    fd_error: float | None = None  # the estimate's relative error bar
    fd_step: float | None = None  # the relative step whose estimate was accepted
    fd_probe: str | None = None  # the probe (group, or a part of it after bisection) that judged it
    # a passing probe: 1 + the relative error of this gradient that the probe could have passed (x1.5 means
    # anything from x0.5 to x1.5 could hide); None where its share of the probe's change is unknown or zero,
    # or it was not probed
    fd_resolution: float | None = None
    # reported / measured on the weight's own module's output (module-local finite differences; for a weight
    # moved with others of its module, the set's ratio), and that estimate's error bar
    fd_local: float | None = None
    fd_local_error: float | None = None
    finite: bool = True
    tolerance: float = 0.0  # linearity tolerance
    fd_tolerance: float = 0.0  # finite-difference tolerance beyond the error bar (from the compute dtype)
    anomalies: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unused: bool = False
    inconclusive: bool = False

    def could_hide(self, factor: float) -> bool:
        """Whether the finite differences could have passed this gradient off by `factor` (x2, x0.5, ...): not
        probed, no bound, or a bound that wide. A failing parameter hides nothing: it was caught."""
        if self.anomalies:
            return False
        if self.fd_resolution is None:
            return True
        return self.fd_resolution - 1 >= abs(factor - 1)

    @property
    def ok(self) -> bool:
        """No anomaly (an unused or inconclusive parameter is not a failure; see `verdict`)."""
        return not self.anomalies

    @property
    def verdict(self) -> str:
        """ "ok", "unused", "inconclusive", or the anomaly codes joined by "+" (worst first)."""
        if self.anomalies:
            return "+".join(self.anomalies)
        if self.inconclusive:
            return INCONCLUSIVE
        return UNUSED if self.unused else OK

    def to_dict(self) -> dict[str, Any]:
        out = dict(vars(self))
        out["fit"] = list(self.fit) if self.fit is not None else None
        out["verdict"] = self.verdict
        return out


@dataclass
class Probe:
    """One finite-difference estimate: the loss of the first micro-batch along the reported gradient of a set
    of parameters (each moved by `step` x its weights' norm), or along a random direction where the reported
    gradient is zero. Central differences at two or more steps; `levels` holds (step, loss change, predicted)."""

    key: str
    names: list[str]
    zero_gradient: bool
    depth: int = 0  # bisection depth (0: a group)
    levels: list[tuple[float, float, float]] = field(default_factory=list)
    scale: float | None = None  # reported / estimated (0.0: the loss moves but the gradient is zero)
    error: float | None = None  # relative error bar of the estimate
    step: float | None = None  # the accepted step
    verdict: str = "not judged"  # ok | scaled | wrong | lost | unused | inconclusive | split | not finite
    reason: str = ""
    method: str = "central, two steps"
    noise: float = 0.0  # the loss's measured rounding noise used for this probe
    unit: float = 0.0  # unit round-off of the probe's compute dtype


@dataclass
class PreflightResult:
    """Verdicts per parameter, the finite-difference probes, the cost, and the table / JSON / records forms."""

    wrapper: str
    strategy: str | None
    status: str  # one of STATUSES
    params: list[ParamResult]
    groups: list[Probe]
    cost: dict[str, Any]
    tolerances: dict[str, Any]
    error: str | None = None
    error_traceback: str | None = None
    label: str | None = None
    wrapper_kind: str = "plain"
    microbatches: int = 0  # how many micro-batches were run (all that were passed)
    sequence: list[int] = field(default_factory=list)  # their order in the accumulated run (0-based)
    warnings: list[str] = field(default_factory=list)
    fixes: dict[str, str] = field(default_factory=dict)  # anomaly code -> fix for this wrapper
    # module-local finite differences: {"on": bool, "judged": n, "verdicts": {verdict: n}, "not_judged":
    # {reason: n}}, and where given "own_classes": {class: weights} judged by the loss alone in modules of the
    # caller's own classes (`classify._own_classes`), "declared": the module_fd_classes' names, "errors",
    # "used_outside"
    local: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Every parameter was checked and holds (an inconclusive parameter makes this False, not a failure)."""
        return self.status == "pass"

    @property
    def failed(self) -> bool:
        return self.status in ("fail", "error")

    @property
    def failing(self) -> list[ParamResult]:
        return [p for p in self.params if p.anomalies]

    @property
    def inconclusive(self) -> list[ParamResult]:
        return [p for p in self.params if p.inconclusive and not p.anomalies]

    def weakly_checked(self, factor: float = 2.0) -> list[ParamResult]:
        """Passing parameters whose finite-difference probe could have passed a gradient off by `factor`: what
        their ok does not rule out."""
        return [p for p in self.params if p.verdict == OK and p.fd_probe is not None and p.could_hide(factor)]

    def verdicts(self) -> dict[str, str]:
        """parameter name -> verdict, for every parameter."""
        return {p.name: p.verdict for p in self.params}

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "status": self.status,
            "wrapper": self.wrapper,
            "wrapper_kind": self.wrapper_kind,
            "strategy": self.strategy,
            "error": self.error,
            "microbatches": self.microbatches,
            "sequence": self.sequence,
            "warnings": self.warnings,
            "cost": self.cost,
            "tolerances": self.tolerances,
            "fixes": self.fixes,
            "local": self.local,
            "summary": self.summary_rows(),
            "groups": [vars(g) for g in self.groups],
            "params": [p.to_dict() for p in self.params],
        }

    # -- table ------------------------------------------------------------------------------------------------
    def summary_rows(self) -> list[dict[str, Any]]:
        """One row per (verdict, module type): count, examples, worst numbers, mechanism and fix; worst first."""
        rows: dict[tuple[str, str, str], dict[str, Any]] = {}
        for p in self.params:
            verdict = p.verdict
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
                row["fix"] = self.fix(p.anomalies[0]) if p.anomalies else ""
        order = {code: i for i, code in enumerate(PREFLIGHT_ANOMALIES)}
        order[INCONCLUSIVE] = len(order)

        def rank(row: dict[str, Any]) -> tuple[int, int, str]:
            first = row["verdict"].split("+")[0]
            return (order.get(first, len(order) + 1), -row["count"], row["module_type"])

        out = sorted(rows.values(), key=rank)
        for row in out:
            del row["_worst"]
        return out

    def fix(self, code: str) -> str:
        """The fix for `code` under this result's wrapper (the generic remedy where none was written)."""
        return self.fixes.get(code) or ANOMALIES[code].remedy

    def table(self) -> str:
        """The human form: failing module types worst first (mechanism per row), inconclusive ones, the passing
        ones in one line, the finite-difference probes, and each failing code's fix once."""
        failing, unsure = self.failing, self.inconclusive
        head = (
            f"maingrad preflight{f' [{self.label}]' if self.label else ''}: {self.status.upper()} - "
            f"{self.wrapper}{f' ({self.strategy})' if self.strategy else ''}: "
            f"{len(failing)} of {len(self.params)} parameters fail"
            + (f", {len(unsure)} inconclusive" if unsure else "")
        )
        lines = [head]
        if self.error:
            lines.append(f"  error: {self.error}")
        lines.extend(f"  warning: {w}" for w in self.warnings)
        cost = self.cost
        lines.append(
            f"  cost: {self.microbatches} micro-batches; {cost.get('microbatch_passes', 0)} forward+backward "
            f"passes, {cost.get('forward_passes', 0)} forward passes"
            + (f" ({cost['loss_replays']} replayed from a CUDA graph)" if cost.get("loss_replays") else "")
            + f", {cost.get('seconds', 0.0):.2f} s"
        )
        rows = self.summary_rows()
        bad = [row for row in rows if row["verdict"] not in (OK, UNUSED)]
        good = [row for row in rows if row["verdict"] in (OK, UNUSED)]
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
            count = sum(row["count"] for row in good if row["verdict"] == OK)
            unused = sum(row["count"] for row in good if row["verdict"] == UNUSED)
            lines.append(
                f"  {'ok':<30} {count:>4}  ({len(good)} module types)"
                + (f", {unused} unused" if unused else "")
            )
            bounded = [p for p in self.params if p.unused and p.notes]
            if bounded:
                names = ", ".join(p.name for p in bounded[:3]) + (", ..." if len(bounded) > 3 else "")
                lines.append(f"      {names}: {bounded[0].notes[0]}")
        if self.local.get("on"):
            judged = self.local.get("judged", 0)
            verdicts = ", ".join(f"{n} {v}" for v, n in sorted(self.local.get("verdicts", {}).items()))
            skipped = "; ".join(f"{n} {why}" for why, n in self.local.get("not_judged", {}).items())
            lines.append(
                f"  module-local finite differences: {judged} weight{'' if judged == 1 else 's'} judged on their own "
                f"module's output ({verdicts or 'none'})"
                + (f"; not judged there: {skipped}" if skipped else "")
            )
            own = self.local.get("own_classes", {})
            if own:
                lines.append(
                    "    judged by the loss alone, in modules of your own classes: "
                    + ", ".join(f"{name} ({n})" for name, n in list(own.items())[:4])
                    + (", ..." if len(own) > 4 else "")
                    + "; pass those whose forward is affine in each parameter and pure as module_fd_classes="
                )
            if self.local.get("declared"):
                lines.append(
                    "    probed as declared (module_fd_classes): " + ", ".join(self.local["declared"])
                )
            lines.extend(f"    a module rerun failed: {e}" for e in self.local.get("errors", []))
            outside = self.local.get("used_outside", {})
            if outside:
                lines.append(
                    "    used outside its module's call, e.g. "
                    + ", ".join(f"{n} ({how})" for n, how in outside.items())
                )
        weak = self.weakly_checked()
        if weak:
            lines.append(
                f"  finite differences cannot rule out a x2 gradient on {len(weak)} of the passing parameters: each "
                "carries too small a share of its probe's change (fd_resolution), e.g. "
                + ", ".join(p.name for p in weak[:3])
            )
        judged = [g for g in self.groups if g.verdict != "not judged"]
        if judged:
            lines.append("  finite differences (reported / estimated, error bar, step), per probe:")
            noise, drawn = self.tolerances.get("fd_noise"), self.tolerances.get("fd_noise_drawn")
            if isinstance(noise, float) and isinstance(drawn, float) and noise > drawn:
                lines.append(
                    f"    the loss's noise {noise:.3g}: its measured draw {drawn:.3g}, raised by what steps below "
                    "an agreeing pair showed"
                )
            for g in judged:
                scale = "-" if g.scale is None else f"{g.scale:.4g}"
                err = "" if g.error is None else f" +-{g.error:.2g}"
                step = "" if g.step is None else f" @2^{math.log2(g.step):.0f}"
                name = g.key if len(g.names) > 1 else g.names[0]
                why = f": {g.reason}" if g.reason and g.verdict in ("inconclusive", "wrong") else ""
                lines.append(
                    f"    {scale:>8}{err:<9}{step:<7} {g.verdict:<12} {'  ' * g.depth}{name} "
                    f"({len(g.names)} params){why}"
                )
        codes = list(dict.fromkeys(code for p in failing for code in p.anomalies))
        if self.status == "error":
            codes.insert(0, "preflight_error")
        if codes:
            lines.append("  fix:")
            lines.extend(f"    {code}: {self.fix(code)}" for code in codes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    # -- records ------------------------------------------------------------------------------------------------
    def records(
        self, *, run: str, rank: int = 0, commit: str | None = None, t_ns: int | None = None
    ) -> list[dict[str, Any]]:
        """Records of the runtime schema (phase "preflight", mode "check"): one per failing parameter and
        anomaly, and one for the whole check (param "*": anomaly `preflight_error` when it could not finish,
        else none) so a passing preflight shows on the dashboard too."""
        stamp = time.time_ns() if t_ns is None else t_ns
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
                "t_ns": stamp,
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
    values = [p.rel_sum or 0.0, p.rel_twice or 0.0, p.rel_repeat or 0.0, p.stale or 0.0]
    if p.fd_scale is not None:
        values.append(abs(math.log(abs(p.fd_scale))) if p.fd_scale != 0.0 else 99.0)
    return max(values) + (100.0 if not p.finite else 0.0)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _measured(p: ParamResult) -> str:
    parts = []
    if not p.finite:
        parts.append("non-finite gradient")
    if p.stale:
        parts.append(f"|G| after zeroing {_fmt(p.stale)} of |G(first)|")
    if p.rel_repeat:
        parts.append(f"repeat differs {_fmt(p.rel_repeat)}")
    if p.rel_sum is not None:
        parts.append(f"|G(seq)-sum of singles| {_fmt(p.rel_sum)}")
    if p.fit is not None:
        parts.append(
            "G(seq) = "
            + " + ".join(f"{c:.2f} g{k + 1}" for k, c in enumerate(p.fit))
            + " (by position)"
            + (f", residual {_fmt(p.fit_residual)}" if p.fit_residual is not None else "")
        )
    if p.fd_scale is not None:
        err = f" +-{p.fd_error:.2g}" if p.fd_error is not None else ""
        parts.append(f"reported/estimated x{p.fd_scale:.3g}{err}")
    return "; ".join(parts)


def result_from_dict(data: dict[str, Any]) -> PreflightResult:
    """A PreflightResult rebuilt from `to_dict()` output (for `maingrad preflight --show`)."""
    params = []
    names = set(ParamResult.__dataclass_fields__)
    for p in data.get("params", []):
        kwargs = {k: v for k, v in p.items() if k in names}
        if kwargs.get("fit") is not None:
            kwargs["fit"] = tuple(kwargs["fit"])
        params.append(ParamResult(**kwargs))
    probe_fields = set(Probe.__dataclass_fields__)
    groups = []
    for g in data.get("groups", []):
        kwargs = {k: v for k, v in g.items() if k in probe_fields}
        kwargs["levels"] = [tuple(level) for level in kwargs.get("levels", [])]
        groups.append(Probe(**kwargs))
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
        wrapper_kind=data.get("wrapper_kind", "plain"),
        microbatches=data.get("microbatches", 0),
        sequence=list(data.get("sequence", [])),
        warnings=list(data.get("warnings", [])),
        fixes=dict(data.get("fixes", {})),
    )
