"""GPU idle by host work: what the engine thread was doing while the GPU sat idle (docs/concepts.md, "GPU idle
by host work").

Only where kernel records say when the GPU idled: inside a kernel-timing window, from its first recorded
kernel's start (before it the GPU may still have run unrecorded work) to the window's end (work launched
after it cannot run before it), the gaps between the union of its kernels and after the last one. Each
instant of such a gap goes to what the primary timeline's thread was in: the innermost busy span covering it
(its label), a wait span (`wait:<label>`, whatever is nested in it), or no span (`unlabelled`, as in busy by
label: the engine's own code between hooked calls, the hooks). Gaps are cut at step boundaries and each part
counted in the step it falls in; idle outside steps is not counted. A window's first step is known only from
its first kernel on: it counts in the shares, not in the ms a step (a costly collector's windows of one step
give shares alone). A launch-bound step's idle shows up under the label of its launch calls, a CPU-bound
async step's under the work that prepared the next batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from overshoot.analysis.frames import codes_and_names, timeline_spans
from overshoot.analysis.kernels import instrumented_steps, joint_windows, window_of
from overshoot.analysis.labels import UNLABELLED


def idle_gaps(steps: pd.DataFrame, kernels: pd.DataFrame | None,
              windows: pd.DataFrame | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The GPU's known idle intervals (gap starts, gap ends: disjoint, sorted) and, per step of one timeline
    (ordered by start), the stretch of it whose GPU state the kernel records know (from, to; NaN: none).

    Inside a window every kernel launched was recorded, so between its first recorded kernel's start and the
    window's end the GPU ran nothing else (work launched before the window ran before that kernel on its
    stream; work launched after the window cannot start before it): the gaps between the union of the
    window's kernels, and after the last one until the window's end, are idle. Before the first one the GPU
    may still have run unrecorded work (an async step's predecessor): unknown. A run recorded whole (no
    windows) is one window that ends at its last kernel's end (records after it may be lost at shutdown)."""
    empty = np.zeros(0)
    n = len(steps)
    unknown = np.full(n, np.nan)
    if kernels is None or len(kernels) == 0 or n == 0:
        return empty, empty, unknown, unknown.copy()
    start = steps["start_ns"].to_numpy("float64")
    end = steps["end_ns"].to_numpy("float64")
    g_start = kernels["gpu_start_ns"].to_numpy("float64")
    g_end = kernels["gpu_end_ns"].to_numpy("float64")
    launch = kernels["launch_start_ns"].to_numpy("float64", na_value=np.nan)
    key = np.where(np.isnan(launch), g_start, launch)
    inst, _ = instrumented_steps(start, end, windows, key)
    window = window_of(key, windows)
    if window is None:  # recorded whole: one window, closed at the last kernel's end
        window, n_windows = np.zeros(len(key), "int64"), 1
        step_window = np.zeros(n, "int64")
        closes = np.array([g_end.max()])
    else:
        n_windows = len(windows)
        step_window = window_of(start, windows)
        # (window_of numbers the windows in order of start)
        closes = windows["end_ns"].to_numpy("float64")[np.argsort(windows["start_ns"].to_numpy(),
                                                                  kind="stable")]
    rec = window >= 0
    if not rec.any():
        return empty, empty, unknown, unknown.copy()
    order = np.flatnonzero(rec)[np.argsort(g_start[rec], kind="stable")]
    s, e, w = g_start[order], g_end[order], window[order]
    # Per window: its first recorded start (the GPU's state is known from there) and its close.
    first = np.full(n_windows, np.nan)
    np.fmin.at(first, w, s)
    reach = np.maximum.accumulate(e)  # the GPU is busy until here once the kernels so far have run
    last = np.r_[w[1:] != w[:-1], True]  # a window's last kernel in GPU-start order
    gap = ~last[:-1] & (s[1:] > reach[:-1])  # (the time between two windows was not recorded)
    lo, hi = [reach[:-1][gap]], [s[1:][gap]]
    tail_from, tail_to = reach[last], closes[w[last]]
    tail = tail_to > tail_from
    lo.append(tail_from[tail])
    hi.append(tail_to[tail])
    lo, hi = np.concatenate(lo), np.concatenate(hi)
    by = np.argsort(lo, kind="stable")
    ok = inst & (step_window >= 0)
    sw = np.maximum(step_window, 0)
    known_from = np.where(ok, np.fmax(start, first[sw]), np.nan)  # (NaN: no record in its window)
    known_to = np.where(ok, np.minimum(end, closes[sw]), np.nan)
    none = ~(known_to > known_from)
    known_from[none] = np.nan
    known_to[none] = np.nan
    return lo[by], hi[by], known_from, known_to


