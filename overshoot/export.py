"""`overshoot export`: the steps / spans / gpu tables as Parquet or CSV, or a Chrome/Perfetto trace.

Schemas are in docs/schema.md; Parquet files carry them exactly (explicit Arrow types, nullable GPU columns).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from overshoot.analysis.analyze import CPU_BOUND_SHARE, joined_steps, steps_table
from overshoot.analysis.frames import as_str

WHATS = ("steps", "spans", "gpu", "kernels", "ranks", "idle")
FORMATS = ("parquet", "csv", "chrome")

STEPS_TYPES = {
    "run_id": pa.string(),
    "pid": pa.int64(),
    "thread": pa.string(),
    "step": pa.int64(),
    "start_ns": pa.int64(),
    "step_ms": pa.float64(),
    "busy_ms": pa.float64(),
    "wait_ms": pa.float64(),
    "batch_size": pa.int32(),
    "num_tokens": pa.int32(),
    "phase": pa.string(),
    "gpu_ms": pa.float64(),
    "gpu_idle_before_ms": pa.float64(),
    "gpu_busy_ms": pa.float64(),
    "gpu_idle_in_step_ms": pa.float64(),
    "kernels": pa.float64(),
    "launch_ms": pa.float64(),
    "gpu_idle_ms": pa.float64(),
    "gpu_idle_share": pa.float64(),
    "gpu_timing": pa.string(),
    "cpu_bound": pa.bool_(),
    "thread_never_waited": pa.bool_(),
    "concurrency": pa.int32(),
    "load_window": pa.string(),
}
SPANS_TYPES = {
    "pid": pa.int64(),
    "thread": pa.string(),
    "step": pa.int64(),
    "kind": pa.string(),
    "label": pa.string(),
    "start_ns": pa.int64(),
    "dur_ns": pa.int64(),
}
KERNELS_TYPES = {
    "pid": pa.int64(),
    "thread": pa.string(),
    "kind": pa.string(),
    "name": pa.string(),
    "stream": pa.int64(),
    "correlation": pa.int64(),
    "launch_start_ns": pa.int64(),
    "launch_end_ns": pa.int64(),
    "gpu_start_ns": pa.int64(),
    "gpu_end_ns": pa.int64(),
    "gpu_ms": pa.float64(),
}
IDLE_TYPES = {
    "pid": pa.int64(),
    "thread": pa.string(),
    "step": pa.int64(),
    "label": pa.string(),
    "idle_ms": pa.float64(),
    "step_idle_ms": pa.float64(),
    "known_ms": pa.float64(),
    "step_ms": pa.float64(),
}
GPU_TYPES = {
    "pid": pa.int64(),
    "thread": pa.string(),
    "step": pa.int64(),
    "gpu_start_ns": pa.int64(),
    "gpu_end_ns": pa.int64(),
    "gpu_ms": pa.float64(),
}


class ExportError(Exception):
    """Bad export request or unwritable output; the message is one line for the user."""


def format_for(path: Path, fmt: str | None) -> str:
    """The explicit --format, else from the file suffix (.csv, .json -> chrome), else parquet."""
    if fmt:
        if fmt not in FORMATS:
            raise ExportError(f"unknown --format {fmt!r}: choose one of {', '.join(FORMATS)}")
        return fmt
    return {".csv": "csv", ".json": "chrome"}.get(path.suffix.lower(), "parquet")


def table_of(run, what: str, *, cpu_bound_ms: float = 0.02, cpu_bound_share: float = CPU_BOUND_SHARE,
             warmup_steps: int = 0) -> pd.DataFrame:
    if what == "steps":
        return steps_table(run, cpu_bound_ms=cpu_bound_ms, cpu_bound_share=cpu_bound_share,
                           warmup_steps=warmup_steps)
    if what == "kernels":
        kernels = run.kernels if run.kernels is not None else pd.DataFrame(columns=list(KERNELS_TYPES))
        kernels = kernels.assign(thread=kernels["thread"].astype("str"),
                                 gpu_ms=(kernels["gpu_end_ns"] - kernels["gpu_start_ns"]) / 1e6)
        return kernels[list(KERNELS_TYPES)].sort_values(["pid", "gpu_start_ns"], kind="stable")
    if what == "spans":
        spans = _plain_strings(run.spans)
        return spans[list(SPANS_TYPES)].sort_values(["pid", "thread", "start_ns"], kind="stable")
    if what == "ranks":  # multi-rank engines: one row per engine step and rank (analysis/ranks.py)
        from overshoot.analysis.analyze import summarize

        ranks = summarize(run, cpu_bound_ms=cpu_bound_ms, cpu_bound_share=cpu_bound_share,
                          warmup_steps=warmup_steps).ranks
        if ranks is None:
            raise ExportError("--what ranks: this run has no per-rank steps (a single-rank engine)")
        return ranks.per_rank
    if what == "idle":
        from overshoot.analysis.analyze import summarize

        return idle_table(run, summarize(run, cpu_bound_ms=cpu_bound_ms, cpu_bound_share=cpu_bound_share,
                                         warmup_steps=warmup_steps))
    if what == "gpu":
        gpu = _plain_strings(run.gpu)
        gpu = gpu.assign(gpu_ms=(gpu["gpu_end_ns"] - gpu["gpu_start_ns"]) / 1e6)
        return gpu[list(GPU_TYPES)].sort_values(["pid", "thread", "gpu_start_ns"], kind="stable")
    raise ExportError(f"unknown --what {what!r}: choose one of {', '.join(WHATS)}")


def idle_table(run, summary) -> pd.DataFrame:
    """GPU idle by host work, one row per step whose idle is known and label (analysis/idle.py): the primary
    timeline's summarised steps (`summary`: summarize of `run`), as the report splits them."""
    from overshoot.analysis import idle

    split = idle.primary_idle(run, summary.steps, summary.primary)
    parts = split.parts
    rows = parts["row"].to_numpy("int64")
    pid, thread = summary.primary
    frame = pd.DataFrame({"pid": pid, "thread": str(thread), "step": split.steps["step"].to_numpy()[rows],
                          "label": parts["label"].astype(str).to_numpy(), "idle_ms": parts["ns"] / 1e6,
                          "step_idle_ms": split.total[rows] / 1e6, "known_ms": split.known[rows] / 1e6,
                          "step_ms": split.length[rows] / 1e6})
    return frame[list(IDLE_TYPES)].sort_values(["step", "idle_ms"], ascending=[True, False], kind="stable")


