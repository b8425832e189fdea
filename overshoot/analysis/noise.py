"""Is a difference between two runs outside the noise? A percentile bootstrap, vectorised with numpy.

Each run's steps of a group are resampled with replacement (the same resample indices serve every metric of
that group, so metrics stay consistent with each other), each resample gives the group's figures (median step,
busy and GPU ms, CPU-bound share, GPU idle share), and the 2.5th and 97.5th percentiles of B's figure minus
A's over the resamples bound the delta. A delta is outside the noise when that interval excludes zero.
Groups larger than MAX_POINTS steps are bootstrapped on a random subsample of that size (seeded): the interval
gets wider, never narrower, so "outside the noise" stays a safe claim.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

RESAMPLES = 400
MAX_POINTS = 5_000
CONFIDENCE = 0.95
SEED = 0
MIN_STEPS = 10  # fewer steps in either run: no interval
METHOD = (
    f"percentile bootstrap, {RESAMPLES} resamples of each run's steps per group (at most {MAX_POINTS:,}), "
    f"seed {SEED}, {CONFIDENCE:.0%} interval"
)
# metric -> (statistic, relative delta in % or difference in points)
METRICS = {
    "step_ms_median": ("median:step_ms", True),
    "busy_ms_median": ("median:busy_ms", True),
    "gpu_ms_median": ("median:gpu_ms", True),
    "cpu_bound_pct": ("share:cpu_bound", False),
    "gpu_idle_pct": ("idle", False),
}


def group_samples(steps: pd.DataFrame, rows: np.ndarray, n_groups: int) -> list[dict[str, np.ndarray]]:
    """Per group row, the per-step columns the bootstrap needs (`rows`: each step's group row, -1: none)."""
    columns = {
        "step_ms": steps["step_ms"].to_numpy(dtype="float64"),
        "busy_ms": steps["busy_ms"].to_numpy(dtype="float64"),
        "gpu_ms": steps["gpu_ms"].to_numpy(dtype="float64"),
        "cpu_bound": steps["cpu_bound"].to_numpy(dtype="float64"),
        "idle": steps["gpu_idle_before_ms"].to_numpy(dtype="float64"),
    }
    order = np.argsort(rows, kind="stable")
    bounds = np.searchsorted(rows[order], np.arange(-1, n_groups) + 0.5)
    out = []
    for g in range(n_groups):
        pick = order[bounds[g] : bounds[g + 1]]
        out.append({name: values[pick] for name, values in columns.items()})
    return out


def _statistic(name: str, sample: dict[str, np.ndarray], idx: np.ndarray) -> np.ndarray | None:
    """The statistic over each resample (rows of `idx`); None when the data cannot give it."""
    kind, _, column = name.partition(":")
    if kind == "median":
        values = sample[column]
        if np.isnan(values).all():
            return None
        drawn = values[idx]
        return np.median(drawn, axis=1) if not np.isnan(values).any() else np.nanmedian(drawn, axis=1)
    if kind == "share":
        return 100.0 * sample[column][idx].mean(axis=1)
    # GPU idle share, time-weighted like the report: idle before the steps over those steps' durations.
    has_gpu = ~np.isnan(sample["gpu_ms"])
    if not has_gpu.any():
        return None
    idle = np.nan_to_num(sample["idle"])[idx].sum(axis=1)
    span = np.where(has_gpu, sample["step_ms"], 0.0)[idx].sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return 100.0 * idle / span


def _resample(n: int, rng: np.random.Generator) -> np.ndarray:
    if n > MAX_POINTS:
        base = rng.choice(n, MAX_POINTS, replace=False)
        return base[rng.integers(0, MAX_POINTS, size=(RESAMPLES, MAX_POINTS))]
    return rng.integers(0, n, size=(RESAMPLES, n))


def delta_intervals(a: dict[str, np.ndarray], b: dict[str, np.ndarray], rng: np.random.Generator) -> dict:
    """metric -> (low, high) interval of B vs A (relative % or points, as the compare table shows it), or
    None where either run has too few steps or lacks the data."""
    n_a, n_b = len(a["step_ms"]), len(b["step_ms"])
    if min(n_a, n_b) < MIN_STEPS:
        return dict.fromkeys(METRICS)
    idx_a, idx_b = _resample(n_a, rng), _resample(n_b, rng)
    out: dict[str, tuple[float, float] | None] = {}
    for metric, (statistic, relative) in METRICS.items():
        sa, sb = _statistic(statistic, a, idx_a), _statistic(statistic, b, idx_b)
        if sa is None or sb is None:
            out[metric] = None
            continue
        with np.errstate(divide="ignore", invalid="ignore"):
            delta = 100.0 * (sb / sa - 1.0) if relative else sb - sa
        delta = delta[np.isfinite(delta)]
        if len(delta) < RESAMPLES // 2:
            out[metric] = None
            continue
        tail = (1.0 - CONFIDENCE) / 2 * 100
        low, high = np.percentile(delta, [tail, 100 - tail])
        out[metric] = (float(low), float(high))
    return out


def beyond_noise(interval: tuple[float, float] | None) -> bool | None:
    if interval is None:
        return None
    low, high = interval
    return low > 0 or high < 0


def summary_samples(summary) -> list[dict[str, np.ndarray]]:
    """group_samples of a Summary, one entry per row of summary.groups."""
    from overshoot.analysis.labels import group_rows

    rows = group_rows(summary.steps, summary.groups, summary.group_keys)
    return group_samples(summary.steps, rows, len(summary.groups))
