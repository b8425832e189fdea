"""Each rank's own GPU (docs/concepts.md, "Multi-rank engines"): how busy it was a step, how much of the
step it idled, and what its worker thread was in while it idled. A multiprocess engine's workers launch the
kernels, each on its own GPU; the engine core's steps see the union of them all ("any GPU busy"), which hides
a rank that idles while another computes.

A worker's step cycle runs from the start of one of its steps (a scheduler output it runs) to the start of
the next (the last one: to its end), so the time between its steps, when the worker waits for the engine
core's next output, is in the cycle before: on a CPU-bound engine core that is where every rank's GPU
starves. The worker's time between its steps outside any span of its own is labelled `between_steps`. GPU
idle is known where the rank's own kernel-timing windows say (analysis/idle.py, over the rank's kernels and
windows alone: a rank needs no other rank's window, unlike the engine core's steps, which need all of
theirs). Times stay on the worker's own clock: no alignment between processes enters these figures.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from overshoot.analysis import idle
from overshoot.analysis.frames import contains, timeline_spans

BETWEEN_STEPS = "between_steps"
COLUMNS = ("cycle_ms", "known_ms", "gpu_idle_ms", "gpu_busy_ms", "collective_kernels_ms")  # per (step, rank)
# Kernels of collectives, by name (NCCL's, and vLLM's custom all-reduce): they run while the rank waits for
# the others, so their time is GPU busy that is no work of the rank's own.
COLLECTIVE_KERNEL = r"nccl|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|cross_device_reduce"


def cycles(steps: pd.DataFrame) -> pd.DataFrame:
    """A worker's steps (ordered by start) as step cycles: each from its start to the next one's start."""
    start = steps["start_ns"].to_numpy("int64")
    end = steps["end_ns"].to_numpy("int64")
    cycle_end = np.append(start[1:], end[-1:]) if len(start) else end  # (a partition of the thread's time)
    return pd.DataFrame({"step": steps["step"].to_numpy(), "start_ns": start, "end_ns": cycle_end})


def _between_spans(steps: pd.DataFrame, pid: int, thread: str) -> pd.DataFrame:
    """A busy span `between_steps` over each gap between two of the worker's steps: the outermost span
    there, so a span of the worker's own inside the gap (e.g. a sampling call made outside the step) keeps
    its label."""
    start = steps["start_ns"].to_numpy("int64")
    end = steps["end_ns"].to_numpy("int64")
    gap = start[1:] > end[:-1]
    lo, hi = end[:-1][gap], start[1:][gap]
    return pd.DataFrame({"pid": pid, "thread": thread, "step": steps["step"].to_numpy()[:-1][gap],
                         "kind": "busy", "label": BETWEEN_STEPS, "start_ns": lo, "dur_ns": hi - lo})


def rank_idle(run, steps: pd.DataFrame, pid: int, thread: str) -> tuple[pd.DataFrame, idle.IdleSplit | None]:
    """One worker timeline's steps (ordered by start) as cycles, with per cycle `cycle_ms`, `known_ms` (the
    part whose GPU state the rank's kernel records know; NaN: none), `gpu_idle_ms` (known idle in it),
    `gpu_busy_ms` (known minus idle, where the cycle is known whole) and `collective_kernels_ms`; and the idle
    split over the cycles (None without kernel records of the pid)."""
    frame = cycles(steps)
    n = len(frame)
    frame["cycle_ms"] = (frame["end_ns"] - frame["start_ns"]) / 1e6
    for name in COLUMNS[1:]:
        frame[name] = np.full(n, np.nan)
    kernels = getattr(run, "kernels", None)
    if kernels is None or n == 0:
        return frame, None
    kernels = kernels[kernels["pid"].to_numpy() == pid]
    if len(kernels) == 0:
        return frame, None
    windows = getattr(run, "kernel_windows", None)
    if windows is not None and "pid" in windows.columns:
        windows = windows[windows["pid"].to_numpy() == pid]
    if windows is not None and len(windows) == 0:
        windows = None  # kernels but no window: the process recorded its whole run
    own = timeline_spans(run.spans, pid, thread)
    parts_of = [s for s in (own, _between_spans(steps, pid, thread)) if s is not None and len(s)]
    spans = pd.concat(parts_of, ignore_index=True) if parts_of else None
    split = idle.IdleSplit(frame, *idle.idle_by_label(frame, spans, kernels, windows))
    whole = split.whole
    frame["known_ms"] = split.known / 1e6
    frame["gpu_idle_ms"] = split.total / 1e6
    frame["gpu_busy_ms"] = np.where(whole, (split.known - split.total) / 1e6, np.nan)
    frame["collective_kernels_ms"] = np.where(whole, _collective_ns(frame, kernels) / 1e6, np.nan)
    return frame, split


def _collective_ns(frame: pd.DataFrame, kernels: pd.DataFrame) -> np.ndarray:
    """Per cycle: the GPU time inside it covered by collective kernels (the union of their intervals)."""
    mine = contains(kernels["name"], COLLECTIVE_KERNEL)
    if not mine.any():
        return np.zeros(len(frame))
    start = kernels["gpu_start_ns"].to_numpy("float64")[mine]
    end = kernels["gpu_end_ns"].to_numpy("float64")[mine]
    order = np.argsort(start, kind="stable")
    start, end = start[order], end[order]
    reach = np.maximum.accumulate(end)
    head = np.r_[True, start[1:] > reach[:-1]]  # a kernel that starts after all before it ended
    lo = start[head]
    hi = np.maximum.reduceat(end, np.flatnonzero(head))
    bounds = [frame[c].to_numpy("float64") for c in ("start_ns", "end_ns")]
    return idle.covered_before(bounds[1], lo, hi) - idle.covered_before(bounds[0], lo, hi)


def rank_figures(rows: pd.DataFrame, split: idle.IdleSplit | None) -> dict:
    """One rank's GPU over some of its cycles (`rows` of the per-rank table; column `cycle`: the row of
    `split`, the rank's idle split): `gpu_cycles` known (whole or in part), `gpu_busy_ms` and
    `collective_kernels_ms` (medians over the cycles known whole), `gpu_idle_pct` (known idle over known
    time) and `gpu_idle_by_label` (idle.group_idle_by_label of these cycles); 0, None and [] without kernel
    records."""
    known = rows["known_ms"].to_numpy("float64")
    mask = ~np.isnan(known)
    if split is None or not mask.any():
        return {"gpu_cycles": 0, "gpu_busy_ms": None, "gpu_idle_pct": None, "gpu_idle_by_label": [],
                "collective_kernels_ms": None}
    busy = rows["gpu_busy_ms"].to_numpy("float64")
    whole = ~np.isnan(busy)
    collective = rows["collective_kernels_ms"].to_numpy("float64")
    total = known[mask].sum()
    chosen = np.full(len(split.total), -1, "int64")
    chosen[rows["cycle"].to_numpy("int64")] = 0
    return {
        "gpu_cycles": int(mask.sum()),
        "gpu_busy_ms": float(np.median(busy[whole])) if whole.any() else None,
        "gpu_idle_pct": 100.0 * float(rows["gpu_idle_ms"].to_numpy("float64")[mask].sum() / total)
        if total > 0 else None,
        "gpu_idle_by_label": idle.group_idle_by_label(split, chosen, 1)[0]["rows"],
        # GPU busy in collective kernels (NCCL's), a cycle: time the rank's GPU waited for the others
        "collective_kernels_ms": float(np.median(collective[whole])) if whole.any() else None,
    }
