"""Runtime record schema (DESIGN.md §4), the bounded ring buffer hooks write into, and conversion to JSON.

Hooks append plain tuples (cheap: no dict, no string formatting on the hot path); `to_dict` turns them into
the schema's dicts at step boundaries, outside the hooks. No torch import here: dtype, shape and device are
stored as the objects torch returned and formatted with `str()`/`list()` later.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

SCHEMA_VERSION = 1

FIELDS: tuple[str, ...] = (
    "schema",
    "id",
    "run",
    "rank",
    "step",
    "microbatch",
    "phase",
    "module",
    "param",
    "has_main_grad",
    "main_grad_is_none",
    "dtype",
    "shape",
    "device",
    "data_ptr",
    "overwrite_main_grad",
    "grad_added_to_main_grad",
    "is_fsdp_param",
    "action",
    "anomaly",
    "mode",
    "commit",
    "t_ns",
)

PHASES: tuple[str, ...] = ("forward", "backward")
ACTIONS: tuple[str, ...] = ("none", "exposed", "raised", "error")
MODES: tuple[str, ...] = ("fix", "check", "observe")

# Phase / action codes stored in rows (indexes into PHASES / ACTIONS).
FORWARD, BACKWARD = 0, 1
A_NONE, A_EXPOSED, A_RAISED, A_ERROR = 0, 1, 2, 3

# `param` of a record that is about the whole call (an internal error before any parameter was read).
WHOLE_CALL = "*"

# anomaly -> meaning. Set on a record when, after our action, the fused path would fail or be wrong.
ANOMALIES: dict[str, str] = {
    "main_grad_missing": "no main_grad attribute where the fused path needs one (TE: 'MAIN GRAD NOT FOUND')",
    "main_grad_none": "main_grad is None where the fused path needs a buffer (TE: 'MAIN GRAD IS NONE')",
    "main_grad_not_tensor": "main_grad is set to something that is not a tensor",
    "get_main_grad_failed": "fix mode called get_main_grad() and it raised or returned a non-tensor",
    "main_grad_shape_mismatch": "main_grad's element count differs from the parameter's (the GEMM output "
    "view fails or writes out of place)",
    "param_missing": "the instrumented parameter slot is gone or None (parameter removed or replaced by None)",
    "flag_not_bool": "overwrite_main_grad or grad_added_to_main_grad holds a non-bool (a tensor flag would "
    "be truth-tested by TE and sync the device, or be ambiguous)",
    "overwrite_discards_microbatch": "backward only: overwrite_main_grad is True in micro-batch >= 1 while "
    "main_grad is the persistent accumulation buffer, so the fused wgrad overwrites what earlier micro-batches "
    "accumulated. Known exactly under Megatron-FSDP (the parameter's gradient buffer `_gbuf` is not sharded: "
    "no_shard/optim, or any strategy at data-parallel size 1); elsewhere a heuristic: this micro-batch's "
    "forward found main_grad still holding the buffer the previous backward wrote",
    "hook_error": "maingrad's own hook code raised; the record says what it could, training went on",
}

# Anomalies that make TE (or the GEMM) fail: `check` mode raises MainGradContractError for these.
FATAL_ANOMALIES: frozenset[str] = frozenset(
    {
        "main_grad_missing",
        "main_grad_none",
        "main_grad_not_tensor",
        "get_main_grad_failed",
        "main_grad_shape_mismatch",
    }
)

# Row layout (tuple positions); keep in sync with the hook that builds rows (instrument.py).
R_SEQ, R_T, R_STEP, R_MB, R_PHASE, R_SITE, R_SLOT = 0, 1, 2, 3, 4, 5, 6
R_HAS, R_ISNONE, R_DTYPE, R_SHAPE, R_DEVICE, R_PTR, R_OW, R_GAM, R_FSDP, R_ACTION, R_ANOMALY = range(7, 18)


@dataclass(frozen=True)
class RunMeta:
    """What every record of one handle shares."""

    run: str
    rank: int
    mode: str
    commit: str | None


class RecordRing:
    """Bounded ring of record rows; the hooks' only write is `append` (deque.append, atomic under the GIL).

    Rows carry a monotonically increasing sequence number, so `take_new()` can hand each row to the sinks
    exactly once and count what the ring overwrote before it was flushed.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.rows: deque[tuple] = deque(maxlen=capacity)
        self.append = self.rows.append
        self.extend = self.rows.extend
        self._seq = itertools.count(1)
        self.next_seq = self._seq.__next__
        self.flushed_seq = 0
        self.overflow = 0

    def __len__(self) -> int:
        return len(self.rows)

    def reserve(self, n: int) -> int:
        """The first of `n` consecutive sequence numbers (n >= 1), for rows appended in one `extend`.

        `islice` draws them from the counter in C without releasing the GIL, so a backward hook on the
        autograd thread cannot interleave its own numbers.
        """
        return next(itertools.islice(self._seq, n - 1, None)) - n + 1

    def take_new(self) -> list[tuple]:
        """Rows appended since the previous call, oldest first; counts rows lost to overwriting."""
        rows = self.rows
        new: list[tuple] = []
        last = self.flushed_seq
        for row in reversed(rows):
            if row[R_SEQ] <= last:
                break
            new.append(row)
        new.reverse()
        if new:
            lost = new[0][R_SEQ] - last - 1
            if lost > 0:
                self.overflow += lost
            self.flushed_seq = new[-1][R_SEQ]
        return new


