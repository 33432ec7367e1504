"""Storing an uploaded report: parse, fingerprint, replace by key, keep alerts current.

Idempotent three ways: a byte-identical re-upload for the same (project, commit, category) is a no-op that
returns the same analysis; an `Idempotency-Key` replays the first answer; concurrent uploads of one key end
with exactly one analysis (the losers retry and see the winner).
"""

from __future__ import annotations

import datetime as dt
import gc
import hashlib
import logging
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, select, text, update
from sqlalchemy.orm import Session

from maingrad.service.bulk import insert_columns
from maingrad.service.config import Settings
from maingrad.service.db import Database
from maingrad.service.dialect import bump_revision, insert_for, note_commit, with_retries
from maingrad.service.models import Alert, Analysis, Finding, IdempotencyKey, Project, utcnow
from maingrad.service.parsing import Limits, NormAnalysis, assign_fingerprints, parse_report
from maingrad.service.problems import ProblemError

log = logging.getLogger("maingrad.service")


@dataclass
class UploadOutcome:
    body: dict[str, Any]
    status_code: int  # 201 created/replaced, 200 unchanged or replayed


def iso(value: dt.datetime) -> str:
    """RFC 3339 in UTC with a Z, like pydantic writes datetimes."""
    return value.astimezone(dt.timezone.utc).isoformat().replace("+00:00", "Z")


def analysis_dict(a: Analysis, project_name: str) -> dict[str, Any]:
    return {
        "id": a.id,
        "project": project_name,
        "commit_sha": a.commit_sha,
        "branch": a.branch,
        "category": a.category,
        "format": a.format,
        "tool": {"name": a.tool_name, "version": a.tool_version},
        "results_count": a.results_count,
        "files_scanned": a.files_scanned,
        "execution_successful": a.execution_successful,
        "not_analyzed": a.not_analyzed,
        "content_sha256": a.content_sha256,
        "created_at": iso(a.created_at),
    }


# The cyclic garbage collector, paused while a report is stored. Parsing a 25,000-result report creates 425,000
# containers that all stay alive until the request ends and form no reference cycles (parsed JSON, row tuples):
# each allocation burst made the collector traverse the whole growing heap again (full collections at every
# 25 % growth), 0.2-0.5 s of CPU that freed nothing. Reference counting still frees everything at once; the
# collector resumes when the last concurrent store ends, with whatever cycles other threads made meanwhile.
_gc_lock = threading.Lock()
_gc_pausers = 0
_gc_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    global _gc_pausers, _gc_was_enabled
    with _gc_lock:
        if _gc_pausers == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pausers += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_was_enabled:
                gc.enable()


@gc_paused()  # a contextmanager is also a decorator: each call pauses the collector anew
def store_report(
    db: Database,
    settings: Settings,
    project: Project,
    *,
    commit_sha: str,
    branch: str | None,
    category: str | None,
    body: bytes | bytearray,
    idempotency_key: str | None = None,
) -> UploadOutcome:
    digest = hashlib.sha256(body)  # the body, NUL, commit, NUL, branch, NUL, category (no copy of the body)
    content_sha = digest.hexdigest()  # the body's own: hexdigest() leaves the hash open to more updates
    for part in (commit_sha, branch or "", category or ""):
        digest.update(b"\0" + part.encode())
    request_sha = digest.hexdigest()
    ttl = dt.timedelta(hours=settings.idempotency_ttl_hours)
    if idempotency_key:
        replay = _replay(db, project.id, idempotency_key, request_sha, ttl)
        if replay is not None:
            return replay
    norm = parse_report(body, Limits.from_settings(settings))
    cat = (category or norm.tool_name or norm.format)[:200]
    assign_fingerprints(norm.findings, cat)
    staged: int | None = None
    if len(norm.findings) > WRITE_CHUNK_ROWS:
        staged = _stage(db, project, cat, content_sha, norm)

    def attempt() -> UploadOutcome:
        with db.writing() as session:
            if idempotency_key:
                lock_key(session, "idempotency", project.id, idempotency_key)
                replay = _replay_in(session, project.id, idempotency_key, request_sha, ttl)
                if replay is not None:
                    return replay
                session.execute(
                    delete(IdempotencyKey).where(
                        IdempotencyKey.project_id == project.id, IdempotencyKey.created_at < utcnow() - ttl
                    )
                )
            outcome = _store(session, project, commit_sha, branch, cat, content_sha, norm, staged)
            if idempotency_key:
                session.add(
                    IdempotencyKey(
                        project_id=project.id,
                        key=idempotency_key,
                        request_sha256=request_sha,
                        analysis_id=outcome.body["id"],
                        status_code=outcome.status_code,
                        response=outcome.body,
                        created_at=utcnow(),
                    )
                )
            return outcome

    try:
        outcome = with_retries(attempt)
    except BaseException:
        if staged is not None:
            _discard(db, staged)
        raise
    if staged is not None:
        _finish_staged(db, project, staged, outcome, norm)
    return outcome


