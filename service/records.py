"""Runtime records from maingrad.hooks: NDJSON batches in, per-run timelines and aggregates out.

Ingest is the hot path (target >= 50,000 records/s in batches of 1,000): one hand-written validation pass
per line (no per-record model objects), then a single bulk INSERT ... ON CONFLICT DO NOTHING on
(run, record id), which makes re-sent batches harmless. The raw line is stored next to the indexed columns,
so nothing the hooks add later is lost. Aggregates are computed on read, off the hot path.
"""

from __future__ import annotations

import functools
from typing import Any, cast

from sqlalchemy import Table, bindparam, case, func, select, update
from sqlalchemy.orm import Session

from maingrad.contracts import records as contract
from maingrad.contracts.anomalies import ANOMALIES
from maingrad.service import fastjson
from maingrad.service.bodyschema import INT32_MAX, INT64_MAX, INT64_MIN, STEP_BOUND
from maingrad.service.db import Database
from maingrad.service.dialect import bump_revision, insert_for, note_commit, with_retries
from maingrad.service.identifiers import COMMIT_RE
from maingrad.service.models import Project, Record, Run, RunEnd, utcnow
from maingrad.service.parsing import without_nul
from maingrad.service.problems import ProblemError

PHASES = frozenset(contract.PHASES)
ACTIONS = frozenset(contract.ACTIONS)


def _bad(line: int, detail: str, field: str | None = None, index: int | None = None) -> ProblemError:
    """422 naming the line (1-based, blank lines counted) and, where known, the JSON pointer of the field in
    the batch read as an array of its non-blank lines (the shape the OpenAPI document publishes)."""
    extra: dict[str, Any] = {"line": line}
    if index is not None:
        extra["pointer"] = f"/{index}" + (f"/{field}" if field else "")
    return ProblemError(422, "invalid_record", f"line {line}: {detail}", **extra)


# Column order of the tuples parse_batch returns (run_id is prepended at insert time).
COLUMNS = (
    "run_id", "record_key", "rank", "step", "microbatch", "phase", "module", "param",
    "has_main_grad", "main_grad_is_none", "action", "anomaly", "t_ns", "raw",
)  # fmt: skip

_INT32 = INT32_MAX
_STEP = STEP_BOUND


def _slices(lines: list[tuple[int, str]], max_chars: int = 256 * 1024, max_lines: int = 500) -> Any:
    """(offset, lines) slices of at most `max_chars` characters or `max_lines` lines: a batch is parsed and
    validated a slice at a time and each slice's objects are dropped before the next is built, so the memory a
    batch takes is its text plus one slice's objects, whatever the lines hold (a 64 KiB line of `[],` builds
    21,000 lists; 1,000 such lines parsed at once took more than a gigabyte)."""
    start, size = 0, 0
    for end, (_, line) in enumerate(lines):
        size += len(line)
        if size >= max_chars or end + 1 - start >= max_lines:
            yield start, lines[start : end + 1]
            start, size = end + 1, 0
    if start < len(lines):
        yield start, lines[start:]


def _load_lines(lines: list[tuple[int, str]], offset: int = 0) -> list[Any]:
    """Each line parsed on its own (a batch is one JSON value per line, never a JSON array of them, so a
    value split over lines or two values on one line are refused). One `map` over the batch; only when a
    line is bad does the loop run again to name it (a third of the per-record parse cost on the ingest
    path went to the per-line try/append loop)."""
    try:
        return list(map(fastjson.loads, [line for _, line in lines]))
    except (fastjson.DecodeError, RecursionError):
        pass
    out = []
    for index, (lineno, line) in enumerate(lines, start=offset):
        try:
            out.append(fastjson.loads(line))
        except (fastjson.DecodeError, RecursionError) as exc:
            raise _bad(lineno, f"not JSON: {exc}", index=index) from None
    return out


def _split(body: bytes | bytearray, max_records: int, max_line: int) -> list[tuple[int, str]]:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProblemError(422, "invalid_encoding", f"body is not UTF-8: {exc}") from None
    raw_lines = text.split("\n")
    if max(map(len, raw_lines)) > max_line // 4:  # rare: only then measure lines in bytes, one by one
        for n, raw in enumerate(raw_lines, start=1):
            if len(raw) > max_line // 4 and len(raw.encode("utf-8")) > max_line:
                raise ProblemError(
                    413, "line_too_long", f"line {n}: longer than {max_line} bytes", limit=max_line, line=n
                )
    lines = [(n, line) for n, raw in enumerate(raw_lines, start=1) if (line := raw.strip())]
    if len(lines) > max_records:
        raise ProblemError(
            413, "too_many_records", f"a batch holds at most {max_records} records", limit=max_records
        )
    return lines


