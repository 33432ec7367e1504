"""Content-hash cache of per-file results in `<root>/.maingrad_cache/`.

One JSON file per analysis configuration: its name hashes the tool version, the analyzer's own sources
(framework and rules, so editing a rule invalidates it), the selected rules, severities, per-file ignores,
exposure helpers and suppression mode. Inside, each scanned path maps to the hash of its content and its
result (findings already after suppressions). A hit therefore returns exactly what a fresh analysis of the
same bytes would, and output is identical with and without the cache. JSON, not pickle: a cache directory
is writable by anything in the work tree and must never execute code.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from maingrad.analyzer.catalog import source_hash
from maingrad.analyzer.fileio import atomic_write

CACHE_DIR_NAME = ".maingrad_cache"
_FORMAT = 1
_KEEP = 16  # configuration files kept; older ones are pruned


def content_hash(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def settings_key(settings: dict[str, Any]) -> str:
    payload = json.dumps(
        {"format": _FORMAT, "sources": source_hash(), **settings}, sort_keys=True, default=str
    )
    return hashlib.blake2b(payload.encode(), digest_size=16).hexdigest()


def cache_dir(root: Path) -> Path:
    return root / CACHE_DIR_NAME


class ResultCache:
    """Maps (path, content hash) to a cached result for one analysis configuration."""

    def __init__(self, directory: Path | None, key: str) -> None:
        self.directory = directory
        self.path = directory / f"results-{key}.json" if directory is not None else None
        self._entries: dict[str, list[Any]] = {}
        self._dirty = False
        if self.path is not None:
            with contextlib.suppress(OSError, ValueError):
                data = json.loads(self.path.read_bytes())
                if isinstance(data, dict):
                    self._entries = data

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def get(self, relpath: str, digest: str) -> dict[str, Any] | None:
        entry = self._entries.get(relpath)
        if entry is not None and entry[0] == digest:
            return entry[1]
        return None

    def put(self, relpath: str, digest: str, result: dict[str, Any]) -> None:
        if self.path is None:
            return
        self._entries[relpath] = [digest, result]
        self._dirty = True

    def save(self) -> None:
        """Write the cache (a no-op when nothing changed; failures only cost the next run its speed)."""
        if self.path is None or self.directory is None or not self._dirty:
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            _mark_cache_dir(self.directory)
            atomic_write(self.path, json.dumps(self._entries, separators=(",", ":")).encode("utf-8"))
            _prune(self.directory)
        except OSError:
            return
        self._dirty = False


def _mark_cache_dir(directory: Path) -> None:
    gitignore = directory / ".gitignore"
    if not gitignore.exists():
        gitignore.write_text("# Created by maingrad automatically.\n*\n", encoding="utf-8")
    tag = directory / "CACHEDIR.TAG"
    if not tag.exists():
        tag.write_text(
            "Signature: 8a477f597d28d172789f06886806bc55\n# This file is a cache directory tag created by maingrad.\n",
            encoding="utf-8",
        )


def _prune(directory: Path) -> None:
    files = sorted(directory.glob("results-*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in files[_KEEP:]:
        with contextlib.suppress(OSError):
            os.unlink(old)
