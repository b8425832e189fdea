"""Parts of `overshoot report` beside the groups table: the run's status line, busy time by label per group
(`--by-label`), the load sweep per level with its crossover."""

from __future__ import annotations

import numpy as np
from rich.console import Console

from overshoot.analysis import idle, labels, sweep
from overshoot.analysis.analyze import Summary
from overshoot.analysis.frames import codes_and_names, timeline_spans
from overshoot.report.fmt import fmt_num, pct, report_table

MAX_LABEL_COLUMNS = 8  # more labels than this: the smallest are shown together as "other labels"
STATUS_LINES = {
    "interrupted": "interrupted run (meta.json status 'interrupted'): the figures cover what was recorded "
    "before the interruption",
    "failed": "failed run (meta.json status 'failed'): the figures cover what was recorded before the "
    "failure",
    "starting": "unfinished run (meta.json status 'starting'): `overshoot run` never finished it (killed, or "
    "still running); the figures cover what was flushed so far",
}


def status_line(status: str | None) -> str | None:
    """The report's first line when the run did not end normally (None: it did, or no status recorded)."""
    if status in (None, "ok"):
        return None
    return STATUS_LINES.get(status, f"run status {status!r} in meta.json: the figures may be partial")


def add_sections(groups: list[dict], *, run, summary: Summary) -> str | None:
    """Adds each group's busy time by label (key busy_by_label) and GPU idle by host work (key
    gpu_idle_by_label: empty without kernel records) to the report's group dicts. Returns why the idle
    split is empty although the run has kernel records, if it is."""
    spans = timeline_spans(run.spans, *summary.primary)
    split = labels.busy_by_label(summary.steps, spans, summary.groups, summary.group_keys)
    idle_split = _idle_split(run, summary)
    for group, rows, idle_entry in zip(groups, split, idle_split, strict=True):
        group["busy_by_label"] = rows
        group["gpu_idle_by_label"] = idle_entry["rows"]
        group["gpu_idle_by_label_steps"] = idle_entry["steps"]
        group["gpu_idle_by_label_borrowed"] = idle_entry["borrowed"]
    kernels = getattr(run, "kernels", None)
    if any(e["rows"] for e in idle_split) or kernels is None or len(kernels) == 0:
        return None
    if not (kernels["pid"].to_numpy() == summary.primary[0]).any():
        return (f"GPU idle by host work: the kernel records come from other processes than the primary "
                f"timeline's (pid {summary.primary[0]}: e.g. an engine core whose workers launch the "
                "kernels); the split covers the primary timeline's process only")
    return ("GPU idle by host work: no summarised step lies inside a kernel-timing window after its first "
            "kernel started (the GPU's state is known from there)")


def _idle_split(run, summary: Summary) -> list[dict]:
    """GPU idle by host work per group (idle.split_by_group) over the whole primary timeline: a group's own
    summarised steps, or, where none of them is instrumented, its phase and batch size's anywhere else."""
    timeline = summary.timeline if summary.timeline is not None else summary.steps
    # (primary_idle orders the steps by start, stably: the same order for the mask of summarised ones)
    order = np.argsort(timeline["start_ns"].to_numpy(), kind="stable")
    summarised = timeline.index.isin(summary.steps.index)[order]
    known = idle.primary_idle(run, timeline, summary.primary)
    steps, groups, keys = known.steps, summary.groups, summary.group_keys
    empty = np.zeros(0, "int64")
    own = np.where(summarised, labels.group_rows(steps, groups, keys), -1) if len(steps) else empty
    pool_keys = [k for k in keys if k != "concurrency"]
    if pool_keys and len(steps) and len(groups):
        pools = groups[pool_keys].drop_duplicates().reset_index(drop=True)
        pool = labels.group_rows(steps, pools, pool_keys)
        group_pool = labels.group_rows(groups, pools, pool_keys)
    else:
        pool, group_pool = np.full(len(steps), -1, "int64"), np.full(len(groups), -1, "int64")
    return idle.split_by_group(known, np.asarray(own, "int64"), pool, group_pool, len(groups))


