"""The progress bar appears only on a terminal, only for scans that last more than a second."""

from __future__ import annotations

import io

import pytest

from maingrad.analyzer import progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_after_the_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = _Terminal()
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    with progress.Progress(10, "maingrad check", enabled=True, stream=stream) as bar:
        bar.advance()
        assert bar._bar is not None
        bar.advance(5)
    assert bar._bar is None  # stopped (transient)
    assert stream.getvalue() != ""


def test_no_progress_when_piped_quick_or_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    piped = io.StringIO()
    with progress.Progress(10, "x", enabled=True, stream=piped) as bar:
        bar.advance(3)
    assert piped.getvalue() == "" and bar._bar is None
    terminal = _Terminal()
    with progress.Progress(10, "x", enabled=False, stream=terminal) as bar:
        bar.advance(3)
    assert terminal.getvalue() == ""
    monkeypatch.setattr(progress, "DELAY_S", 3600.0)
    with progress.Progress(10, "x", enabled=True, stream=terminal) as bar:
        bar.advance(3)  # a scan shorter than the delay never shows a bar
    assert terminal.getvalue() == ""