def _parsed(lines: list[tuple[int, str]]) -> Any:
    """(index, (lineno, line), record) for every line, parsed a slice at a time (see _slices)."""
    for offset, part in _slices(lines):
        records = _load_lines(part, offset)
        for i, (item, rec) in enumerate(zip(part, records, strict=True)):
            yield offset + i, item, rec
        del records


def parse_batch(  # noqa: C901 - one pass per record on the 50,000-records/s path, by design
    body: bytes | bytearray,
    run_name: str,
    max_records: int,
    max_line: int = 64 * 1024,
    max_string: int = 4_096,
) -> tuple[list[tuple[Any, ...]], str | None]:
    """Validated rows (tuples in COLUMNS order, without run_id) and the batch's commit, or 422/413.

    The checks are exactly the record schema of bodyschema.record_schema (written out by hand: this is the
    50,000-records/s path), plus two rules a schema cannot say: a record's `run` is the run in the URL, and
    one batch names one commit."""
    lines = _split(body, max_records, max_line)
    if not lines:
        raise ProblemError(422, "empty_batch", "the batch holds no record (one JSON object per line)")
    rows: list[tuple[Any, ...]] = []
    commit: str | None = None
    seen_commit: Any = None
    for index, (lineno, line), rec in _parsed(lines):
        if type(rec) is not dict:
            raise _bad(lineno, "a record must be a JSON object", index=index)
        if "\\u0000" in line:  # an escaped NUL: PostgreSQL text cannot hold it in the indexed columns
            rec = without_nul(rec)
        get = rec.get
        if "schema" in rec and (type(rec["schema"]) is not int or rec["schema"] != contract.SCHEMA_VERSION):
            raise _bad(
                lineno,
                f"'schema' must be {contract.SCHEMA_VERSION} (got {get('schema')!r}: unsupported record schema)",
                "schema",
                index,
            )
        rid = get("id")
        if type(rid) is not str or not 0 < len(rid) <= 255:
            raise _bad(lineno, "'id' must be a non-empty string of at most 255 characters", "id", index)
        if "run" in rec:
            run = rec["run"]
            if type(run) is not str or not 0 < len(run) <= 255:
                raise _bad(lineno, "'run' must be a non-empty string of at most 255 characters", "run", index)
            if run != run_name:
                raise _bad(lineno, f"record belongs to run {run!r}, not {run_name!r}", "run", index)
        rank, step, mb, t_ns = get("rank"), get("step"), get("microbatch"), get("t_ns")
        if type(rank) is not int or not 0 <= rank <= _INT32:
            raise _bad(lineno, f"'rank' must be an integer from 0 to {_INT32}", "rank", index)
        if type(step) is not int or not -_STEP <= step <= _STEP:
            raise _bad(lineno, f"'step' must be an integer of magnitude at most {_STEP}", "step", index)
        if mb is not None and (type(mb) is not int or not -_INT32 <= mb <= _INT32):
            raise _bad(lineno, "'microbatch' must be a 32-bit integer or null", "microbatch", index)
        if t_ns is not None and (type(t_ns) is not int or not INT64_MIN <= t_ns <= INT64_MAX):
            raise _bad(lineno, "'t_ns' must be a 64-bit integer or null", "t_ns", index)
        phase, action = get("phase"), get("action", "none")
        if type(phase) is not str or phase not in PHASES:
            raise _bad(lineno, f"'phase' must be one of {list(contract.PHASES)}", "phase", index)
        if type(action) is not str or action not in ACTIONS:
            raise _bad(lineno, f"'action' must be one of {list(contract.ACTIONS)}", "action", index)
        module, param = get("module", ""), get("param", "")
        if type(module) is not str or len(module) > max_string:
            raise _bad(
                lineno, f"'module' must be a string of at most {max_string} characters", "module", index
            )
        if type(param) is not str or len(param) > max_string:
            raise _bad(lineno, f"'param' must be a string of at most {max_string} characters", "param", index)
        has, is_none = get("has_main_grad"), get("main_grad_is_none")
        if has is not None and has is not True and has is not False:
            raise _bad(lineno, "'has_main_grad' must be a boolean or null", "has_main_grad", index)
        if is_none is not None and is_none is not True and is_none is not False:
            raise _bad(lineno, "'main_grad_is_none' must be a boolean or null", "main_grad_is_none", index)
        anomaly = get("anomaly")
        if anomaly is not None and (type(anomaly) is not str or len(anomaly) > 255):
            raise _bad(
                lineno, "'anomaly' must be a string of at most 255 characters or null", "anomaly", index
            )
        if anomaly is None and action in contract.ANOMALOUS_ACTIONS:
            anomaly = f"action:{action}"
        rec_commit = get("commit")
        if rec_commit is not None and rec_commit != seen_commit:
            if type(rec_commit) is not str or not COMMIT_RE.match(rec_commit):
                raise _bad(
                    lineno,
                    "'commit' must be a SHA or revision id (letters, digits, . _ -) or null",
                    "commit",
                    index,
                )
            if commit is not None and rec_commit.lower() != commit:
                raise _bad(
                    lineno,
                    f"records of one batch name two commits ({commit}, {rec_commit.lower()})",
                    "commit",
                    index,
                )
            seen_commit, commit = rec_commit, rec_commit.lower()
        rows.append((rid, rank, step, mb, phase, module, param, has, is_none, action, anomaly, t_ns, line))
    return rows, commit


