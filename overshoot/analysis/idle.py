"""GPU idle by host work: what the engine thread was doing while the GPU sat idle (docs/concepts.md, "GPU idle
by host work").

Only where kernel records say when the GPU idled: the gaps between the union of the kernels launched in
instrumented steps, inside one kernel-timing window, in the steps between its first and last (the GPU's
state before the first one's kernels and after the last one's was not recorded). Each instant of such a
gap goes to what the primary timeline's thread was in: the innermost busy span covering it (its label), a
wait span (`wait:<label>`, whatever is nested in it), or no span (`unlabelled`, as in busy by label: the
engine's own code between hooked calls, the hooks). Gaps are cut at step boundaries and each part counted
in the step it falls in; idle outside those steps is not counted. A launch-bound step's idle shows up under
the label of its launch calls, a CPU-bound async step's under the work that prepared the next batch.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from overshoot.analysis.frames import codes_and_names, timeline_spans
from overshoot.analysis.kernels import instrumented_steps, window_of
from overshoot.analysis.labels import UNLABELLED


def idle_gaps(steps: pd.DataFrame, kernels: pd.DataFrame | None,
              windows: pd.DataFrame | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(gap starts, gap ends, instrumented-step mask) of one timeline's steps (ordered by start): the GPU's
    known idle intervals, host ns."""
    empty = np.zeros(0)
    start = steps["start_ns"].to_numpy("float64")
    end = steps["end_ns"].to_numpy("float64")
    if kernels is None or len(kernels) == 0 or len(steps) == 0:
        return empty, empty, np.zeros(len(steps), bool)
    g_start = kernels["gpu_start_ns"].to_numpy("float64")
    g_end = kernels["gpu_end_ns"].to_numpy("float64")
    launch = kernels["launch_start_ns"].to_numpy("float64", na_value=np.nan)
    key = np.where(np.isnan(launch), g_start, launch)
    inst, _ = instrumented_steps(start, end, windows, key)
    row = np.searchsorted(start, key, side="right") - 1
    mine = (row >= 0) & (key < end[np.maximum(row, 0)]) & inst[np.maximum(row, 0)]
    if not mine.any():
        return empty, empty, inst
    window = window_of(key, windows)
    window = np.zeros(len(key), "int64") if window is None else window
    order = np.flatnonzero(mine)[np.argsort(g_start[mine], kind="stable")]
    s, e, w = g_start[order], g_end[order], window[order]
    reach = np.maximum.accumulate(e)  # the GPU is busy until here once the kernels so far have run
    gap = s[1:] > reach[:-1]
    gap &= w[1:] == w[:-1]  # (the time between two windows was not recorded)
    return reach[:-1][gap], s[1:][gap], inst


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


