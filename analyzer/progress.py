"""A progress bar on a terminal for scans that last more than a second; nothing at all otherwise.

rich is imported only when the bar is actually shown, so short and piped runs never pay for it.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

DELAY_S = 1.0


class Progress:
    def __init__(self, total: int, label: str, enabled: bool, stream: TextIO | None = None) -> None:
        self.total = total
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = enabled and total > 0 and _is_tty(self.stream)
        self.done = 0
        self._start = time.monotonic()
        self._bar: Any = None
        self._task: Any = None

    def advance(self, count: int = 1) -> None:
        self.done += count
        if not self.enabled:
            return
        if self._bar is None:
            if time.monotonic() - self._start < DELAY_S or self.done >= self.total:
                return
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(file=self.stream),
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=self.total, completed=self.done)
        else:
            self._bar.update(self._task, completed=self.done)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
