"""`[tool.maingrad]` in pyproject.toml: found by walking up from the scanned paths, validated strictly
(a typo in a rule id must not silently disable a rule), then overridden by command-line flags.

Keys: `select`, `ignore`, `include`, `exclude`, `per-file-ignores`, `severity`, `exposure-helpers`,
`warn-unused-ignores`. Rule codes may be full ids (`MG001`), prefixes (`MG00`) or `ALL`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from maingrad.contracts.report import Severity

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

CONFIG_FILE = "pyproject.toml"
_KEYS = {
    "select",
    "ignore",
    "include",
    "exclude",
    "per-file-ignores",
    "severity",
    "exposure-helpers",
    "warn-unused-ignores",
}
DEFAULT_INCLUDE = ("*.py",)


class ConfigError(ValueError):
    """Invalid configuration or flags: the CLI prints it and exits 2."""


@dataclass(frozen=True)
class Config:
    root: Path  # the scan root: paths in reports are relative to it
    path: Path | None = None  # the pyproject.toml it came from
    select: tuple[str, ...] | None = None
    ignore: tuple[str, ...] = ()
    include: tuple[str, ...] = DEFAULT_INCLUDE
    exclude: tuple[str, ...] = ()
    per_file_ignores: dict[str, tuple[str, ...]] = field(default_factory=dict)
    severity: dict[str, Severity] = field(default_factory=dict)
    exposure_helpers: tuple[str, ...] = ()
    warn_unused_ignores: bool = False

    def with_overrides(
        self,
        select: Sequence[str] | None = None,
        ignore: Sequence[str] | None = None,
        warn_unused_ignores: bool | None = None,
        severity: dict[str, Severity] | None = None,
    ) -> Config:
        """CLI flags win: `--select` replaces the configured selection (and its `ignore`, since an explicit
        selection on the command line means exactly those rules); `--ignore` adds to `ignore`."""
        updated = self
        if select:
            updated = replace(updated, select=tuple(select), ignore=())
        if ignore:
            updated = replace(updated, ignore=updated.ignore + tuple(ignore))
        if warn_unused_ignores:
            updated = replace(updated, warn_unused_ignores=True)
        if severity:
            updated = replace(updated, severity={**updated.severity, **severity})
        return updated

    def selected(self, known: Iterable[str], opt_in: Iterable[str] = ()) -> tuple[str, ...]:
        """The rule ids enabled by select/ignore, validated against `known`. Opt-in rules (`opt_in`) are
        enabled only by a `select` code that names them (their id or a prefix of it), never by the default
        selection or `ALL`."""
        known = tuple(sorted(known))
        opt_in = frozenset(opt_in)
        select = self.select if self.select is not None else ("ALL",)
        check_codes(select, known, "select")
        check_codes(self.ignore, known, "ignore")
        named = tuple(code for code in select if code != "ALL")
        return tuple(
            rid
            for rid in known
            if _matches(rid, named if rid in opt_in else select) and not _matches(rid, self.ignore)
        )


def _matches(rule_id: str, codes: Iterable[str]) -> bool:
    return any(code == "ALL" or rule_id.startswith(code) for code in codes)


def check_codes(codes: Iterable[str], known: Sequence[str], where: str) -> None:
    for code in codes:
        if code != "ALL" and not any(rid.startswith(code) for rid in known):
            raise ConfigError(f"unknown rule code {code!r} in {where} (known: {', '.join(known) or 'none'})")


def parse_codes(text: str) -> list[str]:
    """`MG001,MG003` -> ["MG001", "MG003"] (for CLI flags)."""
    return [part.strip().upper() for part in text.split(",") if part.strip()]


def find_config(paths: Sequence[Path]) -> Path | None:
    """The nearest pyproject.toml with a [tool.maingrad] table, walking up from the first path."""
    start = Path(paths[0] if paths else ".").resolve()
    directory = start if start.is_dir() else start.parent
    for candidate in (directory, *directory.parents):
        config = candidate / CONFIG_FILE
        if config.is_file() and _has_table(config):
            return config
    return None


def _has_table(path: Path) -> bool:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return False
    if "maingrad" not in text:
        return False
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
    return isinstance(data.get("tool"), dict) and "maingrad" in data["tool"]


def scan_root(paths: Sequence[Path], config_path: Path | None) -> Path:
    """The directory report paths are relative to: the config's directory; else the working directory when
    every path lies under it; else the paths' common directory."""
    if config_path is not None:
        return config_path.resolve().parent
    cwd = Path.cwd().resolve()
    resolved = [Path(p).resolve() for p in paths] or [cwd]
    if all(p == cwd or cwd in p.parents for p in resolved):
        return cwd
    dirs = [p if p.is_dir() else p.parent for p in resolved]
    return Path(os.path.commonpath([str(d) for d in dirs]))


def load_config(paths: Sequence[Path], config_file: Path | None = None) -> Config:
    """Configuration for scanning `paths` (explicit `config_file` wins over discovery)."""
    if config_file is not None:
        if not config_file.is_file():
            raise ConfigError(f"config file {config_file} does not exist")
        path: Path | None = config_file
    else:
        path = find_config(paths)
    root = scan_root(paths, path)
    if path is None:
        return Config(root=root)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read configuration: {exc}") from exc
    table = data.get("tool", {}).get("maingrad", {})
    return from_table(table, root=root, path=path)


def from_table(table: Any, root: Path, path: Path | None = None) -> Config:
    where = f"{path or 'config'} [tool.maingrad]"
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table")
    unknown = sorted(set(table) - _KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (valid: {', '.join(sorted(_KEYS))})")
    select = table.get("select")
    per_file = table.get("per-file-ignores", {})
    if not isinstance(per_file, dict):
        raise ConfigError(f"{where}: per-file-ignores must be a table of glob = [codes]")
    severity_table = table.get("severity", {})
    if not isinstance(severity_table, dict):
        raise ConfigError(f"{where}: severity must be a table of CODE = 'info' | 'warning' | 'error'")
    severity: dict[str, Severity] = {}
    for code, value in severity_table.items():
        try:
            severity[str(code).upper()] = Severity(value)
        except ValueError:
            raise ConfigError(
                f"{where}: severity.{code} must be 'info', 'warning' or 'error', not {value!r}"
            ) from None
    warn = table.get("warn-unused-ignores", False)
    if not isinstance(warn, bool):
        raise ConfigError(f"{where}: warn-unused-ignores must be true or false")
    return Config(
        root=root,
        path=path,
        select=None if select is None else _codes(select, where, "select"),
        ignore=_codes(table.get("ignore", []), where, "ignore"),
        include=_strings(table.get("include", list(DEFAULT_INCLUDE)), where, "include"),
        exclude=_strings(table.get("exclude", []), where, "exclude"),
        per_file_ignores={
            str(glob): _codes(codes, where, f"per-file-ignores.{glob!r}") for glob, codes in per_file.items()
        },
        severity=severity,
        exposure_helpers=_strings(table.get("exposure-helpers", []), where, "exposure-helpers"),
        warn_unused_ignores=warn,
    )


def _strings(value: Any, where: str, key: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: {key} must be a list of strings")
    return tuple(value)


def _codes(value: Any, where: str, key: str) -> tuple[str, ...]:
    return tuple(code.upper() for code in _strings(value, where, key))


def validate_codes(config: Config, known: Sequence[str]) -> None:
    """Every code in the configuration names a known rule (typos are errors, not silent no-ops)."""
    config.selected(known)
    for glob, codes in config.per_file_ignores.items():
        check_codes(codes, known, f"per-file-ignores[{glob!r}]")
    check_codes(config.severity, known, "severity")