def _plain_strings(df: pd.DataFrame) -> pd.DataFrame:
    """The thread, and any categorical column (the spool's dictionary columns: kind, label), as "str"."""
    cats = [c for c in df.columns if c == "thread" or isinstance(df[c].dtype, pd.CategoricalDtype)]
    return df.assign(**{c: as_str(df[c]) for c in cats})


def to_arrow(df: pd.DataFrame, what: str) -> pa.Table:
    """The table with the documented Arrow types; extra fact columns keep their inferred types."""
    known = {"steps": STEPS_TYPES, "spans": SPANS_TYPES, "gpu": GPU_TYPES,
             "kernels": KERNELS_TYPES, "idle": IDLE_TYPES}.get(what, {})
    table = pa.Table.from_pandas(df.reset_index(drop=True), preserve_index=False)
    fields = []
    for f in table.schema:
        kind = known.get(f.name)
        if kind is None and pa.types.is_large_string(f.type):
            kind = pa.string()
        fields.append(pa.field(f.name, kind or f.type))
    return table.cast(pa.schema(fields))


def export(
    run,
    out: str | Path,
    *,
    what: str = "steps",
    fmt: str | None = None,
    cpu_bound_ms: float = 0.02,
    cpu_bound_share: float = CPU_BOUND_SHARE,
    warmup_steps: int = 0,
) -> tuple[str, int]:
    """Write one table (or the whole trace) to `out`; returns (format, number of rows/events written)."""
    out = Path(out)
    fmt = format_for(out, fmt)
    if what not in WHATS:
        raise ExportError(f"unknown --what {what!r}: choose one of {', '.join(WHATS)}")
    if fmt == "chrome":
        trace = chrome_trace(run, cpu_bound_ms=cpu_bound_ms, cpu_bound_share=cpu_bound_share)
        _write(out, lambda f: json.dump(trace, f), text=True)
        return fmt, len(trace["traceEvents"])
    df = table_of(run, what, cpu_bound_ms=cpu_bound_ms, cpu_bound_share=cpu_bound_share,
                  warmup_steps=warmup_steps)
    if fmt == "csv":
        _write(out, lambda f: df.to_csv(f, index=False), text=True)
    else:
        table = to_arrow(df, what)
        _write(out, lambda f: pq.write_table(table, f), text=False)
    return fmt, len(df)


def _write(out: Path, write, *, text: bool) -> None:
    try:
        with open(out, "w" if text else "wb") as f:
            write(f)
    except OSError as e:
        raise ExportError(f"cannot write {out}: {e.strerror or e}") from None


