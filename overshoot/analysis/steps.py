"""The steps table of docs/schema.md: a run's raw step, span and GPU rows joined per step.

One row per recorded step with its CPU busy/wait time, its GPU interval (from the CUDA events) and its load
level. Everything is vectorised pandas/numpy; analyze.py summarises this table per group.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from overshoot.analysis.frames import as_str, positions, str_column, worker_rows
from overshoot.analysis.kernels import attach_gpu_truth

STEP_COLUMNS = [
    "run_id",
    "pid",
    "thread",
    "step",
    "start_ns",
    "step_ms",
    "busy_ms",
    "wait_ms",
    "batch_size",
    "num_tokens",
    "phase",
    "gpu_ms",
    "gpu_idle_before_ms",
    "gpu_busy_ms",
    "gpu_idle_in_step_ms",
    "kernels",
    "launch_ms",
    "gpu_idle_ms",
    "gpu_idle_share",
    "gpu_timing",
    "cpu_bound",
    "thread_never_waited",
]
RAW_STEP_COLUMNS = [
    "step",
    "start_ns",
    "end_ns",
    "wait_ns",
    "batch_size",
    "num_tokens",
    "phase",
    "pid",
    "thread",
]
# Values of the load_window column (runs with load levels), in code order: before the first level, inside
# one, elsewhere. Machine-readable on purpose; the report says "warm-up".
LOAD_WINDOWS = ("warmup", "level", "outside")
# Columns the analyzer keeps beside the contract columns (whatif.py and mode detection need them).
_INTERNAL = ["end_ns", "gpu_start_ns", "gpu_end_ns", "_timeline", "_gpu_busy_est_ms", "_busy_group",
             "_busy_pool", "_collector_ns", "_gpu_idle_lo_ms", "_gpu_idle_hi_ms", "_cpu_bound_lo",
             "_cpu_bound_hi", "_busy_n"]
# A step is CPU-bound when the GPU idled, waiting for the CPU, for more than this share of it.
CPU_BOUND_SHARE = 0.05
# The case study's narrower view (column thread_never_waited): the thread waited at most this long.
NEVER_WAITED_MS = 0.02


def extra_fact_columns(raw_steps: pd.DataFrame) -> list[str]:
    return [c for c in raw_steps.columns if c not in RAW_STEP_COLUMNS]


def joined_steps(run, *, cpu_bound_ms: float = NEVER_WAITED_MS,
                 cpu_bound_share: float = CPU_BOUND_SHARE) -> pd.DataFrame:
    return joined_steps_and_kernels(run, cpu_bound_ms=cpu_bound_ms, cpu_bound_share=cpu_bound_share)[0]


def joined_steps_and_kernels(run, *, cpu_bound_ms: float = NEVER_WAITED_MS,
                             cpu_bound_share: float = CPU_BOUND_SHARE):
    """Every recorded step of every process/thread with GPU times joined; contract columns + _INTERNAL.

    Rows are ordered by timeline (pid, thread) and start. Internally a timeline is an integer code, so that
    a million steps never go through string joins. Kernel records, the GPU idle share and the verdicts come
    from analysis/kernels.py.
    """

    raw = run.steps
    heads = _run_heads(raw)
    pid_codes, pids = pd.factorize(raw["pid"].to_numpy()[heads])
    thread_codes, threads = pd.factorize(as_str(raw["thread"].iloc[heads]))
    pids, threads = pd.Index(pids), pd.Index(threads)
    code = _expand(heads, pid_codes * len(threads) + thread_codes, len(raw))
    order = np.lexsort((raw["start_ns"].to_numpy(), code))
    if np.any(order[1:] < order[:-1]):  # not already in order
        raw, code = raw.take(order), code[order]
    df = raw.reset_index(drop=True)
    out = pd.DataFrame(
        {
            "run_id": str_column([run.run_id], np.zeros(len(df), "int8")),
            "pid": df["pid"].astype("int64"),
            "thread": as_str(df["thread"]),
            "step": df["step"].astype("int64"),
            "start_ns": df["start_ns"].astype("int64"),
        }
    )
    step_ns = (df["end_ns"] - df["start_ns"]).to_numpy(dtype="int64")
    wait_ns = df["wait_ns"].to_numpy(dtype="int64")
    out["step_ms"] = step_ns / 1e6
    out["busy_ms"] = (step_ns - wait_ns) / 1e6
    out["wait_ms"] = wait_ns / 1e6
    out["batch_size"] = df["batch_size"].fillna(0).astype("int32")
    out["num_tokens"] = df["num_tokens"].fillna(0).astype("int32")
    out["phase"] = as_str(df["phase"], "unknown")
    gpu_start, gpu_end, idle_before = _gpu_columns(run, df, code, pids, threads)
    out["gpu_ms"] = (gpu_end - gpu_start) / 1e6
    out["gpu_idle_before_ms"] = idle_before
    levels = (run.meta or {}).get("levels") or []
    if levels:
        out["concurrency"] = _level_of(out["start_ns"].to_numpy(), levels)
        out["load_window"] = _load_window(out["start_ns"].to_numpy(), out["concurrency"], levels)
    out["end_ns"] = df["end_ns"].astype("int64")
    out["gpu_start_ns"] = gpu_start
    out["gpu_end_ns"] = gpu_end
    out["_timeline"] = code
    kernels = attach_gpu_truth(out, run, cpu_bound_ms=cpu_bound_ms, cpu_bound_share=cpu_bound_share)
    for name in extra_fact_columns(raw):
        out[name] = df[name]
    return out, kernels


def steps_table(run, *, cpu_bound_ms: float = NEVER_WAITED_MS, cpu_bound_share: float = CPU_BOUND_SHARE,
                warmup_steps: int = 0) -> pd.DataFrame:
    """The steps table (docs/schema.md): one row per step of every recorder, ordered by pid, thread, start."""
    df = drop_warmup(joined_steps(run, cpu_bound_ms=cpu_bound_ms, cpu_bound_share=cpu_bound_share),
                     warmup_steps)
    rest = [c for c in df.columns if c not in STEP_COLUMNS and c not in _INTERNAL]
    return df[STEP_COLUMNS + rest].reset_index(drop=True)


def drop_warmup(df: pd.DataFrame, warmup_steps: int) -> pd.DataFrame:
    """Drop the first N steps of each timeline, and of each concurrency level when the run has levels."""
    if warmup_steps <= 0:
        return df
    keys = ["_timeline"] + (["concurrency"] if "concurrency" in df.columns else [])
    rank = df.groupby(keys, sort=False, dropna=False).cumcount().to_numpy()
    return df[rank >= warmup_steps]


def _run_heads(frame: pd.DataFrame) -> np.ndarray:
    """First row of every run of consecutive rows with the same (pid, thread).

    load_run yields each recorder's rows as one block (one spool file each), so a million rows are a handful
    of runs: finding them takes two vectorised comparisons with the previous row, and only the heads need
    hashing, instead of a hash lookup per row of a string column. Any order is still correct, only slower.
    """
    n = len(frame)
    if n == 0:
        return np.zeros(0, "int64")
    pid = frame["pid"].to_numpy()
    thread = frame["thread"].array
    changed = (pid[1:] != pid[:-1]) | np.asarray(thread[1:] != thread[:-1], dtype=bool)
    return np.concatenate([[0], np.flatnonzero(changed) + 1])


def _expand(heads: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """Per row: the value of the run it belongs to (runs start at `heads`)."""
    return np.repeat(np.asarray(values, dtype="int64"), np.diff(np.append(heads, n)))


def _timeline_codes(frame: pd.DataFrame, pids: pd.Index, threads: pd.Index) -> np.ndarray:
    """Integer code of each row's (pid, thread); -1 for a recorder that has no steps."""
    heads = _run_heads(frame)
    p = pids.get_indexer(frame["pid"].to_numpy()[heads])
    t = threads.get_indexer(as_str(frame["thread"].iloc[heads]))
    return _expand(heads, np.where((p >= 0) & (t >= 0), p * len(threads) + t, -1), len(frame))


