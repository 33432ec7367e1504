"""The runtime record schema: one record per instrumented call and parameter, written by the hooks and read
by the service, the CLI and the dashboard.

`RECORD_FIELDS` is the one table of the record: each field's name, JSON type, whether the hooks may write
null, its default, its enumeration and how the service checks it on ingest. Everything else derives from it:
`FIELDS` (the order of a record's keys), `new_record(...)` (a record with the defaults filled in, for every
writer that is not a hot path), `validate(...)` (a complete record as the hooks write it) and
`json_schema(bounds)` (what the service accepts, published in its OpenAPI document and enforced on ingest).

Two writers/parsers stay hand-written because they are hot paths: the hooks' `to_dicts` (records at step
boundaries) and the service's `parse_batch` (50,000 records/s). Tests hold them to this table: every record
`to_dicts` writes equals `new_record` of the same values, and `parse_batch` accepts exactly what
`json_schema` accepts.

Standard library only: the hooks import it on the training process's start-up path.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, cast

from maingrad.contracts.anomalies import ANOMALIES

SCHEMA_VERSION = 1

# "preflight": a verdict of `maingrad.hooks.preflight` about one parameter (or, with param "*", the whole check);
# appended last because the hooks store phases as indexes into this tuple.
PHASES: tuple[str, ...] = ("forward", "backward", "preflight")
ACTIONS: tuple[str, ...] = ("none", "exposed", "raised", "error")
MODES: tuple[str, ...] = ("fix", "check", "observe")
# Actions that are anomalous by themselves (a record with one and no anomaly code still counts as one).
ANOMALOUS_ACTIONS: frozenset[str] = frozenset({"raised", "error"})

# `param` of a record that is about the whole call (an internal error before any parameter was read).
WHOLE_CALL = "*"


class _Required:
    """The default of a field every writer must give (`new_record` refuses a record without it)."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()

_JSON_TYPES: dict[type, str] = {int: "integer", str: "string", bool: "boolean", list: "array"}


@dataclass(frozen=True)
class RecordBounds:
    """What the service's storage can hold (its column types and configured limits): the bounds of
    `json_schema`. Defaults are the service's defaults."""

    max_string_chars: int = 4_096  # module, param
    max_key_chars: int = 255  # id, run, anomaly
    int32_max: int = 2**31 - 1  # INTEGER columns: rank, microbatch
    step_bound: int = 2**62 - 1  # steps: BIGINT with room for arithmetic on them
    int64_min: int = -(2**63)  # BIGINT columns: t_ns
    int64_max: int = 2**63 - 1
    commit_pattern: str | None = None  # the service's commit-identifier pattern


@dataclass(frozen=True)
class Field:
    """One record field.

    `kind` and `nullable` describe what the hooks write; `default` is what `new_record` fills in (REQUIRED: no
    default). `ingest` says how the service checks the field: "required" (refused when absent), "optional"
    (checked when present) or "kept" (stored verbatim in the raw line, not checked); `ingest_null` lets the
    service accept null where the hooks never write it (records of earlier writers)."""

    name: str
    kind: type
    nullable: bool
    default: Any = REQUIRED
    doc: str = ""
    enum: tuple[str, ...] | None = None
    ingest: str = "kept"
    ingest_null: bool = False

    def json_schema(self, bounds: RecordBounds) -> dict[str, Any]:
        """This field's JSON Schema as the service accepts it."""
        schema: dict[str, Any] = {"type": _JSON_TYPES[self.kind]}
        if self.name == "schema":
            schema["const"] = SCHEMA_VERSION
        elif self.enum is not None:
            schema["enum"] = list(self.enum)
        elif self.name in ("id", "run"):
            schema.update(maxLength=bounds.max_key_chars, minLength=1)
        elif self.name == "anomaly":
            schema["maxLength"] = bounds.max_key_chars
        elif self.name in ("module", "param"):
            schema["maxLength"] = bounds.max_string_chars
        elif self.name == "commit" and bounds.commit_pattern is not None:
            schema["pattern"] = bounds.commit_pattern
        elif self.name == "rank":
            schema.update(minimum=0, maximum=bounds.int32_max)
        elif self.name == "microbatch":
            schema.update(minimum=-bounds.int32_max, maximum=bounds.int32_max)
        elif self.name == "step":
            schema.update(minimum=-bounds.step_bound, maximum=bounds.step_bound)
        elif self.name == "t_ns":
            schema.update(minimum=bounds.int64_min, maximum=bounds.int64_max)
        if self.nullable or self.ingest_null:
            schema["type"] = [schema["type"], "null"]
        return schema


