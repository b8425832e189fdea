"""`overshoot report`: the summary as a plain dict (what --json prints) and its rich rendering."""

from __future__ import annotations

import numpy as np
import pandas as pd
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from overshoot.analysis.analyze import CPU_BOUND_SHARE, NEVER_WAITED_MS, Summary, group_title, summarize
from overshoot.analysis.frames import plain
from overshoot.analysis.kernels import MIN_STEPS_FOR_INTERVAL
from overshoot.analysis.whatif import WhatIf
from overshoot.report import sections
from overshoot.report.fmt import estimate_range, fmt_num, pct, report_table, signed
from overshoot.report.ranks import rank_groups, render_ranks
from overshoot.report.verdict import rank_lines, top_lines

DEFAULT_WHAT_IFS = [WhatIf("gpu", -0.10), WhatIf("cpu", -0.10)]


def build_report(run, **options) -> dict:
    """The report alone (analyse's keyword options)."""
    return analyse(run, **options)[0]


def analyse(
    run,
    *,
    what_ifs: list[WhatIf] | None = None,
    cpu_bound_ms: float = NEVER_WAITED_MS,
    cpu_bound_share: float = CPU_BOUND_SHARE,
    warmup_steps: int = 0,
    mode: str | None = None,
    projections: bool = True,
) -> tuple[dict, Summary]:
    """The report (a plain dict, what --json prints) and the summary it was built from (its steps serve
    compare's bootstrap and the plots). `projections=False` skips the what-ifs (check and plot need none,
    and the replay is the slow part at scale)."""
    what_ifs = (list(what_ifs) if what_ifs else list(DEFAULT_WHAT_IFS)) if projections else []
    summary = summarize(
        run, cpu_bound_ms=cpu_bound_ms, cpu_bound_share=cpu_bound_share, warmup_steps=warmup_steps, mode=mode,
        what_ifs=what_ifs,
    )
    groups = []
    for row in summary.groups.to_dict("records"):
        row = {k: plain(v) for k, v in row.items()}
        changes = {w.label: row.pop(f"whatif:{w.label}") for w in what_ifs}
        row["title"] = group_title(row, summary.group_keys)
        row["what_if_pct"] = changes
        row["verdict"] = _verdict(row, what_ifs, summary.mode.mode)
        groups.append(row)
    client = client_stats(run.client)
    idle_note = sections.add_sections(groups, run=run, summary=summary)
    status = (run.meta or {}).get("status")
    ranks = rank_groups(summary, group_title)
    report = {
        "run_id": run.run_id,
        "status": status,
        "status_line": sections.status_line(status),
        "engine": (run.meta or {}).get("engine") or next((p.get("engine") for p in run.processes), None),
        "mode": summary.mode.mode,
        "mode_source": summary.mode.source,
        "cpu_bound_ms": cpu_bound_ms,
        "cpu_bound_share": cpu_bound_share,
        "warmup_steps": warmup_steps,
        "primary": {"pid": summary.primary[0], "thread": summary.primary[1]},
        "group_keys": summary.group_keys,
        "what_ifs": [w.label for w in what_ifs],
        "groups": groups,
        "top_lines": top_lines(groups, [w.label for w in what_ifs]) + rank_lines(ranks),
        "levels": sections.levels(summary, client),
        "crossover": sections.crossover(groups),
        "client": client,
        "ranks": ranks,
        "hook_problems": hook_problems(run),
        "notes": [*summary.notes, *filter(None, [sections.own_cost(run, summary)])],
        "gpu_idle_by_label_note": idle_note,
        "warnings": list(run.warnings),
    }
    return report, summary


