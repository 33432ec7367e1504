"""`bulk.insert_rows` stores exactly what SQLAlchemy's own executemany of the same statement stores."""

from __future__ import annotations

import datetime as dt
from typing import Any

from conftest import settings_for
from sqlalchemy import select

from maingrad.service.bulk import insert_rows
from maingrad.service.local import ensure_project, open_database
from maingrad.service.models import Alert, Analysis, Finding
from maingrad.service.reports import _FINDINGS_INSERT, _upsert_alerts


def _analysis(session: Any, project_id: int, sha: str) -> int:
    a = Analysis(
        project_id=project_id,
        commit_sha=sha,
        category="c",
        format="sarif",
        tool_name="t",
        tool_version="",
        content_sha256="0" * 64,
        results_count=0,
        files_scanned=0,
        execution_successful=True,
        runs_meta=[],
        created_at=dt.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=dt.timezone.utc),
    )
    session.add(a)
    session.flush()
    return a.id


def _finding_rows(analysis_id: int, n: int) -> list[dict[str, Any]]:
    return [
        {
            "analysis_id": analysis_id,
            "run_index": i % 3,
            "fingerprint": f"{i:064x}",
            "context_hash": None if i % 4 == 0 else f"ctx{i}",
            "rule": f"R{i % 7}",
            "level": ("error", "warning", "note")[i % 3],
            "severity_rank": i % 3,
            "path": f"src/p{i}.py",
            "start_line": None if i % 5 == 0 else i,
            "start_column": i % 9,
            "end_line": None,
            "end_column": None,
            "message": f"m{i} 'quoted' \"double\" \\ back, {{braces}} % percent\n\u00e9\U0001f600",
            "snippet": "" if i % 2 else f"x = {i}",
            "suppressed": i % 6 == 0,
            "sarif": {"ruleId": f"R{i}", "nested": [1, 2.5, None, True, {"k": "v"}], "s": "\u00e9"},
        }
        for i in range(n)
    ]


def _two_analyses(db: Any) -> tuple[Any, Any, int, int]:
    """Two projects with an analysis each: one written by the path under test, one by SQLAlchemy."""
    ours = ensure_project(db, "ours")
    theirs = ensure_project(db, "theirs")
    with db.writing() as session:
        a = _analysis(session, ours.id, "a" * 40)
        b = _analysis(session, theirs.id, "b" * 40)
    return ours, theirs, a, b


def _columns(row: Any, table: Any, skip: set[str]) -> dict[str, Any]:
    return {c.name: getattr(row, c.key) for c in table.c if c.name not in skip}


def test_findings_and_alerts_match_sqlalchemy(fresh_database_url: str) -> None:
    settings = settings_for(fresh_database_url)
    with open_database(settings) as db:
        ours, theirs, a, b = _two_analyses(db)
        n = 2_500  # more than one PostgreSQL page
        with db.writing() as session:
            insert_rows(session.connection(), _FINDINGS_INSERT, _finding_rows(a, n), "findings")
            session.connection().execute(_FINDINGS_INSERT, _finding_rows(b, n))
        when = dt.datetime(2026, 5, 6, 7, 8, 9, 123456, tzinfo=dt.timezone.utc)

        def alert_rows(project_id: int, analysis_id: int, level: str) -> list[dict[str, Any]]:
            return [
                {
                    "project_id": project_id,
                    "fingerprint": f"{i:064x}",
                    "category": "c",
                    "rule": f"R{i % 7}",
                    "level": level,
                    "severity_rank": 1,
                    "path": f"src/p{i}.py",
                    "message": f"m{i} %s %(x)s",
                    "state": "open",
                    "first_seen_commit": "a" * 40,
                    "first_seen_at": when,
                    "last_seen_commit": "a" * 40,
                    "last_seen_branch": None if i % 2 else "main",
                    "last_seen_at": when,
                    "last_seen_analysis_id": analysis_id,
                }
                for i in range(n)
            ]

        with db.writing() as session:  # first insert, then an upsert that updates (and reopens fixed ones)
            _upsert_alerts(session, alert_rows(ours.id, a, "warning"))
            _upsert_alerts(session, alert_rows(theirs.id, b, "warning"))
            for pid in (ours.id, theirs.id):
                session.execute(
                    Alert.__table__.update()  # type: ignore[attr-defined]
                    .where(Alert.project_id == pid, Alert.id % 3 == 0)
                    .values(state="fixed", fixed_commit="f" * 40)
                )
        with db.writing() as session:
            _upsert_alerts(session, alert_rows(ours.id, a, "error"))
            stmt = _upsert_statement(session)
            session.connection().execute(stmt, alert_rows(theirs.id, b, "error"))
        with db.reading() as session:
            alerts = _same_rows(session, (a, b), (ours.id, theirs.id), n)
            assert {r["state"] for r in alerts[ours.id]} == {"open"}
            assert {r["level"] for r in alerts[ours.id]} == {"error"}


