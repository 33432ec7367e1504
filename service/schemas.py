"""Pydantic API schemas (the wire format), apart from the storage models in models.py."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

T = TypeVar("T")

PROJECT_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
EVIDENCE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._/:-]{0,199}$"  # a category name (<= 200 characters) or "runtime"
NO_NUL = r"^[^\x00]*$"  # PostgreSQL text cannot store NUL
Scope = Literal["upload", "read", "triage", "admin"]
GateStatus = Literal["pass", "fail", "neutral", "pending", "error"]
DismissReason = Literal["false_positive", "wont_fix", "used_in_tests"]


class Problem(BaseModel):
    """RFC 9457 problem details; `code` is the machine-readable reason."""

    type: str
    title: str
    status: int
    detail: str
    code: str
    instance: str | None = None
    errors: list[dict[str, Any]] | None = None
    limit: int | None = None
    line: int | None = Field(None, description="NDJSON bodies: the 1-based line at fault.")
    pointer: str | None = Field(
        None, description="JSON pointer (RFC 6901) of the value at fault in the body."
    )
    required_scope: str | None = None


class Page(BaseModel, Generic[T]):
    items: list[T]
    next_cursor: str | None = Field(
        None, description="Pass as `cursor` to get the next page; null at the end."
    )


# --- projects and tokens -------------------------------------------------------------------------------


EvidenceName = Annotated[
    str,
    Field(
        pattern=EVIDENCE_NAME,
        description="`runtime` (runtime records for the commit) or an analysis category (e.g. `maingrad`).",
    ),
]
RequiredEvidence = Annotated[
    list[EvidenceName],
    Field(
        max_length=20,
        description="Evidence every commit needs before its gate decides; while some is missing the gate "
        "is `pending`.",
    ),
]


class ProjectCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=PROJECT_NAME, examples=["megatron-lm"])
    default_branch: str = Field("main", min_length=1, max_length=255, pattern=NO_NUL)
    required_evidence: RequiredEvidence = Field(default_factory=list)


class ProjectUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    default_branch: str | None = Field(None, min_length=1, max_length=255, pattern=NO_NUL)
    required_evidence: RequiredEvidence | None = None


class ProjectOut(BaseModel):
    name: str
    default_branch: str
    required_evidence: list[str]
    created_at: dt.datetime


class TokenCreate(BaseModel):
    # At most one of the two expiry fields (null counts as given): the schema says it with `not`.
    model_config = ConfigDict(
        extra="forbid", json_schema_extra={"not": {"required": ["expires_at", "expires_in_days"]}}
    )
    name: str = Field("", max_length=200, pattern=NO_NUL)
    scopes: list[Scope] = Field(min_length=1)
    expires_at: dt.datetime | None = Field(None, description="Must be in the future.")
    expires_in_days: int | None = Field(None, ge=1, le=3650)

    @model_validator(mode="after")
    def _one_expiry(self) -> TokenCreate:
        if {"expires_at", "expires_in_days"} <= self.model_fields_set:
            raise ValueError("give expires_at or expires_in_days, not both")
        if self.expires_at is not None:
            if self.expires_at.tzinfo is None:
                self.expires_at = self.expires_at.replace(tzinfo=dt.timezone.utc)
            if self.expires_at <= dt.datetime.now(dt.timezone.utc):
                raise ValueError("expires_at is in the past: the token would be expired already")
        return self


class TokenOut(BaseModel):
    id: int
    project: str | None
    name: str
    prefix: str
    scopes: list[str]
    created_at: dt.datetime
    expires_at: dt.datetime | None
    revoked_at: dt.datetime | None
    last_used_at: dt.datetime | None


class TokenCreated(TokenOut):
    token: str = Field(description="The secret; shown once, store it now.")


# --- analyses and findings -----------------------------------------------------------------------------


class ToolOut(BaseModel):
    name: str
    version: str


class AnalysisOut(BaseModel):
    id: int
    project: str
    commit_sha: str
    branch: str | None
    category: str
    format: Literal["maingrad", "sarif"]
    tool: ToolOut
    results_count: int
    files_scanned: int | None
    execution_successful: bool
    not_analyzed: int = Field(
        description="paths the tool reported it could not analyze (error-level notifications)"
    )
    content_sha256: str
    created_at: dt.datetime


class UploadResult(AnalysisOut):
    outcome: Literal["created", "replaced", "unchanged"]
    replaced_id: int | None = None


class FindingOut(BaseModel):
    fingerprint: str
    category: str
    rule: str
    level: str
    path: str
    start_line: int | None
    start_column: int | None
    end_line: int | None
    end_column: int | None
    message: str
    snippet: str
    suppressed: bool


class CommitOut(BaseModel):
    sha: str
    branch: str | None
    analyses: int
    runs: int
    last_activity: dt.datetime


# --- gate ----------------------------------------------------------------------------------------------


class GateFinding(FindingOut):
    match: Literal["fingerprint", "nearby", "renamed"] | None = Field(
        None, description="How an unchanged finding was matched to the baseline."
    )
    base_path: str | None = None
    base_start_line: int | None = None
    dismissed: bool = False


class GateCondition(BaseModel):
    name: str
    description: str
    operator: Literal["<=", "=="]
    threshold: int | bool
    actual: int | bool
    passed: bool


class Baseline(BaseModel):
    commit_sha: str | None
    how: Literal["explicit", "default_branch", "none"]
    branch: str | None
    analysis_ids: list[int]


class GatePolicy(BaseModel):
    fail_on_severity: Literal["info", "warning", "error"]
    fail_on_runtime_anomalies: bool


class GateSummary(BaseModel):
    new: int
    new_failing: int
    unchanged: int
    fixed: int
    suppressed: int
    dismissed: int


class AnomalySample(BaseModel):
    run: str
    rank: int
    step: int
    phase: str
    module: str
    param: str
    anomaly: str


class IncompleteRun(BaseModel):
    run: str
    ended_ranks: int
    world_size: int | None
    lost: int


class GateRuntime(BaseModel):
    runs: list[str]
    records: int
    anomalies: int
    samples: list[AnomalySample]
    incomplete: list[IncompleteRun] = Field(
        description="Runs whose ranks have not all sent their end marker, or that lost records: their "
        "records are not evidence yet, and the gate is `pending` (or `fail` on an anomaly already seen)."
    )


class GateEvidence(BaseModel):
    required: list[str]
    present: list[str]
    missing: list[str] = Field(
        description="Required evidence not there yet: the gate is `pending` meanwhile."
    )
    source: Literal["request", "project", "default_branch", "explicit_base", "configured_default"] = Field(
        description="Where `required` came from: the call's `require`, the project's `required_evidence`, "
        "what the default branch received last, what the explicit `base_sha` received, or the server's "
        "configured default."
    )


class GateOut(BaseModel):
    project: str
    commit_sha: str
    status: GateStatus
    reason: str | None
    policy: GatePolicy
    baseline: Baseline
    analyses: list[AnalysisOut]
    conditions: list[GateCondition]
    summary: GateSummary
    new: list[GateFinding]
    unchanged: list[GateFinding]
    fixed: list[GateFinding]
    truncated: bool = Field(description="True when a findings list was cut at the server's limit.")
    runtime: GateRuntime
    evidence: GateEvidence


# --- runtime records -----------------------------------------------------------------------------------


class RecordsIngested(BaseModel):
    run: str
    commit_sha: str | None
    received: int
    inserted: int
    duplicates: int


class RunEnded(BaseModel):
    run: str
    commit_sha: str | None
    ended_ranks: int
    world_size: int | None
    lost: int
    complete: bool


class RunOut(BaseModel):
    name: str
    commit_sha: str | None
    created_at: dt.datetime
    last_record_at: dt.datetime | None
    record_count: int


class Aggregate(BaseModel):
    key: str
    records: int
    params: int
    forward: int
    backward: int
    exposed: int
    none: int = Field(description="records where main_grad existed but was None")
    missing: int = Field(description="records where the parameter had no main_grad attribute")
    anomalies: int


class RunDetail(RunOut):
    steps: int
    modules: list[Aggregate]
    ranks: list[Aggregate]
    anomalies: list[AnomalySample]


class TimelinePoint(BaseModel):
    step: int
    records: int
    forward: int
    backward: int
    exposed: int
    none: int
    missing: int
    anomalies: int


class Timeline(BaseModel):
    run: str
    commit_sha: str | None
    points: list[TimelinePoint]


class RecordOut(BaseModel):
    id: str
    record: dict[str, Any]


# --- alerts --------------------------------------------------------------------------------------------


class AlertOut(BaseModel):
    id: int
    fingerprint: str
    category: str
    rule: str
    level: str
    path: str
    message: str
    state: Literal["open", "dismissed", "fixed"]
    dismissed_reason: str | None
    dismissed_comment: str | None
    dismissed_at: dt.datetime | None
    dismissed_by: str | None
    first_seen_commit: str
    first_seen_at: dt.datetime
    last_seen_commit: str
    last_seen_branch: str | None
    last_seen_at: dt.datetime
    fixed_commit: str | None


class AlertEventOut(BaseModel):
    created_at: dt.datetime
    actor: str
    from_state: str
    to_state: str
    reason: str | None
    comment: str | None


class AlertDetail(AlertOut):
    events: list[AlertEventOut]


class AlertDismiss(BaseModel):
    """Dismiss an alert: a reason is required."""

    model_config = ConfigDict(extra="forbid")
    state: Literal["dismissed"]
    reason: DismissReason
    comment: str | None = Field(None, max_length=2000, pattern=NO_NUL)


class AlertReopen(BaseModel):
    """Reopen a dismissed alert (no reason: reasons belong to dismissals)."""

    model_config = ConfigDict(extra="forbid")
    state: Literal["open"]
    comment: str | None = Field(None, max_length=2000, pattern=NO_NUL)


# The state decides which shape applies, so every rule is in the published schema (no cross-field 422).
AlertUpdate = Annotated[AlertDismiss | AlertReopen, Field(discriminator="state")]


# --- health --------------------------------------------------------------------------------------------


class Health(BaseModel):
    status: Literal["ok"]


class Ready(BaseModel):
    status: Literal["ready"]
    database: str
    revision: str | None
