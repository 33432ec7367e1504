"""The bounded ring buffer hooks write runtime records into, and their conversion to the schema's dicts
(the schema itself: `maingrad.contracts.records`).

Hooks push one compact entry per call (cheap: no dict, no string formatting, no per-row numbering on the hot
path); the ring expands entries into rows and `to_dict` turns those into the schema's dicts at step
boundaries, outside the hooks. No torch import here: dtype, shape and device are stored as the objects torch
returned and formatted with `str()`/`list()` later.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain, repeat
from typing import Any

from maingrad.contracts.records import ACTIONS, PHASES, SCHEMA_VERSION, WHOLE_CALL

# Phase / action codes stored in rows (indexes into PHASES / ACTIONS).
FORWARD, BACKWARD = 0, 1
A_NONE, A_EXPOSED, A_RAISED, A_ERROR = 0, 1, 2, 3

# Row layout (tuple positions) of the rows the ring hands out (`take_new`, `snapshot`); `to_dict` reads them.
R_SEQ, R_T, R_STEP, R_MB, R_PHASE, R_SITE, R_SLOT = 0, 1, 2, 3, 4, 5, 6
R_HAS, R_ISNONE, R_DTYPE, R_SHAPE, R_DEVICE, R_PTR, R_OW, R_GAM, R_FSDP, R_ACTION, R_ANOMALY = range(7, 18)

# What the hooks push instead (instrument.py builds these): one entry per recorded call, element 0 its row
# count, the call's (t_ns, step, microbatch, phase, site) last; told apart by length:
#   7: (n, rows, t, step, mb, phase, site)  rows, one per slot, told apart by length:
#       5: (slot, meta, ow, gam, fsdp)                       main_grad a tensor; no action, no anomaly
#       7: (slot, meta, ow, gam, fsdp, action, anomaly)      main_grad a tensor
#       8: (slot, has, is_none, ow, gam, fsdp, action, anomaly)  main_grad not a tensor (or no parameter)
#      17: a whole row without its sequence number (hook_error rows, which carry their own time)
#     meta = (data_ptr, dtype, shape, device) of the buffer, shared by every row of the same buffer. `rows` (a
#     tuple from the fast paths) and the column lists below may be the very objects of an earlier entry: the
#     hooks push what they last pushed again when nothing changed, so nothing may modify them.
#  14: (n, ptrs, dtypes, shapes, devices, ows, gams, fsdps, anomalies, t, step, mb, phase, site)  slots
#      0..n-1 as columns (lists); anomalies is None when there is none; action "none".
#   2: (n, rows)  rows of 17 only (a hook_error outside any recorded call).
# Expanding them into rows, formatting and the sequence numbers all wait for the flush, off the hot path.


def _expand(entry: tuple, seq: int, out: list[tuple]) -> None:
    """Append the full rows of one entry, numbered from `seq`."""
    if len(entry) == 14:
        n, ptrs, dtypes, shapes, devices, ows, gams, fsdps, anomalies, t, step, mb, phase, site = entry
        out.extend(
            zip(
                range(seq, seq + n), repeat(t), repeat(step), repeat(mb), repeat(phase), repeat(site), range(n),
                repeat(True), repeat(False), dtypes, shapes, devices, ptrs, ows, gams, fsdps, repeat(A_NONE),
                anomalies if anomalies is not None else repeat(None), strict=False,
            )
        )  # fmt: skip
        return
    t, step, mb, phase, site = entry[2:] if len(entry) == 7 else (None,) * 5
    append = out.append
    for row in entry[1]:
        size = len(row)
        if size == 5:
            slot, (ptr, dtype, shape, device), ow, gam, fsdp = row
            append((seq, t, step, mb, phase, site, slot, True, False, dtype, shape, device, ptr, ow, gam, fsdp, A_NONE, None))  # fmt: skip
        elif size == 7:
            slot, (ptr, dtype, shape, device), ow, gam, fsdp, action, anomaly = row
            append((seq, t, step, mb, phase, site, slot, True, False, dtype, shape, device, ptr, ow, gam, fsdp, action, anomaly))  # fmt: skip
        elif size == 8:
            slot, has, is_none, ow, gam, fsdp, action, anomaly = row
            append((seq, t, step, mb, phase, site, slot, has, is_none, None, None, None, None, ow, gam, fsdp, action, anomaly))  # fmt: skip
        else:
            append((seq, *row))
        seq += 1


@dataclass(frozen=True)
class RunMeta:
    """What every record of one handle shares."""

    run: str
    rank: int
    mode: str
    commit: str | None


class RecordRing:
    """The last `capacity` record rows, pushed one instrumented call at a time (see the entry layouts above).

    A row's sequence number is its position: the k-th row ever pushed is number k. So rows carry none and
    hooks count nothing per row; `take_new()` numbers the rows made since the previous call (each row reaches
    the sinks once) and counts those overwritten before it, exactly as a `deque(maxlen=capacity)` of rows
    would. Entries go into `current`; once it holds `capacity` rows it becomes `previous` and the generation
    before is freed at once (no per-entry work in Python), so the newest `capacity` rows are always held and
    memory stays below twice that plus one call's rows. Hooks of one handle never run at the same time (the
    autograd engine runs gradient hooks while the thread that called backward() waits), so the counters are
    plain ints, like the per-module counters.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.current: deque[tuple] = deque()
        self.previous: deque[tuple] = deque()  # the generation before: >= capacity rows once there is one
        self.held = 0  # rows in `current`
        self.held_previous = 0
        self.dropped = 0  # rows of freed generations
        self.flushed = 0  # rows (by number) handed out or counted as lost
        self.overflow = 0

    def __len__(self) -> int:
        return min(self.held + self.held_previous, self.capacity)

    @property
    def total(self) -> int:
        """Rows ever pushed: the sequence number of the newest one."""
        return self.held + self.held_previous + self.dropped

    def push(self, entry: tuple) -> None:
        """Add one call's entry (`entry[0]` rows, >= 1); the hooks' only write."""
        self.current.append(entry)
        self.held += entry[0]
        if self.held >= self.capacity:
            self.dropped += self.held_previous
            self.previous = self.current
            self.held_previous = self.held
            self.current = deque()
            self.held = 0

    def _tail(self, count: int) -> list[tuple]:
        """The newest `count` rows (count <= len(self)), oldest first, numbered."""
        if count <= 0:
            return []
        chosen: list[tuple] = []
        covered = 0
        for entry in chain(reversed(self.current), reversed(self.previous)):
            chosen.append(entry)
            covered += entry[0]
            if covered >= count:
                break
        rows: list[tuple] = []
        seq = self.total - covered + 1
        for entry in reversed(chosen):
            _expand(entry, seq, rows)
            seq += entry[0]
        return rows[len(rows) - count :] if len(rows) > count else rows

    def snapshot(self) -> list[tuple]:
        """Every row still held (the newest `capacity`), oldest first; consumes nothing."""
        return self._tail(len(self))

    rows = property(snapshot, doc="Same as snapshot(): the rows still held, as full row tuples.")

    def take_new(self) -> list[tuple]:
        """Rows pushed since the previous call, oldest first; counts rows lost to overwriting."""
        new = self.total - self.flushed
        kept = min(new, self.capacity)
        rows = self._tail(kept)
        self._advance(new, kept)
        return rows

    def skip_new(self) -> int:
        """take_new() for nobody (no sink): count the new rows, lost ones included, without building them."""
        new = self.total - self.flushed
        kept = min(new, self.capacity)
        self._advance(new, kept)
        return max(kept, 0)

    def _advance(self, new: int, kept: int) -> None:
        if new > 0:
            self.overflow += new - kept
            self.flushed = self.total


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


