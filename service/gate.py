"""The CI gate, recomputed on every read from what is stored (nothing cached can go stale).

Status: `pending` while evidence the commit needs is missing (the project's `required_evidence`, or the
call's `require`: analysis categories and/or `runtime` records), or nothing for the commit (or its explicit
baseline) has arrived; `error` when an
uploaded tool run says it failed; `fail` when a condition fails (new findings at or above the policy
severity that nobody dismissed, or runtime anomalies recorded for the commit); `neutral` when there is
nothing to judge (only runtime records without anomalies, or analyses that scanned no file); else `pass`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, func, or_, select
from sqlalchemy.orm import Session, aliased

from maingrad.service.config import Settings
from maingrad.service.matching import Item, Matching, match
from maingrad.service.models import Alert, Analysis, Finding, Project, Record, Run
from maingrad.service.parsing import LEVEL_RANK
from maingrad.service.records import completions
from maingrad.service.reports import analysis_dict

SAMPLE_ANOMALIES = 20

# Statements are built once at import: on SQLite, building a select() costs more than running it, and
# the gate is the hottest read (CI polls it).
_ANALYSIS_COLUMNS = (
    Analysis.id,
    Analysis.commit_sha,
    Analysis.branch,
    Analysis.category,
    Analysis.format,
    Analysis.tool_name,
    Analysis.tool_version,
    Analysis.content_sha256,
    Analysis.results_count,
    Analysis.files_scanned,
    Analysis.execution_successful,
    Analysis.not_analyzed,
    Analysis.created_at,
)
_A1, _A2 = aliased(Analysis), aliased(Analysis)
_FIRST_HEAD = (
    select(func.min(_A2.id))
    .where(_A2.project_id == bindparam("p"), _A2.commit_sha == bindparam("c"))
    .scalar_subquery()
)
_BASELINE_COMMIT = (
    select(_A1.commit_sha)
    .where(
        _A1.project_id == bindparam("p"),
        _A1.branch == bindparam("b"),
        _A1.commit_sha != bindparam("c"),
        _A1.id < _FIRST_HEAD,
    )
    .order_by(_A1.id.desc())
    .limit(1)
    .scalar_subquery()
)
# The head's analyses and those of its default-branch baseline (the latest default-branch commit
# analyzed before the head) in one round trip; split by commit in Python.
_HEAD_AND_DEFAULT_BASE = (
    select(*_ANALYSIS_COLUMNS)
    .where(
        Analysis.project_id == bindparam("p"),
        or_(Analysis.commit_sha == bindparam("c"), Analysis.commit_sha == _BASELINE_COMMIT),
    )
    .order_by(Analysis.id)
)
# Head and an explicit baseline together.
_HEAD_AND_EXPLICIT_BASE = (
    select(*_ANALYSIS_COLUMNS)
    .where(
        Analysis.project_id == bindparam("p"), Analysis.commit_sha.in_([bindparam("c"), bindparam("base")])
    )
    .order_by(Analysis.id)
)
_FINDINGS = select(
    Finding.analysis_id,
    Finding.run_index,
    Finding.fingerprint,
    Finding.context_hash,
    Finding.rule,
    Finding.level,
    Finding.path,
    Finding.start_line,
    Finding.start_column,
    Finding.end_line,
    Finding.end_column,
    Finding.message,
    Finding.snippet,
    Finding.suppressed,
).where(Finding.analysis_id.in_(bindparam("ids", expanding=True)))
# Runs of the commit with their anomaly counts (a partial index holds only anomalous records).
_RUNS_OF_COMMIT = select(
    Run.id,
    Run.name,
    Run.record_count,
    select(func.count())
    .where(Record.run_id == Run.id, Record.anomaly.is_not(None))
    .correlate(Run)
    .scalar_subquery()
    .label("anomalies"),
).where(Run.project_id == bindparam("p"), Run.commit_sha == bindparam("c"))
_ANOMALY_SAMPLES = (
    select(Record.run_id, Record.rank, Record.step, Record.phase, Record.module, Record.param, Record.anomaly)
    .where(Record.run_id.in_(bindparam("ids", expanding=True)), Record.anomaly.is_not(None))
    .order_by(Record.step, Record.record_key)
    .limit(SAMPLE_ANOMALIES)
)
# Dismissed alerts among the head analyses' findings. The findings are named by their analyses (a handful of
# ids), never by fingerprint: a list of every new fingerprint passed PostgreSQL's 65,535 bind parameters at
# 22,000 results x 3 runs, and that commit never got a gate.
_DISMISSED = select(Alert.fingerprint).where(
    Alert.project_id == bindparam("p"),
    Alert.state == "dismissed",
    Alert.fingerprint.in_(
        select(Finding.fingerprint).where(Finding.analysis_id.in_(bindparam("ids", expanding=True)))
    ),
)
_SEVERITY = {"info": LEVEL_RANK["note"], "warning": LEVEL_RANK["warning"], "error": LEVEL_RANK["error"]}


def _conn(session: Session) -> Any:
    """Core statements run on the session's connection: the ORM execution layer would double their cost."""
    return session.connection()


