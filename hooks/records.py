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
from typing import Any, NamedTuple

from maingrad.contracts.records import ACTIONS, PHASES, SCHEMA_VERSION, WHOLE_CALL, new_record, record_id

# Phase / action codes stored in rows (indexes into PHASES / ACTIONS).
FORWARD, BACKWARD = 0, 1
A_NONE, A_EXPOSED, A_RAISED, A_ERROR = 0, 1, 2, 3

# The shapes the hooks push (instrument.py builds them), each declared once below as a NamedTuple so every
# record shape has a name and named fields. On the hot path they are plain tuples laid out as those classes:
# entries and rows carry their class in field 0 (the ring and the flush dispatch on it, `view(x)` gives the
# named form); BufferMeta, which only ever stands in a row's meta field, carries no tag. A NamedTuple instance
# costs more to make, free and index than a tuple (measured at 2 parameters: fix+record went from 1.25x to 1.45x
# the hand-written hook with NamedTuple entries, 1.35x with NamedTuple rows), and a call makes an entry every
# time. Expanding entries into rows, formatting and the sequence numbers wait for the flush, off the hot path.
# Entries, rows and their column lists may be the very objects of an earlier entry (the hooks push what they
# last pushed again when nothing changed), so nothing may modify them.

new = tuple.__new__


class BufferMeta(NamedTuple):
    """What a record says of a main_grad tensor: shared by every row of the same buffer (no tensor held)."""

    data_ptr: int
    dtype: Any
    shape: Any
    device: Any


class TensorRow(NamedTuple):
    """One slot whose main_grad is a tensor, with no action and no anomaly: the steady state."""

    kind: type  # TensorRow: the tag in field 0
    slot: int
    meta: BufferMeta
    ow: Any  # overwrite_main_grad as read (bool or None when absent)
    gam: Any  # grad_added_to_main_grad as read
    fsdp: bool  # the parameter carries __fsdp_param__


class FlaggedRow(NamedTuple):
    """One slot whose main_grad is a tensor, with an action or an anomaly."""

    kind: type  # FlaggedRow: the tag in field 0
    slot: int
    meta: BufferMeta
    ow: Any
    gam: Any
    fsdp: bool
    action: int  # index into ACTIONS
    anomaly: str | None


class PlainRow(NamedTuple):
    """One slot whose main_grad is not a tensor (absent, None, something else) or whose parameter is gone."""

    kind: type  # PlainRow: the tag in field 0
    slot: int
    has: bool  # main_grad attribute present
    is_none: bool | None
    ow: Any
    gam: Any
    fsdp: bool
    action: int
    anomaly: str | None


class ErrorRow(NamedTuple):
    """A hook_error: a whole row but its sequence number; it carries its own time."""

    kind: type  # ErrorRow: the tag in field 0
    t: int
    step: int
    mb: int
    phase: int
    site: int
    slot: int
    has: bool
    is_none: bool | None
    dtype: Any
    shape: Any
    device: Any
    data_ptr: int | None
    ow: Any
    gam: Any
    fsdp: bool
    action: int
    anomaly: str | None


# A tuple laid out as TensorRow, FlaggedRow, PlainRow or ErrorRow, field 0 naming which.
SlotRow = tuple[Any, ...]


class CallEntry(NamedTuple):
    """One recorded call of a site: one row per slot (an ErrorRow may stand among them)."""

    kind: type  # CallEntry: what the ring dispatches on (field 0 of every entry)
    n: int  # rows (field 1 of every entry)
    rows: Sequence[SlotRow]
    t: int
    step: int
    mb: int
    phase: int  # FORWARD / BACKWARD
    site: int


class ColumnsEntry(NamedTuple):
    """One recorded call of a large site from the vectorised path: slots 0..n-1 as columns, action "none"."""

    kind: type  # ColumnsEntry
    n: int
    ptrs: list[int]
    dtypes: list[Any]
    shapes: list[Any]
    devices: list[Any]
    ows: list[Any]
    gams: list[Any]
    fsdps: list[bool]
    anomalies: list[str | None] | None  # None when there is none
    t: int
    step: int
    mb: int
    phase: int
    site: int


class ErrorEntry(NamedTuple):
    """A hook_error outside any recorded call."""

    kind: type  # ErrorEntry
    n: int
    rows: list[ErrorRow]


# What the ring holds: a tuple laid out as one of the entry classes, field 0 naming which.
Entry = tuple[Any, ...]


def view(item: tuple[Any, ...]) -> Any:
    """The named form of a ring entry or row (for tests and debugging; the flush reads them by position)."""
    kind: Any = item[0]
    return new(kind, item)


class Row(NamedTuple):
    """A whole record row as the ring hands it out (`take_new`, `snapshot`); `to_dict` formats it."""

    seq: int
    t: int
    step: int
    mb: int
    phase: int
    site: int
    slot: int
    has: bool
    is_none: bool | None
    dtype: Any
    shape: Any
    device: Any
    data_ptr: int | None
    ow: Any
    gam: Any
    fsdp: bool
    action: int
    anomaly: str | None