def ingest(
    db: Database,
    project: Project,
    run_name: str,
    commit_param: str | None,
    body: bytes | bytearray,
    max_records: int,
    max_line: int = 64 * 1024,
    max_string: int = 4_096,
) -> dict[str, Any]:
    rows, record_commit = parse_batch(body, run_name, max_records, max_line, max_string)
    if commit_param and record_commit and commit_param != record_commit:
        raise ProblemError(
            409, "commit_mismatch", f"commit_sha={commit_param} but the records name commit {record_commit}"
        )
    commit = commit_param or record_commit

    def attempt() -> dict[str, Any]:
        with db.writing() as session:
            run_id, run_commit = _get_or_create_run(session, project, run_name, commit)
            inserted = 0
            if rows:
                inserted = _insert_rows(session, run_id, rows)
                session.connection().execute(_COUNT_RECORDS, {"rid": run_id, "n": inserted, "now": utcnow()})
            return {
                "run": run_name,
                "commit_sha": run_commit,
                "received": len(rows),
                "inserted": inserted,
                "duplicates": len(rows) - inserted,
            }

    return with_retries(attempt)


def end_run(
    db: Database, project: Project, run_name: str, commit_param: str | None, marker: Any
) -> dict[str, Any]:
    """Store one rank's end marker (contracts.records.end_marker); a re-sent marker replaces the first.

    The run is created when it has no record yet (a rank that made none still ends), bound to `commit_param`
    like a records batch would bind it."""
    problems = contract.validate_end_marker(marker)
    if problems:
        raise ProblemError(422, "invalid_end_marker", "; ".join(problems))
    if "run" in marker and marker["run"] != run_name:
        raise ProblemError(
            422, "invalid_end_marker", f"marker belongs to run {marker['run']!r}, not {run_name!r}"
        )

    def attempt() -> dict[str, Any]:
        with db.writing() as session:
            run_id, run_commit = _get_or_create_run(session, project, run_name, commit_param)
            values = {
                "run_id": run_id,
                "rank": marker["rank"],
                "world_size": marker["world_size"],
                "records": marker["records"],
                "lost": marker["lost"],
                "created_at": utcnow(),
            }
            stmt = insert_for(session, RunEnd)
            session.execute(
                stmt.values(**values).on_conflict_do_update(
                    index_elements=["run_id", "rank"],
                    set_={k: stmt.excluded[k] for k in ("world_size", "records", "lost", "created_at")},
                )
            )
            bump_revision(session, project.id)
            return {"run": run_name, "commit_sha": run_commit, **run_completion(session, run_id)}

    return with_retries(attempt)


_ENDS = select(RunEnd.run_id, RunEnd.rank, RunEnd.world_size, RunEnd.lost).where(
    RunEnd.run_id.in_(bindparam("ids", expanding=True))
)


def completions(session: Session, run_ids: list[int]) -> dict[int, dict[str, Any]]:
    """Per run: the ranks that ended, the world size they name, the records lost, and whether it is complete."""
    out: dict[int, dict[str, Any]] = {
        rid: {"ended_ranks": 0, "world_size": None, "lost": 0, "complete": False} for rid in run_ids
    }
    if not run_ids:
        return out
    ranks: dict[int, set[int]] = {rid: set() for rid in run_ids}
    for row in session.connection().execute(_ENDS, {"ids": run_ids}):
        state = out[row.run_id]
        ranks[row.run_id].add(row.rank)
        state["world_size"] = max(state["world_size"] or 0, row.world_size)
        state["lost"] += int(row.lost)
    for rid, state in out.items():
        state["ended_ranks"] = len(ranks[rid])
        state["complete"] = bool(
            state["world_size"] and state["ended_ranks"] >= state["world_size"] and state["lost"] == 0
        )
    return out


