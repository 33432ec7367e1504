"""Settings from the environment (prefix MAINGRAD_), so one image serves SQLite and PostgreSQL unchanged."""

from __future__ import annotations

import os
import secrets
from functools import cached_property
from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from maingrad.contracts.report import DEFAULT_FAIL_ON

MiB = 1024 * 1024


class Settings(BaseSettings):
    """Every knob of the service. Limits default to what GitHub code scanning accepts for SARIF."""

    model_config = SettingsConfigDict(env_prefix="MAINGRAD_", extra="ignore")

    database_url: str = "sqlite:///maingrad.db"
    # Key of the HMAC that stores tokens. Unset: read (or create, mode 0600) `secret_file`.
    secret: SecretStr | None = None
    secret_file: str = "maingrad.secret"
    # A bootstrap admin token accepted on every project (compared through the same HMAC).
    admin_token: SecretStr | None = None
    # Where a minted bootstrap admin token is written (mode 0600) when no admin credential exists.
    bootstrap_token_file: str = "maingrad.admin-token"

    # Work per request is bounded before it is done (each cap answers 413/422 naming its limit); with the
    # defaults one request stays far below 512 MB of server memory (benchmarks/service.py --memory measures it).
    max_body_bytes: int = Field(10 * MiB, ge=1024)
    # Inflating stops at this size, and a report is parsed only when it counts at most max_json_values values.
    max_decompressed_bytes: int = Field(32 * MiB, ge=1024)
    max_json_values: int = Field(2_000_000, ge=1000)
    max_runs: int = Field(20, ge=1)
    max_results_per_run: int = Field(25_000, ge=1)
    # Results of one report over all its runs (the per-run cap alone let 20 x 25,000 through).
    max_results_per_report: int = Field(25_000, ge=1)
    # Per-field caps of what is stored (a SARIF message after template expansion counts as a message).
    max_message_chars: int = Field(8_192, ge=64)
    max_snippet_chars: int = Field(8_192, ge=64)
    max_path_chars: int = Field(4_096, ge=64)
    # Message and snippet text stored for one analysis, over all its results.
    max_analysis_text_chars: int = Field(32 * MiB, ge=1024)
    max_records_body_bytes: int = Field(32 * MiB, ge=1024)
    max_records_decompressed_bytes: int = Field(64 * MiB, ge=1024)
    max_records_per_batch: int = Field(10_000, ge=1)
    max_record_line_bytes: int = Field(64 * 1024, ge=1024)
    max_record_string_chars: int = Field(4_096, ge=64)
    max_gate_findings: int = Field(1_000, ge=1)
    # Gate answers kept per process, reused only while their inputs are unchanged (0: never reuse).
    gate_cache_size: int = Field(512, ge=0)

    # What a commit needs before the gate decides when neither the call nor the project requires anything
    # and the default branch has received nothing yet (else: what the default branch received last).
    default_required_evidence: list[str] = Field(default_factory=list)
    gate_fail_severity: str = Field(DEFAULT_FAIL_ON.value, pattern="^(info|warning|error)$")
    gate_fail_on_runtime_anomalies: bool = True
    # Lines within which a finding with the same rule, path and message counts as the same finding.
    match_line_window: int = Field(3, ge=0)

    # Requests handled at once by one worker; past it the worker answers 503 with Retry-After at once
    # instead of queueing requests for seconds (health checks are always answered). 0: no limit.
    max_concurrent_requests: int = Field(32, ge=0)
    # Of those, what one project (or one token outside projects) may hold, so another always finds room;
    # the same number of its request bodies may be arriving at once (they do not count as in hand).
    max_concurrent_requests_per_project: int = Field(24, ge=1)
    # A request body must arrive whole within this many seconds of the request's start (408 otherwise).
    body_read_timeout_s: float = Field(60.0, gt=0, le=3600)
    # Retry-After (seconds) on 503 answers: load shed, database unavailable.
    retry_after_s: int = Field(2, ge=1, le=3600)
    # PostgreSQL: give up connecting after this long (the answer is then a 503, not a hung request).
    db_connect_timeout_s: int = Field(5, ge=1, le=300)

    public_dashboard: bool = False
    sqlite_busy_timeout_ms: int = Field(30_000, ge=0)
    db_pool_size: int = Field(10, ge=1)
    db_pool_pre_ping: bool = False
    idempotency_ttl_hours: int = Field(24, ge=1)
    log_level: str = "info"
    # sys.setswitchinterval for the server process (see app.lifespan).
    gil_switch_interval_ms: float = Field(1.0, gt=0, le=100)

    @cached_property
    def hmac_key(self) -> bytes:
        """The token-hashing key; a persisted random file when MAINGRAD_SECRET is unset (zero setup)."""
        if self.secret is not None and self.secret.get_secret_value():
            return self.secret.get_secret_value().encode("utf-8")
        return load_or_create_secret(Path(self.secret_file)).encode("utf-8")

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")


def load_or_create_secret(path: Path) -> str:
    """Read the secret file, or create it atomically (several workers may start at once: the first link
    wins and everyone reads the same value; a half-written file is never visible)."""
    try:
        value = path.read_text(encoding="utf-8").strip()
        if value:
            return value
    except FileNotFoundError:
        pass
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(secrets.token_urlsafe(48) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    try:
        os.link(tmp, path)  # atomic; fails when another process got there first
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    value = path.read_text(encoding="utf-8").strip()
    if not value:
        raise RuntimeError(f"{path} is empty: remove it or set MAINGRAD_SECRET")
    return value
