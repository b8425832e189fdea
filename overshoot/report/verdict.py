"""The report's top lines: per group, is it CPU-bound and by how much, which labelled CPU work fills it (or,
with kernel records, what the thread was in while the GPU idled), and
the change with the largest projected gain (from the what-ifs the report ran). Before the table, so the
answer to "what do I change?" comes first; the table and the notes hold the evidence.

Without GPU data (a CPU-only run) the verdict is unknown and the line says so instead of calling every step
CPU-bound. A group counts as CPU-bound when at least half its steps are (docs/concepts.md).
"""

from __future__ import annotations

from overshoot.report.fmt import fmt_num, pct

MOST_GROUPS = 4  # top lines for the groups with the most steps; the table has the rest
CPU_BOUND_GROUP_PCT = 50.0


def top_lines(groups: list[dict], what_ifs: list[str]) -> list[str]:
    ranked = sorted(groups, key=lambda g: -(g.get("steps") or 0))
    lines = [_line(g, what_ifs) for g in ranked[:MOST_GROUPS]]
    if len(ranked) > MOST_GROUPS:
        lines.append(f"({len(ranked) - MOST_GROUPS} more groups in the table)")
    return lines


def rank_lines(ranks: list[dict] | None) -> list[str]:
    """Per group of a multi-rank engine whose ranks recorded kernels: the spread of the ranks' GPU idle and
    where the idlest rank's worker was while its GPU idled (analysis/rank_gpu.py)."""
    lines = []
    for g in ranks or []:
        known = [r for r in g["per_rank"] if r.get("gpu_idle_pct") is not None]
        if not known:
            continue
        least = min(known, key=lambda r: r["gpu_idle_pct"])
        most = max(known, key=lambda r: r["gpu_idle_pct"])
        line = (f"{g['title']}, each rank's own GPU: idle {pct(least['gpu_idle_pct'])} (rank "
                f"{least['rank']}) to {pct(most['gpu_idle_pct'])} (rank {most['rank']}) of its step cycle")
        top = (most.get("gpu_idle_by_label") or [None])[0]
        if top:
            line += (f"; rank {most['rank']}'s GPU idles most while its worker is in '{top['label']}' "
                     f"({pct(top['share_pct'])} of its idle)")
        lines.append(line)
    return lines


def _line(g: dict, what_ifs: list[str]) -> str:
    title = g["title"]
    if g.get("cpu_bound_pct") is None:
        share = pct(g.get("cpu_share_pct"))
        return f"{title}: no GPU data, so whether its steps are CPU-bound is unknown (CPU busy {share})"
    bound = g["cpu_bound_pct"] >= CPU_BOUND_GROUP_PCT
    parts = [f"{'CPU' if bound else 'GPU'}-bound: {pct(g['cpu_bound_pct'])} of steps CPU-bound"]
    low, high = g.get("cpu_bound_pct_low"), g.get("cpu_bound_pct_high")
    if low is not None and high is not None and (low >= CPU_BOUND_GROUP_PCT) != (high >= CPU_BOUND_GROUP_PCT):
        parts[0] += (f" ({low:.0f}-{high:.0f}% as the GPU busy estimate moves within its 95% interval: not "
                     "settled)")
    idle = g.get("gpu_idle_pct")
    if idle is not None:
        inside = g.get("gpu_idle_in_step_pct")
        where = "" if inside is not None else " between steps (inside them unknown)"
        parts.append(f"the GPU idles {pct(idle)} of each step{where}")
    label = _dominant_label(g)
    starved_in = max(g.get("gpu_idle_by_label") or [], key=lambda r: r["share_pct"], default=None)
    if bound and starved_in:  # kernel records: what the thread did while the GPU waited, not only its busy
        parts.append(f"the GPU idles most while the thread is in '{starved_in['label']}' "
                     f"({pct(starved_in['share_pct'])} of its idle"
                     f"{', borrowed' if g.get('gpu_idle_by_label_borrowed') else ''})")
    elif bound and label:
        parts.append(f"'{label['label']}' is {pct(label['share_pct'])} of CPU busy")
    best = _best_change(g, what_ifs)
    if best:
        parts.append(best)
    busy = g.get("gpu_busy_ms_median")
    if bound and busy is not None and g.get("step_ms_median"):
        step = fmt_num(g["step_ms_median"])
        parts.append(f"the GPU's own work is {fmt_num(busy)} ms of the {step} ms step")
    return f"{title}: " + "; ".join(parts)


def _dominant_label(g: dict) -> dict | None:
    labelled = [r for r in g.get("busy_by_label") or [] if r.get("label") != "unlabelled"]
    return max(labelled, key=lambda r: r.get("share_pct") or 0, default=None)


def _best_change(g: dict, what_ifs: list[str]) -> str | None:
    """The what-if with the largest projected shortening, and the others for scale."""
    changes = {w: g["what_if_pct"].get(w) for w in what_ifs if g["what_if_pct"].get(w) is not None}
    if not changes:
        return None
    best = min(changes, key=changes.get)
    if changes[best] >= -0.05:
        return "no projected change shortens its steps"
    rest = ", ".join(f"{w} {fmt_num(v, '+.1f')}%" for w, v in changes.items() if w != best)
    return f"largest gain: {best} -> steps {fmt_num(changes[best], '+.1f')}%" + (f" ({rest})" if rest else "")
