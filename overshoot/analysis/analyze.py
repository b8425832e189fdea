"""The summary of a run's steps table (analysis/steps.py) per group: medians, CPU-bound share, GPU idle, the
scheduling mode and the what-if projections, plus the notes a report prints.

Everything here is vectorised pandas/numpy; the only sequential part (the what-if replay) lives in whatif.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from pandas.core.groupby import SeriesGroupBy

from overshoot.analysis.frames import (
    codes_and_names,
    group_ids,
    group_keys,
    per_step,
    positions,
    timeline_spans,
    worker_rows,
)
from overshoot.analysis.kernels import SOURCES, per_group, primary_row, windows_apart
from overshoot.analysis.ranks import summarize_ranks
from overshoot.analysis.steps import (  # re-exported: the steps table is part of this module's API
    CPU_BOUND_SHARE,
    LOAD_WINDOWS,
    NEVER_WAITED_MS,
    RAW_STEP_COLUMNS,
    STEP_COLUMNS,
    drop_warmup,
    extra_fact_columns,
    joined_steps,
    joined_steps_and_kernels,
    steps_table,
)

__all__ = [
    "RAW_STEP_COLUMNS",
    "STEP_COLUMNS",
    "ModeGuess",
    "Summary",
    "aggregate_levels",
    "detect_mode",
    "extra_fact_columns",
    "group_title",
    "joined_steps",
    "primary_timeline",
    "steps_table",
    "summarize",
]

# GPU work that ends this long after its step's end counts as "still running when the step ended" (async).
ASYNC_END_TOLERANCE_NS = 20_000
# Share of steps, among those with GPU times, whose GPU work outlives the step: above it the engine is async.
ASYNC_SHARE = 0.5

def primary_timeline(df: pd.DataFrame) -> tuple[int, str]:
    """The engine thread: the (pid, thread) with the most steps (ties: the earliest to start)."""
    best = primary_row(df)
    return int(df["pid"].iat[best]), str(df["thread"].iat[best])


@dataclass
class ModeGuess:
    mode: str  # "sync" | "async"
    source: str  # "option" | "data" | "meta" | "default"
    detail: str = ""


def detect_mode(
    df: pd.DataFrame,
    *,
    spans: pd.DataFrame | None = None,
    meta: dict | None = None,
    processes: list[dict] | None = None,
    override: str | None = None,
) -> ModeGuess:
    """Sync vs async (overlapped) scheduling of one timeline (rows ordered by start).

    Data first. A sync engine waits for the GPU work it launched in the same step, so that work has ended by
    the end of the step's last wait; an async engine waits for the batch launched one record earlier, and the
    work it just launched is still running when that wait ends. So among steps with GPU times and a wait that
    blocked (longer than NEVER_WAITED_MS), the share whose own GPU work ended by their last wait's end
    (+ tolerance) decides: above half, sync. A wait that did not block tells nothing: a CPU-bound async
    engine's own work has often ended by then too (kernel timing's cost on the launches makes a mixed async
    engine so). Where fewer than 3 steps blocked, the scheduling hint below decides; without one, all steps
    with a wait do. Without wait spans: GPU work that outlives its step means async. Without GPU times: a
    hint in meta.json / the per-process json (`async_scheduling` bool, `scheduling`, or the server command's
    --async-scheduling / --no-async-scheduling flag); else sync.
    """
    if override:
        return ModeGuess(override, "option")
    hint = _hinted_mode(meta, processes)
    has_gpu = df["gpu_end_ns"].notna().to_numpy()
    if has_gpu.sum() >= 3:
        wait_end = _last_wait_end(df, spans)
        usable = has_gpu & ~np.isnan(wait_end)
        gpu_end = df["gpu_end_ns"].to_numpy(dtype="float64")
        blocked = usable & (df["wait_ms"].to_numpy(dtype="float64") > NEVER_WAITED_MS)
        if blocked.sum() >= 3 or (usable.sum() >= 3 and hint is None):
            rows = blocked if blocked.sum() >= 3 else usable
            own = gpu_end[rows] <= wait_end[rows] + ASYNC_END_TOLERANCE_NS
            share = float(own.mean())
            mode = "sync" if share > ASYNC_SHARE else "async"
            which = "steps that blocked" if rows is blocked else "steps"
            return ModeGuess(mode, "data", f"{share:.0%} of {which} wait for the GPU work they launched")
        if usable.sum() < 3:
            outlives = gpu_end[has_gpu] > df["end_ns"].to_numpy()[has_gpu] + ASYNC_END_TOLERANCE_NS
            share = float(outlives.mean())
            mode = "async" if share > ASYNC_SHARE else "sync"
            detail = f"no wait spans; GPU work outlives its step in {share:.0%} of steps"
            return ModeGuess(mode, "data", detail)
        detail = "the thread hardly ever blocked in a wait, so the data cannot tell"
        return ModeGuess(hint.mode, hint.source, f"{detail}; {hint.detail}" if hint.detail else detail)
    return hint or ModeGuess("sync", "default", "no GPU times and no scheduling hint: assumed sync")


def _hinted_mode(meta: dict | None, processes: list | None) -> ModeGuess | None:
    """The scheduling the run's meta.json or process records name, if any."""
    for source in [meta or {}] + list(processes or []):
        for where in (source, source.get("process_info") or {}, source.get("options") or {}):
            if isinstance(where.get("async_scheduling"), bool):
                return ModeGuess("async" if where["async_scheduling"] else "sync", "meta")
            if where.get("scheduling") in ("sync", "async"):
                return ModeGuess(where["scheduling"], "meta")
        command = source.get("command") or source.get("argv") or []
        for flag, mode in (("--async-scheduling", "async"), ("--no-async-scheduling", "sync")):
            if isinstance(command, list) and flag in command:
                return ModeGuess(mode, "meta", f"server command has {flag}")
    return None


