"""Alerts (one per fingerprint per project) and their audited triage."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from sqlalchemy import select

from maingrad.service.api.deps import DbDep, ReadAccess, SessionDep, TriageAccess
from maingrad.service.api.params import CursorQuery, IdPath, LimitQuery
from maingrad.service.dialect import bump_revision
from maingrad.service.models import Alert, AlertEvent, utcnow
from maingrad.service.pagination import keyset_page
from maingrad.service.problems import ProblemError
from maingrad.service.schemas import AlertDetail, AlertOut, AlertUpdate, Page

router = APIRouter(tags=["alerts"])

_FIELDS = [
    "id",
    "fingerprint",
    "category",
    "rule",
    "level",
    "path",
    "message",
    "state",
    "dismissed_reason",
    "dismissed_comment",
    "dismissed_at",
    "dismissed_by",
    "first_seen_commit",
    "first_seen_at",
    "last_seen_commit",
    "last_seen_branch",
    "last_seen_at",
    "fixed_commit",
]


def alert_out(a: Alert) -> dict[str, Any]:
    return {k: getattr(a, k) for k in _FIELDS}


def _detail(session: Any, a: Alert) -> dict[str, Any]:
    events = session.execute(
        select(AlertEvent).where(AlertEvent.alert_id == a.id).order_by(AlertEvent.id)
    ).scalars()
    return {
        **alert_out(a),
        "events": [
            {
                "created_at": e.created_at,
                "actor": e.actor,
                "from_state": e.from_state,
                "to_state": e.to_state,
                "reason": e.reason,
                "comment": e.comment,
            }
            for e in events
        ],
    }


@router.get("/projects/{project}/alerts", response_model=Page[AlertOut], summary="Alerts, newest first")
def list_alerts(
    access: ReadAccess,
    session: SessionDep,
    state: Annotated[Literal["open", "dismissed", "fixed"] | None, Query()] = None,
    rule: Annotated[str | None, Query(max_length=255)] = None,
    cursor: CursorQuery = None,
    limit: LimitQuery = 50,
) -> dict[str, Any]:
    query = select(Alert).where(Alert.project_id == access.project.id).order_by(Alert.id.desc())
    if state:
        query = query.where(Alert.state == state)
    if rule:
        query = query.where(Alert.rule == rule)
    rows, nxt = keyset_page(session, query, Alert.id, cursor, limit, newest_first=True)
    return {"items": [alert_out(a) for a in rows], "next_cursor": nxt}


def _alert(session: Any, project_id: int, alert_id: int) -> Alert:
    alert = session.get(Alert, alert_id)
    if alert is None or alert.project_id != project_id:
        raise ProblemError(404, "alert_not_found", f"no alert {alert_id} in this project")
    return alert


@router.get(
    "/projects/{project}/alerts/{alert_id}",
    response_model=AlertDetail,
    summary="One alert with its triage history",
)
def get_alert(alert_id: IdPath, access: ReadAccess, session: SessionDep) -> dict[str, Any]:
    return _detail(session, _alert(session, access.project.id, alert_id))


@router.patch(
    "/projects/{project}/alerts/{alert_id}",
    response_model=AlertDetail,
    summary="Triage: dismiss (with a reason) or reopen; every change is audited",
)
def triage_alert(alert_id: IdPath, body: AlertUpdate, access: TriageAccess, db: DbDep) -> dict[str, Any]:
    with db.writing() as session:
        alert = _alert(session, access.project.id, alert_id)
        before = alert.state
        if body.state == "dismissed":
            alert.state = "dismissed"
            alert.dismissed_reason = getattr(body, "reason", None)
            alert.dismissed_comment = body.comment
            alert.dismissed_at = utcnow()
            alert.dismissed_by = access.principal.actor
        else:
            # Reopening a dismissed alert: back to open (a later default-branch upload may mark it fixed).
            alert.state = "open" if before == "dismissed" else before
            alert.dismissed_reason = alert.dismissed_comment = alert.dismissed_by = None
            alert.dismissed_at = None
        bump_revision(session, access.project.id)
        session.add(
            AlertEvent(
                alert_id=alert.id,
                created_at=utcnow(),
                actor=access.principal.actor,
                from_state=before,
                to_state=alert.state,
                reason=getattr(body, "reason", None),
                comment=body.comment,
            )
        )
        session.flush()
        return _detail(session, alert)
