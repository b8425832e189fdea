"""`overshoot export RUN --dataset DIR`: a run as a hive-partitioned Parquet dataset, by run and rank.

DIR/<table>/run=<run id>/rank=<rank>/part-0.parquet for the tables steps, spans, gpu, kernels (when
recorded) and ranks (multi-rank engines: one row per engine step and rank, analysis/ranks.py). Timelines
of no rank (the engine core, a single-process engine) are rank=-1. Exporting another run into the same DIR
adds its partitions; exporting a run again replaces its own. DuckDB, pandas (pyarrow) and Spark read each
table folder as one table with `run` and `rank` columns.

Each partition is written by `pyarrow.parquet.write_table` to a temporary name and renamed into place, not by
`pyarrow.dataset.write_dataset`: that writer's thread pool can still be running when a short process such as
`overshoot export` exits, which aborts it (SIGABRT, "terminate called without an active exception"; seen
once in CI, not in 40 runs here; apache/arrow#36980).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import quote

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from overshoot.analysis.frames import worker_rows

NO_RANK = -1


class DatasetError(RuntimeError):
    """A dataset that cannot be written (one line)."""


def rank_of_timelines(steps: pd.DataFrame) -> dict[tuple[int, str], int]:
    """(pid, thread) -> rank, from the steps' rank fact (none: a single-rank engine's steps have no rank)."""
    if "rank" not in steps.columns:
        return {}
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
    for name, df in parts.items():
        table = pa.Table.from_pandas(df.reset_index(drop=True), preserve_index=False)  # one schema for all
        try:
            _write_partitions(table, out / name / f"run={quote(str(run.run_id), safe='')}")
        except (OSError, pa.ArrowException) as e:
            raise DatasetError(f"cannot write the dataset under {out}: {e}") from None
        written[name] = len(df)
    return written


def _write_partitions(table: pa.Table, run_dir: Path) -> None:
    """One folder per rank under `run_dir` (hive: rank=<n>), replacing what an earlier export left there."""
    for rank in sorted(set(table.column("rank").to_pylist())):
        folder = run_dir / f"rank={rank}"
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("*.parquet"):
            old.unlink()
        part = table.filter(pc.equal(table.column("rank"), rank)).drop_columns(["rank"])
        temporary = folder / ".part-0.parquet.tmp"
        pq.write_table(part, temporary)
        os.replace(temporary, folder / "part-0.parquet")