def hook_problems(run) -> list[dict]:
    """Hooks that were disabled or failed, one entry per (target, role): {target, role, status, reason}.

    From meta.json["hooks"] (written by `overshoot run`: every process's statuses), else from the recorders'
    process json (a server started with the hooks by hand). A target counts as it fared best in any process
    (as `overshoot run` prints it): "disabled" when no process installed it; "failed" when it is installed
    but part of it was switched off at run time (its facts or GPU events raised, status "installed" with a
    reason). Targets still pending (their module never imported) are not problems of the hooks.
    """
    meta_hooks = (run.meta or {}).get("hooks")
    if isinstance(meta_hooks, list):
        entries = meta_hooks
    else:
        entries = [dict(h, pid=p.get("pid")) for p in run.processes for h in p.get("hooks") or []]
    rank = {"installed": 0, "pending": 1, "disabled": 2}
    best: dict[tuple, dict] = {}
    for e in entries:
        if not isinstance(e, dict):
            continue
        key = (e.get("target", "?"), e.get("role", ""))
        if key not in best or rank.get(e.get("status"), 3) < rank.get(best[key].get("status"), 3):
            best[key] = e
    problems = []
    for (target, role), e in best.items():
        status, reason = e.get("status"), e.get("reason") or ""
        if status == "installed" and reason:
            status = "failed"
        if status in ("disabled", "failed"):
            problems.append({"target": target, "role": role, "status": status, "reason": reason})
    return problems


def hooks_line(problems: list[dict]) -> str:
    """The one line under the report's table: 'hooks disabled or failed (2): T (busy) disabled: why; ...'."""
    items = [
        f"{p['target']} ({p['role']}) {p['status']}: {p['reason'] or 'no reason given'}" for p in problems
    ]
    return f"hooks disabled or failed ({len(items)}): " + "; ".join(items)


def _too_few(row: dict) -> str:
    """'; too few for an interval' where the group's GPU busy estimate rests on fewer instrumented steps than
    its 95% interval needs (so no range is given)."""
    n = row.get("gpu_busy_steps")
    return "; too few for an interval" if n is not None and n < MIN_STEPS_FOR_INTERVAL else ""


def _verdict(row: dict, what_ifs: list[WhatIf], mode: str) -> str:
    """One line per group: the verdict (GPU starved), the thread's view, GPU idle and where it was known."""
    idle, inside = row["gpu_idle_pct"], row.get("gpu_idle_in_step_pct")
    if row["cpu_bound_pct"] is None:
        parts = ["CPU-bound unknown (no GPU times)"]
    else:
        parts = [f"{pct(row['cpu_bound_pct'])} of steps CPU-bound{estimate_range(row, 'cpu_bound_pct')}"]
    if mode == "sync" and row["cpu_share_pct"] is not None:
        parts.insert(0, f"CPU busy {pct(row['cpu_share_pct'])} of the step")
    parts.append(f"the thread never waited in {pct(row['thread_never_waited_pct'])}")
    if idle is None:
        parts.append("GPU idle n/a (no GPU times)")
    elif row.get("gpu_timing") == "borrowed":
        lenders = row.get("gpu_busy_steps")
        source = f"{lenders:.0f} instrumented steps" if lenders is not None else "the instrumented steps"
        source += " of its phase and batch size elsewhere in the run"
        busy = fmt_num(row.get("gpu_busy_ms_median"))
        parts.append(f"GPU idle {pct(idle)}{estimate_range(row, 'gpu_idle_pct', brief=True)} (between and "
                     f"inside steps, from GPU busy {busy} ms a step borrowed from {source}{_too_few(row)})")
    elif inside is None:
        parts.append(f"GPU idle {pct(idle)} (between steps; inside them unknown: CUDA events only)")
    else:
        busy = row.get("gpu_busy_ms_median")
        source = row["gpu_timing"]
        if source == "sampled":  # how much kernel data the figures rest on
            source = f"sampled: {row.get('kernel_steps')} of {row['steps']} steps instrumented{_too_few(row)}"
        parts.append(f"GPU idle {pct(idle)}{estimate_range(row, 'gpu_idle_pct', brief=True)} ({pct(inside)} "
                     f"inside steps, GPU busy {fmt_num(busy)} ms a step, {source})")
    for w in what_ifs:
        change = row["what_if_pct"][w.label]
        if change is not None:
            parts.append(w.describe(change))
    return f"{row['title']}: " + "; ".join(parts)