def _gpu_columns(run, steps: pd.DataFrame, code: np.ndarray, pids: pd.Index, threads: pd.Index):
    """Per step row: GPU start/end (ns, NaN when none) and gpu_idle_before_ms (contract section 4).

    gpu_idle_before = max(0, start - max(end of all earlier GPU work of the timeline, end of the last idle
    span before the start)); NaN for the first GPU work of a timeline (nothing before it to idle after).
    """
    n = len(steps)
    start, end, idle_ms = np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)
    gpu = run.gpu
    if gpu is None or len(gpu) == 0:
        return start, end, idle_ms
    gpu_code = _timeline_codes(gpu, pids, threads)
    gpu_step = gpu["step"].to_numpy()
    gpu, gpu_code, gpu_step = _attach_detached(gpu, gpu_code, gpu_step, steps, code)
    idle_code, idle_end = np.empty(0, "int64"), np.empty(0, "float64")
    spans = run.spans
    if spans is not None and len(spans):
        is_idle = (spans["kind"] == "idle").to_numpy()
        if is_idle.any():
            idle = spans[is_idle]
            idle_code = _timeline_codes(idle, pids, threads)
            idle_end = (idle["start_ns"] + idle["dur_ns"]).to_numpy(dtype="float64")
    bounds = np.flatnonzero(np.diff(code, prepend=-1))  # rows are ordered by code (>= 0): timeline starts
    for lo, hi in zip(bounds, [*bounds[1:], n], strict=True):  # one pass per timeline (few of them)
        mine = gpu_code == code[lo]
        if not mine.any():
            continue
        pick: np.ndarray | slice = slice(None) if mine.all() else mine  # one timeline: no masked copies
        g_step = gpu_step[pick]
        s = gpu["gpu_start_ns"].to_numpy(dtype="float64")[pick]
        e = gpu["gpu_end_ns"].to_numpy(dtype="float64")[pick]
        if not np.all(np.diff(g_step) > 0):  # out of order or repeated steps: one interval per step, sorted
            g = pd.DataFrame({"step": g_step, "s": s, "e": e}).groupby("step", as_index=False)
            g = g.agg(s=("s", "min"), e=("e", "max")).sort_values("s", kind="stable")
            g_step, s, e = g["step"].to_numpy(), g["s"].to_numpy(), g["e"].to_numpy()
        # End of all earlier GPU work (cummax: robust to out-of-order event resolution).
        prev_end = np.concatenate([[np.nan], np.maximum.accumulate(e)[:-1]])
        ends = np.concatenate([[np.nan], np.sort(idle_end[idle_code == code[lo]])])  # [0]: "no idle before"
        last_idle = ends[np.searchsorted(ends[1:], s, side="right")]
        gap = s - np.where(np.isnan(prev_end), np.nan, np.fmax(prev_end, last_idle))
        step_values = steps["step"].to_numpy()[lo:hi]
        if not np.all(step_values[1:] > step_values[:-1]):  # (increasing: unique, no hash table to check)
            step_index = pd.Index(step_values)
            if not step_index.is_unique:
                step_values = step_index.where(~step_index.duplicated(), -(2**62)).to_numpy()
        pos = positions(step_values, g_step)
        if len(pos) == hi - lo and np.array_equal(pos, np.arange(hi - lo)):
            rows: np.ndarray | slice = slice(lo, hi)  # every step has GPU work, same order: no scatter
            ok: np.ndarray | slice = slice(None)
        else:
            ok = pos >= 0
            rows = lo + pos[ok]
        start[rows], end[rows], idle_ms[rows] = s[ok], e[ok], np.maximum(gap[ok], 0.0) / 1e6
    return start, end, idle_ms


