"""SARIF 2.1.0 out: a whole analysis, or only a gate's new results (for GitHub code scanning uploads)."""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from maingrad.contracts.sarif import SARIF_SCHEMA, SARIF_VERSION
from maingrad.service.models import Analysis, Finding

FINGERPRINT_KEY = "maingrad/alert"


def _run(analysis: Analysis, run_index: int, results: list[dict[str, Any]]) -> dict[str, Any]:
    metas = analysis.runs_meta or [{"tool": {"driver": {"name": analysis.tool_name}}}]
    run = copy.deepcopy(metas[run_index] if run_index < len(metas) else metas[0])
    run.setdefault("automationDetails", {"id": f"{analysis.category}/"})  # GitHub's category
    run["results"] = results
    return run


def _result(sarif: dict[str, Any], fingerprint: str) -> dict[str, Any]:
    result = dict(sarif)
    partial = dict(result.get("partialFingerprints") or {})
    partial.setdefault(FINGERPRINT_KEY, fingerprint)
    result["partialFingerprints"] = partial
    return result


def log(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"$schema": SARIF_SCHEMA, "version": SARIF_VERSION, "runs": runs}


def analysis_sarif(session: Session, analysis: Analysis) -> dict[str, Any]:
    rows = session.execute(
        select(Finding.run_index, Finding.fingerprint, Finding.sarif)
        .where(Finding.analysis_id == analysis.id)
        .order_by(Finding.id)
    ).all()
    by_run: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_run[r.run_index].append(_result(r.sarif, r.fingerprint))
    count = max(len(analysis.runs_meta or []), 1)
    return log([_run(analysis, i, by_run.get(i, [])) for i in range(count)])


def new_results_sarif(session: Session, analyses: list[Analysis], new_rows: list[Any]) -> dict[str, Any]:
    """One run per head analysis run, holding only the gate's new results."""
    wanted: dict[tuple[int, str], int] = defaultdict(int)
    for row in new_rows:
        wanted[(row.analysis_id, row.fingerprint)] += 1
    runs: list[dict[str, Any]] = []
    for analysis in analyses:
        by_run: dict[int, list[dict[str, Any]]] = defaultdict(list)
        if any(aid == analysis.id for aid, _ in wanted):
            rows = session.execute(
                select(Finding.run_index, Finding.fingerprint, Finding.sarif).where(
                    Finding.analysis_id == analysis.id
                )
            ).all()
            for r in rows:
                if wanted.get((analysis.id, r.fingerprint), 0) > 0:
                    wanted[(analysis.id, r.fingerprint)] -= 1
                    by_run[r.run_index].append(_result(r.sarif, r.fingerprint))
        count = max(len(analysis.runs_meta or []), 1)
        runs.extend(_run(analysis, i, by_run.get(i, [])) for i in range(count))
    return log(runs)
