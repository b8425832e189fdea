"""Is a difference between two runs outside the noise? A percentile bootstrap, vectorised with numpy.

For each run and group: the bootstrap distribution of each figure over RESAMPLES resamples of the group's
steps (with replacement); the 2.5th and 97.5th percentiles of B's figure minus A's (relative for times)
bound the delta, which is outside the noise when that interval excludes zero.

Resampling a million steps 400 times is not needed: a resample's median is an order statistic of uniform
draws mapped through the sorted steps, and the k-th of n uniform draws follows Beta(k, n - k + 1), so each
replicate's median costs one Beta draw after one sort; a resample's share of CPU-bound steps is a binomial
count. Both are exactly what resampling gives. The GPU idle share (a ratio of sums) is resampled for real,
from at most MAX_POINTS steps of the group (a seeded subsample: the interval gets wider, never narrower).
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
    f"percentile bootstrap of each run's steps per group, {RESAMPLES} resamples, seed {SEED}, "
    f"{CONFIDENCE:.0%} interval"
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
        "cpu_bound": steps["cpu_bound"].to_numpy(dtype="float64", na_value=np.nan),  # NA: unknown verdict
        "idle": steps["gpu_idle_ms"].to_numpy(dtype="float64"),  # the verdict's GPU idle (by source)
    }
    order = np.argsort(rows, kind="stable")
    bounds = np.searchsorted(rows[order], np.arange(-1, n_groups) + 0.5)
    out = []
    for g in range(n_groups):
        pick = order[bounds[g] : bounds[g + 1]]
        out.append({name: values[pick] for name, values in columns.items()})
    return out


def _median(values: np.ndarray, rng: np.random.Generator) -> np.ndarray | None:
    """Bootstrap replicates of the median (as np.median: the mean of the two middle values for even n)."""
    ordered = np.sort(values[~np.isnan(values)])
    n = len(ordered)
    if n == 0:
        return None
    h = (n + 1) // 2
    low = rng.beta(h, n - h + 1, RESAMPLES)  # the h-th smallest of n uniform draws
    at = lambda u: ordered[np.minimum((u * n).astype("int64"), n - 1)]  # noqa: E731
    if n % 2:
        return at(low)
    high = low + (1.0 - low) * rng.beta(1, n - h, RESAMPLES)  # the next one: the least of the n - h above
    return (at(low) + at(high)) / 2


def _share(flags: np.ndarray, rng: np.random.Generator) -> np.ndarray | None:
    flags = flags[~np.isnan(flags)]
    n = len(flags)
    if n == 0:
        return None
    return 100.0 * rng.binomial(n, float(flags.mean()), RESAMPLES) / n


def _idle_share(sample: dict[str, np.ndarray], rng: np.random.Generator) -> np.ndarray | None:
    """GPU idle share, time-weighted like the report: the steps' GPU idle over their durations."""
    has_gpu = ~np.isnan(sample["idle"])
    if not has_gpu.any():
        return None
    idle = np.nan_to_num(sample["idle"])
    span = np.where(has_gpu, sample["step_ms"], 0.0)
    n = len(idle)
    if n > MAX_POINTS:
        keep = rng.choice(n, MAX_POINTS, replace=False)
        idle, span, n = idle[keep], span[keep], MAX_POINTS
    idx = rng.integers(0, n, size=(RESAMPLES, n))
    with np.errstate(divide="ignore", invalid="ignore"):
        return 100.0 * idle[idx].sum(axis=1) / span[idx].sum(axis=1)


def _replicates(statistic: str, sample: dict[str, np.ndarray], rng: np.random.Generator) -> np.ndarray | None:
    kind, _, column = statistic.partition(":")
    if kind == "median":
        return _median(sample[column], rng)
    if kind == "share":
        return _share(sample[column], rng)
    return _idle_share(sample, rng)


def delta_intervals(a: dict[str, np.ndarray], b: dict[str, np.ndarray], rng: np.random.Generator) -> dict:
    """metric -> (low, high) interval of B vs A (relative % or points, as the compare table shows it), or
    None where either run has too few steps or lacks the data."""
    if min(len(a["step_ms"]), len(b["step_ms"])) < MIN_STEPS:
        return dict.fromkeys(METRICS)
    out: dict[str, tuple[float, float] | None] = {}
    for metric, (statistic, relative) in METRICS.items():
        sa, sb = _replicates(statistic, a, rng), _replicates(statistic, b, rng)
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
