"""The spool's clock (CLOCK_MONOTONIC, `time.perf_counter_ns`) placed against the wall clock, with an error.

Processes of one boot of one host share CLOCK_MONOTONIC, so their spans compare directly; the only error is
how long a timestamp takes to read. Across hosts (or boots) only the wall clock is shared: each process
brackets a wall-clock read between two monotonic reads (best of a few: the narrowest bracket), at start and
at close, so `wall - monotonic` is known to half the bracket, and its change between the two samples bounds
the wall clock's own slewing over the run. The analyzer (rundir/clocks.py) turns these into per-process
offsets and error bounds.
"""

from __future__ import annotations

import time
from pathlib import Path

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str | None:
    """This boot of this host (Linux); processes with the same id share CLOCK_MONOTONIC."""
    try:
        return BOOT_ID.read_text().strip() or None
    except OSError:
        return None


def clock_sample(tries: int = 5) -> dict:
    """{"mono_ns", "wall_ns", "error_ns"}: a wall-clock read and the midpoint of the narrowest monotonic
    bracket around it; error_ns is half that bracket."""
    best = None
    for _ in range(tries):
        before = time.perf_counter_ns()
        wall = time.time_ns()
        after = time.perf_counter_ns()
        if best is None or after - before < best[1] - best[0]:
            best = (before, after, wall)
    before, after, wall = best
    return {"mono_ns": (before + after) // 2, "wall_ns": wall, "error_ns": max((after - before + 1) // 2, 1)}
