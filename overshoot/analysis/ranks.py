"""Multi-rank engines: each rank's share of every engine step, the slowest rank, and what it cost the others.

Each worker process (one per rank) records a step per scheduler output it runs (engine_hooks/vllm.py), with
its rank and parallel layout as step facts, busy spans (execute_model, sample_tokens) and waits in
collectives. The engine core's steps that scheduled work send one scheduler output each to every worker, in
order: the k-th of them is every rank's k-th step. That is how steps are joined (not by time windows), and
each join is checked by the scheduled token count both sides recorded (`tokens_match`).

Per (engine step, rank): busy ms (the union of its busy spans), collective wait ms, compute ms (busy -
collective), the GPU interval when recorded, and when the rank finished (its last busy span's end, on the
engine core's clock). Per engine step:
- the slowest rank: the most compute; what it cost the others is the imbalance, max - min compute, which
  the others spent waiting in collectives (tensor parallel ranks meet at every collective, so they finish
  together and the finish spread alone would not show a straggler);
- the spread between the first and the last rank to finish, which rank was last, and the clock error bound
  of that spread (rundir/clocks.py): a spread within its bound is unresolved. Durations inside one process
  need no alignment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from overshoot.analysis import rank_gpu
from overshoot.analysis.frames import worker_rows
from overshoot.rundir.clocks import align

RANK_COLUMNS = ["step", "rank", "pid", "busy_ms", "collective_ms", "compute_ms", "gpu_ms", "finish_ns",
                "tokens_match"]


@dataclass
class RankSummary:
    # one row per (engine step, rank): RANK_COLUMNS, error_ns, the rank's own GPU in its step cycle
    # (rank_gpu.COLUMNS) and the engine step's group keys
    per_rank: pd.DataFrame
    per_step: pd.DataFrame  # one row per engine step: spread_ms, last_rank, error_ms, resolved
    groups: pd.DataFrame  # per group: ranks, slowest rank and how often, median spread, per-rank medians
    notes: list[str] = field(default_factory=list)


def summarize_ranks(run, steps: pd.DataFrame, engine_steps: pd.DataFrame, primary_pid: int,
                    keys: list[str]) -> RankSummary | None:
    """Per-rank view of a run whose workers recorded steps; None with fewer than two ranks. `steps`: every
    timeline's joined steps (analysis/steps.py); `engine_steps`: the engine core's summarised steps
    (analyze.Summary.steps), whose group keys the rank rows take."""
    workers = steps[worker_rows(steps)]
    if len(workers) == 0 or pd.to_numeric(workers["rank"]).nunique() < 2:
        return None  # one rank (vLLM's CPU build runs even one in a worker process): nothing to compare
    notes: list[str] = []
    spans = run.spans
    scheduled = _scheduled_steps(spans, primary_pid, run.steps)
    alignment = align(run.processes, primary_pid)
    rows, splits = [], {}
    for (pid, thread), mine in workers.sort_values("start_ns").groupby(["pid", "thread"], sort=True):
        rank = int(pd.to_numeric(mine["rank"]).iloc[0])
        mine = mine.reset_index(drop=True)
        n = min(len(mine), len(scheduled))
        if len(mine) != len(scheduled):
            notes.append(f"rank {rank} (pid {pid}) ran {len(mine)} steps, the engine core scheduled "
                         f"{len(scheduled)}: the first {n} are joined in order")
        part = _rank_rows(mine.iloc[:n], spans, int(pid), str(thread))
        gpu, splits[rank] = rank_gpu.rank_idle(run, mine, int(pid), str(thread))
        for name in rank_gpu.COLUMNS:
            part[name] = gpu[name].to_numpy()[:n]
        part["cycle"] = np.arange(n)  # the row of the rank's idle split (_groups)
        shift = alignment.get(int(pid))
        part["finish_ns"] = part["finish_ns"] + (shift.offset_ns if shift else 0)
        part["error_ns"] = np.nan if shift is None or shift.error_ns is None else float(shift.error_ns)
        part["step"] = scheduled["step"].to_numpy()[:n]
        part["rank"] = rank
        part["pid"] = int(pid)
        engine_tokens = scheduled["num_tokens"].to_numpy()[:n]
        part["tokens_match"] = part["num_tokens"].to_numpy() == engine_tokens
        rows.append(part)
    per_rank = pd.concat(rows, ignore_index=True)
    bad = int((~per_rank["tokens_match"]).sum())
    if bad:
        notes.append(f"{bad} rank steps do not match the engine core's step in scheduled tokens: the order "
                     "join is off there")
    group_cols = [k for k in keys if k in engine_steps.columns]
    # the engine steps' groups (steps the summary leaves out, e.g. warm-up, get none)
    per_rank = per_rank.merge(engine_steps[["step", *group_cols]], on="step", how="left")
    per_step = _per_step(per_rank)
    groups = _groups(per_rank, per_step, group_cols, splits)
    basis = {a.basis for pid, a in alignment.items() if pid in set(per_rank["pid"])}
    notes.append("ranks joined to the engine core's steps by the order of the scheduler outputs they ran; "
                 f"clocks: {', '.join(sorted(basis))}")
    columns = [*RANK_COLUMNS, "error_ns", *rank_gpu.COLUMNS, *group_cols]
    return RankSummary(per_rank[columns], per_step, groups, notes)


def _scheduled_steps(spans: pd.DataFrame, pid: int, raw_steps: pd.DataFrame) -> pd.DataFrame:
    """The engine core's steps that scheduled (a "schedule" span), in order, with their scheduled tokens."""
    mine = spans[(spans["pid"] == pid) & (spans["label"] == "schedule") & (spans["step"] >= 0)]
    steps = raw_steps[(raw_steps["pid"] == pid) & raw_steps["step"].isin(mine["step"].unique())]
    steps = steps.sort_values("start_ns")
    tokens = pd.to_numeric(steps.get("num_tokens"), errors="coerce").fillna(-1).astype("int64")
    return pd.DataFrame({"step": steps["step"].to_numpy(), "num_tokens": tokens.to_numpy()})


