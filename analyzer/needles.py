"""The cheap text pre-filter, kept free of libcst so warm (cached) runs never import it."""

from __future__ import annotations

# A needle is a string that must occur in a file, or a tuple of strings that must all occur.
Needle = str | tuple[str, ...]


def needles_match(needles: tuple[Needle, ...], text: str) -> bool:
    """True when one needle matches `text`: only then can the rule find anything in the file."""
    return any(
        needle in text if isinstance(needle, str) else all(part in text for part in needle)
        for needle in needles
    )
