"""Kernel records joined to steps: GPU busy inside each step, the idle gaps between its kernels, launch time,
and the per-step terms the what-if replays kernel by kernel (docs/concepts.md, "GPU truth inside the step").

A kernel belongs to the step during which the host launched it (its launch call's start; its GPU start when
the launch is unknown), on the primary timeline. A step is instrumented when it lies inside a kernel-timing
window (every kernel launched in it was recorded); a run with kernels but no windows is one window. Kernels
of one step form one chain in launch order (several streams are serialised: an upper bound on their time).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from overshoot.analysis.frames import group_ids, group_keys, run_starts, str_column, worker_rows

# Where a step's GPU idle comes from, best first (column gpu_timing; docs/concepts.md).
SOURCES = ("kernels", "estimate", "borrowed", "events", "none")
KERNELS, ESTIMATE, BORROWED, EVENTS, NONE = range(len(SOURCES))
# Launch-to-start latency assumed when no kernel started on an idle GPU (none to measure it from).
DEFAULT_LATENCY_NS = 5_000.0


@dataclass
class StepKernels:
    """The instrumented steps of a timeline of `n` steps: their rows (`rows`, sorted) and, aligned with
    them, their figures (NaN: no kernel in the step). A sampled run instruments ~3% of its steps, so only
    theirs are kept (`dense` spreads a figure over the timeline): a million steps' nine dense arrays were
    ~70 MB."""

    n: int
    rows: np.ndarray  # timeline rows of the instrumented steps
    kernels: np.ndarray  # count launched in the step
    busy_ns: np.ndarray  # union of the step's kernel intervals
    first_ns: np.ndarray  # first kernel start
    last_ns: np.ndarray  # last kernel end
    idle_before_ns: np.ndarray  # first start - end of all earlier kernels (NaN: previous step not recorded)
    launch_ns: np.ndarray  # host time inside the launch calls (a graph launch counted once)
    launches: np.ndarray  # launch calls (a graph launch counted once)
    first_launch_ns: np.ndarray  # host time of the step's first launch
    chain_total: np.ndarray  # sum of kernel durations
    latency_ns: float  # median launch-to-start of kernels launched onto an idle stream
    empty_windows: int  # kernel-timing windows with no record launched inside (records lost): not used
    # Kernel chains for the replay: kernel rows of instrumented steps, grouped by step (contiguous).
    chain_step: np.ndarray  # timeline row of each chained kernel
    chain_offset: np.ndarray  # launch - the step's first launch (host ns)
    chain_launch: np.ndarray  # how many of the step's launch calls came before this kernel's
    chain_rest: np.ndarray  # duration of this kernel and every later one of the step (ns)

    @property
    def any(self) -> bool:
        return len(self.rows) > 0

    @property
    def with_kernels(self) -> np.ndarray:
        """Per instrumented step: whether it launched a kernel (its GPU work is replayed kernel by kernel)."""
        return self.kernels > 0

    def dense(self, values: np.ndarray) -> np.ndarray:
        """A figure of the instrumented steps over the whole timeline (NaN elsewhere)."""
        out = np.full(self.n, np.nan)
        out[self.rows] = values
        return out

    def replay_terms(self, cpu_scale: float | np.ndarray, gpu_scale: float | np.ndarray) -> np.ndarray:
        """Per step: K = max over its kernels of (cpu_scale x launch offset + latency + gpu_scale x the
        remaining durations); the step's GPU work then ends at max(previous end + gpu_scale x total,
        first launch' + K). Scales: one for all steps or one per step. NaN where not instrumented."""
        out = np.full(self.n, np.nan)
        if len(self.chain_step) == 0:
            return out
        if np.ndim(cpu_scale):
            cpu_scale = cpu_scale[self.chain_step]
        if np.ndim(gpu_scale):
            gpu_scale = gpu_scale[self.chain_step]
        terms = cpu_scale * self.chain_offset + self.latency_ns + gpu_scale * self.chain_rest
        heads = np.flatnonzero(np.diff(self.chain_step, prepend=-1))
        out[self.chain_step[heads]] = np.maximum.reduceat(terms, heads)
        return out