def _opt_bool(value: Any) -> bool | None:
    return value if type(value) is bool else None


def to_dict(
    row: Sequence[Any], meta: RunMeta, modules: Sequence[str], params: Sequence[Sequence[str]]
) -> dict:
    """One schema record (an ordered dict with exactly FIELDS) from a hook row."""
    site, slot = row[R_SITE], row[R_SLOT]
    shape = row[R_SHAPE]
    dtype = row[R_DTYPE]
    device = row[R_DEVICE]
    return {
        "schema": SCHEMA_VERSION,
        "id": f"{meta.run}:{meta.rank}:{row[R_SEQ]}",
        "run": meta.run,
        "rank": meta.rank,
        "step": row[R_STEP],
        "microbatch": row[R_MB],
        "phase": PHASES[row[R_PHASE]],
        "module": modules[site],
        "param": WHOLE_CALL if slot < 0 else params[site][slot],
        "has_main_grad": bool(row[R_HAS]),
        "main_grad_is_none": _opt_bool(row[R_ISNONE]),
        "dtype": None if dtype is None else str(dtype),
        "shape": None if shape is None else [int(d) for d in shape],
        "device": None if device is None else str(device),
        "data_ptr": row[R_PTR],
        "overwrite_main_grad": _opt_bool(row[R_OW]),
        "grad_added_to_main_grad": _opt_bool(row[R_GAM]),
        "is_fsdp_param": bool(row[R_FSDP]),
        "action": ACTIONS[row[R_ACTION]],
        "anomaly": row[R_ANOMALY],
        "mode": meta.mode,
        "commit": meta.commit,
        "t_ns": row[R_T],
    }


_TYPES: dict[str, tuple[tuple[type, ...], bool]] = {
    # field -> (allowed types, nullable)
    "schema": ((int,), False),
    "id": ((str,), False),
    "run": ((str,), False),
    "rank": ((int,), False),
    "step": ((int,), False),
    "microbatch": ((int,), False),
    "phase": ((str,), False),
    "module": ((str,), False),
    "param": ((str,), False),
    "has_main_grad": ((bool,), False),
    "main_grad_is_none": ((bool,), True),
    "dtype": ((str,), True),
    "shape": ((list,), True),
    "device": ((str,), True),
    "data_ptr": ((int,), True),
    "overwrite_main_grad": ((bool,), True),
    "grad_added_to_main_grad": ((bool,), True),
    "is_fsdp_param": ((bool,), False),
    "action": ((str,), False),
    "anomaly": ((str,), True),
    "mode": ((str,), False),
    "commit": ((str,), True),
    "t_ns": ((int,), False),
}


def validate(record: Any) -> list[str]:
    """Problems of one record against the schema (empty when valid). Used by tests, the CLI and sinks' users."""
    if not isinstance(record, dict):
        return ["record is not an object"]
    problems = []
    keys = list(record)
    if set(keys) != set(FIELDS):
        missing = [f for f in FIELDS if f not in record]
        extra = [k for k in keys if k not in _TYPES]
        problems.append(f"fields differ: missing={missing} extra={extra}")
    for name, (types, nullable) in _TYPES.items():
        if name not in record:
            continue
        value = record[name]
        if value is None:
            if not nullable:
                problems.append(f"{name} is null")
            continue
        # bool is an int subclass: ints must not be bools and bools must be bools.
        if isinstance(value, bool) and bool not in types:
            problems.append(f"{name} is a bool")
        elif not isinstance(value, types):
            problems.append(f"{name} has type {type(value).__name__}")
    if record.get("schema") != SCHEMA_VERSION:
        problems.append(f"schema is {record.get('schema')!r}, expected {SCHEMA_VERSION}")
    for name, allowed in (("phase", PHASES), ("action", ACTIONS), ("mode", MODES)):
        if name in record and record[name] not in allowed:
            problems.append(f"{name}={record[name]!r} not in {allowed}")
    anomaly = record.get("anomaly")
    if anomaly is not None and anomaly not in ANOMALIES:
        problems.append(f"unknown anomaly {anomaly!r}")
    shape = record.get("shape")
    if isinstance(shape, list) and not all(type(d) is int for d in shape):
        problems.append("shape has non-int entries")
    expected_id = f"{record.get('run')}:{record.get('rank')}:"
    if isinstance(record.get("id"), str) and not record["id"].startswith(expected_id):
        problems.append("id is not '<run>:<rank>:<seq>'")
    return problems


def iter_jsonl(lines: Iterable[str]) -> Iterator[dict]:
    """Records from NDJSON lines (blank lines skipped); raises ValueError naming the bad line."""
    import json

    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text:
            continue
        try:
            yield json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"line {number}: not JSON ({exc.msg})") from exc
