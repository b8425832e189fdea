"""`overshoot check`: limits on a run (and against a baseline run) for CI pipelines; one line per broken
limit.

Limits apply per group (level, phase, batch size) with at least `min_steps` steps, so that a handful of
ramp-up steps cannot fail a pipeline. The regression limit compares each group's median step with the
baseline's same group: the point estimate decides, and the line carries the bootstrap interval of the delta
(analysis/noise.py) so that a break inside the noise is visible as such. A limit on a figure the run does not
have (CPU-bound or GPU idle without GPU times) breaks with a line saying so: it cannot pass unchecked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from overshoot.report.fmt import estimate_range, fmt_num, signed

_PCT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%?\s*$")


@dataclass(frozen=True, kw_only=True)
class Limits:
    max_cpu_bound_pct: float | None = None
    max_gpu_idle_pct: float | None = None
    max_regression_pct: float | None = None
    min_steps: int = 20

    def any(self) -> bool:
        return any(v is not None for v in (self.max_cpu_bound_pct, self.max_gpu_idle_pct,
                                           self.max_regression_pct))  # fmt: skip


def parse_pct(text: str | None, option: str) -> float | None:
    """'10%' or '10' -> 10.0; raises ValueError with a one-line message."""
    if text is None:
        return None
    match = _PCT.match(text)
    if not match:
        raise ValueError(f"bad {option} {text!r}: expected a percentage like 10%")
    return float(match.group(1))


@dataclass
class Outcome:
    broken: list[str]
    checked: int  # groups checked
    skipped: int  # groups below min_steps
    summary: str  # one line for a passing check


def check(report: dict, limits: Limits, *, compared: list[dict] | None = None) -> Outcome:
    """Apply `limits` to a report (and to its compare rows against a baseline, for the regression limit)."""
    broken: list[str] = []
    groups = [g for g in report["groups"] if g["steps"] >= limits.min_steps]
    skipped = len(report["groups"]) - len(groups)
    for g in groups:
        value, limit = g["cpu_bound_pct"], limits.max_cpu_bound_pct
        if limit is not None and value is None:  # a gate that passes on missing data gates nothing
            broken.append(f"{g['title']}: CPU-bound unknown (no GPU times), so --max-cpu-bound {limit:g}% "
                          "cannot be checked")  # fmt: skip
        elif limit is not None and value > limit:
            spread = estimate_range(g, "cpu_bound_pct")
            broken.append(f"{g['title']}: {fmt_num(value, '.1f')}% of steps CPU-bound{spread}, above "
                          f"--max-cpu-bound {limit:g}%")  # fmt: skip
        value, limit = g["gpu_idle_pct"], limits.max_gpu_idle_pct
        if limit is not None and value is None:
            broken.append(f"{g['title']}: GPU idle unknown (no GPU times), so --max-gpu-idle {limit:g}% "
                          "cannot be checked")
        elif limit is not None and value > limit:
            spread = estimate_range(g, "gpu_idle_pct")
            broken.append(f"{g['title']}: GPU idle {fmt_num(value, '.1f')}%{spread}, above --max-gpu-idle "
                          f"{limit:g}%")
    compared_groups = 0
    if limits.max_regression_pct is not None and compared is not None:
        for row in compared:
            step = row["step_ms_median"]
            if row["in"] != "both" or not _enough(row["title"], groups):
                continue
            compared_groups += 1
            if step["delta"] is not None and step["delta"] > limits.max_regression_pct:
                broken.append(_regression_line(row["title"], step, limits.max_regression_pct))
    parts = [f"{len(groups)} groups within the limits"]
    if compared is not None:
        parts.append(f"{compared_groups} compared with the baseline")
    if skipped:
        parts.append(f"{skipped} groups under {limits.min_steps} steps not checked")
    return Outcome(broken, len(groups), skipped, "ok: " + ", ".join(parts))


def _enough(title: str, groups: list[dict]) -> bool:
    return any(g["title"] == title for g in groups)


def _regression_line(title: str, step: dict, limit: float) -> str:
    line = (
        f"{title}: median step {fmt_num(step['a'])} -> {fmt_num(step['b'])} ms "
        f"({signed(step['delta'], '.1f', '%')}), above --max-regression {limit:g}%"
    )
    if step["interval"] is not None:
        low, high = step["interval"]
        where = "outside the noise" if step["beyond_noise"] else "inside the noise"
        line += f" (95% interval {signed(low, '.1f')}..{signed(high, '.1f')}%, {where})"
    return line
