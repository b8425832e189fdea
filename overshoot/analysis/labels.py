"""CPU busy time by label: which labelled work (schedule, prepare, launch, update, ...) fills each group's
busy time (docs/concepts.md, "Busy time by label").

Each instant of a step's busy time belongs to the innermost busy span covering it (its *exclusive* time), so
nested spans never count twice; time inside a wait span is wait, not busy, whatever is nested in it; busy time
that no busy span covers (hook and loop code between the hooked calls) is "unlabelled". Per group the split
reported is that of the median step: each label's share of the group's total busy time times the group's
median busy ms, so the labels add up to the median busy time exactly.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

UNLABELLED = "unlabelled"


def exclusive_busy(spans: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """(step, label code, exclusive busy ns) of each busy span of one timeline that holds busy time of its
    own, and the label names the codes index. `spans`: one timeline's spans, in recording order.

    Labels are factorised on the string column itself: a million steps' spans never become Python objects.
    """
    step = spans["step"].to_numpy(dtype="int64")
    kind = spans["kind"]
    is_busy = (kind == "busy").to_numpy(dtype=bool)
    is_wait = (kind == "wait").to_numpy(dtype=bool)
    dur = spans["dur_ns"].to_numpy(dtype="int64")
    # Spans inside steps; zero-length ones hold no time (and would confuse the nesting depth below).
    keep = (step >= 0) & (is_busy | is_wait) & (dur > 0)
    codes, uniques = pd.factorize(spans["label"])
    names = [str(u) for u in uniques]
    if (codes < 0).any():  # a span without a label
        codes = np.where(codes < 0, len(names), codes)
        names.append(UNLABELLED)
    start = spans["start_ns"].to_numpy(dtype="int64")
    if not keep.all():
        step, is_busy, is_wait, dur, codes, start = (
            a[keep] for a in (step, is_busy, is_wait, dur, codes, start)
        )
    end = start + dur
    if len(start) < 2 or np.all(start[1:] >= end[:-1]):
        # The usual case: no span inside another, so a busy span's own time is all of it.
        return step[is_busy], codes[is_busy], dur[is_busy], names
    own, under_wait = _nesting(start, end, is_wait)
    counted = is_busy & ~under_wait & (own > 0)
    return step[counted], codes[counted], own[counted], names


def _nesting(start: np.ndarray, end: np.ndarray, is_wait: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exclusive ns of each span (its duration minus its direct children's) and whether a wait span encloses
    it. Spans come from a stack, so they nest properly; vectorised by nesting depth (at most a few levels)."""
    order = np.lexsort((-end, start))  # by start; of two spans starting together, the enclosing one first
    s, e = start[order], end[order]
    n = len(s)
    # Spans sorted before i that ended by i's start do not enclose it; all others before it do.
    depth = np.arange(n) - np.searchsorted(np.sort(e), s, side="right")
    child_ns = np.zeros(n, "int64")
    under_wait = np.zeros(n, bool)
    wait_sorted = is_wait[order]
    rows_at = [np.flatnonzero(depth == d) for d in range(int(depth.max(initial=0)) + 1)]
    for d in range(1, len(rows_at)):
        parents, children = rows_at[d - 1], rows_at[d]
        if len(children) == 0 or len(parents) == 0:
            continue
        parent = parents[np.maximum(np.searchsorted(parents, children) - 1, 0)]
        np.add.at(child_ns, parent, e[children] - s[children])
        under_wait[children] = under_wait[parent] | wait_sorted[parent]
    own = np.empty(n, "int64")
    own[order] = np.maximum(e - s - child_ns, 0)
    enclosed = np.empty(n, bool)
    enclosed[order] = under_wait
    return own, enclosed


