"""Pausing Python's cyclic garbage collector while one file is parsed and analyzed (all its pieces).

Parsing allocates hundreds of thousands of container objects (libcst or `ast` nodes, lists, tuples) that all
survive until the analysis of their module ends, and the analysis adds its indexes (parent maps, node lists)
on top. Every 700 net allocations the collector scans the young objects, and as survivors pile up it rescans
the older generations, up to every object in the process (the findings gathered so far included): measured
on a 3.3 MB module with 75,216 findings, a third of `maingrad check`'s time went to collections that found
nothing.

The pause covers a whole file, not each piece of a large one: what a piece leaves behind (its findings, and
the fixes that hold nodes of its tree) is only freed with the file's result, and collections between pieces
scanned it again and again (2.0-2.6 s of about 24 s on that module). Pausing is safe because the analysis
creates no reference cycles: reference counting frees everything, so a collection during the analysis could
not free anything. Keep it so (the syntax index and the rules' helpers avoid self-referencing closures and
bound method tables, and `rules._common.literal_value` avoids `ast.literal_eval`'s closures): a cycle would
only be freed after the file.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused() -> Iterator[None]:
    """No automatic collection inside the block; the caller's setting is restored exactly on the way out
    (a collector the caller disabled stays disabled, one it enabled is enabled again, also on errors)."""
    enabled = gc.isenabled()
    if enabled:
        gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
