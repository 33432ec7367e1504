"""JSON on the hot paths: orjson when installed (the `service` extra has it), else the standard library.

orjson parses a 1,000-record NDJSON batch about 3x faster than `json`, which matters at 50,000 records/s.
"""

from __future__ import annotations

import json
from typing import Any

try:
    import orjson

    DecodeError: type[ValueError] = orjson.JSONDecodeError

    def loads(data: str | bytes) -> Any:
        return orjson.loads(data)

    def dumps(value: Any) -> bytes:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)

except ImportError:  # pragma: no cover - exercised only without the extra
    DecodeError = json.JSONDecodeError

    def loads(data: str | bytes) -> Any:
        return json.loads(data)

    def dumps(value: Any) -> bytes:
        return json.dumps(value, separators=(",", ":"), default=str).encode()