def _last_wait_end(df: pd.DataFrame, spans: pd.DataFrame | None) -> np.ndarray:
    """End of each step's last wait span (NaN: the step has none). `spans` are the timeline's spans."""
    out = np.full(len(df), np.nan)
    if spans is None or len(spans) == 0:
        return out
    step = spans["step"].to_numpy()
    is_wait = (spans["kind"] == "wait").to_numpy() & (step >= 0)
    if not is_wait.any():
        return out
    end = spans["start_ns"].to_numpy()[is_wait] + spans["dur_ns"].to_numpy()[is_wait]
    steps, last = per_step(step[is_wait], end, "max")
    pos = positions(df["step"].to_numpy(), steps)
    out[pos[pos >= 0]] = last.astype("float64")[pos >= 0]
    return out


@dataclass
class Summary:
    run_id: str
    mode: ModeGuess
    primary: tuple[int, str]
    group_keys: list[str]
    groups: pd.DataFrame
    steps: pd.DataFrame  # the primary timeline's steps (warm-up dropped), with projected columns
    notes: list[str] = field(default_factory=list)
    what_ifs: list = field(default_factory=list)
    ranks: object = None  # analysis/ranks.RankSummary of a multi-rank engine, else None
    # every step of the primary timeline (warm-up and steps outside the load levels too), ordered by start,
    # index as in `steps`: the steps a group without kernel data of its own borrows its idle split from
    # (start_ns, end_ns and the group keys only, unless every step is summarised)
    timeline: pd.DataFrame | None = None


# Async alignment check: CPU-bound share vs share of steps with GPU idle before them, in percentage points.
AGREEMENT_TOLERANCE_PCT = 10.0
# Mostly CPU-bound steps with less GPU idle between steps than this: the GPU waits on launches inside them.
LAUNCH_GAP_IDLE_PCT = 10.0
_MIN_STEPS_FOR_CHECK = 20