def _attach_detached(gpu: pd.DataFrame, gpu_code: np.ndarray, gpu_step: np.ndarray, steps: pd.DataFrame,
                     code: np.ndarray) -> tuple[pd.DataFrame, np.ndarray, np.ndarray]:
    """GPU intervals recorded outside any step (step -1, e.g. by model workers that run no steps), and those
    of worker timelines (steps with a rank, analysis/ranks.py: they keep theirs too, as a copy), go to the
    step of the one engine timeline during which their GPU work started. With several engine timelines
    (e.g. data-parallel engine cores) time cannot tell them apart and they stay unattributed. Several
    intervals of one step (ranks, calls) merge: first start .. last end."""
    worker_codes = np.unique(code[worker_rows(steps)])
    detached = (gpu_code < 0) | (gpu_step < 0)
    from_worker = np.isin(gpu_code, worker_codes) & ~detached
    if not (detached.any() or from_worker.any()):  # the usual case: nothing to attach
        return gpu, gpu_code, gpu_step
    engine_rows = ~np.isin(code, worker_codes)
    engines = np.unique(code[engine_rows])
    if len(engines) != 1:
        return gpu, gpu_code, gpu_step
    if from_worker.any():  # a copy for the engine step; the original stays on the worker's step
        gpu = pd.concat([gpu, gpu[from_worker]], ignore_index=True)
        gpu_code = np.concatenate([gpu_code, gpu_code[from_worker]])
        gpu_step = np.concatenate([gpu_step, gpu_step[from_worker]])
        detached = np.concatenate([detached, np.ones(int(from_worker.sum()), bool)])
    rows = np.flatnonzero(engine_rows)  # contiguous: rows are sorted by timeline
    starts = steps["start_ns"].to_numpy(dtype="int64")[rows]
    ends = steps["end_ns"].to_numpy(dtype="int64")[rows]
    g_start = gpu["gpu_start_ns"].to_numpy(dtype="int64")[detached]
    i = np.searchsorted(starts, g_start, side="right") - 1
    inside = (i >= 0) & (g_start < ends[np.maximum(i, 0)])
    gpu_code, gpu_step = gpu_code.copy(), gpu_step.astype("int64", copy=True)
    gpu_code[detached] = np.where(inside, engines[0], -1)
    gpu_step[detached] = np.where(inside, steps["step"].to_numpy(dtype="int64")[rows][np.maximum(i, 0)], -1)
    return gpu, gpu_code, gpu_step