def client_stats(client: pd.DataFrame | None) -> list[dict]:
    """Per concurrency level: requests, errors, latency and TTFT (median, p90, p99), inter-token latency over
    every gap of the level's requests (p50, p90, p99), output tokens/s."""
    if client is None or len(client) == 0:
        return []
    rows = []
    for level, df in client.groupby("concurrency", sort=True):
        ok = df[df["ok"].astype(bool)]
        window_s = (df["end_ns"].max() - df["start_ns"].min()) / 1e9
        tokens = int(ok["completion_tokens"].sum())
        per_request = ok["completion_tokens"] / (ok["latency_ms"] / 1e3)
        itl = _level_gaps(ok)
        itl_p50, itl_p90, itl_p99 = np.percentile(itl, [50, 90, 99]) if len(itl) else (None,) * 3
        rows.append(
            {
                k: plain(v)
                for k, v in {
                    "concurrency": int(level),
                    "requests": len(df),
                    "errors": int(len(df) - len(ok)),
                    "latency_ms_median": ok["latency_ms"].median(),
                    "latency_ms_p90": ok["latency_ms"].quantile(0.9),
                    "ttft_ms_median": ok["ttft_ms"].median(),
                    "ttft_ms_p90": ok["ttft_ms"].quantile(0.9),
                    "ttft_ms_p99": ok["ttft_ms"].quantile(0.99),
                    "itl_ms_p50": itl_p50,
                    "itl_ms_p90": itl_p90,
                    "itl_ms_p99": itl_p99,
                    "output_tokens": tokens,
                    "tokens_per_s": tokens / window_s if window_s > 0 else None,
                    "tokens_per_s_per_request": per_request.median(),
                }.items()
            }
        )
    return rows


def _level_gaps(ok: pd.DataFrame) -> np.ndarray:
    """Every inter-token gap of a level's requests (runs recorded before the column existed have none)."""
    if "itl_ms" not in ok.columns:
        return np.empty(0)
    parts = [np.asarray(gaps, dtype=np.float64) for gaps in ok["itl_ms"] if gaps is not None and len(gaps)]
    return np.concatenate(parts) if parts else np.empty(0)


def render(report: dict, console: Console, *, by_label: bool = False) -> None:
    if report.get("status_line"):  # first: every figure below is partial
        console.print(report["status_line"], highlight=False, markup=False, style="bold")
    for line in report.get("top_lines") or []:
        console.print(f"verdict: {line}", highlight=False, markup=False)
    table = _groups_table(report, report["what_ifs"])
    wide = console.options.update_width(10_000)  # measure unclamped: Measurement caps at the options width
    narrow = report["what_ifs"] and Measurement.get(console, wide, table).maximum > console.width
    if narrow:  # the what-if numbers are also in the verdict lines: drop them before any number is cut
        table = _groups_table(report, [])
    console.print(table)
    if narrow:
        console.print("(what-if columns left out at this width: see the lines below, or widen the terminal)",
                      highlight=False)
    if report.get("hook_problems"):  # right under the table: these numbers lack what those hooks measure
        console.print(hooks_line(report["hook_problems"]), highlight=False, markup=False)
    if any(g.get("gpu_busy_ms_median") is None and g["gpu_ms_median"] is not None for g in report["groups"]):
        console.print("GPU ms*: the step's GPU interval (two CUDA events), gaps between kernels included; "
                      "in step ?: GPU idle inside steps unknown without kernel timing", highlight=False)
    for g in report["groups"]:
        console.print(f"- {g['verdict']}", highlight=False)
    if by_label:
        sections.render_by_label(report, console)
    sections.render_sweep(report, console)
    render_ranks(report, console)
    if report["client"]:
        console.print(_client_table(report["client"]))
    for note in report["notes"]:
        console.print(f"[dim]note: {note}[/dim]", highlight=False)


