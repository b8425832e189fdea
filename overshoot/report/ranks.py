"""The report's per-rank section: per group of a multi-rank engine, which rank finished each step last, by
how much, and each rank's busy, collective-wait and compute time (analysis/ranks.py)."""

from __future__ import annotations

from rich.console import Console

from overshoot.analysis.frames import plain
from overshoot.report.fmt import fmt_num, pct, report_table


def rank_groups(summary, title_of) -> list[dict] | None:
    """JSON rows of the per-rank section, or None for a single-rank engine."""
    ranks = summary.ranks
    if ranks is None:
        return None
    rows = []
    for row in ranks.groups.to_dict("records"):
        clean = {k: plain(v) if k != "per_rank" else v for k, v in row.items()}
        clean["per_rank"] = [{"rank": r, **v} for r, v in sorted((row["per_rank"] or {}).items())]
        clean["title"] = title_of(clean, summary.group_keys)
        rows.append(clean)
    return rows


def render_ranks(report: dict, console: Console) -> None:
    groups = report.get("ranks")
    if not groups:
        return
    table = report_table("per rank: the slowest rank (most compute), what it cost the others (imbalance: "
                         "their wait in collectives), the finish spread and its clock bound")
    for name in ("group", "steps", "slowest", "in", "imbalance", "spread", "bound", "rank", "busy",
                 "collective", "compute"):
        table.add_column(name, justify="left" if name == "group" else "right")
    for g in groups:
        unresolved = (g.get("unresolved_pct") or 0) >= 50
        spread = "unresolved" if unresolved else fmt_num(g["spread_ms_median"])
        bound = "?" if g["spread_error_ms"] is None else fmt_num(g["spread_error_ms"], ".4f")
        for i, r in enumerate(g["per_rank"]):
            head = [g["title"], str(g["steps"]), f"rank {g['slowest_rank']}", f"{g['slowest_pct']:.0f}%",
                    fmt_num(g["imbalance_ms_median"]), spread, bound]
            table.add_row(*(head if i == 0 else [""] * len(head)), str(r["rank"]), fmt_num(r["busy_ms"]),
                          fmt_num(r["collective_ms"]), fmt_num(r["compute_ms"]))
    console.print(table)
    console.print("(ms, medians a step)", highlight=False)
    render_rank_gpus(groups, console)


def render_rank_gpus(groups: list[dict], console: Console) -> None:
    """Each rank's own GPU from its kernel records (analysis/rank_gpu.py), where any rank has them."""
    if not any(r.get("gpu_cycles") for g in groups for r in g["per_rank"]):
        return
    table = report_table("per rank GPU, from each rank's own kernel records: busy ms a step cycle (from one "
                         "step's start to the next's), of it in collective kernels (waiting for the other "
                         "ranks), idle share of the cycle, what the worker was in while its GPU idled")
    for name in ("group", "rank", "cycles", "GPU busy", "in collectives", "GPU idle", "idle mostly in"):
        table.add_column(name, justify="left" if name in ("group", "idle mostly in") else "right")
    for g in groups:
        for i, r in enumerate(g["per_rank"]):
            top = (r.get("gpu_idle_by_label") or [None])[0]
            where = f"{top['label']} {pct(top['share_pct'])}" if top else "-"
            table.add_row(g["title"] if i == 0 else "", str(r["rank"]), str(r.get("gpu_cycles") or 0),
                          fmt_num(r.get("gpu_busy_ms")), fmt_num(r.get("collective_kernels_ms")),
                          pct(r.get("gpu_idle_pct")), where)
    console.print(table)