def own_cost(run, summary: Summary) -> str | None:
    """What overshoot itself cost the primary timeline's thread, from its own spans (`overshoot:*`: flushes
    between steps, kernel timing's switches) against the summarised steps' time, and what the kernel
    timing windows cost the run as the sampler measured it. None when nothing of the kind was recorded."""
    spans = timeline_spans(run.spans, *summary.primary)
    parts = []
    if spans is not None and len(spans):
        # by label code: the distinct labels are a handful, the spans millions (no string per span)
        codes, names = codes_and_names(spans["label"])
        steps_ms = float(summary.steps["step_ms"].sum()) if len(summary.steps) else 0.0
        dur = spans["dur_ns"].to_numpy()
        for code, name in enumerate(names):
            if not str(name).startswith("overshoot:"):
                continue
            mine = codes == code
            if not mine.any():  # (a categorical keeps the labels of every timeline)
                continue
            ms = float(dur[mine].sum()) / 1e6
            share = f", {100 * ms / steps_ms:.2f}% of the steps' time" if steps_ms > 0 else ""
            parts.append(f"{str(name).removeprefix('overshoot:')} {int(mine.sum())}x, {ms:.1f} ms{share}")
    timing = [p.get("kernel_timing") or {} for p in run.processes if p.get("pid") == summary.primary[0]]
    costs = [t["cost_pct"] for t in timing if t.get("cost_pct") is not None]
    if costs:
        parts.append(f"kernel-timing windows {costs[0]:.2f}% of the run (the sampler's measure)")
    if not parts:
        return None
    return "overshoot's own work on the engine thread, outside the steps: " + "; ".join(parts)


def levels(summary: Summary, client: list[dict]) -> list[dict]:
    return sweep.level_rows(summary, client)


def crossover(groups: list[dict]) -> dict | None:
    return sweep.crossover(groups)


def label_columns(groups: list[dict], key: str = "busy_by_label") -> list[str]:
    """Labels of the groups' `key` split in order of their time over all groups (step-weighted), at most
    MAX_LABEL_COLUMNS (the smallest then as "other labels")."""
    weight: dict[str, float] = {}
    for g in groups:
        for r in g.get(key) or []:
            weight[r["label"]] = weight.get(r["label"], 0.0) + _label_ms(g, r) * g["steps"]
    ordered = sorted(weight, key=lambda k: -weight[k])
    if len(ordered) > MAX_LABEL_COLUMNS:
        ordered = [*ordered[: MAX_LABEL_COLUMNS - 1], "other labels"]
    return ordered


def _label_ms(group: dict, row: dict) -> float:
    """A split row's ms a step; an idle row without one (no step known whole) by its share of the group's
    GPU idle a step, for the columns' order only."""
    if row["ms"] is not None:
        return row["ms"]
    idle = (group.get("gpu_idle_pct") or 0.0) / 100.0 * (group.get("step_ms_median") or 0.0)
    return row["share_pct"] / 100.0 * idle


