"""`load_run`: one run directory (meta.json, every recorder's spool, client.parquet) into DataFrames.

pandas is imported only inside `load_run`. Damaged chunks do not fail the load; `Run.warnings` says what
was lost.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from overshoot.rundir.meta import META_NAME, SPOOL_NAME, RunDirError, read_meta

if TYPE_CHECKING:
    import pandas as pd


@dataclass
class Run:
    path: Path
    run_id: str
    meta: dict
    processes: list[dict]
    steps: pd.DataFrame
    spans: pd.DataFrame
    gpu: pd.DataFrame
    client: pd.DataFrame | None = None
    # Kernel timing (empty without it): one row per kernel/copy, and the windows in which all were recorded.
    kernels: pd.DataFrame | None = None
    kernel_windows: pd.DataFrame | None = None
    warnings: list[str] = field(default_factory=list)

    def __repr__(self) -> str:
        return (
            f"Run({self.run_id!r}, steps={len(self.steps)}, spans={len(self.spans)}, gpu={len(self.gpu)}, "
            f"kernels={0 if self.kernels is None else len(self.kernels)}, "
            f"processes={len(self.processes)}, warnings={len(self.warnings)})"
        )



def _read_processes(spool_dir: Path, warnings: list[str]) -> list[dict]:
    processes = []
    for path in sorted(spool_dir.glob("*.json")):
        if path.name.startswith("."):
            continue
        try:
            processes.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            warnings.append(f"{SPOOL_NAME}/{path.name}: unreadable recorder info, ignored")
    return processes


# Written by the recorder for every row, so never null: these stay plain numpy int64.
_NEVER_NULL = {"step", "start_ns", "end_ns", "wait_ns", "dur_ns", "pid", "gpu_start_ns", "gpu_end_ns"}


def _to_pandas(table) -> pd.DataFrame:
    """Arrow -> pandas keeping integers integers: the never-null core columns are numpy int64; int32 facts
    (batch_size, num_tokens) are pandas Int32, integer extra facts Int64 and bool facts boolean, all
    nullable, instead of turning into floats where a value is missing."""
    import pandas as pd
    import pyarrow as pa

    def mapper(arrow_type):
        if arrow_type == pa.int32():
            return pd.Int32Dtype()
        if pa.types.is_boolean(arrow_type):
            return pd.BooleanDtype()
        return None

    frame = table.to_pandas(types_mapper=mapper)
    for column in table.schema:
        if pa.types.is_integer(column.type) and column.type != pa.int32() and column.name not in _NEVER_NULL:
            frame[column.name] = table.column(column.name).to_pandas(types_mapper=lambda _: pd.Int64Dtype())
    return frame


def load_run(path: str | os.PathLike) -> Run:
    """Read a run directory (meta.json, every recorder's spool, client.parquet) into one `Run`.

    Damaged chunks do not fail the load: their readable part is kept and `run.warnings` says what was lost.
    Raises RunDirError with a one-line message when there is nothing usable.
    """
    import pandas as pd
    import pyarrow as pa

    from overshoot.rundir.spool import read_table

    run_path = Path(path)
    if not run_path.exists():
        raise RunDirError(f"run dir not found: {run_path}")
    if not run_path.is_dir():
        raise RunDirError(f"not a directory: {run_path}")
    spool_dir = run_path / SPOOL_NAME
    if not spool_dir.is_dir() and not (run_path / META_NAME).is_file():
        raise RunDirError(f"not an overshoot run dir (no meta.json or spool/): {run_path}")
    meta = read_meta(run_path)
    warnings: list[str] = []
    processes = _read_processes(spool_dir, warnings) if spool_dir.is_dir() else []
    frames: dict[str, pd.DataFrame] = {}
    try:
        for table in ("steps", "spans", "gpu", "kernels", "kernel_windows"):
            # One table at a time: its Arrow copy is freed before the next one is read (peak memory).
            frames[table] = _to_pandas(read_table(spool_dir, table, warnings))
    except (OSError, pa.ArrowException) as e:
        raise RunDirError(f"cannot read spool of {run_path}: {e}") from None
    if len(frames["steps"]) == 0:
        detail = f" ({warnings[0]})" if warnings else ""
        raise RunDirError(f"no steps recorded in {run_path}{detail}")
    client = None
    client_path = run_path / "client.parquet"
    if client_path.is_file():
        try:
            client = pd.read_parquet(client_path)
        except (OSError, pa.ArrowException, ValueError) as e:
            warnings.append(f"client.parquet: unreadable ({e}), ignored")
    return Run(
        path=run_path,
        run_id=run_path.resolve().name,
        meta=meta,
        processes=processes,
        steps=frames["steps"],
        spans=frames["spans"],
        gpu=frames["gpu"],
        kernels=frames["kernels"],
        kernel_windows=frames["kernel_windows"],
        client=client,
        warnings=warnings,
    )
