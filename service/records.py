"""Runtime records from maingrad.hooks: NDJSON batches in, per-run timelines and aggregates out.

Ingest is the hot path (target >= 50,000 records/s in batches of 1,000): one hand-written validation pass
per line (no per-record model objects), then a single bulk INSERT ... ON CONFLICT DO NOTHING on
(run, record id), which makes re-sent batches harmless. The raw line is stored next to the indexed columns,
so nothing the hooks add later is lost. Aggregates are computed on read, off the hot path.
"""

from __future__ import annotations

import json
from typing import Any

from maingrad.service.db import Database
from maingrad.service.dialect import insert_for, note_commit, with_retries
from maingrad.service.models import Project, Record, Run, utcnow
from maingrad.service.parsing import without_nul
from maingrad.service.problems import ProblemError
from sqlalchemy import case, func, select, update
from sqlalchemy.orm import Session

PHASES = frozenset({"forward", "backward"})
ACTIONS = frozenset({"none", "exposed", "raised", "error"})
_ANOMALOUS_ACTIONS = frozenset({"raised", "error"})
_INT = int


def _bad(line: int, detail: str) -> ProblemError:
    return ProblemError(422, "invalid_record", f"line {line}: {detail}", line=line)


def _is_int(v: Any) -> bool:
    return type(v) is _INT


def _opt_bool(rec: dict[str, Any], key: str, line: int) -> bool | None:
    v = rec.get(key)
    if v is None or v is True or v is False:
        return v
    raise _bad(line, f"{key!r} must be a boolean or null")