def render_by_label(report: dict, console: Console) -> None:
    groups = [g for g in report["groups"] if g.get("busy_by_label")]
    if not groups:
        console.print("busy by label: no labelled busy spans recorded", highlight=False)
    else:
        _label_table(groups, "busy_by_label", "CPU busy by label: ms of the median busy (share of busy)",
                     console, busy=True)
    groups = [g for g in report["groups"] if g.get("gpu_idle_by_label")]
    if not groups:
        why = report.get("gpu_idle_by_label_note") or ("GPU idle by host work: no kernel records (record "
                                                        "with --gpu-timing sampled or kernels)")
        console.print(why, highlight=False)
    else:  # what the engine thread was in while the GPU idled (instrumented steps)
        shown = [{**g, "title": f"{g['title']} (borrowed)"} if g.get("gpu_idle_by_label_borrowed") else g
                 for g in groups]
        _label_table(shown, "gpu_idle_by_label",
                     "GPU idle by host work, instrumented steps: ms a step (share of the GPU idle)", console)
        lent = [g for g in groups if g.get("gpu_idle_by_label_borrowed")]
        if lent:  # no instrumented step of its own: its phase and batch size's elsewhere (sampled mode)
            which = ", ".join(f"{g['title']} ({sum(g['gpu_idle_by_label_steps'])} steps)" for g in lent)
            console.print(f"borrowed: {which}: no instrumented step of the group's own; the split is that of "
                          "the instrumented steps of its phase and batch size elsewhere in the run (the "
                          "warm-up, other load levels)", highlight=False)
        partial = [g["title"] for g in groups if not (g.get("gpu_idle_by_label_steps") or [1])[0]]
        if partial:  # one-step windows: the GPU's state before the step's first kernel is unknown
            console.print(f"-: no step of {', '.join(partial)} has its GPU state known whole (one-step "
                          "windows); its shares count the part after each step's first kernel started",
                          highlight=False)


def _label_table(groups: list[dict], key: str, title: str, console: Console, *, busy: bool = False) -> None:
    """A group per row, a label per column (label_columns) of the groups' `key` split: ms (share)."""
    names = label_columns(groups, key)
    table = report_table(title)
    table.add_column("group", justify="left", no_wrap=True)
    if busy:
        table.add_column("busy\nms", justify="right", no_wrap=True)
    for name in names:
        table.add_column(name, justify="right", overflow="fold")
    shown = set(names) - {"other labels"}
    for g in groups:
        by = {r["label"]: r for r in g[key]}
        rest = [r for label, r in by.items() if label not in shown]
        if "other labels" in names:
            ms = [r["ms"] for r in rest]
            by["other labels"] = {
                "ms": None if None in ms else sum(ms), "share_pct": sum(r["share_pct"] for r in rest)
            }
        cells = [f"{fmt_num(by[n]['ms'])} {pct(by[n]['share_pct'])}" if n in by else "-" for n in names]
        table.add_row(g["title"], *([fmt_num(g["busy_ms_median"])] if busy else []), *cells)
    console.print(table)


def render_sweep(report: dict, console: Console) -> None:
    """The load sweep per level and its crossover line (runs with two levels or more)."""
    rows = report.get("levels") or []
    if len(rows) >= 2:
        console.print(sweep_table(rows, title="load sweep: all steps of each level"))
    if report.get("crossover"):
        console.print(report["crossover"]["text"], highlight=False, markup=False)


def sweep_table(rows: list[dict], *, title: str, requests: dict[int, str] | None = None):
    """Per level: steps, median step, CPU busy and GPU ms, CPU-bound and GPU idle shares, output tokens/s
    (also the live view of `overshoot run`, which adds a requests column)."""
    table = report_table(title)
    names = ["level", *(["requests"] if requests is not None else []), "steps", "step\nms", "busy\nms",
             "GPU\nms", "CPU-\nbound", "GPU\nidle", "output\ntok/s"]  # fmt: skip
    for name in names:
        table.add_column(name, justify="right", no_wrap=True)
    for r in rows:
        gpu = r.get(sweep.gpu_column(r))
        cells = [str(r["concurrency"])]
        if requests is not None:
            cells.append(requests.get(r["concurrency"], "-"))
        cells += [
            str(r["steps"]),
            fmt_num(r["step_ms_median"]),
            fmt_num(r["busy_ms_median"]),
            fmt_num(gpu),
            pct(r["cpu_bound_pct"]),
            pct(r["gpu_idle_pct"]),
            fmt_num(r["tokens_per_s"], ".1f"),
        ]
        table.add_row(*cells)
    return table