@dataclass
class GateResult:
    """The gate's answer plus what the SARIF view needs (the head analyses and the new findings)."""

    body: dict[str, Any]
    head_ids: list[int]
    new_rows: list[Any]


def _load_findings(session: Session, ids: list[int]) -> list[Any]:
    return list(_conn(session).execute(_FINDINGS, {"ids": ids}).all()) if ids else []


def _items(rows: list[Any], categories: dict[int, str]) -> list[Item]:
    return [
        Item(
            r.fingerprint,
            categories[r.analysis_id],
            r.rule,
            r.path,
            r.message,
            r.start_line,
            r.context_hash,
            r,
        )
        for r in rows
        if not r.suppressed
    ]


def finding_out(row: Any, category: str, **extra: Any) -> dict[str, Any]:
    """A stored finding as the API's FindingOut (plus gate-specific extras)."""
    return {
        "fingerprint": row.fingerprint,
        "category": category,
        "rule": row.rule,
        "level": row.level,
        "path": row.path,
        "start_line": row.start_line,
        "start_column": row.start_column,
        "end_line": row.end_line,
        "end_column": row.end_column,
        "message": row.message,
        "snippet": row.snippet,
        "suppressed": row.suppressed,
        **extra,
    }


def _sort_key(item: Item) -> tuple[int, str, int, str]:
    return (-LEVEL_RANK.get(item.ref.level, 1), item.path, item.start_line or 0, item.rule)


def head_and_baseline(
    session: Session, project: Project, commit_sha: str, base_sha: str | None
) -> tuple[list[Any], dict[str, Any], list[Any]]:
    """(head analyses, how the baseline was chosen, baseline analyses)."""
    if base_sha:
        rows = (
            _conn(session)
            .execute(_HEAD_AND_EXPLICIT_BASE, {"p": project.id, "c": commit_sha, "base": base_sha})
            .all()
        )
        head = [a for a in rows if a.commit_sha == commit_sha]
        base = [a for a in rows if a.commit_sha == base_sha]
        return (
            head,
            {"commit_sha": base_sha, "how": "explicit", "branch": base[0].branch if base else None},
            base,
        )
    params = {"p": project.id, "b": project.default_branch, "c": commit_sha}
    rows = _conn(session).execute(_HEAD_AND_DEFAULT_BASE, params).all()
    head = [a for a in rows if a.commit_sha == commit_sha]
    base = [a for a in rows if a.commit_sha != commit_sha]
    if base:
        return (
            head,
            {"commit_sha": base[0].commit_sha, "how": "default_branch", "branch": project.default_branch},
            base,
        )
    return head, {"commit_sha": None, "how": "none", "branch": None}, []


def runtime_summary(session: Session, project: Project, commit_sha: str) -> dict[str, Any]:
    """The commit's runs, records and anomalies, and which runs have not ended yet (`incomplete`): a run's
    records are evidence only once each of its ranks has sent its end marker and none lost a record."""
    runs = list(_conn(session).execute(_RUNS_OF_COMMIT, {"p": project.id, "c": commit_sha}).all())
    if not runs:
        return {"runs": [], "records": 0, "anomalies": 0, "samples": [], "incomplete": []}
    ids = [r.id for r in runs]
    names = {r.id: r.name for r in runs}
    ended = completions(session, ids)
    incomplete = [
        {
            "run": names[rid],
            "ended_ranks": state["ended_ranks"],
            "world_size": state["world_size"],
            "lost": state["lost"],
        }
        for rid, state in sorted(ended.items(), key=lambda item: names[item[0]])
        if not state["complete"]
    ]
    count = sum(int(r.anomalies) for r in runs)
    samples = []
    if count:
        for rec in _conn(session).execute(_ANOMALY_SAMPLES, {"ids": ids}).all():
            samples.append(
                {
                    "run": names[rec.run_id],
                    "rank": rec.rank,
                    "step": rec.step,
                    "phase": rec.phase,
                    "module": rec.module,
                    "param": rec.param,
                    "anomaly": rec.anomaly or "",
                }
            )
    return {
        "runs": sorted(names.values()),
        "records": int(sum(r.record_count for r in runs)),
        "anomalies": int(count),
        "samples": samples,
        "incomplete": incomplete,
    }


