"""The runtime record schema: one record per instrumented call and parameter, written by the hooks and read
by the service, the CLI and the dashboard.

Standard library only: the hooks import it on the training process's start-up path. The hooks' ring buffer
and formatting live in `maingrad.hooks.records`; the service's batch parser in `maingrad.service.records`;
both take the field list, the enumerations and the schema version from here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from maingrad.contracts.anomalies import ANOMALIES

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

# "preflight": a verdict of `maingrad.hooks.preflight` about one parameter (or, with param "*", the whole check);
# appended last because the hooks store phases as indexes into this tuple.
PHASES: tuple[str, ...] = ("forward", "backward", "preflight")
ACTIONS: tuple[str, ...] = ("none", "exposed", "raised", "error")
MODES: tuple[str, ...] = ("fix", "check", "observe")
# Actions that are anomalous by themselves (a record with one and no anomaly code still counts as one).
ANOMALOUS_ACTIONS: frozenset[str] = frozenset({"raised", "error"})

# `param` of a record that is about the whole call (an internal error before any parameter was read).
WHOLE_CALL = "*"

# field -> (allowed types, nullable)
FIELD_TYPES: dict[str, tuple[tuple[type, ...], bool]] = {
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
        extra = [k for k in keys if k not in FIELD_TYPES]
        problems.append(f"fields differ: missing={missing} extra={extra}")
    for name, (types, nullable) in FIELD_TYPES.items():
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
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text:
            continue
        try:
            yield json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"line {number}: not JSON ({exc.msg})") from exc


# --- the end of a rank's records ---------------------------------------------------------------------------
# Runtime evidence is complete only when the run says so: each rank's sink, once its last batch is acknowledged
# (the hooks' `Handle.remove()`/final flush closes the sinks), POSTs one end marker as JSON to
# `/api/v1/projects/{project}/runs/{run}/end`. The run is complete once every rank of `world_size` has ended
# with no record lost; until then the gate answers `pending` for its commit.

END_PATH = "end"
END_FIELDS: tuple[str, ...] = ("schema", "run", "rank", "world_size", "records", "lost")


def world_size_from_env(env: dict[str, str] | None = None) -> int:
    """The number of ranks of this run as the launcher tells it (torchrun, SLURM, MPI); 1 when none does."""
    import os

    source = os.environ if env is None else env
    for name in ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        value = source.get(name, "")
        if value.isdigit() and int(value) >= 1:
            return int(value)
    return 1


def end_marker(run: str, rank: int, world_size: int, records: int, lost: int) -> dict[str, Any]:
    """What one rank sends when it is done: how many records it handed over and how many never arrived
    (dropped on a full queue, or failed after the retries)."""
    return {
        "schema": SCHEMA_VERSION,
        "run": run,
        "rank": rank,
        "world_size": world_size,
        "records": records,
        "lost": lost,
    }


def validate_end_marker(marker: Any) -> list[str]:
    """Problems of an end marker (empty when valid)."""
    if not isinstance(marker, dict):
        return ["end marker is not an object"]
    problems = []
    extra = sorted(set(marker) - set(END_FIELDS))
    if extra:
        problems.append(f"unknown fields {extra}")
    for name in ("rank", "world_size", "records", "lost"):
        value = marker.get(name)
        if type(value) is not int or not 0 <= value <= 2**31 - 1:
            problems.append(f"{name} must be an integer from 0 to {2**31 - 1}")
    if not problems and not 0 <= marker["rank"] < marker["world_size"]:
        problems.append("rank must be below world_size")
    if "schema" in marker and marker["schema"] != SCHEMA_VERSION:
        problems.append(f"schema is {marker['schema']!r}, expected {SCHEMA_VERSION}")
    if "run" in marker and (type(marker["run"]) is not str or not 0 < len(marker["run"]) <= 255):
        problems.append("run must be a non-empty string of at most 255 characters")
    return problems