def run_completion(session: Session, run_id: int) -> dict[str, Any]:
    return completions(session, [run_id])[run_id]


_SQLITE_CHUNK = 500  # 500 x 14 parameters stays below SQLite's 32,766-variable limit


@functools.lru_cache(maxsize=16)
def _sqlite_insert(rows: int) -> str:
    one = "(" + ", ".join("?" for _ in COLUMNS) + ")"
    return (
        f"INSERT INTO records ({', '.join(COLUMNS)}) VALUES {', '.join(one for _ in range(rows))} "
        "ON CONFLICT (run_id, record_key) DO NOTHING"
    )


_PG_EXISTING = "SELECT record_key FROM records WHERE run_id = %s AND record_key = ANY(%s)"
_PG_COPY = f"COPY records ({', '.join(COLUMNS)}) FROM STDIN"


def _insert_rows(session: Session, run_id: int, rows: list[tuple[Any, ...]]) -> int:
    """Bulk insert straight through the driver, skipping record ids already stored; returns how many
    rows were new.

    SQLite: one executemany of INSERT ... ON CONFLICT DO NOTHING. PostgreSQL: COPY the batch straight
    into the table under a savepoint (first deliveries, the common case, cost nothing more); if some ids
    are already there (a re-sent batch, or a concurrent delivery of the same records that committed
    first), roll back to the savepoint, look the ids up and COPY only the new ones."""
    conn = session.connection()
    cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]  # same connection, same transaction
    if conn.dialect.name == "sqlite":
        # Multi-row VALUES, a few hundred rows per statement: executemany would release and retake the GIL
        # around every row, and a thread parsing the next batch then makes each retake wait (a GIL convoy
        # that halved throughput with two concurrent batches).
        inserted = 0
        for start in range(0, len(rows), _SQLITE_CHUNK):
            chunk = rows[start : start + _SQLITE_CHUNK]
            params = [value for row in chunk for value in (run_id, *row)]
            cursor.execute(_sqlite_insert(len(chunk)), params)
            inserted += cursor.rowcount
        return inserted
    import psycopg

    unique: dict[str, tuple[Any, ...]] = {}
    for row in rows:
        unique.setdefault(row[0], row)
    cursor.execute("SAVEPOINT mg_records")
    try:
        _copy(cursor, run_id, unique.values())
        cursor.execute("RELEASE SAVEPOINT mg_records")
        return len(unique)
    except psycopg.errors.UniqueViolation:
        cursor.execute("ROLLBACK TO SAVEPOINT mg_records")
    cursor.execute(_PG_EXISTING, (run_id, list(unique)), binary=True)
    for (key,) in cursor.fetchall():
        unique.pop(key, None)
    _copy(cursor, run_id, unique.values())
    return len(unique)


def _copy(cursor: Any, run_id: int, rows: Any) -> None:
    with cursor.copy(_PG_COPY) as copy:
        for row in rows:
            copy.write_row((run_id, *row))


# Core statements on the ingest path: the ORM's entity loading and bulk-update machinery cost more per batch
# than the 1,000 rows' validation does (about a tenth of a worker's time in a profile of the benchmark).
_RUNS = cast(Table, Run.__table__)
_FIND_RUN = select(_RUNS.c.id, _RUNS.c.commit_sha).where(
    _RUNS.c.project_id == bindparam("pid"), _RUNS.c.name == bindparam("name")
)
_COUNT_RECORDS = (
    update(_RUNS)
    .where(_RUNS.c.id == bindparam("rid"))
    .values(
        record_count=_RUNS.c.record_count + bindparam("n"),
        last_record_at=bindparam("now", type_=_RUNS.c.last_record_at.type),
    )
)


def _get_or_create_run(
    session: Session, project: Project, name: str, commit: str | None
) -> tuple[int, str | None]:
    """The run's id and commit, creating the run (and binding it to `commit`) where needed."""
    conn = session.connection()
    found = conn.execute(_FIND_RUN, {"pid": project.id, "name": name}).one_or_none()
    if found is None:
        session.execute(
            insert_for(session, Run)
            .values(project_id=project.id, name=name, commit_sha=commit, created_at=utcnow(), record_count=0)
            .on_conflict_do_nothing(index_elements=["project_id", "name"])
        )
        found = conn.execute(_FIND_RUN, {"pid": project.id, "name": name}).one()
    run_id, run_commit = int(found[0]), found[1]
    if commit is not None:
        if run_commit is None:
            run_commit = commit
            conn.execute(update(_RUNS).where(_RUNS.c.id == run_id).values(commit_sha=commit))
            note_commit(session, project.id, commit, None)
        elif run_commit != commit:
            raise ProblemError(
                409, "run_commit_mismatch", f"run {name!r} belongs to commit {run_commit}, not {commit}"
            )
    return run_id, run_commit