def _rank_rows(steps: pd.DataFrame, spans: pd.DataFrame, pid: int, thread: str) -> pd.DataFrame:
    mine = spans[(spans["pid"] == pid) & (spans["thread"] == thread) & (spans["step"] >= 0)]
    mine = mine[mine["step"].isin(steps["step"])]
    busy = mine[mine["kind"] == "busy"].sort_values(["step", "start_ns"])
    end = (busy["start_ns"] + busy["dur_ns"]).to_numpy("float64")
    # busy time: the union of the step's busy spans (a hook may nest one inside another)
    covered_to = pd.Series(end).groupby(busy["step"].to_numpy()).cummax()
    before = covered_to.groupby(busy["step"].to_numpy()).shift(1).to_numpy("float64")
    start = busy["start_ns"].to_numpy("float64")
    union = np.maximum(end - np.fmax(start, np.nan_to_num(before, nan=-np.inf)), 0.0)
    collective = mine[(mine["kind"] == "wait") & (mine["label"] == "collective")]
    by_step = pd.DataFrame({
        "busy": pd.Series(union).groupby(busy["step"].to_numpy()).sum(),
        "finish": pd.Series(end).groupby(busy["step"].to_numpy()).max(),
    })
    by_step["collective"] = collective.groupby("step")["dur_ns"].sum()
    by_step = by_step.fillna({"collective": 0.0})
    by_step = by_step.reindex(steps["step"].to_numpy())
    gpu = (steps["gpu_ms"].to_numpy(dtype="float64") if "gpu_ms" in steps.columns
           else np.full(len(steps), np.nan))
    out = pd.DataFrame({
        "busy_ms": by_step["busy"].to_numpy(dtype="float64") / 1e6,
        "collective_ms": by_step["collective"].to_numpy(dtype="float64") / 1e6,
        "gpu_ms": gpu,
        "finish_ns": by_step["finish"].to_numpy(dtype="float64"),
        "num_tokens": pd.to_numeric(steps.get("num_tokens"), errors="coerce").fillna(-1).astype("int64"),
    })
    out["compute_ms"] = out["busy_ms"] - out["collective_ms"]
    return out


def _per_step(per_rank: pd.DataFrame) -> pd.DataFrame:
    g = per_rank.groupby("step", sort=True)
    first, last = g["finish_ns"].min(), g["finish_ns"].max()
    error = g["error_ns"].max() * 2  # both ends of the spread carry their process's placement error
    out = pd.DataFrame({
        "ranks": g.size(),
        "spread_ms": (last - first) / 1e6,
        "last_rank": per_rank.loc[g["finish_ns"].idxmax().to_numpy(), "rank"].to_numpy(),
        "slowest_rank": per_rank.loc[g["compute_ms"].idxmax().to_numpy(), "rank"].to_numpy(),
        "imbalance_ms": g["compute_ms"].max() - g["compute_ms"].min(),
        "error_ms": error / 1e6,
    })
    out["resolved"] = out["spread_ms"] > out["error_ms"]
    return out.reset_index()


def _groups(per_rank: pd.DataFrame, per_step: pd.DataFrame, keys: list[str], splits: dict) -> pd.DataFrame:
    steps = per_step.merge(per_rank.drop_duplicates("step")[["step", *keys]], on="step", how="inner")
    steps = steps[(steps["ranks"] > 1) & steps[keys].notna().all(axis=1)]  # summarised engine steps only
    rows = []
    for key, grp in steps.groupby(keys, dropna=False, sort=True) if keys else [((), steps)]:
        row = dict(zip(keys, key if isinstance(key, tuple) else (key,), strict=True))
        if "batch_size" in row:
            row["batch_size"] = int(row["batch_size"])
        slowest = grp["slowest_rank"].value_counts()
        last = grp.loc[grp["resolved"], "last_rank"].value_counts()
        ranks = per_rank[per_rank["step"].isin(grp["step"])]
        medians = ranks.groupby("rank")[["busy_ms", "collective_ms", "compute_ms"]].median()
        gpu = {int(r): rank_gpu.rank_figures(mine, splits[int(r)]) for r, mine in ranks.groupby("rank")}
        row.update(
            steps=len(grp), ranks=int(grp["ranks"].max()),
            slowest_rank=int(slowest.index[0]), slowest_pct=100.0 * slowest.iloc[0] / len(grp),
            imbalance_ms_median=float(grp["imbalance_ms"].median()),
            last_rank=int(last.index[0]) if len(last) else None,
            last_pct=100.0 * last.iloc[0] / len(grp) if len(last) else None,
            spread_ms_median=float(grp["spread_ms"].median()),
            spread_error_ms=float(grp["error_ms"].max()) if grp["error_ms"].notna().any() else None,
            unresolved_pct=100.0 * (1 - grp["resolved"].mean()),
            per_rank={int(r): {**{k: float(v) for k, v in m.items()}, **gpu[int(r)]}
                      for r, m in medians.iterrows()},
        )
        rows.append(row)
    return pd.DataFrame(rows)
