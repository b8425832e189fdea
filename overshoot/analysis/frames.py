"""Helpers shared by the analysis modules and the report: pandas "str" columns without a Python object per
row, JSON-safe scalars, and which step rows are a multi-rank engine's workers."""

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
