"""On-disk spool: chunked Arrow IPC streams, written by the Recorder (through record/writer.py), read back
tolerantly.

Layout (docs/contracts.md section 2)::

    RUN/spool/{pid}-{tag}.json                      one per recorder (pid, thread, engine, options, hooks ...)
    RUN/spool/{pid}-{tag}.{table}.{seg:04d}.arrow   Arrow IPC *stream*, one record batch per flushed chunk

Each chunk is written straight to the OS (unbuffered ``pa.OSFile``), so a process killed with SIGKILL loses
only the chunk it was filling. A file cut in the middle of a chunk still reads: the reader keeps the complete
batches before the damage and reports a warning instead of failing.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

TABLES = ("steps", "spans", "gpu", "kernels", "kernel_windows")

# Words repeated on every row (a step's phase, a span's kind and label) are written dictionary-encoded: each
# batch holds its few distinct words once and an index a row. A million steps' spool is ~30% smaller and is
# read without hashing three million strings. Spools of plain strings (written before) read the same.
WORD = pa.dictionary(pa.int32(), pa.string())
STEPS_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("start_ns", pa.int64()),
        ("end_ns", pa.int64()),
        ("wait_ns", pa.int64()),
        ("batch_size", pa.int32()),
        ("num_tokens", pa.int32()),
        ("phase", WORD),
    ]
)
SPANS_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("kind", WORD),
        ("label", WORD),
        ("start_ns", pa.int64()),
        ("dur_ns", pa.int64()),
    ]
)
GPU_SCHEMA = pa.schema([("step", pa.int64()), ("gpu_start_ns", pa.int64()), ("gpu_end_ns", pa.int64())])
# One GPU kernel, copy or set, its times on the host perf_counter_ns clock (kernel timing, docs/schema.md).
# launch_*: the host API call that enqueued it (null when unknown); correlation: the CUDA API call's id
# (kernels of one graph launch share it; -1 when unknown).
KERNELS_SCHEMA = pa.schema(
    [
        ("kind", pa.string()),
        ("name", pa.string()),
        ("stream", pa.int64()),
        ("correlation", pa.int64()),
        ("launch_start_ns", pa.int64()),
        ("launch_end_ns", pa.int64()),
        ("gpu_start_ns", pa.int64()),
        ("gpu_end_ns", pa.int64()),
    ]
)
# Host-clock windows during which every kernel was recorded (sampled kernel timing records some of them).
KERNEL_WINDOWS_SCHEMA = pa.schema([("start_ns", pa.int64()), ("end_ns", pa.int64())])
BASE_SCHEMAS = {
    "steps": STEPS_SCHEMA,
    "spans": SPANS_SCHEMA,
    "gpu": GPU_SCHEMA,
    "kernels": KERNELS_SCHEMA,
    "kernel_windows": KERNEL_WINDOWS_SCHEMA,
}

_CHUNK_NAME = re.compile(
    r"^(?P<pid>\d+)-(?P<tag>[A-Za-z0-9_-]+)\.(?P<table>steps|spans|gpu|kernels|kernel_windows)\.(?P<seg>\d{4,})\.arrow$"
)
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


def safe_tag(name: str) -> str:
    """A thread name made safe for file names ('.' separates fields, so it must not appear)."""
    return _UNSAFE.sub("_", name).strip("_") or "thread"


@dataclass
class _Segment:
    schema: pa.Schema
    sink: pa.OSFile
    writer: pa.ipc.RecordBatchStreamWriter


@dataclass
class SpoolWriter:
    """Writes record batches for one recorder: one Arrow stream per (table, segment).

    A new segment starts when a table's schema changes (a new extra fact, or a fact changing type).
    """

    spool_dir: Path
    prefix: str  # "{pid}-{tag}"
    _segments: dict[str, _Segment] = field(default_factory=dict)
    _next_seg: dict[str, int] = field(default_factory=dict)
    files_written: int = 0

    def write(self, table: str, batch: pa.RecordBatch) -> None:
        seg = self._segments.get(table)
        if seg is None or not seg.schema.equals(batch.schema):
            if seg is not None:
                self._close_segment(table)
            seg = self._open_segment(table, batch.schema)
        seg.writer.write_batch(batch)

    def _open_segment(self, table: str, schema: pa.Schema) -> _Segment:
        number = self._next_seg.get(table, 0)
        self._next_seg[table] = number + 1
        path = self.spool_dir / f"{self.prefix}.{table}.{number:04d}.arrow"
        sink = pa.OSFile(str(path), "wb")
        seg = _Segment(schema, sink, pa.ipc.new_stream(sink, schema))
        self._segments[table] = seg
        self.files_written += 1
        return seg

    def _close_segment(self, table: str) -> None:
        seg = self._segments.pop(table)
        try:
            seg.writer.close()  # writes the end-of-stream marker
        finally:
            seg.sink.close()

    def close(self) -> None:
        for table in list(self._segments):
            self._close_segment(table)


def write_json_atomic(path: Path, data: dict) -> None:
    """Replace `path` with `data` as JSON; readers never see a half-written file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def read_stream_file(path: Path, *, label: str) -> tuple[list[pa.RecordBatch], str | None]:
    """Every complete, valid batch of one Arrow IPC stream file, plus a warning if the tail was bad.

    `label` names the file in warnings (e.g. "spool/123-main.steps.0000.arrow").
    """
    try:
        if path.stat().st_size == 0:
            return [], f"{label}: empty file"
        data = pa.memory_map(str(path))  # zero-copy: batches point into the mapping
    except OSError as e:
        return [], f"{label}: unreadable ({e.strerror or e})"
    try:
        reader = pa.ipc.open_stream(data)
    except (pa.ArrowException, OSError, ValueError):
        return [], f"{label}: not an Arrow stream (corrupt header)"
    batches: list[pa.RecordBatch] = []
    while True:
        try:
            batch = reader.read_next_batch()
            batch.validate(full=True)
        except StopIteration:
            return batches, None
        except (pa.ArrowException, OSError, ValueError):
            return batches, f"{label}: truncated after {len(batches)} chunks"
        batches.append(batch)