def host_segments(spans: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """The thread's time as non-overlapping segments (start, end, label code) from its spans: the innermost
    busy span, or the wait span enclosing it; the names the codes index ("wait:<label>" for waits)."""
    if spans is None or len(spans) == 0:
        return np.zeros(0), np.zeros(0), np.zeros(0, "int64"), []
    kind = spans["kind"].to_numpy()
    keep = np.isin(kind, ("busy", "wait")) & (spans["dur_ns"].to_numpy() > 0)
    spans, is_wait = spans[keep], kind[keep] == "wait"
    # Label codes through the column's distinct values (a categorical's own), never a string per row; a
    # wait's label is its own name, "wait:<label>", the codes after the busy ones.
    codes, uniques = codes_and_names(spans["label"])
    base = [*(str(u) for u in uniques), UNLABELLED]
    codes = np.where(codes < 0, len(base) - 1, codes) + np.where(is_wait, len(base), 0)
    names = [*base, *(f"wait:{n}" for n in base)]
    start = spans["start_ns"].to_numpy("float64")
    end = start + spans["dur_ns"].to_numpy("float64")
    order = np.lexsort((-end, start))
    start, end, codes, is_wait = start[order], end[order], codes[order], is_wait[order]
    if len(start) < 2 or np.all(start[1:] >= end[:-1]):  # the usual case: no span inside another
        return start, end, codes.astype("int64"), names
    return (*_flatten(start, end, codes, is_wait), names)


def _flatten(start, end, codes, is_wait) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Nested spans (from a stack: properly nested) as segments of the innermost one; inside a wait span,
    the wait. A sweep in Python: nesting is rare (an engine's hooked call inside another's)."""
    seg_s, seg_e, seg_c = [], [], []
    stack: list[tuple[float, int, bool]] = []  # (end, code, inside a wait)
    now = -np.inf

    def emit(upto: float) -> None:
        if stack and upto > now:
            seg_s.append(now)
            seg_e.append(upto)
            seg_c.append(stack[-1][1])

    for s, e, c, wait in zip(start.tolist(), end.tolist(), codes.tolist(), is_wait.tolist(), strict=True):
        while stack and stack[-1][0] <= s:  # spans ending before this one starts
            emit(stack[-1][0])
            now = max(now, stack[-1][0])
            stack.pop()
        emit(s)
        now = max(now, s)
        in_wait = bool(stack and stack[-1][2])
        stack.append((e, stack[-1][1] if in_wait else c, in_wait or wait))
    while stack:
        emit(stack[-1][0])
        now = max(now, stack[-1][0])
        stack.pop()
    return np.array(seg_s), np.array(seg_e), np.array(seg_c, "int64")


def covered_before(points: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Time covered in (-inf, t) for each t of `points` by disjoint sorted intervals [lo, hi) (here: the
    GPU's idle gaps)."""
    if len(lo) == 0:
        return np.zeros(len(points))
    cum = np.concatenate([[0.0], np.cumsum(hi - lo)])
    k = np.searchsorted(lo, points, side="right")  # gaps starting at or before t
    inside = np.clip(points - lo[np.maximum(k - 1, 0)], 0.0, (hi - lo)[np.maximum(k - 1, 0)])
    return cum[np.maximum(k - 1, 0)] + np.where(k > 0, inside, 0.0)


def idle_by_label(steps: pd.DataFrame, spans: pd.DataFrame | None, kernels: pd.DataFrame | None,
                  windows: pd.DataFrame | None) -> tuple[pd.DataFrame, np.ndarray, np.ndarray]:
    """Per step row and label: the GPU idle ns spent while the thread was in it (columns row, label, ns); per
    step the known GPU idle ns and the ns of the step whose GPU state is known (NaN: not instrumented; equal
    to the step's length where it is known whole). `steps`: one timeline, ordered by start."""
    lo, hi, known_from, known_to = idle_gaps(steps, kernels, windows)
    known = known_to - known_from
    total = np.full(len(steps), np.nan)
    inst = ~np.isnan(known)
    if not inst.any():
        return pd.DataFrame({"row": [], "label": [], "ns": []}), total, known
    start = steps["start_ns"].to_numpy("float64")
    total[inst] = covered_before(known_to[inst], lo, hi) - covered_before(known_from[inst], lo, hi)
    if spans is not None and len(spans) and not inst.all():  # (a sampled run: ~3% of the spans matter)
        at = np.searchsorted(start, spans["start_ns"].to_numpy("float64"), side="right") - 1
        spans = spans[(at >= 0) & inst[np.maximum(at, 0)]]
    seg_s, seg_e, codes, names = host_segments(spans)
    # Segments cut at step boundaries would split a few; a segment counts in the step its start falls in,
    # over the part of it whose GPU state is known.
    row = np.searchsorted(start, seg_s, side="right") - 1
    ok = (row >= 0) & inst[np.maximum(row, 0)]
    row, codes = row[ok], codes[ok]
    seg_s = np.maximum(seg_s[ok], known_from[row])
    seg_e = np.maximum(np.minimum(seg_e[ok], known_to[row]), seg_s)
    overlap = covered_before(seg_e, lo, hi) - covered_before(seg_s, lo, hi)
    frame = pd.DataFrame({"row": row, "code": codes, "ns": overlap})
    frame = frame[frame["ns"] > 0].groupby(["row", "code"], as_index=False)["ns"].sum()
    frame["label"] = np.array(names, dtype=object)[frame["code"].to_numpy()] if len(frame) else []
    covered = frame.groupby("row")["ns"].sum()
    rows = np.flatnonzero(inst)
    unlabelled = total[rows] - covered.reindex(rows, fill_value=0.0).to_numpy()
    rest = pd.DataFrame({"row": rows, "label": UNLABELLED, "ns": np.maximum(unlabelled, 0.0)})
    out = pd.concat([frame[["row", "label", "ns"]], rest[rest["ns"] > 0]], ignore_index=True)
    # (a span without a label is "unlabelled" too: one row per step and label)
    return out.groupby(["row", "label"], as_index=False, sort=True)["ns"].sum(), total, known


@dataclass
class IdleSplit:
    """idle_by_label over one timeline: its steps (ordered by start), the (row, label, ns) parts, and per
    step the known idle ns and known ns (NaN: not instrumented)."""

    steps: pd.DataFrame
    parts: pd.DataFrame
    total: np.ndarray
    known: np.ndarray

    @property
    def length(self) -> np.ndarray:
        """Per step: its length, ns."""
        return (self.steps["end_ns"] - self.steps["start_ns"]).to_numpy("float64")

    @property
    def whole(self) -> np.ndarray:
        """Per step: its GPU state is known from its start to its end."""
        return self.known >= self.length


def group_idle_by_label(split: IdleSplit, group_id: np.ndarray, n_groups: int) -> list[dict]:
    """Per group (ids 0..n_groups-1 of `group_id`, one per step row): GPU idle by host work over its steps
    whose idle is known, largest first ("rows": label, ms a step, share of the group's known GPU idle in %),
    and how many steps it comes from ("steps": known whole, known in part). Shares count every known
    instant, ms a step only the steps known whole (None where there are none: one-step windows)."""
    out = [{"rows": [], "steps": [0, 0]} for _ in range(n_groups)]
    total = split.total
    known = ~np.isnan(total) & (group_id >= 0)  # (-1: a step in no listed group)
    if not known.any():
        return out
    whole = known & split.whole
    idle = np.bincount(group_id[known], weights=total[known], minlength=n_groups)
    n_whole = np.bincount(group_id[whole], minlength=n_groups)
    n_part = np.bincount(group_id[known & ~whole], minlength=n_groups)
    rows = split.parts["row"].to_numpy("int64")
    parts = split.parts.assign(group=group_id[rows], whole=np.where(whole[rows], split.parts["ns"], 0.0))
    parts = parts[parts["group"] >= 0]
    sums = parts.groupby(["group", "label"])[["ns", "whole"]].sum()
    for (g, label), (ns, ns_whole) in zip(sums.index, sums.to_numpy(), strict=True):
        if idle[g] > 0:
            ms = ns_whole / n_whole[g] / 1e6 if n_whole[g] else None
            out[g]["rows"].append({"label": label, "ms": ms, "share_pct": 100.0 * ns / idle[g]})
    for g, entry in enumerate(out):
        entry["rows"].sort(key=lambda r: -r["share_pct"])
        entry["steps"] = [int(n_whole[g]), int(n_part[g])]
    return out


def split_by_group(split: IdleSplit, own: np.ndarray, pool: np.ndarray, group_pool: np.ndarray,
                   n_groups: int) -> list[dict]:
    """group_idle_by_label by `own` (a group per step, -1: none), each entry marked "borrowed": False. A group
    with no step of its own whose idle is known borrows the split of the known steps of its pool instead
    (`pool` per step, `group_pool` per group, -1: none: its phase and batch size at any load level, the
    warm-up included, the same shapes on the GPU), marked True: a collector that slows eager steps 4x
    affords a window of a few steps every minute or two at sampled mode's budget (in a short run, the
    warm-up's)."""
    out = [{**entry, "borrowed": False} for entry in group_idle_by_label(split, own, n_groups)]
    lacking = [g for g, entry in enumerate(out) if not any(entry["steps"]) and group_pool[g] >= 0]
    if lacking:
        n_pools = int(max(pool.max(initial=-1), group_pool.max(initial=-1))) + 1
        lent = group_idle_by_label(split, pool, n_pools)
        for g in lacking:
            if any(lent[group_pool[g]]["steps"]):
                out[g] = {**lent[group_pool[g]], "borrowed": True}
    return out


def primary_idle(run, steps: pd.DataFrame, primary: tuple[int, str]) -> IdleSplit:
    """idle_by_label over the primary timeline `primary` (pid, thread) of a loaded run: its steps `steps`
    (ordered by start here), its spans, and the kernels its process launched (another process's ran on
    another GPU, or were launched by a thread these spans do not describe)."""
    pid, thread = primary
    steps = steps.sort_values("start_ns", kind="stable").reset_index(drop=True)
    kernels = getattr(run, "kernels", None)
    if kernels is None or len(kernels) == 0 or len(steps) == 0:
        nan = np.full(len(steps), np.nan)
        return IdleSplit(steps, pd.DataFrame({"row": [], "label": [], "ns": []}), nan, nan.copy())
    own = kernels["pid"].to_numpy() == pid
    kernels = kernels if own.all() else kernels[own]
    parts, total, known = idle_by_label(steps, timeline_spans(run.spans, pid, thread), kernels,
                                        joint_windows(getattr(run, "kernel_windows", None), kernels))
    return IdleSplit(steps, parts, total, known)
