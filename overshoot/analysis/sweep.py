"""A load sweep level by level: the figures of each concurrency level side by side (the report's sweep table
and the live view of `overshoot run` compute them with the same code) and the crossover, the level and batch
size at which steps turn from GPU-bound to CPU-bound (docs/concepts.md, "Load sweep and crossover").
"""

from __future__ import annotations

from overshoot.analysis.analyze import Summary, aggregate_levels
from overshoot.analysis.frames import plain

# A group whose steps are CPU-bound at least this often counts as CPU-bound for the crossover.
CROSSOVER_PCT = 50.0
LEVEL_FIELDS = (
    "steps", "step_ms_median", "busy_ms_median", "gpu_ms_median", "cpu_bound_pct", "gpu_idle_pct",
    "cpu_share_pct",
)  # fmt: skip


def gpu_column(row: dict) -> str:
    """The GPU time per step to put beside CPU busy: GPU busy (kernel data) where the run has it, else the
    interval between the step's GPU events."""
    return "gpu_busy_ms_median" if row.get("gpu_busy_ms_median") is not None else "gpu_ms_median"


def level_rows(summary: Summary, client: list[dict]) -> list[dict]:
    """One row per concurrency level over all its summarised steps, plus the client's output tokens/s."""
    table = aggregate_levels(summary)
    tokens = {r["concurrency"]: r.get("tokens_per_s") for r in client}
    fields = [f for f in (*LEVEL_FIELDS, "gpu_busy_ms_median") if f in table.columns]
    rows = []
    for record in table.to_dict("records"):
        level = int(record["concurrency"])
        row = {"concurrency": level, **{f: plain(record[f]) for f in fields}}
        row["tokens_per_s"] = plain(tokens.get(level))
        rows.append(row)
    return rows


def crossover(groups: list[dict], *, threshold_pct: float = CROSSOVER_PCT) -> dict | None:
    """Where steps turn CPU-bound across the levels of a sweep (None: fewer than two levels).

    Per level the group of the main phase (decode when there is one) with the most steps stands for the
    level; the crossover is the first level, by concurrency, whose group has `cpu_bound_pct` >= threshold.
    """
    leveled = [g for g in groups if g.get("concurrency") is not None and g.get("steps")]
    if len({g["concurrency"] for g in leveled}) < 2:
        return None
    phases = {g["phase"] for g in leveled}
    if "decode" in phases:
        phase = "decode"
    else:
        phase = max(phases, key=lambda p: sum(g["steps"] for g in leveled if g["phase"] == p))
    best: dict[int, dict] = {}
    for g in leveled:
        held = best.get(g["concurrency"])
        if g["phase"] == phase and (held is None or g["steps"] > held["steps"]):
            best[g["concurrency"]] = g
    rows = [
        {
            "concurrency": g["concurrency"],
            "batch_size": g["batch_size"],
            "steps": g["steps"],
            "cpu_bound_pct": g["cpu_bound_pct"],
            "busy_ms_median": g["busy_ms_median"],
            "gpu_ms_median": g[gpu_column(g)],
        }
        for _, g in sorted(best.items())
    ]
    bound = [r["cpu_bound_pct"] is not None and r["cpu_bound_pct"] >= threshold_pct for r in rows]
    turned = bound.index(True) if any(bound) else None
    result = {"phase": phase, "threshold_pct": threshold_pct, "level": None, "batch_size": None, "rows": rows}
    if turned is not None:
        result.update(level=rows[turned]["concurrency"], batch_size=rows[turned]["batch_size"])
    result["text"] = _sentence(phase, rows, turned, threshold_pct)
    return result


def _where(row: dict) -> str:
    noun = "request" if row["concurrency"] == 1 else "requests"
    return f"{row['concurrency']} {noun}, batch {row['batch_size']}"


def _share(row: dict) -> str:
    return "n/a" if row["cpu_bound_pct"] is None else f"{row['cpu_bound_pct']:.0f}%"


def _sentence(phase: str, rows: list[dict], turned: int | None, threshold: float) -> str:
    # A level without GPU times has no CPU-bound verdict: it is neither "under" the threshold nor the turn.
    unknown = [r for r in rows if r["cpu_bound_pct"] is None]
    if len(unknown) == len(rows):
        return f"crossover: unknown; no level's {phase} steps have GPU times, so none has a CPU-bound verdict"
    known = [r for r in rows if r["cpu_bound_pct"] is not None]
    gaps = "" if not unknown else f"; unknown at {_levels(unknown)} (no GPU times)"
    if turned is None:
        top = max(known, key=lambda r: r["cpu_bound_pct"])
        span = "every level" if not unknown else "every level with GPU times"
        return (
            f"crossover: none; {phase} steps stay under {threshold:g}% CPU-bound at {span} from "
            f"{known[0]['concurrency']} to {known[-1]['concurrency']} requests (most: {_share(top)} at "
            f"{_where(top)}){gaps}"
        )
    row = rows[turned]
    before = [r for r in rows[:turned] if r["cpu_bound_pct"] is not None]
    if not before:
        lowest = "the lowest level" if turned == 0 else "the lowest level with GPU times"
        return (
            f"crossover: {phase} steps are CPU-bound from {lowest} on: {_share(row)} of steps at "
            f"{_where(row)}{gaps}"
        )
    return (
        f"crossover: {phase} steps turn CPU-bound at {_where(row)} ({_share(row)} of steps), from "
        f"{_share(before[-1])} at {_where(before[-1])}{gaps}"
    )


def _levels(rows: list[dict]) -> str:
    levels = [str(r["concurrency"]) for r in rows]
    noun = "request" if levels == ["1"] else "requests"
    return f"{', '.join(levels)} {noun}"
