"""Helpers shared by the analysis modules and the report: pandas "str" columns without a Python object per
row, string tests through a column's few distinct values, per-step reductions of span values, JSON-safe
scalars, and which step rows are a multi-rank engine's workers."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

_STR = pd.api.types.pandas_dtype("str")  # what dtype="str" means in this pandas


def str_column(names: list[str], codes: np.ndarray) -> pd.Series:
    """names[codes] as dtype "str". When "str" is Arrow-backed (pandas >= 3) it is built by Arrow, a take
    from the few names: pd.Series(value, index=..., dtype="str") goes through a Python object per row
    (~0.1 s per million rows)."""
    if getattr(_STR, "storage", None) != "pyarrow":  # older pandas or Python-backed strings
        return pd.Series(np.asarray(names, dtype=object)[codes], dtype="str")
    import pyarrow as pa

    return pd.Series(pd.array(pa.array(names, pa.large_string()).take(pa.array(codes)), dtype=_STR))


def codes_and_names(column: pd.Series) -> tuple[np.ndarray, pd.Index]:
    """Integer codes of a string column's values (-1: null) and the distinct values they index: a
    categorical's own (the spool's dictionary columns, rundir/spool.py), else factorised."""
    if isinstance(column.dtype, pd.CategoricalDtype):
        return column.cat.codes.to_numpy(), column.cat.categories
    codes, uniques = pd.factorize(column)
    return codes, pd.Index(uniques)


def as_str(column: pd.Series, fill: str | None = None) -> pd.Series:
    """A string column as dtype "str", nulls filled with `fill` (kept null without one). A categorical goes
    through its codes (str_column), not a Python string per row."""
    if not isinstance(column.dtype, pd.CategoricalDtype):
        column = column if fill is None else column.fillna(fill)
        return column if column.dtype == _STR else column.astype("str")
    codes, names = codes_and_names(column)
    names = [str(name) for name in names]
    if fill is not None and (codes < 0).any():
        codes = np.where(codes < 0, len(names), codes)
        names.append(fill)
    if (codes < 0).any():
        return pd.Series(pd.Categorical.from_codes(codes, names)).astype("str")
    return str_column(names, codes)


def timeline_spans(spans: pd.DataFrame | None, pid: int, thread: str) -> pd.DataFrame | None:
    """The spans of one timeline (pid, thread) of a run's spans table (the table itself when it holds no
    other, None or empty as given)."""
    if spans is None or len(spans) == 0:
        return spans
    mine = (spans["pid"].to_numpy() == pid) & (spans["thread"] == thread).to_numpy()
    return spans if mine.all() else spans[mine]


def contains(column: pd.Series, text: str) -> np.ndarray:
    """Per row: the string holds `text` (a regular expression), ignoring case (False where null). Tested once
    per distinct value (a span label column has a handful among millions of rows), then spread to the rows by
    code."""
    codes, names = codes_and_names(column)
    hit = pd.Series(names).str.contains(text, case=False, na=False)
    return np.append(hit.to_numpy(dtype=bool), False)[codes]  # code -1 (null): the appended False


def positions(values: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """pd.Index(values).get_indexer(targets) (-1: not found). Integer values in strictly increasing order
    (the steps of a timeline) take a binary search instead of a hash table over a million steps."""
    values, targets = np.asarray(values), np.asarray(targets)
    if len(values) == len(targets) and np.array_equal(values, targets) and _increasing(values):
        return np.arange(len(values))  # (every step has a value, in order: the usual case)
    if (len(values) and values.dtype.kind in "iu" and targets.dtype.kind in "iu"
            and _increasing(values)):
        pos = np.minimum(np.searchsorted(values, targets), len(values) - 1)
        return np.where(values[pos] == targets, pos, -1)
    return pd.Index(values).get_indexer(targets)


def _increasing(values: np.ndarray) -> bool:
    return bool(np.all(values[1:] > values[:-1]))


def run_starts(values: np.ndarray) -> np.ndarray:
    """First index of every run of equal consecutive values (rows sorted by a key come in such runs)."""
    values = np.asarray(values)
    if len(values) == 0:
        return np.zeros(0, "int64")
    return np.flatnonzero(np.concatenate([[True], values[1:] != values[:-1]]))


def per_step(step: np.ndarray, values: np.ndarray, how: str) -> tuple[np.ndarray, np.ndarray]:
    """Distinct steps (ascending) and the smallest (`how` "min") or largest ("max") value of each. Spans are
    recorded in time order, so their steps normally come in runs: one reduceat over the runs instead of a
    hash group-by."""
    if len(step) and np.all(step[1:] > step[:-1]):  # one value a step
        return step, values
    if len(step) and np.all(step[1:] >= step[:-1]):
        starts = run_starts(step)
        ufunc = np.minimum if how == "min" else np.maximum
        return step[starts], ufunc.reduceat(values, starts)
    reduced = pd.Series(values).groupby(step).agg(how)
    return reduced.index.to_numpy(), reduced.to_numpy()


def plain(value):
    """A JSON-safe scalar: numpy -> Python, NaN/NA -> None."""
    if value is None or value is pd.NA:
        return None
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def worker_rows(steps: pd.DataFrame) -> np.ndarray:
    """Per row: a step of a multi-rank engine's worker (it carries a rank fact; analysis/ranks.py)."""
    if "rank" not in steps.columns:
        return np.zeros(len(steps), bool)
    return pd.to_numeric(steps["rank"], errors="coerce").notna().to_numpy()


# What the report's groups (and the kernel figures' plain-step estimates) are keyed by, where present.
GROUP_KEYS = ("concurrency", "phase", "batch_size")


def group_keys(df: pd.DataFrame) -> list[str]:
    return [k for k in GROUP_KEYS if k in df.columns]


def group_ids(df: pd.DataFrame, keys: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Group id per row (groups in sorted key order, nulls last) and the first row of each group."""
    codes, sizes = [], []
    for key in keys:
        c, uniques = pd.factorize(df[key], sort=True, use_na_sentinel=False)
        codes.append(c)
        sizes.append(max(len(uniques), 1))
    combined = np.ravel_multi_index(codes, sizes) if len(keys) > 1 else codes[0]
    # The combined codes are small and dense: number the present ones by counting, not by sorting rows.
    present = np.flatnonzero(np.bincount(combined, minlength=1))
    number = np.zeros(int(combined.max(initial=0)) + 1, "int64")
    number[present] = np.arange(len(present))
    group_id = number[combined]
    first_row = np.full(len(present), len(df), "int64")
    np.minimum.at(first_row, group_id, np.arange(len(df)))
    return group_id, first_row