def _expand(entry: Entry, seq: int, out: list[Row]) -> None:
    """Append the full rows of one entry, numbered from `seq`."""
    kind = entry[0]
    if kind is ColumnsEntry:
        _, n, ptrs, dtypes, shapes, devices, ows, gams, fsdps, anomalies, t, step, mb, phase, site = entry
        out.extend(
            map(
                new,
                repeat(Row),
                zip(
                    range(seq, seq + n), repeat(t), repeat(step), repeat(mb), repeat(phase), repeat(site), range(n),
                    repeat(True), repeat(False), dtypes, shapes, devices, ptrs, ows, gams, fsdps, repeat(A_NONE),
                    anomalies if anomalies is not None else repeat(None), strict=False,
                ),
            )
        )  # fmt: skip
        return
    # An ErrorEntry has no call: its rows carry their own.
    head: tuple[Any, ...] = entry[3:] if kind is CallEntry else (None,) * 5
    t, step, mb, phase, site = head
    append = out.append
    rows: Sequence[SlotRow] = entry[2]
    for row in rows:
        kind = row[0]
        if kind is TensorRow:
            _, slot, (ptr, dtype, shape, device), ow, gam, fsdp = row
            append(new(Row, (seq, t, step, mb, phase, site, slot, True, False, dtype, shape, device, ptr, ow, gam, fsdp, A_NONE, None)))  # fmt: skip
        elif kind is FlaggedRow:
            _, slot, (ptr, dtype, shape, device), ow, gam, fsdp, action, anomaly = row
            append(new(Row, (seq, t, step, mb, phase, site, slot, True, False, dtype, shape, device, ptr, ow, gam, fsdp, action, anomaly)))  # fmt: skip
        elif kind is PlainRow:
            _, slot, has, is_none, ow, gam, fsdp, action, anomaly = row
            append(new(Row, (seq, t, step, mb, phase, site, slot, has, is_none, None, None, None, None, ow, gam, fsdp, action, anomaly)))  # fmt: skip
        else:  # an ErrorRow: a whole row but its number (the only rows of an ErrorEntry)
            append(new(Row, (seq, *row[1:])))
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
        self.current: deque[Entry] = deque()
        self.previous: deque[Entry] = deque()  # the generation before: >= capacity rows once there is one
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

    def push(self, entry: Entry) -> None:
        """Add one call's entry (`entry[1]` rows, >= 1); the hooks' only write."""
        self.current.append(entry)
        self.held += entry[1]
        if self.held >= self.capacity:
            self.dropped += self.held_previous
            self.previous = self.current
            self.held_previous = self.held
            self.current = deque()
            self.held = 0

    def _tail(self, count: int) -> list[Row]:
        """The newest `count` rows (count <= len(self)), oldest first, numbered."""
        if count <= 0:
            return []
        chosen: list[Entry] = []
        covered = 0
        for entry in chain(reversed(self.current), reversed(self.previous)):
            chosen.append(entry)
            covered += entry[1]
            if covered >= count:
                break
        rows: list[Row] = []
        seq = self.total - covered + 1
        for entry in reversed(chosen):
            _expand(entry, seq, rows)
            seq += entry[1]
        return rows[len(rows) - count :] if len(rows) > count else rows

    def snapshot(self) -> list[Row]:
        """Every row still held (the newest `capacity`), oldest first; consumes nothing."""
        return self._tail(len(self))

    rows = property(snapshot, doc="Same as snapshot(): the rows still held, as full row tuples.")

    def take_new(self) -> list[Row]:
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


def to_dict(row: Row, meta: RunMeta, modules: Sequence[str], params: Sequence[Sequence[str]]) -> dict:
    """One schema record from a hook row, through the contract's `new_record` (the reference `to_dicts`, the
    hand-written hot path, is tested against)."""
    shape, dtype, device = row.shape, row.dtype, row.device
    return new_record(
        id=record_id(meta.run, meta.rank, row.seq),
        run=meta.run,
        rank=meta.rank,
        step=row.step,
        microbatch=row.mb,
        phase=PHASES[row.phase],
        module=modules[row.site],
        param=WHOLE_CALL if row.slot < 0 else params[row.site][row.slot],
        has_main_grad=bool(row.has),
        main_grad_is_none=_opt_bool(row.is_none),
        dtype=None if dtype is None else str(dtype),
        shape=None if shape is None else [int(d) for d in shape],
        device=None if device is None else str(device),
        data_ptr=row.data_ptr,
        overwrite_main_grad=_opt_bool(row.ow),
        grad_added_to_main_grad=_opt_bool(row.gam),
        is_fsdp_param=bool(row.fsdp),
        action=ACTIONS[row.action],
        anomaly=row.anomaly,
        mode=meta.mode,
        commit=meta.commit,
        t_ns=row.t,
    )


def to_dicts(
    rows: Iterable[Row], meta: RunMeta, modules: Sequence[str], params: Sequence[Sequence[str]]
) -> list[dict]:
    """`to_dict` of every row, the same dicts, faster (the hot path, written out by hand; tests compare it with
    `to_dict`, i.e. with the contract's `new_record`): each distinct dtype, shape and device object is
    formatted once per call (rows of one buffer share those objects: see instrument.py's buffer metadata)."""
    run, rank, mode, commit = meta.run, meta.rank, meta.mode, meta.commit
    prefix = f"{run}:{rank}:"
    formatted: dict[int, tuple[Any, Any]] = {}  # id(obj) -> (obj, text); obj held so its id stays its own
    out: list[dict] = []
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