def parse_batch(body: bytes, run_name: str, max_records: int) -> tuple[list[dict[str, Any]], str | None]:
    """Validated rows for the records table and the batch's commit (from the records), or 422."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProblemError(422, "invalid_encoding", f"body is not UTF-8: {exc}") from None
    rows: list[dict[str, Any]] = []
    commit: str | None = None
    loads = json.loads
    for lineno, raw_line in enumerate(text.split("\n"), start=1):
        line = raw_line.strip()
        if not line:
            continue
        if len(rows) >= max_records:
            raise ProblemError(
                413, "too_many_records", f"a batch holds at most {max_records} records", limit=max_records
            )
        try:
            rec = loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise _bad(lineno, f"not JSON: {exc}") from None
        if "\\u0000" in line:  # an escaped NUL: PostgreSQL text cannot hold it in the indexed columns
            rec = without_nul(rec)
        if type(rec) is not dict:
            raise _bad(lineno, "a record must be a JSON object")
        if rec.get("schema", 1) != 1:
            raise _bad(lineno, f"unsupported record schema {rec.get('schema')!r} (expected 1)")
        rid = rec.get("id")
        if type(rid) is not str or not 0 < len(rid) <= 255:
            raise _bad(lineno, "'id' must be a non-empty string of at most 255 characters")
        run = rec.get("run")
        if run is not None and str(run) != run_name:
            raise _bad(lineno, f"record belongs to run {run!r}, not {run_name!r}")
        rank, step, mb, t_ns = rec.get("rank"), rec.get("step"), rec.get("microbatch"), rec.get("t_ns")
        if not _is_int(rank) or rank < 0:
            raise _bad(lineno, "'rank' must be a non-negative integer")
        if not _is_int(step) or not -(2**62) < step < 2**62:
            raise _bad(lineno, "'step' must be an integer")
        if mb is not None and (not _is_int(mb) or not -(2**31) < mb < 2**31):
            raise _bad(lineno, "'microbatch' must be an integer or null")
        if t_ns is not None and (not _is_int(t_ns) or not -(2**63) <= t_ns < 2**63):
            raise _bad(lineno, "'t_ns' must be a 64-bit integer or null")
        phase, action = rec.get("phase"), rec.get("action", "none")
        if phase not in PHASES:
            raise _bad(lineno, "'phase' must be 'forward' or 'backward'")
        if action not in ACTIONS:
            raise _bad(lineno, f"'action' must be one of {sorted(ACTIONS)}")
        module, param = rec.get("module", ""), rec.get("param", "")
        if type(module) is not str or type(param) is not str:
            raise _bad(lineno, "'module' and 'param' must be strings")
        anomaly = rec.get("anomaly")
        if anomaly is not None and type(anomaly) is not str:
            raise _bad(lineno, "'anomaly' must be a string or null")
        if anomaly is None and action in _ANOMALOUS_ACTIONS:
            anomaly = f"action:{action}"
        rec_commit = rec.get("commit")
        if rec_commit is not None:
            if type(rec_commit) is not str or not rec_commit:
                raise _bad(lineno, "'commit' must be a non-empty string or null")
            rec_commit = rec_commit.lower()
            if commit is None:
                commit = rec_commit
            elif rec_commit != commit:
                raise _bad(lineno, f"records of one batch name two commits ({commit}, {rec_commit})")
        rows.append(
            {
                "record_key": rid,
                "rank": rank,
                "step": step,
                "microbatch": mb,
                "phase": phase,
                "module": module,
                "param": param,
                "has_main_grad": _opt_bool(rec, "has_main_grad", lineno),
                "main_grad_is_none": _opt_bool(rec, "main_grad_is_none", lineno),
                "action": action,
                "anomaly": anomaly,
                "t_ns": t_ns,
                "raw": line,
            }
        )
    return rows, commit


def ingest(
    db: Database, project: Project, run_name: str, commit_param: str | None, body: bytes, max_records: int
) -> dict[str, Any]:
    rows, record_commit = parse_batch(body, run_name, max_records)
    if commit_param and record_commit and commit_param != record_commit:
        raise ProblemError(
            409, "commit_mismatch", f"commit_sha={commit_param} but the records name commit {record_commit}"
        )
    commit = commit_param or record_commit

    def attempt() -> dict[str, Any]:
        with db.writing() as session:
            run = _get_or_create_run(session, project, run_name, commit)
            inserted = 0
            if rows:
                for row in rows:
                    row["run_id"] = run.id
                inserted = _insert_rows(session, rows)
                session.execute(
                    update(Run)
                    .where(Run.id == run.id)
                    .values(record_count=Run.record_count + inserted, last_record_at=utcnow())
                )
            return {
                "run": run_name,
                "commit_sha": run.commit_sha,
                "received": len(rows),
                "inserted": inserted,
                "duplicates": len(rows) - inserted,
            }

    return with_retries(attempt)


def _insert_rows(session: Session, rows: list[dict[str, Any]]) -> int:
    """Bulk insert, skipping record ids already stored; returns how many rows were new."""
    stmt = insert_for(session, Record).on_conflict_do_nothing(index_elements=["run_id", "record_key"])
    conn = session.connection()
    if conn.dialect.name == "sqlite":
        return max(conn.execute(stmt, rows).rowcount, 0)  # executemany: rowcount sums the inserts
    # psycopg's executemany has no summed rowcount: RETURNING (batched as multi-row VALUES by
    # SQLAlchemy's insertmanyvalues) yields exactly the rows that were new.
    return len(conn.execute(stmt.returning(Record.__table__.c.id), rows).all())


def _get_or_create_run(session: Session, project: Project, name: str, commit: str | None) -> Run:
    run = session.execute(
        select(Run).where(Run.project_id == project.id, Run.name == name)
    ).scalar_one_or_none()
    if run is None:
        session.execute(
            insert_for(session, Run)
            .values(project_id=project.id, name=name, commit_sha=commit, created_at=utcnow(), record_count=0)
            .on_conflict_do_nothing(index_elements=["project_id", "name"])
        )
        run = session.execute(select(Run).where(Run.project_id == project.id, Run.name == name)).scalar_one()
    if commit is not None:
        if run.commit_sha is None:
            run.commit_sha = commit
            session.execute(update(Run).where(Run.id == run.id).values(commit_sha=commit))
            note_commit(session, project.id, commit, None)
        elif run.commit_sha != commit:
            raise ProblemError(
                409, "run_commit_mismatch", f"run {name!r} belongs to commit {run.commit_sha}, not {commit}"
            )
    return run


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
    rows = session.execute(
        select(column.label("key"), func.count(func.distinct(Record.param)).label("params"), *_counts())
        .where(Record.run_id == run.id)
        .group_by(column)
        .order_by(column)
    ).all()
    return [{"key": str(r.key), "params": int(r.params), **_num(r)} for r in rows]


def anomalies(session: Session, run: Run, limit: int = 100) -> list[dict[str, Any]]:
    rows = session.execute(
        select(Record)
        .where(Record.run_id == run.id, Record.anomaly.is_not(None))
        .order_by(Record.id)
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
        }
        for r in rows
    ]


def step_count(session: Session, run: Run) -> int:
    return int(
        session.execute(
            select(func.count(func.distinct(Record.step))).where(Record.run_id == run.id)
        ).scalar_one()
    )