RUNTIME = "runtime"  # the evidence name of runtime records; every other name is an analysis category


def runtime_complete(runtime: dict[str, Any]) -> bool:
    return bool(runtime["runs"]) and not runtime["incomplete"]


def evidence(
    required: list[str] | tuple[str, ...], head: list[Any], runtime: dict[str, Any], source: str = "required"
) -> dict[str, Any]:
    """Which required pieces of evidence the commit has, and which are still missing (runtime records count
    only once their runs have ended: see runtime_summary). `source` says where the requirement came from."""
    present = sorted({a.category for a in head} | ({RUNTIME} if runtime_complete(runtime) else set()))
    wanted = sorted(set(required))
    return {
        "required": wanted,
        "present": present,
        "missing": [e for e in wanted if e not in present],
        "source": source,
    }


_RUNS_OF = select(func.count()).where(Run.project_id == bindparam("p"), Run.commit_sha == bindparam("c"))


def default_requirement(
    session: Session, settings: Settings, project: Project, baseline: dict[str, Any], base: list[Any]
) -> tuple[list[str], str]:
    """With nothing required by the call or the project: what the baseline received — the default branch's
    latest commit analyzed before this one, or the explicit `base_sha` — (its analysis categories, and `runtime`
    when it had runs), else the configured default. Without it the first evidence to arrive decided, and a commit whose failing
    report landed later had passed already."""
    if baseline.get("how") in ("default_branch", "explicit") and baseline.get("commit_sha") and base:
        wanted = {a.category for a in base}
        runs = _conn(session).execute(_RUNS_OF, {"p": project.id, "c": baseline["commit_sha"]}).scalar_one()
        if runs:
            wanted.add(RUNTIME)
        return sorted(wanted), "default_branch" if baseline["how"] == "default_branch" else "explicit_base"
    return sorted(set(settings.default_required_evidence)), "configured_default"


