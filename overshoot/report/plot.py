"""`overshoot plot`: the pictures a user would otherwise draw in a notebook, as PNG files (matplotlib, the
optional extra `overshoot[plot]`; drawn on Agg canvases, no pyplot and no display needed).

- timeline.png: step ms, CPU busy, GPU time and GPU idle before each step over the run, load levels shaded;
- cpu_vs_gpu.png: CPU busy against GPU time per step, with the line where they are equal;
- groups.png: per group, a stacked bar of CPU busy by label and wait (the thread's step), beside a bar of GPU
  idle per step.

With --compare each figure holds one panel per run. Each PNG carries its panel titles and what each panel drew
(JSON in the "Description" text chunk), so that tests and scripts can check a file without looking at it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

TIMELINE_BINS = 1_000  # longer runs are drawn as this many time bins (median per bin)
SCATTER_POINTS = 20_000  # at most this many steps in the scatter (a seeded sample)
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
          "#bcbd22", "#17becf")  # fmt: skip


@dataclass
class PlotRun:
    name: str  # "A", "B" or the run id
    report: dict
    steps: pd.DataFrame  # Summary.steps
    levels: list[dict] = field(default_factory=list)  # meta.json["levels"]


@dataclass
class Written:
    path: Path
    panels: list[dict]  # {"title", "lines", "collections", "patches"} per axes


def plot_runs(runs: list[PlotRun], out_dir: Path) -> list[Written]:
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        _save(_timeline(runs), out_dir / "timeline.png"),
        _save(_scatter(runs), out_dir / "cpu_vs_gpu.png"),
        _save(_groups(runs), out_dir / "groups.png"),
    ]


def _figure(rows: int, cols: int = 1, *, height: float = 4.0):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12 if cols == 1 else 6 * cols, height * rows), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    return fig, list(axes.flat)


def _save(fig, path: Path) -> Written:
    panels = [
        {"title": ax.get_title(), "lines": len(ax.lines), "collections": len(ax.collections),
         "patches": len(ax.patches)}
        for ax in fig.axes
        if ax.get_title()
    ]  # fmt: skip
    fig.savefig(path, format="png", metadata={"Description": json.dumps({"panels": panels})})
    return Written(path, panels)


def _gpu_values(steps: pd.DataFrame) -> tuple[np.ndarray, str]:
    """GPU busy per step where the run has kernel data, else the step's GPU interval (two events)."""
    if "gpu_busy_ms" in steps.columns and steps["gpu_busy_ms"].notna().any():
        return steps["gpu_busy_ms"].to_numpy(dtype="float64"), "GPU busy"
    return steps["gpu_ms"].to_numpy(dtype="float64"), "GPU interval"


def _timeline(runs: list[PlotRun]):
    fig, axes = _figure(len(runs))
    for ax, run in zip(axes, runs, strict=True):
        steps = run.steps
        t0 = int(steps["start_ns"].min()) if len(steps) else 0
        seconds = (steps["start_ns"].to_numpy(dtype="float64") - t0) / 1e9
        gpu, gpu_name = _gpu_values(steps)
        series = {
            "step ms": steps["step_ms"].to_numpy(dtype="float64"),
            "CPU busy ms": steps["busy_ms"].to_numpy(dtype="float64"),
            f"{gpu_name} ms": gpu,
            "GPU idle before the step, ms": steps["gpu_idle_before_ms"].to_numpy(dtype="float64"),
        }
        x, binned = _bin(seconds, series)
        for (label, values), color in zip(binned.items(), ("black", *COLORS), strict=False):
            if np.isfinite(values).any():  # step ms first, thin and dark: the others are its parts
                ax.plot(x, values, label=label, color=color, linewidth=0.8 if color == "black" else 1.0)
        end = float(np.nanmax(x, initial=0.0)) or 1.0
        _mark_levels(ax, run.levels, t0, end)
        ax.set_xlim(0, end)
        how = f" (median per {TIMELINE_BINS} time bins)" if len(seconds) > 2 * TIMELINE_BINS else ""
        ax.set_title(f"{run.name}: step timeline{how}")
        ax.set_xlabel("seconds since the first summarised step")
        ax.set_ylabel("ms")
        finite = [v[np.isfinite(v)] for v in binned.values()]
        top = max((float(v.max()) for v in finite if len(v)), default=1.0) or 1.0
        ax.set_ylim(0, top * 1.35)  # room for the legend above the lines
        ax.legend(loc="upper right", fontsize="small", ncols=4)
    return fig