def _idle_before(points: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Idle time in (-inf, t) for each t of `points`, over disjoint sorted gaps [lo, hi)."""
    if len(lo) == 0:
        return np.zeros(len(points))
    cum = np.concatenate([[0.0], np.cumsum(hi - lo)])
    k = np.searchsorted(lo, points, side="right")  # gaps starting at or before t
    inside = np.clip(points - lo[np.maximum(k - 1, 0)], 0.0, (hi - lo)[np.maximum(k - 1, 0)])
    return cum[np.maximum(k - 1, 0)] + np.where(k > 0, inside, 0.0)


def idle_by_label(steps: pd.DataFrame, spans: pd.DataFrame | None, kernels: pd.DataFrame | None,
                  windows: pd.DataFrame | None) -> tuple[pd.DataFrame, np.ndarray]:
    """Per step row and label: the GPU idle ns spent while the thread was in it (columns row, label, ns), and
    per step the known GPU idle ns (NaN: not instrumented). `steps`: one timeline, ordered by start."""
    lo, hi, inst = idle_gaps(steps, kernels, windows)
    # A window's first and last steps: the GPU's state before the first one's first kernel, and after the
    # last one's last kernel, was not recorded, so their idle is not all known; only steps between two
    # instrumented ones count (per-step figures are over steps whose idle is known whole).
    inst = inst & np.concatenate([[False], inst[:-1]]) & np.concatenate([inst[1:], [False]])
    start = steps["start_ns"].to_numpy("float64")
    end = steps["end_ns"].to_numpy("float64")
    total = np.full(len(steps), np.nan)
    if not inst.any():
        return pd.DataFrame({"row": [], "label": [], "ns": []}), total
    # Idle inside each instrumented step, the gaps cut at its boundaries.
    total[inst] = _idle_before(end[inst], lo, hi) - _idle_before(start[inst], lo, hi)
    if spans is not None and len(spans) and not inst.all():  # (a sampled run: ~3% of the spans matter)
        at = np.searchsorted(start, spans["start_ns"].to_numpy("float64"), side="right") - 1
        spans = spans[(at >= 0) & inst[np.maximum(at, 0)]]
    seg_s, seg_e, codes, names = host_segments(spans)
    # Segments cut at step boundaries would split a few; a segment counts in the step its start falls in.
    row = np.searchsorted(start, seg_s, side="right") - 1
    ok = (row >= 0) & inst[np.maximum(row, 0)]
    seg_s, seg_e, codes, row = seg_s[ok], np.minimum(seg_e[ok], end[row[ok]]), codes[ok], row[ok]
    overlap = _idle_before(seg_e, lo, hi) - _idle_before(seg_s, lo, hi)
    frame = pd.DataFrame({"row": row, "code": codes, "ns": overlap})
    frame = frame[frame["ns"] > 0].groupby(["row", "code"], as_index=False)["ns"].sum()
    frame["label"] = np.array(names, dtype=object)[frame["code"].to_numpy()] if len(frame) else []
    covered = frame.groupby("row")["ns"].sum()
    rows = np.flatnonzero(inst)
    unlabelled = total[rows] - covered.reindex(rows, fill_value=0.0).to_numpy()
    rest = pd.DataFrame({"row": rows, "label": UNLABELLED, "ns": np.maximum(unlabelled, 0.0)})
    out = pd.concat([frame[["row", "label", "ns"]], rest[rest["ns"] > 0]], ignore_index=True)
    # (a span without a label is "unlabelled" too: one row per step and label)
    return out.groupby(["row", "label"], as_index=False, sort=True)["ns"].sum(), total


def group_idle_by_label(parts: pd.DataFrame, total: np.ndarray, group_id: np.ndarray,
                        n_groups: int) -> list[list[dict]]:
    """Per group (ids 0..n_groups-1 of `group_id`, one per step row) from idle_by_label's `parts` and
    `total`: GPU idle by host work over its steps whose idle is known, largest first: label, ms a step (mean
    over those steps) and share of the group's known GPU idle (%)."""
    out: list[list[dict]] = [[] for _ in range(n_groups)]
    known = ~np.isnan(total) & (group_id >= 0)  # (-1: a step in no listed group)
    if not known.any():
        return out
    idle = np.bincount(group_id[known], weights=total[known], minlength=n_groups)
    count = np.bincount(group_id[known], minlength=n_groups)
    parts = parts.assign(group=group_id[parts["row"].to_numpy("int64")])
    parts = parts[parts["group"] >= 0]
    for (g, label), ns in parts.groupby(["group", "label"])["ns"].sum().items():
        if idle[g] > 0:
            out[g].append({"label": label, "ms": ns / count[g] / 1e6, "share_pct": 100.0 * ns / idle[g]})
    for rows in out:
        rows.sort(key=lambda r: -r["ms"])
    return out


def primary_idle(run, steps: pd.DataFrame, primary: tuple[int, str]) -> tuple[pd.DataFrame, pd.DataFrame,
                                                                              np.ndarray]:
    """idle_by_label over the primary timeline `primary` (pid, thread) of a loaded run: its steps `steps`
    (ordered by start here), its spans, and the kernels its process launched (another process's ran on
    another GPU, or were launched by a thread these spans do not describe). Returns the ordered steps with
    the parts and totals of idle_by_label."""
    pid, thread = primary
    steps = steps.sort_values("start_ns", kind="stable").reset_index(drop=True)
    kernels = getattr(run, "kernels", None)
    if kernels is None or len(kernels) == 0 or len(steps) == 0:
        return steps, pd.DataFrame({"row": [], "label": [], "ns": []}), np.full(len(steps), np.nan)
    own = kernels["pid"].to_numpy() == pid
    parts, total = idle_by_label(steps, timeline_spans(run.spans, pid, thread),
                                 kernels if own.all() else kernels[own],
                                 getattr(run, "kernel_windows", None))
    return steps, parts, total