# --- long writes in short transactions ------------------------------------------------------------------------
# One transaction for a 25,000-result report held SQLite's write lock for 1.4 s (and 28 s for 20 such runs before
# the per-report cap): every other project's upload and records batch waited behind it. A report with more than
# WRITE_CHUNK_ROWS findings is written in transactions of at most that many rows: its analysis is first stored
# under a staging commit id that no query selects (`~` is not allowed in commit ids), its findings in chunks, then
# one short transaction swaps it in for the previous analysis of its key (which is retired the same way), and the
# alerts follow in chunks. Until the swap the gate sees the previous analysis whole; after it, the new one whole.
WRITE_CHUNK_ROWS = 2_000
HIDDEN_PREFIX = "~"  # commit ids of staged and retired analyses (COMMIT_RE never allows it)
_FINDINGS_INSERT = Finding.__table__.insert()  # type: ignore[attr-defined]  # a Table


def _finding_columns(analysis_id: int, findings: list[Any]) -> dict[str, list[Any]]:
    """The findings' rows, column by column (what `insert_columns` hands the driver, without a dict per row)."""
    return {
        "analysis_id": [analysis_id] * len(findings),
        "run_index": [f.run_index for f in findings],
        "fingerprint": [f.fingerprint for f in findings],
        "context_hash": [f.context_hash for f in findings],
        "rule": [f.rule for f in findings],
        "level": [f.level for f in findings],
        "severity_rank": [f.severity_rank for f in findings],
        "path": [f.path for f in findings],
        "start_line": [f.start_line for f in findings],
        "start_column": [f.start_column for f in findings],
        "end_line": [f.end_line for f in findings],
        "end_column": [f.end_column for f in findings],
        "message": [f.message for f in findings],
        "snippet": [f.snippet for f in findings],
        "suppressed": [f.suppressed for f in findings],
        "sarif": [f.sarif for f in findings],
    }


def _stage(db: Database, project: Project, category: str, content_sha: str, norm: NormAnalysis) -> int:
    """Store the analysis hidden (staging commit id, no branch) and its findings, a chunk per transaction."""
    with db.writing() as session:
        analysis = _new_analysis(
            project, f"{HIDDEN_PREFIX}staging-{uuid.uuid4().hex}", None, category, content_sha, norm
        )
        session.add(analysis)
        session.flush()
        staged = analysis.id
    try:
        for start in range(0, len(norm.findings), WRITE_CHUNK_ROWS):
            columns = _finding_columns(staged, norm.findings[start : start + WRITE_CHUNK_ROWS])
            with db.writing() as session:
                insert_columns(session.connection(), _FINDINGS_INSERT, columns, "findings")
    except BaseException:
        _discard(db, staged)
        raise
    return staged


def _discard(db: Database, analysis_id: int) -> None:
    """Delete a hidden analysis and its findings, a chunk per transaction (best effort: a leftover is hidden)."""
    try:
        while True:
            with db.writing() as session:
                ids = select(Finding.id).where(Finding.analysis_id == analysis_id).limit(WRITE_CHUNK_ROWS)
                result = session.execute(delete(Finding).where(Finding.id.in_(ids.scalar_subquery())))
                done = getattr(result, "rowcount", 0)  # a CursorResult: DELETE reports its row count
                if not done:
                    session.execute(delete(Analysis).where(Analysis.id == analysis_id))
                    return
    except Exception as exc:  # noqa: BLE001 - the row stays hidden; a later upload's cleanup is not needed
        log.warning("could not delete hidden analysis %s: %s", analysis_id, exc)