def compute_gate(
    session: Session,
    settings: Settings,
    project: Project,
    commit_sha: str,
    base_sha: str | None = None,
    require: list[str] | tuple[str, ...] | None = None,
) -> GateResult:
    """The gate. `require` (else the project's `required_evidence`) names the evidence the commit needs
    before anything is decided: while some is missing the status is `pending`, whatever has arrived."""
    head, baseline, base = head_and_baseline(session, project, commit_sha, base_sha)
    runtime = runtime_summary(session, project, commit_sha)
    if require is not None:
        required, source = list(require), "request"
    elif project.required_evidence:
        required, source = list(project.required_evidence), "project"
    else:
        required, source = default_requirement(session, settings, project, baseline, base)
    proof = evidence(required, head, runtime, source)
    policy = {
        "fail_on_severity": settings.gate_fail_severity,
        "fail_on_runtime_anomalies": settings.gate_fail_on_runtime_anomalies,
    }
    threshold = _SEVERITY[settings.gate_fail_severity]

    categories = {a.id: a.category for a in head}
    base_categories = {a.id: a.category for a in base}
    # One query for both sides' findings.
    base_all = base
    base = [a for a in base_all if a.category in set(categories.values())]
    head_ids, base_ids = set(categories), {a.id for a in base}
    rows = _load_findings(session, sorted(head_ids | base_ids))
    head_rows = [r for r in rows if r.analysis_id in head_ids]
    base_rows = [r for r in rows if r.analysis_id in base_ids]
    matching: Matching = match(
        _items(head_rows, categories), _items(base_rows, base_categories), settings.match_line_window
    )
    suppressed = sum(1 for r in head_rows if r.suppressed)

    new_fps = {i.fingerprint for i in matching.new}
    dismissed_fps: set[str] = set()
    if new_fps:
        found = _conn(session).execute(_DISMISSED, {"p": project.id, "ids": sorted(head_ids)}).scalars()
        dismissed_fps = new_fps.intersection(found)
    new_sorted = sorted(matching.new, key=_sort_key)
    failing = [
        i
        for i in new_sorted
        if LEVEL_RANK.get(i.ref.level, 1) >= threshold and i.fingerprint not in dismissed_fps
    ]

    conditions = [
        {
            "name": "new_findings",
            "description": f"new findings at severity >= {settings.gate_fail_severity}, not dismissed",
            "operator": "<=",
            "threshold": 0,
            "actual": len(failing),
            "passed": not failing,
        }
    ]
    if settings.gate_fail_on_runtime_anomalies:
        conditions.append(
            {
                "name": "runtime_anomalies",
                "description": "runtime anomalies recorded by maingrad.hooks for this commit",
                "operator": "<=",
                "threshold": 0,
                "actual": runtime["anomalies"],
                "passed": runtime["anomalies"] == 0,
            }
        )
    unanalyzed = sum(a.not_analyzed for a in head)
    conditions.append(
        {
            "name": "all_analyzed",
            "description": "no uploaded analysis reports a file or folder it could not analyze "
            "(error-level tool execution notifications, such as maingrad's MG999)",
            "operator": "<=",
            "threshold": 0,
            "actual": unanalyzed,
            "passed": unanalyzed == 0,
        }
    )
    failed_tools = [a for a in head if not a.execution_successful]
    conditions.append(
        {
            "name": "tool_execution",
            "description": "every uploaded analysis reports a successful tool run",
            "operator": "==",
            "threshold": True,
            "actual": not failed_tools,
            "passed": not failed_tools,
        }
    )

    status, reason = _status(head, base_sha, base_all, runtime, conditions, failed_tools, proof["missing"])
    limit = settings.max_gate_findings
    unchanged_sorted = sorted(matching.unchanged, key=lambda t: _sort_key(t[0]))
    fixed_sorted = sorted(matching.fixed, key=_sort_key)
    body = {
        "project": project.name,
        "commit_sha": commit_sha,
        "status": status,
        "reason": reason,
        "policy": policy,
        "baseline": {**baseline, "analysis_ids": sorted(a.id for a in base)},
        "analyses": [analysis_dict(a, project.name) for a in head],
        "conditions": conditions,
        "summary": {
            "new": len(matching.new),
            "new_failing": len(failing),
            "unchanged": len(matching.unchanged),
            "fixed": len(matching.fixed),
            "suppressed": suppressed,
            "dismissed": sum(1 for i in matching.new if i.fingerprint in dismissed_fps),
        },
        "new": [
            finding_out(i.ref, i.category, dismissed=i.fingerprint in dismissed_fps)
            for i in new_sorted[:limit]
        ],
        "unchanged": [
            finding_out(h.ref, h.category, match=how, base_path=b.path, base_start_line=b.start_line)
            for h, b, how in unchanged_sorted[:limit]
        ],
        "fixed": [finding_out(i.ref, i.category) for i in fixed_sorted[:limit]],
        "truncated": max(len(matching.new), len(matching.unchanged), len(matching.fixed)) > limit,
        "runtime": runtime,
        "evidence": proof,
    }
    return GateResult(body=body, head_ids=[a.id for a in head], new_rows=[i.ref for i in new_sorted])


def _status(
    head: list[Any],
    base_sha: str | None,
    base: list[Any],
    runtime: dict[str, Any],
    conditions: list[dict[str, Any]],
    failed_tools: list[Any],
    missing: list[str],
) -> tuple[str, str | None]:
    anomalous = [c for c in conditions if c["name"] == "runtime_anomalies" and not c["passed"]]
    if anomalous and (missing or runtime["incomplete"]):
        # Records are never withdrawn: an anomaly that has arrived fails the commit whatever else arrives.
        return "fail", "failed: runtime_anomalies (more evidence may still arrive; it cannot change this)"
    if missing:
        return "pending", "waiting for: " + ", ".join(
            "runtime records" if m == RUNTIME else f"analysis {m!r}" for m in missing
        )
    if not head and not runtime["runs"]:
        return "pending", "no analysis or runtime records for this commit yet"
    if base_sha and head and not base:
        return "pending", f"no analysis for the baseline commit {base_sha} yet"
    if runtime["incomplete"]:
        # Partial evidence is never a pass (like missing evidence): the records still to come may hold
        # an anomaly.
        return "pending", "runtime records not complete: " + "; ".join(
            f"run {r['run']!r}: "
            + (
                f"{r['lost']} records lost, so it cannot complete"
                if r["lost"]
                else f"{r['ended_ranks']} of {r['world_size'] or '?'} ranks ended"
            )
            for r in runtime["incomplete"]
        )
    if failed_tools:
        names = ", ".join(sorted({a.tool_name for a in failed_tools}))
        return "error", f"the tool run reported failure: {names}"
    failed = [c["name"] for c in conditions if not c["passed"]]
    if failed:
        return "fail", "failed: " + ", ".join(failed)
    if not head:
        return "neutral", "only runtime records (no anomaly); no static analysis for this commit"
    if all(a.files_scanned == 0 and a.results_count == 0 for a in head):
        return "neutral", "the analyses scanned no file"
    return "pass", None