def to_dicts(
    rows: Iterable[Sequence[Any]], meta: RunMeta, modules: Sequence[str], params: Sequence[Sequence[str]]
) -> list[dict]:
    """`to_dict` of every row, the same dicts, faster: each distinct dtype, shape and device object is
    formatted once per call (rows of one buffer share those objects: see instrument.py's buffer metadata)."""
    run, rank, mode, commit = meta.run, meta.rank, meta.mode, meta.commit
    prefix = f"{run}:{rank}:"
    formatted: dict[int, tuple[Any, Any]] = {}  # id(obj) -> (obj, text); obj held so its id stays its own
    out = []
    append = out.append
    for row in rows:
        (
            seq,
            t,
            step,
            mb,
            phase,
            site,
            slot,
            has,
            is_none,
            dtype,
            shape,
            device,
            ptr,
            ow,
            gam,
            fsdp,
            action,
            anomaly,
        ) = row
        if dtype is not None:
            hit = formatted.get(id(dtype))
            if hit is None or hit[0] is not dtype:
                hit = formatted[id(dtype)] = (dtype, str(dtype))
            dtype = hit[1]
        if shape is not None:
            hit = formatted.get(id(shape))
            if hit is None or hit[0] is not shape:
                hit = formatted[id(shape)] = (shape, [int(d) for d in shape])
            shape = hit[1][:]  # a list of its own per record
        if device is not None:
            hit = formatted.get(id(device))
            if hit is None or hit[0] is not device:
                hit = formatted[id(device)] = (device, str(device))
            device = hit[1]
        append(
            {
                "schema": SCHEMA_VERSION,
                "id": prefix + str(seq),
                "run": run,
                "rank": rank,
                "step": step,
                "microbatch": mb,
                "phase": PHASES[phase],
                "module": modules[site],
                "param": WHOLE_CALL if slot < 0 else params[site][slot],
                "has_main_grad": bool(has),
                "main_grad_is_none": is_none if is_none.__class__ is bool else None,
                "dtype": dtype,
                "shape": shape,
                "device": device,
                "data_ptr": ptr,
                "overwrite_main_grad": ow if ow.__class__ is bool else None,
                "grad_added_to_main_grad": gam if gam.__class__ is bool else None,
                "is_fsdp_param": bool(fsdp),
                "action": ACTIONS[action],
                "anomaly": anomaly,
                "mode": mode,
                "commit": commit,
                "t_ns": t,
            }
        )
    return out