def _same_rows(session: Any, analyses: tuple[int, int], projects: tuple[int, int], n: int) -> dict[int, Any]:
    """The findings of the two analyses and the alerts of the two projects, stored by the path under test
    and by SQLAlchemy's own insert, agree column for column (ids aside); the alerts, by project."""
    findings = []
    for analysis_id in analyses:
        rows = session.execute(
            select(Finding).where(Finding.analysis_id == analysis_id).order_by(Finding.id)
        ).scalars()
        findings.append([_columns(r, Finding.__table__, {"id", "analysis_id"}) for r in rows])
    assert len(findings[0]) == n
    assert findings[0] == findings[1]
    alerts = {}
    for pid in projects:
        rows = session.execute(select(Alert).where(Alert.project_id == pid).order_by(Alert.id)).scalars()
        alerts[pid] = [
            _columns(r, Alert.__table__, {"id", "project_id", "last_seen_analysis_id"}) for r in rows
        ]
    assert len(alerts[projects[0]]) == n
    assert alerts[projects[0]] == alerts[projects[1]]
    return alerts


def _upsert_statement(session: Any) -> Any:
    """The statement `_upsert_alerts` executes, for SQLAlchemy to execute itself."""
    captured: list[Any] = []
    import maingrad.service.reports as reports

    real = reports.insert_columns
    reports.insert_columns = lambda conn, stmt, columns, key: captured.append(stmt)  # type: ignore[assignment]
    try:
        reports._upsert_alerts(session, [{"fingerprint": "x"}])
    finally:
        reports.insert_columns = real
    return captured[0]


def test_constant_columns_and_identical_rows_match_sqlalchemy(fresh_database_url: str) -> None:
    """Columns with one value for every row (sent once on PostgreSQL), columns of NULLs only, and rows that are
    identical in every column (each must be stored, however many there are) store what SQLAlchemy stores."""
    settings = settings_for(fresh_database_url)
    with open_database(settings) as db:
        ours, theirs, a, b = _two_analyses(db)
        same_row = _finding_rows(0, 1)[0]
        n = 2_100  # more than one PostgreSQL page

        def findings(analysis_id: int) -> list[dict[str, Any]]:
            return [{**same_row, "analysis_id": analysis_id} for _ in range(n)]

        when = dt.datetime(2026, 5, 6, 7, 8, 9, 123456, tzinfo=dt.timezone.utc)
        branch = None
        message = "one message for all"

        def alerts(project_id: int, analysis_id: int) -> list[dict[str, Any]]:
            return [
                {
                    "project_id": project_id,
                    "fingerprint": f"{i:064x}",
                    "category": "c",
                    "rule": "R",
                    "level": "note",
                    "severity_rank": 0,
                    "path": "p.py",
                    "message": message,
                    "state": "open",
                    "first_seen_commit": "a" * 40,
                    "first_seen_at": when,
                    "last_seen_commit": "a" * 40,
                    "last_seen_branch": branch,
                    "last_seen_at": when,
                    "last_seen_analysis_id": analysis_id,
                }
                for i in range(n)
            ]

        with db.writing() as session:
            insert_rows(session.connection(), _FINDINGS_INSERT, findings(a), "findings")
            session.connection().execute(_FINDINGS_INSERT, findings(b))
            _upsert_alerts(session, alerts(ours.id, a))
            session.connection().execute(_upsert_statement(session), alerts(theirs.id, b))
        with db.writing() as session:  # again: every row an update
            _upsert_alerts(session, alerts(ours.id, a))
            session.connection().execute(_upsert_statement(session), alerts(theirs.id, b))
        with db.reading() as session:
            stored = _same_rows(session, (a, b), (ours.id, theirs.id), n)
            assert {(r["last_seen_branch"], r["message"], r["first_seen_at"]) for r in stored[ours.id]} == {
                (None, message, when)
            }