def _groups_table(report: dict, what_ifs: list[str]) -> Table:
    keys = report["group_keys"]
    title = f"overshoot report: {report['run_id']}" + (
        f" ({report['engine']})" if report.get("engine") else ""
    )
    table = report_table(title)
    if "concurrency" in keys:
        table.add_column("level", justify="right", no_wrap=True)
    for name in (
        "phase",
        "batch",
        "steps",
        "step\nms",
        "p90\nms",
        "busy\nms",
        "wait\nms",
        "GPU\nms",
        "CPU-\nbound",
        "GPU\nidle",
        "in\nstep",
    ):
        table.add_column(name, justify="left" if name == "phase" else "right", no_wrap=True)
    drafts = any(g.get("spec_tokens_mean") for g in report["groups"])  # only for speculating engines
    if drafts:
        table.add_column("drafts\n/step", justify="right", no_wrap=True)
        table.add_column("taken\n/step", justify="right", no_wrap=True)
    for label in what_ifs:
        table.add_column(f"step if\n{label}", justify="right", no_wrap=True)
    for g in report["groups"]:
        cells = [_level_cell(g)] if "concurrency" in keys else []
        cells += [
            g["phase"],
            str(g["batch_size"]),
            str(g["steps"]),
            fmt_num(g["step_ms_median"]),
            fmt_num(g["step_ms_p90"]),
            fmt_num(g["busy_ms_median"]),
            fmt_num(g["wait_ms_median"]),
            _gpu_cell(g),
            pct(g["cpu_bound_pct"]),
            pct(g["gpu_idle_pct"]),
            "?" if g.get("gpu_idle_in_step_pct") is None and g["gpu_idle_pct"] is not None
            else pct(g.get("gpu_idle_in_step_pct")),
        ]
        if drafts:
            cells += [fmt_num(g.get(key), ".1f") for key in ("spec_tokens_mean", "accepted_tokens_mean")]
        cells += [signed(g["what_if_pct"][label], ".1f", "%") for label in what_ifs]
        table.add_row(*cells)
    return table


def _gpu_cell(group: dict) -> str:
    """GPU busy a step from kernel records; without them the CUDA-event interval, marked '*' (it holds the
    gaps between kernels)."""
    if group.get("gpu_busy_ms_median") is not None:
        return fmt_num(group["gpu_busy_ms_median"])
    return "-" if group["gpu_ms_median"] is None else fmt_num(group["gpu_ms_median"]) + "*"


def _level_cell(group: dict) -> str:
    if group.get("concurrency") is None:
        return "warm-up" if group.get("load_window") == "warmup" else "-"
    return str(group["concurrency"])


def _client_table(rows: list[dict]) -> Table:
    table = report_table("client side, per concurrency level (ms; ITL: inter-token latency)")
    columns = {
        "level": ("concurrency", "d"),
        "requests": ("requests", "d"),
        "errors": ("errors", "d"),
        "latency": ("latency_ms_median", ".1f"),
        "TTFT": ("ttft_ms_median", ".1f"),
        "TTFT\np90": ("ttft_ms_p90", ".1f"),
        "ITL\np50": ("itl_ms_p50", ".2f"),
        "ITL\np90": ("itl_ms_p90", ".2f"),
        "ITL\np99": ("itl_ms_p99", ".2f"),
        "output\ntok/s": ("tokens_per_s", ".1f"),
        "tok/s per\nrequest": ("tokens_per_s_per_request", ".1f"),
    }
    for name in columns:
        table.add_column(name, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(*(fmt_num(r.get(key), fmt) for key, fmt in columns.values()))
    return table