def summarize(
    run,
    *,
    cpu_bound_ms: float = NEVER_WAITED_MS,
    cpu_bound_share: float = CPU_BOUND_SHARE,
    warmup_steps: int = 0,
    mode: str | None = None,
    what_ifs: list | None = None,
) -> Summary:
    """Summary of the primary timeline per (concurrency if present, phase, batch_size)."""
    from overshoot.analysis import whatif

    what_ifs = list(what_ifs or [])
    full, step_kernels = joined_steps_and_kernels(run, cpu_bound_ms=cpu_bound_ms,
                                                  cpu_bound_share=cpu_bound_share)
    best = primary_row(full)
    pid, thread = int(full["pid"].iat[best]), str(full["thread"].iat[best])
    on_primary = full["_timeline"].to_numpy() == full["_timeline"].iat[best]  # ints, not string compares
    timeline = full if on_primary.all() else full[on_primary].reset_index(drop=True)  # ordered by start
    spans = timeline_spans(run.spans, pid, thread)
    guess = detect_mode(timeline, spans=spans, meta=run.meta, processes=run.processes, override=mode)
    kept, left_out = _summarised(drop_warmup(timeline, warmup_steps))
    keys = group_keys(kept)
    ids = group_ids(kept, keys) if len(kept) else None  # the what-ifs' groups and the table's
    group_of = None
    if ids is not None and what_ifs and len(kept) == len(timeline):
        group_of = ids[0]  # every step kept, in the timeline's order
    elif ids is not None and what_ifs:
        group_of = np.full(len(timeline), -1, "int64")
        group_of[timeline.index.get_indexer(kept.index)] = ids[0]
    proj = whatif.project(timeline, spans, what_ifs, mode=guess.mode, kernels=step_kernels, group_of=group_of)
    timeline["model_ms"] = proj.baseline_ms
    for w in what_ifs:
        timeline[f"whatif:{w.label}"] = proj.projected_ms[w.label]
    kept = timeline if len(kept) == len(timeline) else timeline.loc[kept.index]  # all kept: no copy
    groups = _aggregate(kept, keys, what_ifs, proj.group_change_ms, ids)
    notes = _notes(full, on_primary, groups, keys, guess, proj, pid, thread, warmup_steps)
    if left_out:
        notes.insert(1, left_out)
    apart = windows_apart(getattr(run, "kernel_windows", None), getattr(run, "kernels", None))
    if apart:
        notes.append(f"the kernel-timing windows of the {apart} processes that launched kernels never "
                     "overlapped: no step has every GPU's kernels recorded; each rank's own GPU is in the "
                     "per-rank GPU table")
    if step_kernels.empty_windows:
        notes.append(f"{step_kernels.empty_windows} kernel-timing window(s) recorded no kernel (records "
                     "lost): their steps are not counted as instrumented")
    ranks = summarize_ranks(run, full, kept, pid, keys)
    if ranks is not None:
        notes += ranks.notes
    # (the steps left out are kept by the columns the idle split's borrowing reads, not every column)
    every = kept if kept is timeline else timeline[["start_ns", "end_ns", *keys]]
    return Summary(run.run_id, guess, (pid, thread), keys, groups, kept, notes, what_ifs, ranks, every)


