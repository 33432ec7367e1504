"""Reading Python sources as text (encoding and BOM aware) and writing files atomically."""

from __future__ import annotations

import codecs
import contextlib
import io
import os
import tempfile
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO


@dataclass(frozen=True)
class SourceText:
    text: str
    encoding: str
    bom: bool


def decode_source(data: bytes) -> SourceText:
    """Decode like the interpreter does (UTF-8 unless a PEP 263 cookie says otherwise); raises
    UnicodeDecodeError/SyntaxError/LookupError on undecodable input. Newlines are kept as they are."""
    if data.startswith(codecs.BOM_UTF8):
        return SourceText(data[len(codecs.BOM_UTF8) :].decode("utf-8"), "utf-8", True)
    try:
        return SourceText(data.decode("utf-8"), "utf-8", False)
    except UnicodeDecodeError as not_utf8:
        try:
            encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        except SyntaxError as exc:
            if "encoding problem" in str(exc) or "unknown encoding" in str(exc):
                raise  # a cookie that names no codec, or a BOM that contradicts it
            raise not_utf8 from None  # no cookie: the UTF-8 error says where the bad byte is
        if encoding in ("utf-8", "utf-8-sig"):
            raise
        return SourceText(data.decode(encoding), encoding, False)


def encode_source(source: SourceText, text: str) -> bytes:
    data = text.encode(source.encoding)
    return codecs.BOM_UTF8 + data if source.bom else data


def atomic_write(path: Path, data: bytes) -> None:
    """Write via a temporary file in the same directory and rename, keeping the file's mode: a crash or a
    concurrent reader never sees a half-written file."""
    with atomic_writer(path) as handle:
        handle.write(data)


@contextlib.contextmanager
def atomic_writer(path: Path) -> Iterator[IO[bytes]]:
    """`atomic_write` for content written in pieces: a binary handle on the temporary file, renamed over
    `path` when the block ends without an exception (and removed when it raises)."""
    path = Path(path)
    mode: int | None = None
    with contextlib.suppress(OSError):
        mode = path.stat().st_mode & 0o7777
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
        if mode is None:  # a new file gets the permissions a plain open() would give it
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
