"""Shapes of the identifiers the API accepts (no dependencies: the CLI checks them before any import)."""

from __future__ import annotations

import re

# A commit: a git SHA (hex, normalized to lower case) or another revision id (letters, digits, . _ -).
COMMIT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
COMMIT_RE = re.compile(COMMIT_PATTERN)