# --- read side -----------------------------------------------------------------------------------------


def _counts() -> list[Any]:
    one = 1
    return [
        func.count().label("records"),
        func.sum(case((Record.phase == "forward", one), else_=0)).label("forward"),
        func.sum(case((Record.phase == "backward", one), else_=0)).label("backward"),
        func.sum(case((Record.action == "exposed", one), else_=0)).label("exposed"),
        func.sum(
            case(((Record.has_main_grad.is_not(False)) & (Record.main_grad_is_none.is_(True)), one), else_=0)
        ).label("none"),
        func.sum(case((Record.has_main_grad.is_(False), one), else_=0)).label("missing"),
        func.sum(case((Record.anomaly.is_not(None), one), else_=0)).label("anomalies"),
    ]


def _num(row: Any) -> dict[str, int]:
    return {
        k: int(getattr(row, k) or 0)
        for k in ("records", "forward", "backward", "exposed", "none", "missing", "anomalies")
    }


def timeline(session: Session, run: Run) -> list[dict[str, Any]]:
    rows = session.execute(
        select(Record.step, *_counts())
        .where(Record.run_id == run.id)
        .group_by(Record.step)
        .order_by(Record.step)
    ).all()
    return [{"step": int(r.step), **_num(r)} for r in rows]


def aggregates(session: Session, run: Run, column: Any) -> list[dict[str, Any]]:
    """Counts per `column` value (module or rank). `params` counts distinct parameters, i.e. distinct
    (module, param) pairs: per rank, every module's `weight` is a parameter of its own. Records about a
    whole call (param "*") name no parameter."""
    rows = session.execute(
        select(column.label("key"), *_counts())
        .where(Record.run_id == run.id)
        .group_by(column)
        .order_by(column)
    ).all()
    pairs = (
        select(column.label("key"), Record.module, Record.param)
        .where(Record.run_id == run.id, Record.param != contract.WHOLE_CALL)
        .distinct()
        .subquery()
    )
    counted = session.execute(select(pairs.c.key, func.count().label("n")).group_by(pairs.c.key)).all()
    params: dict[Any, int] = {row.key: int(row.n) for row in counted}
    return [{"key": str(r.key), "params": int(params.get(r.key, 0)), **_num(r)} for r in rows]


def anomalies(session: Session, run: Run, limit: int = 100) -> list[dict[str, Any]]:
    rows = session.execute(
        select(Record)
        .where(Record.run_id == run.id, Record.anomaly.is_not(None))
        .order_by(Record.step, Record.record_key)
        .limit(limit)
    ).scalars()
    return [
        {
            "run": run.name,
            "rank": r.rank,
            "step": r.step,
            "phase": r.phase,
            "module": r.module,
            "param": r.param,
            "anomaly": r.anomaly or "",
            "summary": _meaning(r.anomaly or "")[0],
        }
        for r in rows
    ]


def _meaning(code: str) -> tuple[str, str, bool]:
    """(summary, remedy, fatal) of an anomaly code from the contract's table; for the service's own
    `action:<action>` codes (an anomalous action with no code) a description of the action."""
    known = ANOMALIES.get(code)
    if known is not None:
        return known.summary, known.remedy, known.fatal
    if code.startswith("action:"):
        return f"the hook's action was {code.split(':', 1)[1]!r} with no anomaly code", "", False
    return "not an anomaly code of this maingrad version", "", False


def anomaly_summary(session: Session, run: Run) -> list[dict[str, Any]]:
    """One row per anomaly code recorded in the run: how many records carry it, what it means (summary),
    whether it is fatal and its generic fix, read from `maingrad.contracts.anomalies`. Fatal codes first."""
    rows = session.execute(
        select(Record.anomaly, func.count())
        .where(Record.run_id == run.id, Record.anomaly.is_not(None))
        .group_by(Record.anomaly)
    )
    found = [(_meaning(str(code))[2], int(count), str(code)) for code, count in rows]
    found.sort(key=lambda a: (not a[0], -a[1], a[2]))
    out: list[dict[str, Any]] = []
    for fatal, count, code in found:
        summary, remedy, _ = _meaning(code)
        out.append({"code": code, "count": count, "summary": summary, "remedy": remedy, "fatal": fatal})
    return out


def step_count(session: Session, run: Run) -> int:
    return int(
        session.execute(
            select(func.count(func.distinct(Record.step))).where(Record.run_id == run.id)
        ).scalar_one()
    )