def chrome_trace(run, *, cpu_bound_ms: float = 0.02, cpu_bound_share: float = CPU_BOUND_SHARE) -> dict:
    """Chrome trace-event JSON (ui.perfetto.dev, chrome://tracing): per recorder one engine-thread track with
    steps, busy/wait/idle spans as nested complete events, one GPU track with each step's GPU work, and one
    track of recorded kernels per process and stream."""
    steps = joined_steps(run, cpu_bound_ms=cpu_bound_ms, cpu_bound_share=cpu_bound_share)
    spans, gpu = run.spans, steps[steps["gpu_start_ns"].notna()]
    starts = [steps["start_ns"].min()] + ([spans["start_ns"].min()] if len(spans) else [])
    starts += [gpu["gpu_start_ns"].min()] if len(gpu) else []
    origin = int(min(starts))
    engines = {int(p.get("pid", -1)): p.get("engine") for p in run.processes}
    timelines = steps[["pid", "thread"]].drop_duplicates().itertuples(index=False)
    tid_of = {(int(p), str(t)): 2 * i + 1 for i, (p, t) in enumerate(timelines)}
    events: list[dict] = []
    with_gpu = set(zip(gpu["pid"].astype("int64"), gpu["thread"].astype("str"), strict=True))
    for (pid, thread), tid in tid_of.items():
        name = f"{engines.get(pid) or 'engine'} (pid {pid})"
        tracks = [(tid, f"thread {thread}")] + (
            [(tid + 1, f"GPU ({thread})")] if (pid, thread) in with_gpu else []
        )
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
        for track, label in tracks:
            events.append(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": track, "args": {"name": label}}
            )
            events.append(
                {
                    "ph": "M",
                    "name": "thread_sort_index",
                    "pid": pid,
                    "tid": track,
                    "args": {"sort_index": track},
                }
            )

    def us(ns) -> np.ndarray:
        return np.round((np.asarray(ns, dtype="float64") - origin) / 1e3, 3)

    tids = [tid_of[(int(p), str(t))] for p, t in zip(steps["pid"], steps["thread"], strict=True)]
    for row, ts, dur, tid in zip(
        steps[["pid", "step", "phase", "batch_size", "num_tokens", "wait_ms", "cpu_bound"]].itertuples(
            index=False
        ),
        us(steps["start_ns"]),
        us(steps["end_ns"]) - us(steps["start_ns"]),
        tids,
        strict=True,
    ):
        events.append(
            {
                "ph": "X",
                "cat": "step",
                "name": f"step {row.step} {row.phase} x{row.batch_size}",
                "pid": int(row.pid),
                "tid": tid,
                "ts": float(ts),
                "dur": float(dur),
                "args": {
                    "step": int(row.step),
                    "phase": row.phase,
                    "batch_size": int(row.batch_size),
                    "num_tokens": int(row.num_tokens),
                    "wait_ms": float(row.wait_ms),
                    "cpu_bound": None if pd.isna(row.cpu_bound) else bool(row.cpu_bound),
                },
            }
        )
    if len(spans):
        span_tids = [tid_of.get((int(p), str(t))) for p, t in zip(spans["pid"], spans["thread"], strict=True)]
        for row, ts, dur, tid in zip(
            spans[["pid", "step", "kind", "label"]].itertuples(index=False),
            us(spans["start_ns"]),
            np.round(spans["dur_ns"].to_numpy() / 1e3, 3),
            span_tids,
            strict=True,
        ):
            if tid is None:  # a recorder with spans but no steps has no track
                continue
            events.append(
                {
                    "ph": "X",
                    "cat": row.kind,
                    "name": str(row.label or row.kind),
                    "pid": int(row.pid),
                    "tid": tid,
                    "ts": float(ts),
                    "dur": float(dur),
                    "args": {"step": int(row.step)},
                }
            )
    gpu_tids = [tid_of[(int(p), str(t))] + 1 for p, t in zip(gpu["pid"], gpu["thread"], strict=True)]
    for row, ts, dur, tid in zip(
        gpu[["pid", "step", "gpu_idle_before_ms"]].itertuples(index=False),
        us(gpu["gpu_start_ns"]),
        us(gpu["gpu_end_ns"]) - us(gpu["gpu_start_ns"]),
        gpu_tids,
        strict=True,
    ):
        idle = None if pd.isna(row.gpu_idle_before_ms) else float(row.gpu_idle_before_ms)
        events.append(
            {
                "ph": "X",
                "cat": "gpu",
                "name": f"GPU step {row.step}",
                "pid": int(row.pid),
                "tid": tid,
                "ts": float(ts),
                "dur": float(dur),
                "args": {"step": int(row.step), "gpu_idle_before_ms": idle},
            }
        )
    events += _kernel_events(run, us)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"run_id": run.run_id, "time_origin_ns": origin},
    }


def _kernel_events(run, us) -> list[dict]:
    """Recorded kernels and copies, one track per (pid, stream) (tids from 10,000 up, beside the engine's)."""
    kernels = run.kernels
    if kernels is None or len(kernels) == 0:
        return []
    events: list[dict] = []
    streams = kernels[["pid", "stream"]].drop_duplicates().itertuples(index=False)
    tid_of = {(int(p), int(s)): 10_000 + i for i, (p, s) in enumerate(streams)}
    for (pid, stream), tid in tid_of.items():
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                       "args": {"name": f"GPU kernels (stream {stream})"}})
    starts, ends = us(kernels["gpu_start_ns"]), us(kernels["gpu_end_ns"])
    rows = kernels[["pid", "stream", "kind", "name", "correlation"]].itertuples(index=False)
    for row, ts, end in zip(rows, starts, ends, strict=True):
        events.append({"ph": "X", "cat": str(row.kind), "name": str(row.name or row.kind),
                       "pid": int(row.pid), "tid": tid_of[(int(row.pid), int(row.stream))], "ts": float(ts),
                       "dur": float(end - ts), "args": {"correlation": int(row.correlation)}})
    return events