def _summarised(kept: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The steps that form groups, and a note on those left out."""
    left_out = ""
    if "concurrency" in kept.columns:
        # Steps outside every load level (the warm-up before the first level, steps between levels) would
        # form groups of their own under no load that the user did not ask about; they stay in the steps
        # table (column load_window says which).
        outside = kept["concurrency"].isna().to_numpy()
        if outside.any() and not outside.all():
            left_out = _left_out_note(kept["load_window"][outside])
            kept = kept[~outside]
    # Steps that ran no batch (batch size 0: e.g. an engine's empty iterations) are no group of their own:
    # projections over their near-empty work are meaningless. They stay in the steps table.
    empty = kept["batch_size"].to_numpy() == 0
    if empty.any() and not empty.all():
        kept = kept[~empty]
        left_out = "; ".join(filter(None, [left_out, f"{int(empty.sum())} steps with no batch (batch size 0) "
                                           "are not summarised"]))
    return kept, left_out


def _left_out_note(windows: pd.Series) -> str:
    """'38 warm-up steps (before the first load level) and 5 steps outside every load level are not
    summarised' (either part alone when the other is empty)."""
    warm = int((windows == LOAD_WINDOWS[0]).sum())
    parts = [f"{warm} warm-up steps (before the first load level)"] if warm else []
    if len(windows) > warm:
        parts.append(f"{len(windows) - warm} steps outside every load level")
    return f"{' and '.join(parts)} are not summarised"


def _aggregate(df: pd.DataFrame, keys: list[str], what_ifs: list,
               group_change_ms: dict[str, np.ndarray] | None = None,
               ids: tuple[np.ndarray, np.ndarray] | None = None) -> pd.DataFrame:
    """The group table; `ids`: group_ids(df, keys) when known."""
    group_id, first_row = ids if ids is not None else group_ids(df, keys)
    n_groups = len(first_row)

    def total(values: np.ndarray) -> np.ndarray:
        return np.bincount(group_id, weights=values, minlength=n_groups)

    step = df["step_ms"].to_numpy()
    idle_before = df["gpu_idle_before_ms"].to_numpy(dtype="float64")
    has_idle = ~np.isnan(idle_before)
    count = np.bincount(group_id, minlength=n_groups)
    source = _source_codes(df["gpu_timing"])
    measured = source == SOURCES.index("kernels")
    # Steps per group and source (a column per code in SOURCES, and one for none of them).
    width = len(SOURCES) + 1
    by_source = np.bincount(group_id * width + np.where(source < 0, len(SOURCES), source),
                            minlength=n_groups * width).reshape(n_groups, width)
    median, by_group = _medians(df, measured, group_id, n_groups)
    out = df[keys].iloc[first_row].reset_index(drop=True)
    if "concurrency" in keys and "load_window" in df.columns:
        out.insert(len(keys), "load_window", _group_windows(df, out, total, count))
    out["steps"] = count
    out["step_ms_median"] = median["step_ms"].to_numpy()
    out["step_ms_p90"] = by_group.quantile(0.9).to_numpy()
    out["busy_ms_median"] = median["busy_ms"].to_numpy()
    out["wait_ms_median"] = median["wait_ms"].to_numpy()
    out["gpu_ms_median"] = median["gpu_ms"].to_numpy()
    # A group with no instrumented step of its own shows the GPU busy it borrowed (what its idle came from).
    borrowed_busy = np.full(n_groups, np.nan)
    lent = source == SOURCES.index("borrowed")
    if "_gpu_busy_est_ms" in df.columns and lent.any():
        borrowed_busy = per_group(group_id, df["_gpu_busy_est_ms"].to_numpy("float64"), lent, n_groups)[0]
    out["gpu_busy_ms_median"] = np.where(by_source[:, SOURCES.index("kernels")] > 0,
                                         median["gpu_busy_ms"].to_numpy(), borrowed_busy)
    out["kernels_median"] = median["kernels"].to_numpy()
    out["launch_ms_median"] = median["launch_ms"].to_numpy()
    out["kernel_steps"] = by_source[:, SOURCES.index("kernels")].astype("int64")
    out["gpu_timing"] = _group_timing(by_source, count)
    verdict = df["cpu_bound"].to_numpy(dtype="float64", na_value=np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        known = ~np.isnan(verdict)
        out["cpu_bound_pct"] = 100.0 * total(np.nan_to_num(verdict)) / total(known.astype("float64"))
        never_waited = df["thread_never_waited"].to_numpy(dtype="float64")
        out["thread_never_waited_pct"] = 100.0 * total(never_waited) / count
        out["gpu_idle_pct"] = _idle_share(df, source, group_id, n_groups)
        _add_ranges(out, df, source, group_id, n_groups, total, known)
        # The gaps between kernels inside steps: instrumented steps only (unknown without kernel data).
        idle_in = np.nan_to_num(df["gpu_idle_in_step_ms"].to_numpy(dtype="float64"))
        out["gpu_idle_in_step_pct"] = 100.0 * total(np.where(measured, idle_in, 0.0)) / total(
            np.where(measured, step, 0.0))
        idle_steps = total(np.where(has_idle, idle_before > NEVER_WAITED_MS, 0.0))
        out["gpu_idle_steps_pct"] = 100.0 * idle_steps / total(has_idle.astype("float64"))
        out["cpu_share_pct"] = 100.0 * total(df["busy_ms"].to_numpy()) / total(step)
        if "spec_tokens" in df.columns:  # speculating engines: draft tokens verified per step, on average
            drafts = pd.to_numeric(df["spec_tokens"], errors="coerce").fillna(0).to_numpy(dtype="float64")
            if drafts.any():
                out["spec_tokens_mean"] = total(drafts) / count
                if "accepted_tokens" in df.columns:
                    accepted = pd.to_numeric(df["accepted_tokens"], errors="coerce").fillna(0)
                    out["accepted_tokens_mean"] = total(accepted.to_numpy(dtype="float64")) / count
        model = total(df["model_ms"].to_numpy())
        for w in what_ifs:
            # replay: what the whole timeline gains when this group's steps change, over the group's time
            change = (group_change_ms or {}).get(w.label)
            if change is None:
                change = total(df[f"whatif:{w.label}"].to_numpy()) - model
            out[f"whatif:{w.label}"] = 100.0 * (change / model)
    return out.replace([np.inf, -np.inf], np.nan)


# Sources of a step's GPU idle, best first (analysis/kernels.py): a group's share comes from its best one.
_SOURCES = ("estimate", "kernels", "borrowed", "events")


def _source_codes(column: pd.Series) -> np.ndarray:
    """Per row: the index of its gpu_timing value in SOURCES (-1: none of them), found once per distinct
    value rather than through a Python string per row."""
    codes, names = codes_and_names(column)
    lookup = [SOURCES.index(u) if u in SOURCES else -1 for u in names]
    return np.array([*lookup, -1], "int8")[codes]  # code -1 (null): the appended -1


def _medians(df: pd.DataFrame, measured: np.ndarray, group_id: np.ndarray,
             n_groups: int) -> tuple[pd.DataFrame, SeriesGroupBy]:
    """Per group (rows in group order): the median of each figure, NaN ignored (kernel figures: of the
    measured steps only), and the group-by of step_ms for other statistics. Each group's values are cut
    from one stable sort by group and partitioned (np.median: the middle value, or the mean of the middle
    two, as pandas' group median gives); a figure without any value is not sorted through."""
    key = group_id.astype("int16") if n_groups < 2**15 else group_id  # (small ints sort by radix)
    order = np.argsort(key, kind="stable")
    bounds = np.searchsorted(group_id[order], np.arange(n_groups + 1))
    median = pd.DataFrame(np.nan, index=range(n_groups), columns=list(_MEDIAN_COLUMNS))
    step = df["step_ms"].to_numpy(dtype="float64")
    for c in _MEDIAN_COLUMNS:
        v = df[c].to_numpy(dtype="float64")
        v = np.where(measured, v, np.nan) if c in _MEASURED_ONLY else v
        if np.isnan(v).all():
            continue
        v = v[order]
        for g in range(n_groups):
            part = v[bounds[g]:bounds[g + 1]]
            part = part[~np.isnan(part)]
            if len(part):
                median.iat[g, median.columns.get_loc(c)] = np.median(part)
    return median, pd.Series(step).groupby(group_id, sort=True)


_MEDIAN_COLUMNS = ("step_ms", "busy_ms", "wait_ms", "gpu_ms", "gpu_busy_ms", "kernels", "launch_ms")
_MEASURED_ONLY = ("gpu_busy_ms", "kernels", "launch_ms")


def _add_ranges(out: pd.DataFrame, df: pd.DataFrame, source: np.ndarray, group_id: np.ndarray, n_groups: int,
                total, known: np.ndarray) -> None:
    """cpu_bound_pct_low/_high and gpu_idle_pct_low/_high: the group's shares with every estimated step's GPU
    busy at the upper and at the lower end of its estimate's 95% interval (kernels.interval_on_rows); NaN for
    a group with no estimated step, or one whose estimate has no interval (too few instrumented steps). And
    gpu_busy_steps: the instrumented steps its estimate rests on."""
    nan = np.full(n_groups, np.nan)
    for name in ("cpu_bound_pct_low", "cpu_bound_pct_high", "gpu_idle_pct_low", "gpu_idle_pct_high",
                 "gpu_busy_steps"):
        out[name] = nan
    if "_cpu_bound_lo" not in df.columns:
        return
    estimated = np.isin(source, (SOURCES.index("estimate"), SOURCES.index("borrowed")))
    # the instrumented steps the group's estimate rests on (its own, or those it borrowed)
    out["gpu_busy_steps"] = per_group(group_id, df["_busy_n"].to_numpy("float64"), estimated, n_groups)[0]
    lo_idle = df["_gpu_idle_lo_ms"].to_numpy("float64")
    ranged = (total(estimated.astype("float64")) > 0) & (total((estimated & np.isnan(lo_idle)).astype(
        "float64")) == 0)
    for end, bound, idle_end in (("low", "_cpu_bound_lo", "_gpu_idle_lo_ms"),
                                 ("high", "_cpu_bound_hi", "_gpu_idle_hi_ms")):
        verdict = np.nan_to_num(df[bound].to_numpy("float64"))
        share = 100.0 * total(np.where(known, verdict, 0.0)) / total(known.astype("float64"))
        out[f"cpu_bound_pct_{end}"] = np.where(ranged, share, np.nan)
        idle = _idle_share(df, source, group_id, n_groups, idle=df[idle_end].to_numpy("float64"))
        out[f"gpu_idle_pct_{end}"] = np.where(ranged, idle, np.nan)


def _idle_share(df: pd.DataFrame, source: np.ndarray, group_id: np.ndarray, n_groups: int, *,
                idle: np.ndarray | None = None) -> np.ndarray:
    """GPU idle share of each group's steps, time-weighted, from the group's best source: plain steps of a
    sampled group ("estimate": step time of uninstrumented steps, GPU busy of instrumented ones), else the
    instrumented steps, else the idle before the steps (events). Sums per (group, source) in one pass each;
    a bin adds its rows in row order, as a per-source sum over the group would. `idle`: per step, in place
    of the gpu_idle_ms column."""
    idle = df["gpu_idle_ms"].to_numpy(dtype="float64") if idle is None else idle
    step = df["step_ms"].to_numpy()
    width = len(SOURCES) + 1  # the last column: other sources and steps without an idle figure
    column = np.where((source < 0) | np.isnan(idle), len(SOURCES), source)
    bins = group_id * width + column

    def per_source(weights: np.ndarray | None) -> np.ndarray:
        return np.bincount(bins, weights=weights, minlength=n_groups * width).reshape(n_groups, width)

    steps, step_sum = per_source(None), per_source(step)
    idle_sum = per_source(np.where(np.isnan(idle), 0.0, idle))  # (NaN rows are in the last column)
    out = np.full(n_groups, np.nan)
    for name in reversed(_SOURCES):  # best last: it overwrites
        c = SOURCES.index(name)
        share = 100.0 * idle_sum[:, c] / step_sum[:, c]
        out = np.where(steps[:, c] > 0, share, out)
    return out


def _group_timing(by_source: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Per group: "kernels" (every step instrumented), "sampled", "borrowed" (no instrumented step of its
    own: GPU busy of its phase and batch size at other levels), "events" or "none"."""
    kernels = by_source[:, SOURCES.index("kernels")]
    borrowed = by_source[:, SOURCES.index("borrowed")]
    events = by_source[:, SOURCES.index("events")] + by_source[:, SOURCES.index("estimate")]
    return np.where(kernels == count, "kernels", np.where(kernels > 0, "sampled", np.where(
        borrowed > 0, "borrowed", np.where(events > 0, "events", "none")))).astype(object)


def aggregate_levels(summary: Summary) -> pd.DataFrame:
    """The group figures per concurrency level, over all the level's summarised steps (analysis/sweep.py:
    the load sweep table and the live view of `overshoot run`); no rows when the run has no levels."""
    steps = summary.steps
    if "concurrency" not in steps.columns or len(steps) == 0 or steps["concurrency"].isna().all():
        return pd.DataFrame({"concurrency": pd.array([], dtype="Int32")})
    return _aggregate(steps[steps["concurrency"].notna()], ["concurrency"], [])


def _group_windows(df: pd.DataFrame, groups: pd.DataFrame, total, count: np.ndarray) -> np.ndarray:
    """load_window of each group: "level" for a load level's group; a group without a level (only when no
    step of the timeline is inside any level) is "warmup" when all its steps are, else "outside"."""
    level = groups["concurrency"].notna().to_numpy()
    if level.all():
        return np.full(len(groups), LOAD_WINDOWS[1], dtype=object)
    warm = total((df["load_window"] == LOAD_WINDOWS[0]).to_numpy(dtype="float64"))
    return np.where(level, LOAD_WINDOWS[1], np.where(warm == count, LOAD_WINDOWS[0], LOAD_WINDOWS[2]))


def group_title(row: dict, keys: list[str]) -> str:
    """'decode @ 4 requests, batch 4' (with levels) or 'decode @ batch 4'."""
    batch = f"batch {row['batch_size']}"
    if "concurrency" in keys:
        level = row.get("concurrency")
        if level is None or pd.isna(level):
            where = "warm-up" if row.get("load_window") == LOAD_WINDOWS[0] else "no load level"
            return f"{row['phase']} @ {where}, {batch}"
        noun = "request" if int(level) == 1 else "requests"
        return f"{row['phase']} @ {int(level)} {noun}, {batch}"
    return f"{row['phase']} @ {batch}"


def _collector_notes(primary: pd.DataFrame, groups: pd.DataFrame) -> list[str]:
    """What kernel timing cost the launches, where the run measured it, and where it could not."""
    notes = []
    cost = primary["_collector_ns"].to_numpy("float64") if "_collector_ns" in primary.columns else None
    if cost is not None and not np.isnan(cost).all():
        us = np.nanmedian(cost) / 1e3
        notes.append(f"what-if: kernel timing made each launch call {us:.1f} µs longer (CPU busy of "
                     "instrumented against plain steps, per group; a group with too few of either takes "
                     "the median of those measured); the replay takes that out of the instrumented steps")
    every = int((groups["gpu_timing"] == "kernels").sum()) if "gpu_timing" in groups.columns else 0
    if every:
        notes.append(f"every step of {every} group(s) was instrumented, so what kernel timing adds to each "
                     "launch (no plain steps to measure it against) stays in their CPU side and their GPU "
                     "idle share (both read high where it slowed the launches); --gpu-timing sampled "
                     "measures it and takes it out")
    return notes


def _notes(full, on_primary, groups, keys, guess: ModeGuess, proj, pid, thread, warmup_steps) -> list[str]:
    notes = [f"primary timeline: pid {pid} thread {thread!r} (the thread with the most steps)"]
    others = full[~on_primary]
    others = others[~worker_rows(others)]  # worker timelines are in the per-rank table
    if len(others):
        counts = others.groupby(["pid", "thread"], sort=True).size()
        listed = ", ".join(f"{p}/{t}: {n} steps" for (p, t), n in counts.items())
        notes.append(f"other timelines not in the summary (see export): {listed}")
    if warmup_steps:
        notes.append(f"first {warmup_steps} steps of each timeline/level excluded as warm-up")
    detail = f" ({guess.detail})" if guess.detail else ""
    notes.append(f"scheduling: {guess.mode}, from {guess.source}{detail}")
    if guess.mode == "async":
        notes.append(
            "async alignment: record n launches batch n+1 and waits for batch n, so a record whose thread "
            "never waited should show GPU idle before the work it launches"
        )
        for row in groups.to_dict("records"):
            if row["steps"] < _MIN_STEPS_FOR_CHECK or pd.isna(row["gpu_idle_steps_pct"]):
                continue
            diff = row["thread_never_waited_pct"] - row["gpu_idle_steps_pct"]
            if abs(diff) > AGREEMENT_TOLERANCE_PCT:
                notes.append(
                    f"{group_title(row, keys)}: the thread never waited in "
                    f"{row['thread_never_waited_pct']:.0f}% of steps but {row['gpu_idle_steps_pct']:.0f}% "
                    f"have GPU idle before their work: the two views disagree by {abs(diff):.0f} points "
                    f"(tolerance {AGREEMENT_TOLERANCE_PCT:g}); CPU work between a launch and the following "
                    "wait, or waits on something other than the GPU, "
                    "make them differ"
                )
    unknown_inside = [row for row in groups.to_dict("records") if row["gpu_timing"] == "events"]
    if unknown_inside:
        notes.append(
            "GPU idle inside the steps is unknown for groups timed by CUDA events alone (two events a step "
            "see the GPU interval, not the gaps between its kernels): their GPU idle counts only the idle "
            "before each step, a lower bound; run with --gpu-timing sampled or kernels to see inside"
        )
    for row in unknown_inside:
        if row["steps"] < _MIN_STEPS_FOR_CHECK or pd.isna(row["gpu_idle_pct"]):
            continue
        if row["thread_never_waited_pct"] >= 50 and row["gpu_idle_pct"] < LAUNCH_GAP_IDLE_PCT:
            notes.append(
                f"{group_title(row, keys)}: the thread never waited in "
                f"{row['thread_never_waited_pct']:.0f}% of steps while the GPU idled only "
                f"{row['gpu_idle_pct']:.1f}% of the time between steps: the GPU may be waiting on launches "
                "inside the steps (launch-bound), which events cannot see"
            )
    borrowed = [row for row in groups.to_dict("records") if row["gpu_timing"] == "borrowed"]
    if borrowed:
        listed = ", ".join(group_title(row, keys) for row in borrowed[:4])
        more = f" and {len(borrowed) - 4} more" if len(borrowed) > 4 else ""
        notes.append(
            f"GPU busy borrowed: {listed}{more} had no kernel-timing window of their own; their GPU busy is "
            "that of the instrumented steps of the same phase and batch size at other load levels (the same "
            "shapes on the GPU; context lengths may differ), their GPU idle is step time minus it"
        )
    if proj.model == "replay":
        notes.append(
            f"what-if: replay of the recorded CPU/GPU dependencies (reproduces the recorded step "
            f"time within {abs(proj.fit_error or 0.0) * 100:.1f}%)"
        )
        notes += _collector_notes(full[on_primary], groups)
    elif proj.model == "none":
        pass
    elif guess.mode == "async":
        notes.append(
            "what-if: no GPU times, per-step model max(CPU, GPU path); for steps that never waited "
            "the GPU path is unknown, so a faster CPU's gain there is an upper bound"
        )
    else:
        notes.append("what-if: no GPU times, per-step model busy + wait (the wait stands for the GPU work)")
    return notes
