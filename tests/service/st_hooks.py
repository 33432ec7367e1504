"""Schemathesis hooks for the service's contract tests (loaded through SCHEMATHESIS_HOOKS).

The records body is NDJSON; the OpenAPI document describes it as the array of its lines, so a generated array
is sent one JSON value per line (anything else as its JSON text on one line).
"""

from __future__ import annotations

import json
from typing import Any

import schemathesis


@schemathesis.serializer("application/x-ndjson")
def ndjson(ctx: Any, value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, list):
        return "".join(json.dumps(item) + "\n" for item in value).encode()
    return (json.dumps(value) + "\n").encode()


schemathesis.serializer.alias("application/sarif+json", "application/json")