def _bin(seconds: np.ndarray, series: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Points to draw, with NaN in the gaps (between load levels) so that no line bridges them."""
    if len(seconds) <= 2 * TIMELINE_BINS:
        if len(seconds) < 3:
            return seconds, series
        step = np.diff(seconds)
        gaps = np.flatnonzero(step > 10 * np.median(step)) + 1
        if len(gaps) == 0:
            return seconds, series
        return np.insert(seconds, gaps, np.nan), {k: np.insert(v, gaps, np.nan) for k, v in series.items()}
    edges = np.linspace(seconds.min(), seconds.max(), TIMELINE_BINS + 1)
    which = np.clip(np.searchsorted(edges, seconds, side="right") - 1, 0, TIMELINE_BINS - 1)
    frame = pd.DataFrame(series).groupby(which).median().reindex(range(TIMELINE_BINS))  # empty bins: NaN
    centers = (edges[:-1] + edges[1:]) / 2
    return centers, {k: frame[k].to_numpy() for k in series}


def _mark_levels(ax, levels: list[dict], t0: int, last: float) -> None:
    for i, level in enumerate(sorted(levels, key=lambda lv: lv["start_ns"])):
        if level.get("end_ns") is None:
            continue
        start, end = (level["start_ns"] - t0) / 1e9, min((level["end_ns"] - t0) / 1e9, last)
        if end <= 0 or start >= last:
            continue
        ax.axvspan(start, end, color="0.5", alpha=0.08 if i % 2 else 0.16, linewidth=0)
        ax.annotate(f"{level['concurrency']} req", xy=(start, 1.0), xycoords=("data", "axes fraction"),
                    xytext=(2, -12), textcoords="offset points", fontsize="small")  # fmt: skip


def _scatter(runs: list[PlotRun]):
    fig, axes = _figure(1, len(runs), height=6.0)
    rng = np.random.default_rng(0)
    for ax, run in zip(axes, runs, strict=True):
        steps = run.steps
        gpu, gpu_name = _gpu_values(steps)
        busy = steps["busy_ms"].to_numpy(dtype="float64")
        has = np.isfinite(gpu)
        pick = np.flatnonzero(has)
        if len(pick) > SCATTER_POINTS:
            pick = np.sort(rng.choice(pick, SCATTER_POINTS, replace=False))
        if "concurrency" in steps.columns and steps["concurrency"].notna().any():
            level = steps["concurrency"].to_numpy(dtype="float64", na_value=np.nan)[pick]
            for value, color in zip(np.unique(level[np.isfinite(level)]), COLORS * 10, strict=False):
                mine = level == value
                ax.scatter(busy[pick][mine], gpu[pick][mine], s=4, alpha=0.5, color=color,
                           label=f"{int(value)} req")  # fmt: skip
        elif len(pick):
            ax.scatter(busy[pick], gpu[pick], s=4, alpha=0.5, color=COLORS[0], label="steps")
        top = float(np.nanmax([busy[pick].max(initial=0.0), gpu[pick].max(initial=0.0)])) * 1.05 or 1.0
        ax.plot([0, top], [0, top], color="black", linewidth=1, linestyle="--", label="CPU busy = GPU")
        ax.set_xlim(0, top)
        ax.set_ylim(0, top)
        ax.set_xlabel("CPU busy ms per step")
        ax.set_ylabel(f"{gpu_name} ms per step")
        note = "" if len(pick) else " (no GPU times in this run)"
        ax.set_title(f"{run.name}: CPU busy vs {gpu_name} per step{note}")
        ax.legend(loc="upper left", fontsize="small")
    return fig


def _groups(runs: list[PlotRun]):
    fig, axes = _figure(len(runs), height=4.5)
    from overshoot.report.sections import label_columns

    names = label_columns([g for run in runs for g in run.report["groups"]])
    colors = dict(zip([*names, "wait"], COLORS, strict=False))
    for ax, run in zip(axes, runs, strict=True):
        groups = run.report["groups"]
        x = np.arange(len(groups))
        bottom = np.zeros(len(groups))
        for name in names:
            heights = np.array([_label_ms(g, name, names) for g in groups])
            if heights.any():
                ax.bar(x - 0.2, heights, 0.4, bottom=bottom, label=f"busy: {name}", color=colors[name])
            bottom += heights
        wait = np.array([g["wait_ms_median"] or 0.0 for g in groups])
        ax.bar(x - 0.2, wait, 0.4, bottom=bottom, label="wait", color=colors["wait"], alpha=0.6)
        idle = np.array([_idle_ms(g) for g in groups])
        # GPU idle, split by the host work the thread was in where kernel records tell (else one bar)
        split = np.array([[_idle_share(g, name, names) for name in names] for g in groups]).reshape(
            len(groups), len(names))
        rest = np.clip(1.0 - split.sum(axis=1), 0.0, 1.0)
        top = np.zeros(len(groups))
        for k, name in enumerate(names):
            heights = idle * split[:, k]
            if heights.any():
                ax.bar(x + 0.2, heights, 0.4, bottom=top, color=colors[name], hatch="//", alpha=0.5)
            top += heights
        ax.bar(x + 0.2, idle * rest, 0.4, bottom=top, label="GPU idle (hatched: by host work)", color="0.3",
               hatch="//", alpha=0.5)
        ax.set_xticks(x, [_short(g) for g in groups], rotation=30 if len(groups) > 6 else 0, fontsize="small")
        ax.set_ylabel("ms per step")
        tallest = max(float((bottom + wait).max(initial=0.0)), float(idle.max(initial=0.0)), 1e-3)
        ax.set_ylim(0, tallest * 1.4)  # room for the legend above the bars
        ax.set_title(f"{run.name}: per group, CPU busy by label and wait (left), GPU idle by host work "
                     "(right)")
        ax.legend(loc="upper left", fontsize="small", ncols=4)
    return fig


def _label_ms(group: dict, name: str, names: list[str]) -> float:
    rows = group.get("busy_by_label") or []
    if name == "other labels":
        return sum(r["ms"] for r in rows if r["label"] not in names)
    return next((r["ms"] for r in rows if r["label"] == name), 0.0)


def _idle_share(group: dict, name: str, names: list[str]) -> float:
    """Share of the group's GPU idle spent while the thread was in busy label `name` (0: no split)."""
    rows = group.get("gpu_idle_by_label") or []
    if name == "other labels":
        return sum(r["share_pct"] for r in rows if r["label"] not in names) / 100.0
    return next((r["share_pct"] for r in rows if r["label"] == name), 0.0) / 100.0


def _idle_ms(group: dict) -> float:
    """GPU idle per step: the group's time-weighted idle share of its median step."""
    if group.get("gpu_idle_pct") is None or group.get("step_ms_median") is None:
        return 0.0
    return group["gpu_idle_pct"] / 100.0 * group["step_ms_median"]


def _short(group: dict) -> str:
    level = group.get("concurrency")
    head = f"{level} req\n" if level is not None else ""
    return f"{head}{group['phase']}\nbatch {group['batch_size']}"