RECORD_FIELDS: tuple[Field, ...] = (
    Field("schema", int, False, SCHEMA_VERSION, "record schema version", ingest="optional"),
    Field("id", str, False, doc="'<run>:<rank>:<seq>', unique per run", ingest="required"),
    Field("run", str, False, doc="the run name (the service's run)", ingest="optional"),
    Field("rank", int, False, doc="global rank", ingest="required"),
    Field("step", int, False, doc="optimizer step", ingest="required"),
    Field("microbatch", int, False, 0, "micro-batch within the step", ingest="optional", ingest_null=True),
    Field("phase", str, False, doc="when it was read", enum=PHASES, ingest="required"),
    Field("module", str, False, doc="module path", ingest="optional"),
    Field("param", str, False, doc=f"parameter name ({WHOLE_CALL!r}: the whole call)", ingest="optional"),
    Field(
        "has_main_grad",
        bool,
        False,
        False,
        "main_grad attribute present",
        ingest="optional",
        ingest_null=True,
    ),
    Field("main_grad_is_none", bool, True, None, "main_grad is None", ingest="optional"),
    Field("dtype", str, True, None, "main_grad's dtype"),
    Field("shape", list, True, None, "main_grad's shape (ints)"),
    Field("device", str, True, None, "main_grad's device"),
    Field("data_ptr", int, True, None, "main_grad's data pointer"),
    Field("overwrite_main_grad", bool, True, None, "the flag as read (null: absent or not a bool)"),
    Field("grad_added_to_main_grad", bool, True, None, "the flag as read (null: absent or not a bool)"),
    Field("is_fsdp_param", bool, False, False, "the parameter carries __fsdp_param__"),
    Field("action", str, False, "none", "what the hook did", enum=ACTIONS, ingest="optional"),
    Field("anomaly", str, True, None, "anomaly code (contracts.anomalies)", ingest="optional"),
    Field("mode", str, False, doc="the hooks' mode", enum=MODES),
    Field("commit", str, True, None, "the code's commit", ingest="optional"),
    Field("t_ns", int, False, doc="time.time_ns() of the read", ingest="optional", ingest_null=True),
)

FIELD_BY_NAME: dict[str, Field] = {f.name: f for f in RECORD_FIELDS}
FIELDS: tuple[str, ...] = tuple(f.name for f in RECORD_FIELDS)
# field -> (allowed types, nullable): what `validate` checks.
FIELD_TYPES: dict[str, tuple[tuple[type, ...], bool]] = {
    f.name: ((f.kind,), f.nullable) for f in RECORD_FIELDS
}


def record_id(run: str, rank: int, seq: int | str) -> str:
    """A record's id: unique per run, so re-sent batches are harmless (the service ignores a known id)."""
    return f"{run}:{rank}:{seq}"


def new_record(**values: Any) -> dict[str, Any]:
    """A record with exactly FIELDS, in order, defaults filled in. Raises TypeError for an unknown field or a
    missing required one (the record would fail `validate`)."""
    unknown = [name for name in values if name not in FIELD_BY_NAME]
    if unknown:
        raise TypeError(f"unknown record fields: {unknown}")
    record: dict[str, Any] = {}
    for f in RECORD_FIELDS:
        value = values.get(f.name, f.default)
        if value is REQUIRED:
            raise TypeError(f"record field {f.name!r} is required")
        record[f.name] = value
    return record


def json_schema(bounds: RecordBounds | None = None) -> dict[str, Any]:
    """One record as the service accepts it: the fields it checks on ingest, bounded by what it can store.
    Fields not listed (and unknown ones) are kept verbatim in the stored raw line."""
    bounds = bounds or RecordBounds()
    checked = [f for f in RECORD_FIELDS if f.ingest != "kept"]
    return {
        "title": "runtime record",
        "description": f"One record of `maingrad.hooks` (schema {SCHEMA_VERSION}); see docs/hooks.md. "
        "Fields not listed are stored as received.",
        "type": "object",
        "required": [f.name for f in checked if f.ingest == "required"],
        "properties": {f.name: f.json_schema(bounds) for f in checked},
    }


def validate(record: Any) -> list[str]:
    """Problems of one record against the schema (empty when valid). Used by tests, the CLI and sinks' users."""
    if not isinstance(record, dict):
        return ["record is not an object"]
    return _problems(cast("dict[str, Any]", record))


def _problems(record: dict[str, Any]) -> list[str]:
    problems: list[str] = []
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
    if isinstance(anomaly, str) and anomaly not in ANOMALIES:  # a non-string is reported as a type problem
        problems.append(f"unknown anomaly {anomaly!r}")
    shape = record.get("shape")
    if isinstance(shape, list) and not all(type(d) is int for d in cast("Iterable[object]", shape)):
        problems.append("shape has non-int entries")
    expected_id = f"{record.get('run')}:{record.get('rank')}:"
    rid = record.get("id")
    if isinstance(rid, str) and not rid.startswith(expected_id):
        problems.append("id is not '<run>:<rank>:<seq>'")
    return problems


def iter_jsonl(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
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
    marker = cast("dict[str, Any]", marker)
    problems: list[str] = []
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