def _finish_staged(
    db: Database, project: Project, staged: int, outcome: UploadOutcome, norm: NormAnalysis
) -> None:
    """After the swap: the alerts (a chunk per transaction), then the retired analysis's rows."""
    body = outcome.body
    if body.get("id") != staged or outcome.status_code != 201:  # unchanged or replayed: the staged copy goes
        _discard(db, staged)
        return
    with db.reading() as session:
        analysis = session.get(Analysis, staged)
    if analysis is None:
        return
    unique = _alert_findings(norm)
    keys = sorted(unique)
    chunks = [keys[start : start + WRITE_CHUNK_ROWS] for start in range(0, len(keys), WRITE_CHUNK_ROWS)]
    for chunk in [*chunks, None]:  # None: the last step, alerts no longer seen become fixed
        with db.writing() as session:
            if not _still_current(session, staged):
                break  # a newer upload of the key replaced it meanwhile: its alerts are that upload's
            if chunk is None:
                _mark_fixed(session, project, analysis)
            else:
                _upsert_alert_columns(session, _alert_columns(project, analysis, [unique[k] for k in chunk]))
    retired = body.get("replaced_id")
    if retired is not None:
        _discard(db, retired)


def lock_key(session: Session, *parts: Any) -> None:
    """PostgreSQL: serialize writers of one key for the rest of the transaction (an advisory lock).

    Two uploads for one (project, commit, category) both found no analysis, both inserted, and the loser hit
    the unique key; with eight concurrent writers, retries ran out and a fifth of the answers were 500. Under
    the lock the second writer waits, then (READ COMMITTED) sees the first one's analysis and replaces it.
    SQLite needs nothing: its writers are serialized already (BEGIN IMMEDIATE)."""
    if session.get_bind().dialect.name != "postgresql":
        return
    digest = hashlib.blake2b("\0".join(map(str, parts)).encode(), digest_size=8).digest()
    session.execute(
        text("SELECT pg_advisory_xact_lock(:k)"), {"k": int.from_bytes(digest, "big", signed=True)}
    )


def _replay(
    db: Database, project_id: int, key: str, request_sha: str, ttl: dt.timedelta
) -> UploadOutcome | None:
    with db.reading() as session:
        return _replay_in(session, project_id, key, request_sha, ttl)


def _replay_in(
    session: Session, project_id: int, key: str, request_sha: str, ttl: dt.timedelta
) -> UploadOutcome | None:
    row = session.execute(
        select(IdempotencyKey).where(IdempotencyKey.project_id == project_id, IdempotencyKey.key == key)
    ).scalar_one_or_none()
    if row is None or row.created_at < utcnow() - ttl:
        return None
    if row.request_sha256 != request_sha:
        raise ProblemError(
            422, "idempotency_key_reused", "this Idempotency-Key was already used for a different request"
        )
    return UploadOutcome(dict(row.response), row.status_code)


def _still_current(session: Session, analysis_id: int) -> bool:
    commit = session.execute(
        select(Analysis.commit_sha).where(Analysis.id == analysis_id)
    ).scalar_one_or_none()
    return commit is not None and not commit.startswith(HIDDEN_PREFIX)


def _new_analysis(
    project: Project, commit_sha: str, branch: str | None, category: str, content_sha: str, norm: NormAnalysis
) -> Analysis:
    return Analysis(
        project_id=project.id,
        commit_sha=commit_sha,
        branch=branch,
        category=category,
        format=norm.format,
        tool_name=norm.tool_name[:200],
        tool_version=norm.tool_version[:100],
        content_sha256=content_sha,
        results_count=len(norm.findings),
        files_scanned=norm.files_scanned,
        execution_successful=norm.execution_successful,
        not_analyzed=norm.not_analyzed,
        runs_meta=norm.runs_meta,
        created_at=utcnow(),
    )


def _store(
    session: Session,
    project: Project,
    commit_sha: str,
    branch: str | None,
    category: str,
    content_sha: str,
    norm: NormAnalysis,
    staged: int | None = None,
) -> UploadOutcome:
    lock_key(session, "analysis", project.id, commit_sha, category)
    existing = session.execute(
        select(Analysis).where(
            Analysis.project_id == project.id,
            Analysis.commit_sha == commit_sha,
            Analysis.category == category,
        )
    ).scalar_one_or_none()
    replaced_id = None
    if existing is not None:
        if existing.content_sha256 == content_sha and existing.branch == branch:
            body = {**analysis_dict(existing, project.name), "outcome": "unchanged", "replaced_id": None}
            return UploadOutcome(body, 200)
        replaced_id = existing.id
        if staged is not None:  # retired: hidden now, its rows deleted in chunks after this transaction
            session.execute(
                update(Analysis)
                .where(Analysis.id == existing.id)
                .values(commit_sha=f"{HIDDEN_PREFIX}retired-{existing.id}", branch=None)
            )
        else:
            session.execute(delete(Finding).where(Finding.analysis_id == existing.id))
            session.execute(delete(Analysis).where(Analysis.id == existing.id))
    if staged is not None:
        session.execute(
            update(Analysis)
            .where(Analysis.id == staged)
            .values(commit_sha=commit_sha, branch=branch, created_at=utcnow())
        )
        session.flush()
        analysis = session.get(Analysis, staged, populate_existing=True)
        if analysis is None:
            raise RuntimeError(f"staged analysis {staged} vanished")
        note_commit(session, project.id, commit_sha, branch)
    else:
        analysis = _new_analysis(project, commit_sha, branch, category, content_sha, norm)
        session.add(analysis)
        session.flush()
        note_commit(session, project.id, commit_sha, branch)
        if norm.findings:
            insert_columns(
                session.connection(),
                _FINDINGS_INSERT,
                _finding_columns(analysis.id, norm.findings),
                "findings",
            )
        _update_alerts(session, project, analysis, norm)
    bump_revision(session, project.id)
    body = {
        **analysis_dict(analysis, project.name),
        "outcome": "replaced" if replaced_id is not None else "created",
        "replaced_id": replaced_id,
    }
    return UploadOutcome(body, 201)