@dataclass
class ChunkFile:
    path: Path
    pid: int
    tag: str
    table: str
    segment: int


def list_chunk_files(spool_dir: Path) -> list[ChunkFile]:
    """Spool chunk files in a stable order (pid, tag, table, segment); other files are ignored."""
    found = []
    for path in spool_dir.iterdir() if spool_dir.is_dir() else ():
        m = _CHUNK_NAME.match(path.name)
        if m:
            found.append(ChunkFile(path, int(m["pid"]), m["tag"], m["table"], int(m["seg"])))
    found.sort(key=lambda c: (c.pid, c.tag, c.table, c.segment))
    return found


# Base string columns with a handful of distinct values among millions of rows (the recorder's thread, a
# span's kind and label, a step's phase): dictionary-encoded, so pandas reads them as categoricals.
DICTIONARY_COLUMNS = {"steps": ("phase", "thread"), "spans": ("kind", "label", "thread"), "gpu": ("thread",)}


def read_table(spool_dir: Path, table: str, warnings: list[str]) -> pa.Table:
    """All chunks of one raw table across recorders, with `pid` (int64) and `thread` (str) columns added.

    Segments with different extra facts are merged by name (missing values are null; int/float widen).
    The DICTIONARY_COLUMNS come back dictionary-encoded, one contiguous chunk each, with the smallest index
    type: a byte a row instead of an offset and the text (a million steps' spans: ~10 MB instead of ~120
    MB), and a comparison with one value tests a few codes, not millions of strings. Other string columns
    come back as one contiguous `large_string` chunk each (what pandas' "str" dtype holds). Either way:
    left as read, a million steps are ~4,000 chunks (one per flush) that pandas converts one by one, and
    strings kept as Arrow memory by pandas would pin every memory-mapped spool file (resident) for as long
    as the Run lives. Numeric columns stay chunked: the conversion to numpy copies them anyway.
    """
    base = BASE_SCHEMAS[table]
    parts: list[pa.Table] = []
    for chunk in list_chunk_files(spool_dir):
        if chunk.table != table:
            continue
        label = f"{spool_dir.name}/{chunk.path.name}"
        batches, warning = read_stream_file(chunk.path, label=label)
        if warning:
            warnings.append(warning)
        if not batches:
            continue
        part = pa.Table.from_batches(batches)
        missing = [f.name for f in base if f.name not in part.column_names]
        if missing:
            warnings.append(f"{label}: skipped, missing columns {', '.join(missing)}")
            continue
        for name in DICTIONARY_COLUMNS.get(table, ()):  # plain strings (older spools) as words too
            if name in part.column_names and not pa.types.is_dictionary(part.schema.field(name).type):
                at = part.column_names.index(name)
                part = part.set_column(at, name, pc.dictionary_encode(part.column(at)).cast(WORD))
        # The recorder is constant per file: Arrow repeat arrays, no per-row Python.
        n = part.num_rows
        part = part.append_column("pid", pa.repeat(pa.scalar(chunk.pid, pa.int64()), n))
        part = part.append_column("thread", _repeat_tag(chunk.tag, n))
        parts.append(part)
    if not parts:
        empty = base.append(pa.field("pid", pa.int64())).append(pa.field("thread", _TAG_TYPE))
        parts = [empty.empty_table()]
    merged = pa.concat_tables(_as_text_where_types_differ(parts), promote_options="permissive")
    encoded = DICTIONARY_COLUMNS.get(table, ())
    columns = [_dictionary(c) if name in encoded else _own_strings(c)
               for name, c in zip(merged.column_names, merged.columns, strict=True)]
    return pa.Table.from_arrays(columns, names=merged.column_names)


