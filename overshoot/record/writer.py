"""The writing side of one recorder: its `{pid}-{tag}.json` and its chunks, built from the recorder's
Python-list buffers into Arrow arrays without pandas (overshoot/rundir/spool.py has the format and the
reader).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa

from overshoot.rundir.spool import (
    GPU_SCHEMA,
    KERNEL_WINDOWS_SCHEMA,
    KERNELS_SCHEMA,
    SPANS_SCHEMA,
    STEPS_SCHEMA,
    WORD,
    SpoolWriter,
    safe_tag,
    write_json_atomic,
)

# Arrays are built from raw buffers: `pa.array(list)` imports pandas (~0.5 s) on first use, which would stall
# the engine thread of a served process at its first flush. numpy costs nothing extra: pyarrow imports it.
_NUMPY_TYPES = {pa.int64(): np.int64, pa.int32(): np.int32, pa.float64(): np.float64, pa.bool_(): np.bool_}
BUILD_ERRORS = (pa.ArrowException, TypeError, ValueError, OverflowError, AttributeError)


def _validity(values: list) -> tuple[pa.Buffer | None, int]:
    nulls = values.count(None)
    if not nulls:
        return None, 0
    valid = np.fromiter((v is not None for v in values), np.bool_, len(values))
    return pa.py_buffer(np.packbits(valid, bitorder="little")), nulls


def column(values: list, arrow_type: pa.DataType, *, nullable: bool = True) -> pa.Array:
    """An Arrow array of int64/int32/float64/bool/string from a list (None = null), without pandas.
    nullable=False: the caller guarantees no None (skips a scan of the list; the recorder's clock columns)."""
    n = len(values)
    validity, nulls = _validity(values) if nullable else (None, 0)
    if nulls == n:
        return pa.nulls(n, arrow_type)
    if arrow_type == pa.string():
        if nulls:
            values = ["" if v is None else v for v in values]
        text = "".join(values)
        if text.isascii():  # the usual case (labels, phases): one C-level pass, no per-string bytes objects
            data, lengths = text.encode("ascii"), map(len, values)
        else:
            encoded = [v.encode() for v in values]
            data, lengths = b"".join(encoded), map(len, encoded)
        offsets = np.zeros(n + 1, np.int32)
        np.cumsum(np.fromiter(lengths, np.int32, n), out=offsets[1:])
        buffers = [validity, pa.py_buffer(offsets), pa.py_buffer(data)]
        return pa.Array.from_buffers(pa.string(), n, buffers, null_count=nulls)
    filled = values if not nulls else [0 if v is None else v for v in values]
    data = np.fromiter(filled, _NUMPY_TYPES[arrow_type], n)
    if arrow_type == pa.bool_():
        data = np.packbits(data, bitorder="little")
    return pa.Array.from_buffers(arrow_type, n, [validity, pa.py_buffer(data)], null_count=nulls)


def int_column(values, arrow_type: pa.DataType | None = None) -> pa.Array:
    """An Arrow int32/int64 array from a numpy array (or sequence of ints), built from its buffer: even
    `pa.array(ndarray)` imports pandas on first use, which the CUPTI drain thread must not do while holding
    the GIL (~0.3 s on the H200, 2026-12-04)."""
    arrow_type = arrow_type or pa.int32()
    data = np.ascontiguousarray(values, dtype={pa.int32(): np.int32, pa.int64(): np.int64}[arrow_type])
    return pa.Array.from_buffers(arrow_type, len(data), [None, pa.py_buffer(data)])


def _phase_column(phase: list) -> pa.Array:
    """Step phases; anything that is not a string (None: not given) is "unknown"."""
    if None not in phase:  # the usual case: every step set its phase (a C-level scan, no Python loop)
        try:
            return column(phase, pa.string(), nullable=False)
        except BUILD_ERRORS:
            pass
    return column([p if isinstance(p, str) else "unknown" for p in phase], pa.string(), nullable=False)


def _word(array: pa.Array) -> pa.Array:
    """A string column as the spool stores it: dictionary-encoded (spool.WORD)."""
    return array.dictionary_encode().cast(WORD)


def _ints(values: list | memoryview) -> pa.Array:
    """int64 column the recorder always fills (steps, clock times, durations): never null. The recorder's
    int64 buffers (a memoryview) are copied as they are."""
    if isinstance(values, memoryview):
        data = np.frombuffer(values, np.int64).copy()  # the recorder writes on into the buffer
        return pa.Array.from_buffers(pa.int64(), len(data), [None, pa.py_buffer(data)])
    return column(values, pa.int64(), nullable=False)


def _string_column(values: list) -> pa.Array:
    """Labels given by hooks are normally str; anything else is stored as its str()."""
    try:
        return column(values, pa.string())
    except BUILD_ERRORS:
        return column([None if v is None else str(v) for v in values], pa.string())


def _int_array(values: list, arrow_type: pa.DataType) -> pa.Array:
    try:
        return column(values, arrow_type)
    except BUILD_ERRORS:  # e.g. numpy/torch scalars or floats given as counts
        try:
            return column([None if v is None else int(v) for v in values], arrow_type)
        except BUILD_ERRORS:
            return pa.nulls(len(values), arrow_type)


def _infer_type(values: list) -> pa.DataType:
    """Arrow type of a fact column. Done here because pa.array's own inference imports pandas (~0.5 s) into
    the served process on the first flush."""
    kinds = {type(v) for v in values if v is not None}
    if kinds <= {bool}:
        return pa.bool_()
    if kinds <= {int}:
        return pa.int64()
    if kinds <= {int, float}:
        return pa.float64()
    if kinds <= {str}:
        return pa.string()
    names = {k.__name__ for k in kinds}  # numpy scalars, without importing numpy
    if all(n.startswith(("int", "uint")) for n in names):
        return pa.int64()
    if all(n.startswith(("int", "uint", "float")) for n in names):
        return pa.float64()
    return pa.string()  # anything else is stored as its str()


_CONVERTERS = {pa.bool_(): bool, pa.int64(): int, pa.float64(): float, pa.string(): str}


def kernel_batch(columns: dict) -> pa.RecordBatch:
    """A kernels record batch from equal-length columns named as KERNELS_SCHEMA (numpy arrays or lists;
    the string columns also Arrow arrays, dictionary-encoded or not).
    Absent columns: kind "kernel", name "", stream 0, correlation -1, launch times null; a NaN launch time
    is null. Built from buffers, without pandas (see column())."""
    n = len(columns["gpu_start_ns"])
    arrays = []
    for f in KERNELS_SCHEMA:
        values = columns.get(f.name)
        if f.type == pa.string():
            if isinstance(values, pa.Array):  # the collector's dictionary of names: decoded in C++
                arrays.append(values.cast(pa.string()) if pa.types.is_dictionary(values.type) else values)
                continue
            values = [("kernel" if f.name == "kind" else "")] * n if values is None else values
            arrays.append(_string_column(list(values)))
            continue
        if values is None:
            if f.name.startswith("launch"):
                arrays.append(pa.nulls(n, pa.int64()))
                continue
            values = np.full(n, -1 if f.name == "correlation" else 0, np.int64)
        data = np.asarray(values)
        validity, nulls = None, 0
        if data.dtype.kind == "f":
            missing = np.isnan(data)
            nulls = int(missing.sum())
            if nulls:
                validity = pa.py_buffer(np.packbits(~missing, bitorder="little"))
            data = np.where(missing, 0, data)
        data = np.ascontiguousarray(data, dtype=np.int64)
        arrays.append(pa.Array.from_buffers(pa.int64(), n, [validity, pa.py_buffer(data)], null_count=nulls))
    return pa.record_batch(arrays, schema=KERNELS_SCHEMA)


class RecorderIO:
    """Files of one recorder: `{pid}-{tag}.json` (written at start, updated at close) and its Arrow chunks.

    Also writes RUN/meta.json when the run dir has none yet (the first recorder wins; `overshoot run`
    writes a richer one before starting the server). Write errors never propagate into the engine: they are
    counted, reported once on stderr, and the chunk is dropped.
    """

    def __init__(self, run_dir: Path, *, engine: str, thread_name: str, thread_tag: str, options: dict,
                 process_info: dict):
        import sys
        import threading
        import time

        from overshoot.record.clock import boot_id, clock_sample
        from overshoot.rundir.meta import host_info, now_iso, versions, write_meta

        self.spool_dir = Path(run_dir) / "spool"
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self.pid = os.getpid()
        self.tag = self._claim_tag(safe_tag(thread_tag))
        self.prefix = f"{self.pid}-{self.tag}"
        self.json_path = self.spool_dir / f"{self.prefix}.json"
        host = host_info()
        self.info: dict = {
            "pid": self.pid,
            "thread": thread_name,
            "thread_ident": threading.get_ident(),
            "tag": self.tag,
            "engine": engine,
            "argv": list(sys.argv),
            "host": host["hostname"],
            "versions": versions(),
            "gpu": None,
            "start_time": now_iso(),
            # Wall clock <-> the spool's monotonic clock, read back to back.
            "clock": {"perf_counter_ns": time.perf_counter_ns(), "unix_ns": time.time_ns(),
                      "boot_id": boot_id(), "samples": [clock_sample()]},
            "options": options,
            "hooks": [],
            **process_info,
            "closed": False,
        }
        write_json_atomic(self.json_path, self.info)
        meta = {
            "run_id": Path(run_dir).resolve().name,
            "created_by": "recorder",
            "engine": engine,
            "command": list(sys.argv),
            "host": host,
            "versions": self.info["versions"],
            "gpu": None,
            "start_time": self.info["start_time"],
            "options": options,
        }
        self.wrote_meta = write_meta(run_dir, meta, only_if_absent=True)
        self.run_dir = Path(run_dir)
        self.writer = SpoolWriter(self.spool_dir, self.prefix)
        self.kernel_writer = SpoolWriter(self.spool_dir, self.prefix)  # kernels, kernel_windows only
        self._fact_types: dict[str, pa.DataType] = {}
        self.write_errors = 0
        self.chunks = 0

    def _claim_tag(self, base: str) -> str:
        """A tag no other recorder of this pid uses in this run dir (the json is created exclusively)."""
        for i in range(1, 10_000):
            tag = base if i == 1 else f"{base}-{i}"
            try:
                with open(self.spool_dir / f"{self.pid}-{tag}.json", "x"):
                    return tag
            except FileExistsError:
                continue
        raise RuntimeError("too many recorders with the same thread tag")

    def update_info(self, **facts) -> None:
        """Facts of the whole process (e.g. a worker's rank), written to its process record now."""
        self.info.update(facts)
        write_json_atomic(self.json_path, self.info)

    def set_gpu(self, name: str) -> None:
        from overshoot.rundir.meta import read_meta, update_meta

        self.info["gpu"] = name
        self.info["versions"]["torch"] = str(__import__("torch").__version__)
        write_json_atomic(self.json_path, self.info)
        try:
            meta = read_meta(self.run_dir)
            if not meta.get("gpu"):  # "GPU name when known": the first recorder that knows it fills it in
                update_meta(self.run_dir, {"gpu": name})
        except Exception:  # meta.json is informative; never fail recording over it
            pass

    def note_error(self, message: str) -> None:
        import sys

        self.info.setdefault("errors", []).append(message)
        print(f"overshoot: {message}", file=sys.stderr)
        try:
            write_json_atomic(self.json_path, self.info)
        except OSError:
            pass

    def write_chunk(self, *, steps: tuple, spans: tuple, gpu: tuple) -> None:
        try:
            if steps[0]:
                self.writer.write("steps", self._steps_batch(*steps))
            if spans[0]:
                self.writer.write("spans", pa.record_batch(
                    [_ints(spans[0]), _word(column(spans[1], pa.string(), nullable=False)),
                     _word(_string_column(spans[2])), _ints(spans[3]), _ints(spans[4])], schema=SPANS_SCHEMA))
            if gpu[0]:
                gpu_columns = [_ints(values) for values in gpu]
                self.writer.write("gpu", pa.record_batch(gpu_columns, schema=GPU_SCHEMA))
            self.chunks += 1
        except (OSError, *BUILD_ERRORS) as e:
            self._write_failed(e)

    def write_kernels(self, kernels: list[dict], windows: list[tuple[int, int]]) -> None:
        """Kernel records and windows, through a writer of their own: the CUPTI drain thread writes them
        while the engine thread writes its chunks (the two never share a file or a writer)."""
        try:
            for batch in kernels:
                self.kernel_writer.write("kernels", kernel_batch(batch))
            if windows:
                starts, ends = zip(*windows, strict=True)
                self.kernel_writer.write("kernel_windows", pa.record_batch(
                    [_ints(list(starts)), _ints(list(ends))], schema=KERNEL_WINDOWS_SCHEMA))
        except (OSError, *BUILD_ERRORS) as e:
            self._write_failed(e)

    def _write_failed(self, error: Exception) -> None:
        self.write_errors += 1
        if self.write_errors == 1:
            import sys

            print(f"overshoot: could not write spool chunk ({error}); data dropped", file=sys.stderr)

    def _steps_batch(self, step, start, end, wait, batch, tokens, phase, facts) -> pa.RecordBatch:
        columns = [
            _ints(step), _ints(start), _ints(end), _ints(wait),
            _int_array(batch, pa.int32()), _int_array(tokens, pa.int32()),
            _word(_phase_column(phase)),
        ]
        fields = list(STEPS_SCHEMA)
        for f in facts:  # register new fact names in order of first appearance
            if f:
                for name in f:
                    if name not in self._fact_types:
                        self._fact_types[name] = pa.null()
        for name in self._fact_types:
            values = [f.get(name) if f else None for f in facts]
            array = self._fact_array(name, values)
            if array is not None:
                columns.append(array)
                fields.append(pa.field(name, array.type))
        return pa.record_batch(columns, schema=pa.schema(fields))

    def _fact_array(self, name: str, values: list) -> pa.Array | None:
        known = self._fact_types[name]
        if all(v is None for v in values):
            return None if pa.types.is_null(known) else pa.nulls(len(values), known)
        arrow_type = _infer_type(values)
        if (known == pa.float64() and arrow_type == pa.int64()) or known == pa.string():
            arrow_type = known  # the values fit the known type: keep the schema (and the segment)
        # Any other change of type is real: the writer starts a new segment.
        convert = _CONVERTERS[arrow_type]
        try:
            array = column([None if v is None else convert(v) for v in values], arrow_type)
        except BUILD_ERRORS:
            array = column([None if v is None else str(v) for v in values], pa.string())
        self._fact_types[name] = array.type
        return array

    def close(self, *, reason: str, steps: int, gpu: dict | None) -> None:
        from overshoot.record.clock import clock_sample
        from overshoot.rundir.meta import now_iso

        self.info["clock"].setdefault("samples", []).append(clock_sample())  # the second: wall-clock slew

        for writer in (self.writer, self.kernel_writer):
            try:
                writer.close()
            except (OSError, pa.ArrowException):
                self.write_errors += 1
        self.info.update(
            closed=True, end_reason=reason, end_time=now_iso(), steps=steps, chunks=self.chunks,
            segments=self.writer.files_written + self.kernel_writer.files_written,
            write_errors=self.write_errors,
        )
        if gpu is not None:
            self.info["gpu_events"] = gpu
        try:
            write_json_atomic(self.json_path, self.info)
        except OSError:
            pass
