"""A streaming bound on the number of values in a JSON text: linear in the bytes fed, constant memory.

The report parser (orjson) builds every value it reads, so the body's values are counted before it runs, and a
body with more than `max_json_values` is refused without building one. The count must cost little whatever the
content: the earlier counter blanked strings out with a regular expression, which re-scanned the rest of the body
from every unclosed quote (57 s of CPU for a 1,980-byte gzip body of `"` + `\\"` x 1,000 + `,` x 2,000,001) and
built one list item per string (+1.4 GB for `"a",` x 8.4 M).

`ValueScanner` reads the text in chunks and keeps two bits of state between them: whether it is inside a string
and whether a backslash is pending. In each chunk, escape pairs are neutralized (`\\\\` first, then `\\"`), the
chunk is split at the remaining quotes, and the structural characters `,`, `[` and `{` are counted in the parts
outside strings; all of it is C-level bytes work, and the chunk's transient copies are bounded by its size. Every
value but the first is preceded by a `,` or is the first member of a `[`/`{`, so commas plus opening brackets plus
one bound the values (object keys are not values; each has one, so they are bounded too); an empty `[]` or `{}`
opens no member and is not counted twice. For a text that is not
JSON the count is exact up to the first invalid byte, where the JSON parser stops, so the bound still holds for
what the parser would build.
"""

from __future__ import annotations

CHUNK = 256 * 1024
_BACKSLASH = 0x5C


def _structural(part: bytes) -> int:
    # An empty `[]`/`{}` opens no member: the comma (or bracket) before it counted it already.
    opens = part.count(b"[") + part.count(b"{") - part.count(b"[]") - part.count(b"{}")
    return part.count(b",") + opens


class ValueScanner:
    """Feed chunks in order; `values` is then an upper bound on the values of the text fed so far (plus one)."""

    __slots__ = ("in_string", "pending_backslash", "values")

    def __init__(self) -> None:
        self.in_string = False
        self.pending_backslash = False
        self.values = 1  # the first value has no comma or bracket before it

    def feed(self, chunk: bytes | bytearray | memoryview) -> int:
        data = bytes(chunk)
        if self.pending_backslash:
            data = b"\\" + data
            self.pending_backslash = False
        if b"\\" in data:
            # A run of backslashes pairs up from its left end; an odd run at the chunk's end escapes the first
            # byte of the next chunk, so one backslash is carried over (an even run escapes nothing).
            kept = data.rstrip(b"\\")
            self.pending_backslash = (len(data) - len(kept)) % 2 == 1
            data = kept.replace(b"\\\\", b"__").replace(b'\\"', b"__")
        if b'"' not in data:
            if not self.in_string:
                self.values += _structural(data)
            return self.values
        parts = data.split(b'"')
        outside = parts[1::2] if self.in_string else parts[0::2]
        self.values += _structural(b" ".join(outside))  # a space: `["a"]` must not read as `[]`
        if len(parts) % 2 == 0:  # an odd number of quotes flips the state
            self.in_string = not self.in_string
        return self.values


def count_json_values(data: bytes | bytearray, limit: int) -> int:
    """An upper bound on the number of values in `data`; once it passes `limit` the scan stops (the answer is
    then some number above the limit). Linear time; memory bounded by CHUNK whatever the content."""
    loose = data.count(b",") + data.count(b"[") + data.count(b"{") + 1
    if loose <= limit:  # commas and brackets inside strings only make this looser: no scan needed
        return loose
    scanner = ValueScanner()
    view = memoryview(data)
    for start in range(0, len(data), CHUNK):
        if scanner.feed(view[start : start + CHUNK]) > limit:
            break
    return scanner.values