def empty_kernels(n: int, rows: np.ndarray | None = None) -> StepKernels:
    """Instrumented steps `rows` (none by default) with no kernel yet: counts, busy and launch time 0, the
    times NaN."""
    rows = np.zeros(0, "int64") if rows is None else rows
    m = len(rows)

    def nan() -> np.ndarray:
        return np.full(m, np.nan)

    chains = np.empty(0, "int64"), np.empty(0), np.empty(0), np.empty(0)
    return StepKernels(n, rows, np.zeros(m), np.zeros(m), nan(), nan(), nan(), np.zeros(m), np.zeros(m),
                       nan(), np.zeros(m), DEFAULT_LATENCY_NS, 0, *chains)


def _window_bounds(windows: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Kernel-timing windows' starts and ends (host ns, float), in order of start."""
    order = np.argsort(windows["start_ns"].to_numpy(), kind="stable")
    return (windows["start_ns"].to_numpy("float64")[order], windows["end_ns"].to_numpy("float64")[order])


# joint_windows' one window when the processes' windows have none in common (empty: it holds no step)
NONE_IN_COMMON = (0, 0)


def joint_windows(windows: pd.DataFrame | None, kernels: pd.DataFrame | None) -> pd.DataFrame | None:
    """The kernel-timing windows in which every process that launched the kernels recorded them: each
    process samples its own windows (a multiprocess engine's workers, one per GPU, open them apart), and a
    step is instrumented only where all of theirs cover it, else the kernels of a process that was not
    recording are missing from its GPU busy. The intersection of the processes' windows; a process with
    kernels but no windows recorded its whole run (kernels mode ended without closing its window)."""
    if windows is None or len(windows) == 0 or "pid" not in windows.columns or kernels is None:
        return windows
    launching = set(kernels["pid"].unique().tolist())
    mine = windows[windows["pid"].isin(launching)]
    pids = mine["pid"].unique()
    if len(pids) <= 1:
        return mine
    joint: list[tuple[int, int]] | None = None
    for pid in pids:
        own = mine[mine["pid"] == pid].sort_values("start_ns")
        spans = list(zip(own["start_ns"].tolist(), own["end_ns"].tolist(), strict=True))
        joint = spans if joint is None else _intersect(joint, spans)
    # None in common: one empty window, so that no step is instrumented (no windows would read as a run
    # recorded whole)
    return pd.DataFrame(joint or [NONE_IN_COMMON], columns=["start_ns", "end_ns"], dtype="int64")


def windows_apart(windows: pd.DataFrame | None, kernels: pd.DataFrame | None) -> int:
    """How many processes launched kernels in windows of their own with none in common (0: one process, no
    windows, or some overlap)."""
    joint = joint_windows(windows, kernels)
    if joint is None or len(joint) != 1 or tuple(joint.iloc[0].tolist()) != NONE_IN_COMMON:
        return 0
    return int(windows[windows["pid"].isin(kernels["pid"].unique())]["pid"].nunique())


def _intersect(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The intersection of two sorted lists of disjoint intervals."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def instrumented_steps(start: np.ndarray, end: np.ndarray, windows: pd.DataFrame | None,
                       keys: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """Steps lying inside a kernel-timing window (called with kernels recorded), and the number of windows
    left out because no record was launched inside them (`keys`: each record's launch time): their records
    were lost, and steps without kernels must not read as GPU-idle. No windows: the whole run was recorded."""
    if windows is None or len(windows) == 0:
        return np.ones(len(start), bool), 0
    w_start, w_end = _window_bounds(windows)
    empty = 0
    if keys is not None:
        sorted_keys = np.sort(keys)
        has = np.searchsorted(sorted_keys, w_end, side="right") > np.searchsorted(sorted_keys, w_start)
        empty = int((~has & (w_end > w_start)).sum())  # (an empty window holds nothing to lose)
        w_start, w_end = w_start[has], w_end[has]
    i = np.searchsorted(w_start, start, side="right") - 1
    ok = i >= 0
    inside = np.zeros(len(start), bool)
    inside[ok] = end[ok] <= w_end[i[ok]]
    return inside, empty


def step_kernels(timeline: pd.DataFrame, kernels: pd.DataFrame | None,
                 windows: pd.DataFrame | None) -> StepKernels:
    """Join a run's kernel rows to the steps of one timeline (rows ordered by start)."""
    n = len(timeline)
    if kernels is None or len(kernels) == 0 or n == 0:
        return empty_kernels(n)
    start = timeline["start_ns"].to_numpy("float64")
    end = timeline["end_ns"].to_numpy("float64")
    g_start = kernels["gpu_start_ns"].to_numpy("float64")
    g_end = kernels["gpu_end_ns"].to_numpy("float64")
    l_start = kernels["launch_start_ns"].to_numpy("float64", na_value=np.nan)
    l_end = kernels["launch_end_ns"].to_numpy("float64", na_value=np.nan)
    key = np.where(np.isnan(l_start), g_start, l_start)
    inst, empty_windows = instrumented_steps(start, end, windows, key)
    latency = launch_latency(kernels, g_start, g_end, l_start, window=window_of(key, windows))
    row = np.searchsorted(start, key, side="right") - 1
    inside = (row >= 0) & (key < end[np.maximum(row, 0)])
    inside &= inst[np.maximum(row, 0)]
    out = empty_kernels(n, np.flatnonzero(inst))
    out.latency_ns = latency
    out.empty_windows = empty_windows
    if not inside.any():
        return out
    # Chain order: by step, then launch (a graph's kernels share theirs: then by GPU start).
    pick = np.flatnonzero(inside)
    order = pick[np.lexsort((g_start[pick], key[pick], row[pick]))]
    r, s, e, k = row[order], g_start[order], g_end[order], key[order]
    heads = np.flatnonzero(np.diff(r, prepend=-1))
    steps_with = r[heads]
    at = np.searchsorted(out.rows, steps_with)  # their places among the instrumented steps
    counts = np.diff(np.append(heads, len(r)))
    out.kernels[at] = counts
    # Busy: union of the step's intervals, sorted by GPU start within the step.
    by_start = np.lexsort((s, r))
    rs, ss, es = r[by_start], s[by_start], e[by_start]
    prev_max = pd.Series(es).groupby(rs).cummax().groupby(rs).shift(1).to_numpy("float64")
    covered = np.maximum(es - np.fmax(ss, np.nan_to_num(prev_max, nan=-np.inf)), 0.0)
    out.busy_ns[at] = np.add.reduceat(covered, heads)
    out.first_ns[at] = np.minimum.reduceat(s, heads)
    out.last_ns[at] = np.maximum.reduceat(e, heads)
    # Launch calls: a graph's kernels share their call (and its launch time), adjacent in chain order.
    new_call = np.ones(len(r), bool)
    new_call[1:] = (r[1:] != r[:-1]) | (k[1:] != k[:-1])
    # Launch time: each launch call once (NaN where no call of the step has a known end).
    call_ns = np.where(new_call, l_end[order] - k, np.nan)
    known = ~np.isnan(call_ns)
    out.launch_ns[at] = np.where(np.add.reduceat(known, heads) > 0,
                                 np.add.reduceat(np.where(known, call_ns, 0.0), heads), np.nan)
    out.first_launch_ns[at] = k[heads]
    # Idle before: the step's first start minus the end of every kernel that started before it.
    all_order = np.argsort(g_start, kind="stable")
    ends_before = np.maximum.accumulate(g_end[all_order])
    j = np.searchsorted(g_start[all_order], out.first_ns[at], side="left") - 1
    prev_end = np.where(j >= 0, ends_before[np.maximum(j, 0)], np.nan)
    recorded_before = np.zeros(len(steps_with), bool)
    recorded_before[steps_with > 0] = inst[steps_with[steps_with > 0] - 1]
    out.idle_before_ns[at] = np.where(
        recorded_before, np.maximum(out.first_ns[at] - prev_end, 0.0), np.nan)
    # Replay chains.
    d = e - s
    total = np.add.reduceat(d, heads)
    out.chain_total[at] = total
    before = np.cumsum(d) - d - np.repeat(np.cumsum(d)[heads] - d[heads], counts)
    out.chain_step = r.astype("int64")
    out.chain_offset = k - np.repeat(k[heads], counts)
    calls = np.cumsum(new_call) - 1
    out.chain_launch = (calls - np.repeat(calls[heads], counts)).astype("float64")
    out.launches[at] = np.add.reduceat(new_call, heads)
    out.chain_rest = np.repeat(total, counts) - before
    return out


def window_of(key: np.ndarray, windows: pd.DataFrame | None) -> np.ndarray | None:
    """Per kernel record (by its launch time `key`): the number of the kernel-timing window it was launched
    in (-1: none); None when the run has no windows (it was recorded whole)."""
    if windows is None or len(windows) == 0:
        return None
    w_start, w_end = _window_bounds(windows)
    i = np.searchsorted(w_start, key, side="right") - 1
    return np.where((i >= 0) & (key < w_end[np.maximum(i, 0)]), i, -1)


def launch_latency(kernels: pd.DataFrame, g_start: np.ndarray, g_end: np.ndarray,
                   l_start: np.ndarray, *, window: np.ndarray | None = None) -> float:
    """Median launch-call start to GPU start of kernels whose stream was idle at their launch. With windows
    (`window`: window_of), a window's first kernel on a stream is no sample: the work before it was not
    recorded, so an idle stream cannot be told from one still running unrecorded work (on a GPU-bound
    engine every window would add the queue's whole wait as a "latency")."""
    stream = kernels["stream"].to_numpy("float64", na_value=0.0)
    pid = kernels["pid"].to_numpy("float64")
    order = np.lexsort((g_start, stream, pid))
    s, e, ls = g_start[order], g_end[order], l_start[order]
    same = (np.diff(stream[order], prepend=np.nan) == 0) & (np.diff(pid[order], prepend=np.nan) == 0)
    prev_end = np.where(same, np.concatenate([[np.nan], e[:-1]]), -np.inf)
    if window is not None:
        w = window[order]
        prev_end[~same | (np.diff(w, prepend=-2) != 0) | (w < 0)] = np.nan  # unknown: not a sample
    free = ~np.isnan(ls) & (prev_end <= ls)
    samples = s[free] - ls[free]
    samples = samples[samples >= 0]
    return float(np.median(samples)) if len(samples) else DEFAULT_LATENCY_NS


def primary_row(df: pd.DataFrame) -> int:
    """A row of the primary timeline: the (pid, thread) with the most steps (ties: the earliest to start),
    among the timelines of no rank when there are others (a multi-rank engine's workers step too:
    analysis/ranks.py)."""
    code = df["_timeline"].to_numpy()
    if len(code) and np.all(code[1:] >= code[:-1]):  # rows by timeline (the joined steps): no sort
        first_row = run_starts(code)
        counts = np.diff(np.append(first_row, len(code)))
    else:
        _, first_row, counts = np.unique(code, return_index=True, return_counts=True)
    worker = worker_rows(df.iloc[first_row])
    if worker.any() and not worker.all():
        counts = np.where(worker, -1, counts)
    return int(first_row[np.lexsort((df["start_ns"].to_numpy()[first_row], -counts))[0]])


def attach_gpu_truth(out: pd.DataFrame, run, *, cpu_bound_ms: float, cpu_bound_share: float) -> StepKernels:
    """Add the kernel columns, the GPU idle share and both verdicts to the joined steps table `out` (every
    timeline; kernels join the primary one). Returns the primary timeline's StepKernels (for the replay).

    Per step, the GPU idle that decides the verdict comes from the best source it has (`gpu_timing`):
    "kernels" (instrumented: idle before + the gaps between its kernels), "estimate" (a plain step of a group
    with instrumented steps: its step time minus the group's median GPU busy, since kernel times do not change
    under instrumentation while step times do), "borrowed" (the same, for a group of a load level with no
    instrumented step of its own: the median GPU busy of the instrumented steps of its phase and batch size
    at the other levels, the same shapes on the GPU), "events" (the GPU idle before the step only: the gaps
    inside it are unknown), or "none" (no GPU data: the verdict is unknown, never "CPU-bound").
    """
    n = len(out)
    step_ms = out["step_ms"].to_numpy()
    nan = np.full(n, np.nan)
    code = out["_timeline"].to_numpy()
    rows = np.flatnonzero(code == code[primary_row(out)]) if n else np.zeros(0, "int64")
    # (the two columns step_kernels reads: a slice of the whole table would copy every column)
    times = out[["start_ns", "end_ns"]]
    kernels = getattr(run, "kernels", None)
    sk = step_kernels(times if len(rows) == n else times.iloc[rows], kernels,
                      joint_windows(getattr(run, "kernel_windows", None), kernels))
    inst_rows = rows[sk.rows]  # the instrumented steps' rows in `out`
    inst = np.zeros(n, bool)
    inst[inst_rows] = True
    cols = {name: nan.copy() for name in ("kernels", "gpu_busy_ms", "gpu_idle_in_step_ms", "launch_ms")}
    cols["kernels"][inst_rows] = sk.kernels
    cols["gpu_busy_ms"][inst_rows] = sk.busy_ns / 1e6
    cols["gpu_idle_in_step_ms"][inst_rows] = np.where(
        sk.with_kernels, np.maximum(sk.last_ns - sk.first_ns - sk.busy_ns, 0.0) / 1e6, 0.0)
    cols["launch_ms"][inst_rows] = sk.launch_ns / 1e6
    before = out["gpu_idle_before_ms"].to_numpy(dtype="float64").copy()
    k_before = nan.copy()
    k_before[inst_rows] = sk.idle_before_ns / 1e6
    before = np.where(np.isnan(k_before), before, k_before)
    out["gpu_idle_before_ms"] = before
    for name, values in cols.items():
        out[name] = values
    # The verdict's GPU idle by source: codes into SOURCES (a string per row costs a Python object each).
    measured = inst & ~np.isnan(cols["gpu_busy_ms"])
    idle = np.where(measured, np.nan_to_num(before) + np.nan_to_num(cols["gpu_idle_in_step_ms"]), np.nan)
    source = np.where(measured, KERNELS, NONE).astype("int8")
    # The unit whose instrumented steps stand for its plain ones (GPU busy here, the GPU work's shape and the
    # collector's cost in whatif.py): concurrency, phase and batch size; a group without any borrows from
    # its phase and batch size at the other levels (sampled mode's windows follow shapes, not load levels).
    group = busy_groups(out) if measured.any() else np.full(n, -1, "int64")
    busy_est = median_on_rows(group, cols["gpu_busy_ms"], measured)
    pool = None
    lacking = ~measured & np.isnan(busy_est) & (group >= 0)
    if lacking.any() and "concurrency" in group_keys(out):
        pool = pool_groups(out)
        pooled = median_on_rows(pool, cols["gpu_busy_ms"], measured)
        borrowed = lacking & ~np.isnan(pooled)
        busy_est[borrowed] = pooled[borrowed]
        source[borrowed] = BORROWED
    estimate = ~measured & ~np.isnan(busy_est)
    idle[estimate] = np.maximum(step_ms[estimate] - busy_est[estimate], 0.0)
    if estimate.any():  # how far the verdict moves as the estimate moves within its interval
        lo, hi, counts = interval_on_rows(group, cols["gpu_busy_ms"], measured)
        if pool is not None:
            lent = source == BORROWED
            lo, hi, counts = (np.where(lent, p, own) for p, own in zip(
                interval_on_rows(pool, cols["gpu_busy_ms"], measured), (lo, hi, counts), strict=True))
        _estimate_bounds(out, idle, estimate, lo, hi, step_ms, cpu_bound_share)
        # how many instrumented steps each estimate rests on
        out["_busy_n"] = np.where(estimate, counts, np.nan).astype("float32")
    source[estimate & (source != BORROWED)] = ESTIMATE
    events = ~measured & ~estimate & ~np.isnan(before)
    idle[events] = before[events]
    source[events] = EVENTS
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(step_ms > 0, idle / step_ms, np.nan)
    out["gpu_idle_ms"] = idle
    out["gpu_idle_share"] = share
    out["gpu_timing"] = str_column(list(SOURCES), source)
    verdict = pd.array(share > cpu_bound_share, dtype="boolean")
    verdict[np.isnan(share)] = pd.NA
    out["cpu_bound"] = verdict
    out["thread_never_waited"] = out["wait_ms"].to_numpy() <= cpu_bound_ms
    out["_gpu_busy_est_ms"] = busy_est
    if measured.any():  # (without kernel records these would be a million-long -1s and NaNs: 16 MB each)
        out["_busy_group"] = group
        if pool is not None:
            out["_busy_pool"] = pool
        plain = np.zeros(n, bool)
        plain[rows] = True
        plain[inst_rows] = False
        launches = nan.copy()
        launches[inst_rows] = sk.launches
        busy = out["busy_ms"].to_numpy(dtype="float64") * 1e6
        out["_collector_ns"] = collector_cost(group, busy, measured, plain, launches)
    return sk


def _estimate_bounds(out: pd.DataFrame, idle: np.ndarray, estimate: np.ndarray, lo: np.ndarray,
                     hi: np.ndarray, step_ms: np.ndarray, cpu_bound_share: float) -> None:
    """Columns _gpu_idle_lo_ms / _hi_ms and _cpu_bound_lo / _hi: each step's GPU idle and verdict with its
    GPU busy estimate at the upper and lower end of its interval (the measured ones as they are; NaN where
    the estimate has no interval)."""
    idle_lo, idle_hi = idle.copy(), idle.copy()
    idle_lo[estimate] = np.maximum(step_ms[estimate] - hi[estimate], 0.0)
    idle_hi[estimate] = np.maximum(step_ms[estimate] - lo[estimate], 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        for name, values in (("lo", idle_lo), ("hi", idle_hi)):
            out[f"_gpu_idle_{name}_ms"] = values
            share = np.where(step_ms > 0, values / step_ms, np.nan)
            # (float32: 1, 0 or NaN; a million-step run's two flags are 8 MB, not 16)
            out[f"_cpu_bound_{name}"] = np.where(np.isnan(share), np.nan, share > cpu_bound_share).astype(
                "float32")


# Fewer instrumented steps than this: no interval for their median (order statistics cannot give 95%).
MIN_STEPS_FOR_INTERVAL = 6


def interval_on_rows(group: np.ndarray, values: np.ndarray, rows: np.ndarray,
                     z: float = 1.96) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """On every row: the distribution-free 95% interval of its group's median of `values` over `rows` (the
    order statistics of ranks (n - z sqrt(n)) / 2 and 1 + (n + z sqrt(n)) / 2, 1-based; NaN for a group
    with fewer than MIN_STEPS_FOR_INTERVAL values, or none), and the count of those values (NaN: no group)."""
    n_groups = int(group.max(initial=-1)) + 1
    lo, hi = np.full(n_groups, np.nan), np.full(n_groups, np.nan)
    take = rows & (group >= 0) & ~np.isnan(values)
    g, v = group[take], values[take]
    order = np.lexsort((v, g))
    g, v = g[order], v[order]
    starts = np.searchsorted(g, np.arange(n_groups))
    counts = np.bincount(g, minlength=n_groups)
    ok = counts >= MIN_STEPS_FOR_INTERVAL
    n = counts[ok].astype("float64")
    r = np.clip(np.floor((n - z * np.sqrt(n)) / 2).astype("int64"), 1, None) - 1
    q = np.clip(np.ceil(1 + (n + z * np.sqrt(n)) / 2).astype("int64"), None, counts[ok]) - 1
    lo[ok] = v[starts[ok] + r]
    hi[ok] = v[starts[ok] + q]
    return on_rows(group, lo), on_rows(group, hi), on_rows(group, counts.astype("float64"))


# Steps of a group, instrumented and plain each, needed to measure what kernel timing costs its launches.
MIN_STEPS_FOR_COST = 5


def collector_cost(group: np.ndarray, busy_ns: np.ndarray, measured: np.ndarray, plain: np.ndarray,
                   launches: np.ndarray) -> np.ndarray:
    """Per row: what kernel timing added to each launch call of its group's instrumented steps (ns), from
    the group's median CPU busy inside windows and outside them, over its median launch calls a step.
    CUPTI's callbacks run inside the launch calls, so the whole difference is put there; whatever else
    slows an instrumented step (the drain thread taking the GIL) is counted with it. A group with
    instrumented steps but fewer than MIN_STEPS_FOR_COST of either kind (a sampled group's early window
    may be one step) takes the median of the groups that have them: the cost is the collector's, a call
    costs it about the same whatever the batch. NaN where no group has enough, as in kernels mode where
    every step is instrumented."""
    n_groups = int(group.max(initial=-1)) + 1
    inside, n_inside = per_group(group, busy_ns, measured, n_groups)
    outside, n_outside = per_group(group, busy_ns, plain, n_groups)
    calls, _ = per_group(group, launches, measured, n_groups)
    with np.errstate(divide="ignore", invalid="ignore"):
        cost = np.maximum(inside - outside, 0.0) / calls
    enough = (n_inside >= MIN_STEPS_FOR_COST) & (n_outside >= MIN_STEPS_FOR_COST) & (calls > 0)
    shared = float(np.median(cost[enough])) if enough.any() else np.nan
    return on_rows(group, np.where(enough, cost, np.where(n_inside > 0, shared, np.nan)))


def busy_groups(df: pd.DataFrame) -> np.ndarray:
    """Per row: a number for its (concurrency, phase, batch size)."""
    return group_ids(df, group_keys(df))[0]


def pool_groups(df: pd.DataFrame) -> np.ndarray:
    """Per row: a number for its (phase, batch size) over every load level (busy_groups less the level)."""
    keys = [k for k in group_keys(df) if k != "concurrency"]
    return group_ids(df, keys)[0] if keys else np.zeros(len(df), "int64")


def per_group(group: np.ndarray, values: np.ndarray, rows: np.ndarray,
              n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """(median, count) of `values` over the `rows` (a mask; NaN values ignored) of each group 0..n_groups-1:
    one step whose records were cut short must not move the whole group's figure. Only the rows taken are
    copied (a million-step run's plain steps are 8 MB; full-length masked copies were 16 MB each)."""
    take = rows & (group >= 0)
    g, v = group[take], values[take]
    known = ~np.isnan(v)
    g, v = g[known], v[known]
    count = np.bincount(g, minlength=n_groups).astype("float64")
    median = np.full(n_groups, np.nan)
    if len(v):
        stat = pd.Series(v).groupby(g).median()
        median[stat.index.to_numpy()] = stat.to_numpy("float64")
    return median, count


def median_on_rows(group: np.ndarray, values: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """On every row: per_group's median of its group (NaN on rows of no group, -1, or of a group without
    any of `rows`)."""
    return on_rows(group, per_group(group, values, rows, int(group.max(initial=-1)) + 1)[0])


def on_rows(group: np.ndarray, per: np.ndarray) -> np.ndarray:
    """A per-group figure on every row (NaN on rows of no group, -1)."""
    return np.append(per, np.nan)[group]