def busy_by_label(
    steps: pd.DataFrame, spans: pd.DataFrame | None, groups: pd.DataFrame, keys: list[str]
) -> list[list[dict]]:
    """Per row of `groups` (the summary's groups, keyed by `keys`): the busy time by label of its steps, as
    [{label, ms, share_pct, mean_ms}], largest share first; `ms` is the label's part of the median busy ms.

    `steps`: the summarised steps of one timeline (warm-up and steps outside the levels already dropped);
    `spans`: that timeline's spans.
    """
    out: list[list[dict]] = [[] for _ in range(len(groups))]
    if len(steps) == 0 or len(groups) == 0:
        return out
    group_of_step = group_rows(steps, groups, keys)
    n_groups = len(groups)
    listed = group_of_step >= 0
    busy = steps["busy_ms"].to_numpy()[listed] * 1e6
    busy_ns = np.bincount(group_of_step[listed], weights=busy, minlength=n_groups)
    count = np.bincount(group_of_step[listed], minlength=n_groups)
    names: list[str] = []
    labelled = np.zeros((n_groups, 0))
    if spans is not None and len(spans):
        span_step, codes, own, names = exclusive_busy(spans)
        pos = _positions(steps["step"].to_numpy(dtype="int64"), span_step)
        kept = pos >= 0
        kept[kept] = group_of_step[pos[kept]] >= 0
        flat = group_of_step[pos[kept]] * len(names) + codes[kept]
        totals = np.bincount(flat, weights=own[kept], minlength=n_groups * len(names))
        labelled = totals.reshape(n_groups, len(names))
    # Busy time no busy span covers; a few ns below zero are clock rounding.
    table = np.column_stack([labelled, np.maximum(busy_ns - labelled.sum(axis=1), 0.0)])
    names = [*names, UNLABELLED]
    medians = groups["busy_ms_median"].to_numpy(dtype="float64")
    for g in range(n_groups):
        denominator = float(table[g].sum())
        if denominator <= 0 or count[g] == 0:
            continue
        by_name: dict[str, float] = {}
        for name, ns in zip(names, table[g], strict=True):  # a label named "unlabelled" merges with ours
            if ns > 0:
                by_name[name] = by_name.get(name, 0.0) + float(ns)
        rows = [
            {
                "label": name,
                "ms": float(medians[g]) * ns / denominator,
                "share_pct": 100.0 * ns / denominator,
                "mean_ms": ns / 1e6 / int(count[g]),
            }
            for name, ns in by_name.items()
        ]
        out[g] = sorted(rows, key=lambda r: -r["share_pct"])
    return out


def _positions(step_numbers: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Row of each wanted step number in `step_numbers` (-1: absent). A recorder numbers its steps 0, 1, 2..,
    so a lookup table indexed by step number does (no hashing, no search); anything else goes through a
    hash index."""
    if len(step_numbers) == 0 or len(wanted) == 0:
        return np.full(len(wanted), -1, "int64")
    low, high = int(step_numbers.min()), int(step_numbers.max())
    if low >= 0 and high < 4 * len(step_numbers) + 1024:
        table = np.full(high + 2, -1, "int64")  # the last slot answers for step numbers out of range
        table[step_numbers] = np.arange(len(step_numbers))
        return table[np.where((wanted >= 0) & (wanted <= high), wanted, high + 1)]
    index = pd.Index(step_numbers)
    if not index.is_unique:  # one timeline numbers its steps once; be safe anyway
        index = index.where(~index.duplicated(), -(2**62))
    return index.get_indexer(wanted)


def group_rows(steps: pd.DataFrame, groups: pd.DataFrame, keys: list[str]) -> np.ndarray:
    """Row of `groups` of each step (-1: in no listed group). Factorises the few distinct key tuples, then
    matches them by merge, so it does not depend on the order the summary lists its groups in."""
    codes = []
    for key in keys:
        c, _ = pd.factorize(steps[key], sort=False, use_na_sentinel=False)
        codes.append(c.astype("int64"))
    sizes = [int(c.max(initial=0)) + 1 for c in codes]
    combined = np.ravel_multi_index(codes, sizes) if len(keys) > 1 else codes[0]
    distinct, first, inverse = np.unique(combined, return_index=True, return_inverse=True)
    heads = steps[keys].iloc[first].reset_index(drop=True)
    heads["_head"] = np.arange(len(distinct))
    targets = groups[keys].reset_index(drop=True).assign(_row=np.arange(len(groups)))
    matched = heads.merge(targets, on=keys, how="left")
    row_of_head = np.full(len(distinct), -1, "int64")
    found = matched["_row"].notna().to_numpy()
    row_of_head[matched["_head"].to_numpy()[found]] = matched["_row"].to_numpy()[found].astype("int64")
    return row_of_head[inverse.reshape(-1)]
