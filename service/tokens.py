"""API tokens: `mgp_` (project) / `mga_` (instance admin) + 30 random base62 chars + a 6-char base62 CRC32.

The prefix makes a leaked token recognisable to secret scanners; the checksum lets us reject typos and
random strings without touching the database. Only HMAC-SHA256(secret, token) is stored.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import zlib

ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
PROJECT_PREFIX = "mgp_"
ADMIN_PREFIX = "mga_"
_RANDOM_LEN = 30  # 30 * log2(62) = 178 bits
_CHECK_LEN = 6  # 62**6 > 2**32

SCOPES = ("upload", "read", "triage", "admin")
# What each scope grants besides itself.
_IMPLIED = {"admin": {"upload", "read", "triage"}, "triage": {"read"}, "read": set(), "upload": set()}


def _base62(value: int, width: int) -> str:
    chars = []
    for _ in range(width):
        value, digit = divmod(value, 62)
        chars.append(ALPHABET[digit])
    return "".join(reversed(chars))


def generate(admin: bool = False) -> str:
    prefix = ADMIN_PREFIX if admin else PROJECT_PREFIX
    body = "".join(secrets.choice(ALPHABET) for _ in range(_RANDOM_LEN))
    return prefix + body + _base62(zlib.crc32(body.encode("ascii")), _CHECK_LEN)


def well_formed(token: str) -> bool:
    """Prefix, length, alphabet and checksum; says nothing about whether the token exists."""
    if len(token) != 4 + _RANDOM_LEN + _CHECK_LEN or token[:4] not in (PROJECT_PREFIX, ADMIN_PREFIX):
        return False
    body, check = token[4 : 4 + _RANDOM_LEN], token[4 + _RANDOM_LEN :]
    if any(c not in ALPHABET for c in token[4:]):
        return False
    return hmac.compare_digest(_base62(zlib.crc32(body.encode("ascii")), _CHECK_LEN), check)


def hash_token(token: str, key: bytes) -> str:
    return hmac.new(key, token.encode("utf-8"), hashlib.sha256).hexdigest()


def display_prefix(token: str) -> str:
    return token[:8]


def expand_scopes(scopes: frozenset[str] | set[str]) -> frozenset[str]:
    out = set(scopes)
    for scope in scopes:
        out |= _IMPLIED.get(scope, set())
    return frozenset(out)


def normalize_scopes(scopes: list[str] | tuple[str, ...] | str) -> str:
    """Canonical comma-separated storage form; raises ValueError on an unknown scope."""
    items = scopes.split(",") if isinstance(scopes, str) else list(scopes)
    clean = sorted({s.strip() for s in items if s.strip()})
    bad = [s for s in clean if s not in SCOPES]
    if bad:
        raise ValueError(f"unknown scope(s) {bad}; valid: {list(SCOPES)}")
    if not clean:
        raise ValueError("at least one scope is required")
    return ",".join(clean)
