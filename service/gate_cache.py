"""Reuse of encoded gate answers while nothing they depend on has changed.

The gate is recomputed whenever any input changed: every read first checks, inside its own database
snapshot, the project's `revision` (bumped in the same transaction as every upload, triage and settings
change), its default branch, and the count and record total of the commit's runs (bumped by every stored
record). Only when all are equal to those of a previous computation in this process is its encoded answer
served again: the same inputs give the same answer, at a fraction of the cost of CI polling loops.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from sqlalchemy import bindparam, func, select
from sqlalchemy.orm import Session

from maingrad.service.models import Project, Run

_RUNS_VERSION = select(func.count(), func.coalesce(func.sum(Run.record_count), 0)).where(
    Run.project_id == bindparam("p"), Run.commit_sha == bindparam("c")
)

Key = tuple[Any, ...]  # (project id, commit, base, required evidence)


def version(session: Session, project: Project, commit_sha: str) -> tuple[Any, ...]:
    runs, records = session.connection().execute(_RUNS_VERSION, {"p": project.id, "c": commit_sha}).one()
    return (
        project.revision,
        project.default_branch,
        tuple(project.required_evidence or ()),
        int(runs),
        int(records),
    )


class GateCache:
    """A small thread-safe LRU of (key -> (version, encoded body))."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[Key, tuple[tuple[Any, ...], bytes]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: Key, current: tuple[Any, ...]) -> bytes | None:
        with self._lock:
            item = self._items.get(key)
            if item is None or item[0] != current:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return item[1]

    def put(self, key: Key, current: tuple[Any, ...], body: bytes) -> None:
        if self.size <= 0:
            return
        with self._lock:
            self._items[key] = (current, body)
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)