def _load_window(start_ns: np.ndarray, concurrency: pd.Series, levels: list[dict]) -> pd.Series:
    """Where each step falls in the load sweep (docs/schema.md, column load_window): "level" inside a load
    level, "warmup" before the first level starts (server warm-up, calibration and warm-up requests),
    "outside" otherwise (between levels or after the last)."""
    first_start = min(lv["start_ns"] for lv in levels)
    inside = concurrency.notna().to_numpy()
    codes = np.where(inside, 1, np.where(start_ns < first_start, 0, 2)).astype("int8")
    return str_column(list(LOAD_WINDOWS), codes)


def _level_of(start_ns: np.ndarray, levels: list[dict]) -> pd.Series:
    """Concurrency level whose [start_ns, end_ns) window holds each step's start; null outside every level."""
    windows = sorted(levels, key=lambda lv: lv["start_ns"])
    starts = np.array([lv["start_ns"] for lv in windows], dtype="int64")
    ends = np.array([lv["end_ns"] for lv in windows], dtype="int64")
    values = np.array([lv["concurrency"] for lv in windows], dtype="int64")
    idx = np.searchsorted(starts, start_ns, side="right") - 1
    inside = (idx >= 0) & (start_ns < ends[np.clip(idx, 0, None)])
    level = pd.array(np.where(inside, values[np.clip(idx, 0, None)], 0), dtype="Int32")
    level[~inside] = pd.NA
    return pd.Series(level)
