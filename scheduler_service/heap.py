"""The garbage collector in the scheduler's processes (the engine core's and each frontend's).

Once a process serves, what its start-up made (modules, the tokenizer, the doors' handlers and
models) lives as long as the process does. `freeze_startup_heap` moves it out of the collector's
generations, so that a full collection walks only what serving made since: before, each full
collection walked the whole heap and paused the loop while it did, a stall of every stream behind
it (and, in the engine core, of the engine's steps).

The young generation's threshold is raised too. At the default 700 a collection ran every few
milliseconds under load; the tracked objects in flight at any moment (each stream's task, frames,
futures and queued outputs) outnumber it, so each collection walked objects still in use and
promoted them, and the promotions brought on the full collections. The new threshold is above
what a thousand streams keep in flight. docs/benchmarks.md ("The collector, a frontend's own
share, and how gRPC streams arrive") has the figures.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000
"""Tracked allocations (net of frees) between young collections (CPython's default: 700)."""


def freeze_startup_heap() -> int:
    """Collects what start-up left behind, freezes the rest and raises the young generation's
    threshold; returns the number of objects frozen. Call once, when the process serves."""
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, oldest)
    return gc.get_freeze_count()