def _update_alerts(session: Session, project: Project, analysis: Analysis, norm: NormAnalysis) -> None:
    unique = _alert_findings(norm)
    _upsert_alert_columns(session, _alert_columns(project, analysis, [unique[k] for k in sorted(unique)]))
    _mark_fixed(session, project, analysis)


def _alert_findings(norm: NormAnalysis) -> dict[str, Any]:
    """The first unsuppressed finding of each fingerprint: what its alert shows."""
    first: dict[str, Any] = {}
    for f in norm.findings:
        if f.suppressed or f.fingerprint in first:
            continue
        first[f.fingerprint] = f
    return first


def _alert_columns(project: Project, analysis: Analysis, findings: list[Any]) -> dict[str, list[Any]]:
    """The alert rows of `findings`, column by column."""
    n = len(findings)
    now = analysis.created_at
    commit = analysis.commit_sha
    return {
        "project_id": [project.id] * n,
        "fingerprint": [f.fingerprint for f in findings],
        "category": [analysis.category] * n,
        "rule": [f.rule for f in findings],
        "level": [f.level for f in findings],
        "severity_rank": [f.severity_rank for f in findings],
        "path": [f.path for f in findings],
        "message": [f.message for f in findings],
        "state": ["open"] * n,
        "first_seen_commit": [commit] * n,
        "first_seen_at": [now] * n,
        "last_seen_commit": [commit] * n,
        "last_seen_branch": [analysis.branch] * n,
        "last_seen_at": [now] * n,
        "last_seen_analysis_id": [analysis.id] * n,
    }


def _upsert_alerts(session: Session, rows: list[dict[str, Any]]) -> None:
    """Rows sorted by fingerprint, so concurrent uploads lock alert rows in one order (no deadlock)."""
    if rows:
        _upsert_alert_columns(session, {n: [row[n] for row in rows] for n in rows[0]})


def _upsert_alert_columns(session: Session, columns: dict[str, list[Any]]) -> None:
    """`_upsert_alerts` for rows given column by column (sorted by fingerprint, likewise)."""
    stmt = insert_for(session, Alert)
    table = Alert.__table__
    stmt = stmt.on_conflict_do_update(
        index_elements=["project_id", "fingerprint"],
        set_={
            "level": stmt.excluded.level,
            "severity_rank": stmt.excluded.severity_rank,
            "path": stmt.excluded.path,
            "message": stmt.excluded.message,
            "last_seen_commit": stmt.excluded.last_seen_commit,
            "last_seen_branch": stmt.excluded.last_seen_branch,
            "last_seen_at": stmt.excluded.last_seen_at,
            "last_seen_analysis_id": stmt.excluded.last_seen_analysis_id,
            # A fixed alert that comes back is open again; a dismissed one stays dismissed.
            "state": _case_reopen(table),
            "fixed_commit": None,
        },
    )
    insert_columns(session.connection(), stmt, columns, "alerts upsert")


def _mark_fixed(session: Session, project: Project, analysis: Analysis) -> None:
    if analysis.branch is not None and analysis.branch == project.default_branch:
        session.execute(
            update(Alert)
            .where(
                Alert.project_id == project.id,
                Alert.category == analysis.category,
                Alert.state == "open",
                Alert.last_seen_analysis_id != analysis.id,
            )
            .values(state="fixed", fixed_commit=analysis.commit_sha)
        )


def _case_reopen(table: Any) -> Any:
    from sqlalchemy import case

    return case((table.c.state == "fixed", "open"), else_=table.c.state)
