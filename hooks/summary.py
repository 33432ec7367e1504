"""Per-module aggregates of a run, computed off the hot path, printable as a table (no torch import).

Two sources: a live handle's counters (`Handle.summary()`, exact even when records were sampled or the ring
overflowed) and a set of records (`summarize_records`, e.g. a JSONL file read by `maingrad hooks summary`).
The overwrite_main_grad value seen at forward and at backward is tallied per module, so which value a fused
backward reads (TE modules capture it at forward, op-fuser ops read it at backward) is answered from data.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class ModuleSummary:
    module: str
    kind: str
    params: int
    forward_calls: int = 0
    backward_calls: int = 0
    records: int = 0
    exposed: int = 0
    raised: int = 0
    errors: int = 0
    anomalies: dict[str, int] = field(default_factory=dict)
    # "forward"/"backward" -> {"true"/"false"/"null": count}; only from records
    overwrite_seen: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass
class Summary:
    mode: str
    run: str
    rank: int
    step: int
    modules: list[ModuleSummary]
    internal_errors: int = 0
    ring_overflow: int = 0
    sinks: list[dict[str, Any]] = field(default_factory=list)
    last_error: str | None = None

    @property
    def anomalies(self) -> dict[str, int]:
        total: Counter[str] = Counter()
        for module in self.modules:
            total.update(module.anomalies)
        return dict(total)

    @property
    def ok(self) -> bool:
        """No anomaly and no internal error anywhere."""
        return not self.anomalies and not self.internal_errors

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["anomalies"] = self.anomalies
        data["ok"] = self.ok
        return data

    def table(self) -> str:
        header = (
            "module",
            "kind",
            "params",
            "fwd",
            "bwd",
            "records",
            "exposed",
            "raised",
            "anomalies",
            "overwrite_main_grad seen",
        )
        rows: list[tuple[str, ...]] = [header]
        any_overwrite = False
        for m in self.modules:
            anomalies = ", ".join(f"{k}={v}" for k, v in sorted(m.anomalies.items())) or "-"
            seen = "-"
            if m.overwrite_seen:
                any_overwrite = True
                seen = " ".join(
                    f"{_PHASE.get(phase, phase)}=" + ",".join(f"{k}:{v}" for k, v in sorted(c.items()))
                    for phase, c in sorted(
                        m.overwrite_seen.items(), key=lambda kv: _PHASE_ORDER.get(kv[0], 9)
                    )
                )
            rows.append(
                (
                    m.module or "(root)",
                    m.kind,
                    str(m.params),
                    str(m.forward_calls),
                    str(m.backward_calls),
                    str(m.records),
                    str(m.exposed),
                    str(m.raised),
                    anomalies,
                    seen,
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
        lines = [
            f"maingrad hooks: mode={self.mode} run={self.run} rank={self.rank} steps={self.step} "
            f"internal_errors={self.internal_errors} ring_overflow={self.ring_overflow}"
        ]
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1])
        if any_overwrite:
            lines.append(
                "overwrite_main_grad seen: the flag's value in the records at forward (fwd) and backward (bwd), "
                "as value:records; null = the parameter has no such attribute"
            )
        for sink in self.sinks:
            lines.append("sink " + " ".join(f"{k}={v}" for k, v in sink.items() if v is not None))
        if self.last_error:
            lines.append(f"last internal error: {self.last_error}")
        return "\n".join(lines)

    __str__ = table


_PHASE = {"forward": "fwd", "backward": "bwd"}
_PHASE_ORDER = {"forward": 0, "backward": 1}


def _flag(value: Any) -> str:
    return "null" if value is None else ("true" if value else "false")


def summarize_records(records: Iterable[dict]) -> Summary:
    """A Summary rebuilt from records. Calls are counted as distinct (rank, step, microbatch) per module and
    phase, so sampled or truncated files give lower bounds."""
    modules: dict[str, ModuleSummary] = {}
    params: dict[str, set[str]] = {}
    calls: dict[tuple[str, str], set[tuple]] = {}
    modes: set[str] = set()
    runs: set[str] = set()
    ranks: set[int] = set()
    steps = 0
    errors = 0
    for rec in records:
        name = rec.get("module", "?")
        summary = modules.get(name)
        if summary is None:
            summary = modules[name] = ModuleSummary(module=name, kind="-", params=0)
            params[name] = set()
        summary.records += 1
        phase = rec.get("phase", "?")
        calls.setdefault((name, phase), set()).add((rec.get("rank"), rec.get("step"), rec.get("microbatch")))
        if rec.get("param") not in (None, "*"):
            params[name].add(rec["param"])
        action = rec.get("action")
        if action == "exposed":
            summary.exposed += 1
        elif action == "raised":
            summary.raised += 1
        elif action == "error":
            summary.errors += 1
            errors += 1
        anomaly = rec.get("anomaly")
        if anomaly:
            summary.anomalies[anomaly] = summary.anomalies.get(anomaly, 0) + 1
        if rec.get("param") != "*":
            seen = summary.overwrite_seen.setdefault(phase, {})
            key = _flag(rec.get("overwrite_main_grad"))
            seen[key] = seen.get(key, 0) + 1
        modes.add(str(rec.get("mode")))
        runs.add(str(rec.get("run")))
        if isinstance(rec.get("rank"), int):
            ranks.add(rec["rank"])
        if isinstance(rec.get("step"), int):
            steps = max(steps, rec["step"] + 1)
    for name, summary in modules.items():
        summary.params = len(params[name])
        summary.forward_calls = len(calls.get((name, "forward"), ()))
        summary.backward_calls = len(calls.get((name, "backward"), ()))
    return Summary(
        mode=",".join(sorted(modes)) or "-",
        run=",".join(sorted(runs)) or "-",
        rank=min(ranks) if len(ranks) == 1 else -1,
        step=steps,
        modules=sorted(modules.values(), key=lambda m: m.module),
        internal_errors=errors,
    )