def _as_text_where_types_differ(parts: list[pa.Table]) -> list[pa.Table]:
    """A column whose type differs between parts and cannot widen (a fact given as a number in one segment
    and as text or a flag in another) is read as text in every part, so no part is lost; numbers widen."""
    types: dict[str, set[pa.DataType]] = {}
    for part in parts:
        for column_field in part.schema:
            types.setdefault(column_field.name, set()).add(column_field.type)

    def widens(t: pa.DataType) -> bool:
        return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_null(t)

    text = {name for name, seen in types.items() if len(seen) > 1 and not all(map(widens, seen))}
    if not text:
        return parts
    out = []
    for part in parts:
        for name in text & set(part.column_names):
            at = part.column_names.index(name)
            column = part.column(at)
            if pa.types.is_dictionary(column.type):
                column = column.cast(column.type.value_type)
            if pa.types.is_boolean(column.type):  # as the writer's str() spells a flag among text
                column = pc.if_else(column, "True", "False")
            elif not pa.types.is_string(column.type):
                column = pc.cast(column, pa.string())
            part = part.set_column(at, name, column)
        out.append(part)
    return out


_TAG_TYPE = pa.dictionary(pa.int8(), pa.string())


def _repeat_tag(tag: str, n: int) -> pa.DictionaryArray:
    """The recorder's tag on each of its n rows: one dictionary entry and n zero codes, no string a row."""
    return pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, "int8")), pa.array([tag], pa.string()))


def _dictionary(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """A dictionary column (read_table encodes plain strings per file) as one contiguous dictionary chunk in
    fresh memory, its indices the smallest integer type that holds them."""
    array = column.unify_dictionaries().combine_chunks() if column.num_chunks else column.combine_chunks()
    size = len(array.dictionary)
    index = pa.int8() if size <= 127 else pa.int16() if size <= 32767 else pa.int32()
    return pa.chunked_array([array.cast(pa.dictionary(index, array.type.value_type))])


def _own_strings(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """A string column as one contiguous large_string chunk in fresh memory; any other column as it is."""
    if not pa.types.is_string(column.type):
        return column
    return pa.chunked_array([column.combine_chunks().cast(pa.large_string())])
