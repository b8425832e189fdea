"""`overshoot export RUN --dataset DIR`: a run as a hive-partitioned Parquet dataset, by run and rank.

DIR/<table>/run=<run id>/rank=<rank>/part-0.parquet for the tables steps, spans, gpu, kernels (when
recorded) and ranks (multi-rank engines: one row per engine step and rank, analysis/ranks.py). Timelines
of no rank (the engine core, a single-process engine) are rank=-1. Exporting another run into the same DIR
adds its partitions; exporting a run again replaces its own. DuckDB, pandas (pyarrow) and Spark read each
table folder as one table with `run` and `rank` columns.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds

from overshoot.analysis.frames import worker_rows

NO_RANK = -1


class DatasetError(RuntimeError):
    """A dataset that cannot be written (one line)."""


def rank_of_timelines(steps: pd.DataFrame) -> dict[tuple[int, str], int]:
    """(pid, thread) -> rank, from the steps' rank fact."""
    ranked = steps[worker_rows(steps)]
    first = ranked.groupby(["pid", "thread"], sort=False)["rank"].first()
    return {(int(p), str(t)): int(r) for (p, t), r in first.items()}


def _with_rank(df: pd.DataFrame, ranks: dict[tuple[int, str], int]) -> pd.DataFrame:
    keys = zip(df["pid"].astype("int64"), df["thread"].astype("str"), strict=True)
    rank = [ranks.get((p, t), NO_RANK) for p, t in keys]
    return df.drop(columns=["rank"], errors="ignore").assign(rank=pd.array(rank, dtype="int64"))


def export_dataset(run, out_dir: str | Path, *, tables: dict[str, pd.DataFrame],
                   rank_rows: pd.DataFrame | None) -> dict[str, int]:
    """Write the tables (each with pid and thread) and the per-rank rows under `out_dir`; rows per table."""
    out = Path(out_dir)
    ranks = rank_of_timelines(run.steps)
    written = {}
    parts = {name: _with_rank(df, ranks) for name, df in tables.items() if df is not None and len(df)}
    if rank_rows is not None and len(rank_rows):
        parts["ranks"] = rank_rows.assign(rank=rank_rows["rank"].astype("int64"))
    partitioning = ds.partitioning(pa.schema([("run", pa.string()), ("rank", pa.int64())]), flavor="hive")
    for name, df in parts.items():
        df = df.assign(run=run.run_id)
        table = pa.Table.from_pandas(df.reset_index(drop=True), preserve_index=False)
        try:
            ds.write_dataset(table, out / name, format="parquet", partitioning=partitioning,
                             existing_data_behavior="delete_matching",
                             basename_template="part-{i}.parquet")
        except (OSError, pa.ArrowException) as e:
            raise DatasetError(f"cannot write the dataset under {out}: {e}") from None
        written[name] = len(df)
    return written
