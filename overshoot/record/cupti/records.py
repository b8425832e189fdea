"""CUPTI activity records as numpy columns: layouts, buffer walk, parse, launch join (pure numpy, CPU-tested).

Layouts are byte offsets taken with `offsetof` against the headers of the nvidia-cuda-cupti 13.0.85 wheel
(cupti_activity.h, CUPTI API 130001) and cross-checked with cupti-python 13.0.1's numpy dtypes; the leading
fields are the same in 13.5, only record sizes grow. Records are packed and 8-byte aligned, each starting
with its kind (u32), so a buffer is walked with a kind -> size table, which the collector checks against
cuptiActivityGetNextRecord on its first buffer (and learns for unknown versions). Verified on the H200
(CUPTI 13.0.85, 2026-12-03): the size walk equals CUPTI's own on every buffer checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

KIND_MEMCPY, KIND_MEMSET, KIND_KERNEL, KIND_DRIVER, KIND_RUNTIME = 1, 2, 3, 4, 5
KIND_CONCURRENT_KERNEL, KIND_OVERHEAD, KIND_MEMCPY2 = 10, 17, 22

# The API calls that put work on the GPU (cupti_runtime_cbid.h / cupti_driver_cbid.h, 13.0.85). Torch's
# eager kernels come through cudaLaunchKernel (211), CUDA graphs through cudaGraphLaunch (311), Triton's
# through cuLaunchKernel (307) (seen on the H200).
RUNTIME_LAUNCH_CBIDS = {
    211: "cudaLaunchKernel", 214: "cudaLaunchKernel_ptsz", 269: "cudaLaunchCooperativeKernel",
    270: "cudaLaunchCooperativeKernel_ptsz", 311: "cudaGraphLaunch", 312: "cudaGraphLaunch_ptsz",
    430: "cudaLaunchKernelExC", 431: "cudaLaunchKernelExC_ptsz", 505: "__cudaLaunchKernel",
    506: "__cudaLaunchKernel_ptsz",
    # copies and sets
    31: "cudaMemcpy", 41: "cudaMemcpyAsync", 225: "cudaMemcpyAsync_ptsz", 51: "cudaMemsetAsync",
    235: "cudaMemsetAsync_ptsz",
}
DRIVER_LAUNCH_CBIDS = {
    307: "cuLaunchKernel", 442: "cuLaunchKernel_ptsz", 477: "cuLaunchCooperativeKernel",
    478: "cuLaunchCooperativeKernel_ptsz", 514: "cuGraphLaunch", 515: "cuGraphLaunch_ptsz",
    652: "cuLaunchKernelEx", 653: "cuLaunchKernelEx_ptsz",
}
# The API domains of CUPTI's callback API (cupti_callbacks.h)
DOMAIN_DRIVER, DOMAIN_RUNTIME = 1, 2
# A launch call recorded by the shim's callback (calls.c, ovs_call): on the host clock already
CALL_DTYPE = np.dtype([("cbid", "<u4"), ("correlation", "<u4"), ("thread_id", "<u4"), ("driver", "<u4"),
                       ("start", "<i8"), ("end", "<i8")])
MEMCPY_KINDS = {0: "?", 1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD", 7: "DtoA",
                8: "DtoD", 9: "HtoH", 10: "PtoP"}
KERNEL, MEMCPY, MEMSET = 0, 1, 2  # gpu_kind codes
KIND_NAMES = ("kernel", "memcpy", "memset")


class LayoutError(ValueError):
    """A buffer that does not walk with the size table."""


@dataclass(frozen=True)
class RecordLayout:
    """Per kind: record size; per record type: (offset, dtype) of the fields read."""

    name: str
    sizes: dict
    kernel: dict = field(default_factory=lambda: {  # CUpti_ActivityKernel10 (13.0) / 13 (13.5)
        "start": (16, "<u8"), "end": (24, "<u8"), "stream": (48, "<u4"), "correlation": (92, "<u4"),
        "name_ptr": (104, "<u8")})
    memcpy: dict = field(default_factory=lambda: {  # CUpti_ActivityMemcpy6 / 7
        "copy_kind": (4, "<u1"), "start": (16, "<u8"), "end": (24, "<u8"), "stream": (40, "<u4"),
        "correlation": (44, "<u4")})
    memset: dict = field(default_factory=lambda: {  # CUpti_ActivityMemset4 / 5
        "start": (16, "<u8"), "end": (24, "<u8"), "stream": (40, "<u4"), "correlation": (44, "<u4")})
    api: dict = field(default_factory=lambda: {  # CUpti_ActivityAPI (40 bytes in 13.0 and 13.5)
        "cbid": (4, "<u4"), "start": (8, "<u8"), "end": (16, "<u8"), "thread_id": (28, "<u4"),
        "correlation": (32, "<u4")})

    def with_sizes(self, sizes: dict, name: str) -> RecordLayout:
        return replace(self, sizes=dict(sizes), name=name)


CUPTI_13_0 = RecordLayout("cupti-13.0", {KIND_KERNEL: 216, KIND_CONCURRENT_KERNEL: 216, KIND_MEMCPY: 96,
                                         KIND_MEMSET: 88, KIND_RUNTIME: 40, KIND_DRIVER: 40,
                                         KIND_MEMCPY2: 96, KIND_OVERHEAD: 56})
CUPTI_13_5 = RecordLayout("cupti-13.5", {KIND_KERNEL: 248, KIND_CONCURRENT_KERNEL: 248, KIND_MEMCPY: 112,
                                         KIND_MEMSET: 104, KIND_RUNTIME: 40, KIND_DRIVER: 40})


def layout_for_version(api_version: int) -> RecordLayout | None:
    """The known layout of a cuptiGetVersion() value; None: sizes are learned from the first buffer."""
    if 130000 <= api_version < 130100:
        return CUPTI_13_0
    if 130500 <= api_version < 130600:
        return CUPTI_13_5
    return None


def walk(raw, sizes: dict) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, kinds) of the records packed in `raw`, up to its end or a zero kind (a zeroed tail)."""
    buf = np.frombuffer(raw, np.uint8) if not isinstance(raw, np.ndarray) else raw.view(np.uint8).ravel()
    offsets, kinds, pos = [], [], 0
    while pos + 4 <= buf.size:
        kind = int.from_bytes(buf[pos:pos + 4].tobytes(), "little")
        if kind == 0:
            break
        size = sizes.get(kind)
        if size is None or pos + size > buf.size:
            raise LayoutError(f"record of kind {kind} at byte {pos} does not fit the size table")
        offsets.append(pos)
        kinds.append(kind)
        pos += size
    return np.asarray(offsets, np.int64), np.asarray(kinds, np.int32)


def learn_sizes(offsets: np.ndarray, kinds: np.ndarray, valid: int | None) -> dict:
    """kind -> size from record offsets (cuptiActivityGetNextRecord's); `valid` is where the last record
    ends (None: unknown, its size is not learned). A kind whose records differ in size means they are not
    packed back to back, which no size table can walk."""
    sizes: dict = {}
    for kind, size in zip(np.asarray(kinds)[:-1].tolist(), np.diff(offsets).tolist(), strict=True):
        if sizes.setdefault(kind, size) != size:
            raise LayoutError(f"kind {kind}: records of {sizes[kind]} and {size} bytes")
    if len(offsets) and valid is not None:  # the last record: what is left of the valid bytes
        sizes.setdefault(int(kinds[-1]), int(valid - offsets[-1]))
    return sizes


def member(values: np.ndarray, codes) -> np.ndarray:
    """`np.isin(values, codes)` for small non-negative codes (record kinds, callback ids) by a lookup table:
    one pass instead of one per code or a sort, on the drain thread that holds the GIL while it runs."""
    codes = np.fromiter(codes, np.int64)
    values = np.asarray(values)
    top = int(values.max(initial=0))
    if not len(values) or top >= 1 << 16 or (len(codes) and codes.min() < 0):
        return np.isin(values, codes)
    table = np.zeros(max(top, int(codes.max(initial=0))) + 1, bool)
    table[codes] = True
    return table[values]


def _gather(buf: np.ndarray, offsets: np.ndarray, fields: dict, copy=None) -> dict:
    out = {}
    for name, (offset, dtype) in fields.items():
        dt = np.dtype(dtype)
        if copy is not None:  # native.Shim.gather: the same bytes, gathered in C
            raw = copy(buf, offsets, offset, dt.itemsize)
        else:
            index = (offsets + offset)[:, None] + np.arange(dt.itemsize)  # unaligned-safe byte gather
            raw = np.ascontiguousarray(buf[index])
        out[name] = raw.view(dt).ravel().astype(dt.newbyteorder("="))
    return out


def parse(raw, layout: RecordLayout, offsets: np.ndarray, kinds: np.ndarray, *,
          copy=None) -> tuple[dict, dict]:
    """One buffer's records as columns (CUPTI's clock): GPU work (kernels, copies, sets) and API calls.
    `copy`: a C byte gather (native.Shim.gather) instead of numpy's."""
    buf = np.frombuffer(raw, np.uint8) if not isinstance(raw, np.ndarray) else raw.view(np.uint8).ravel()
    parts = []
    record_types = ((KERNEL, (KIND_KERNEL, KIND_CONCURRENT_KERNEL), layout.kernel),
                    (MEMCPY, (KIND_MEMCPY,), layout.memcpy), (MEMSET, (KIND_MEMSET,), layout.memset))
    for code, kind_set, fields in record_types:
        cols = _gather(buf, offsets[member(kinds, kind_set)], fields, copy)
        n = len(cols["start"])
        cols.setdefault("name_ptr", np.zeros(n, np.uint64))
        cols.setdefault("copy_kind", np.zeros(n, np.uint8))
        cols["gpu_kind"] = np.full(n, code, np.int8)
        parts.append(cols)
    gpu = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    calls = member(kinds, (KIND_RUNTIME, KIND_DRIVER))
    api = _gather(buf, offsets[calls], layout.api, copy)
    api["driver"] = kinds[calls] == KIND_DRIVER
    return gpu, api


def call_columns(calls: np.ndarray) -> dict:
    """The shim's launch calls (CALL_DTYPE) as the API columns `parse` gives."""
    return {"cbid": calls["cbid"].copy(), "start": calls["start"].copy(), "end": calls["end"].copy(),
            "thread_id": calls["thread_id"].copy(), "correlation": calls["correlation"].copy(),
            "driver": calls["driver"] != 0}


def launch_call_ids() -> list[tuple[int, int]]:
    """(domain, cbid) of every call that puts work on the GPU: what the shim's callback is enabled for."""
    return ([(DOMAIN_RUNTIME, c) for c in sorted(RUNTIME_LAUNCH_CBIDS)]
            + [(DOMAIN_DRIVER, c) for c in sorted(DRIVER_LAUNCH_CBIDS)])


def concat(parts: list[dict]) -> dict:
    parts = [p for p in parts if p and len(next(iter(p.values())))]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]} if parts else {}


def join_launches(gpu_correlation: np.ndarray, api: dict) -> np.ndarray:
    """Index into `api` of the call with each GPU record's correlation id (the runtime call when both a
    runtime and a driver call carry it), or -1."""
    if not api or not len(api["correlation"]) or not len(gpu_correlation):
        return np.full(len(gpu_correlation), -1, np.int64)
    corr = api["correlation"].astype(np.int64)
    order = np.lexsort((api["driver"], corr))
    sorted_corr = corr[order]
    key = gpu_correlation.astype(np.int64)
    pos = np.searchsorted(sorted_corr, key, side="left")
    hit = (pos < len(sorted_corr)) & (sorted_corr[np.minimum(pos, len(sorted_corr) - 1)] == key) & (key != 0)
    return np.where(hit, order[np.minimum(pos, len(order) - 1)], -1)


def launch_calls(api: dict) -> np.ndarray:
    """Mask of the API records of calls that put work on the GPU (launches, graph launches, copies, sets)."""
    runtime = member(api["cbid"], RUNTIME_LAUNCH_CBIDS)
    driver = member(api["cbid"], DRIVER_LAUNCH_CBIDS)
    return np.where(api["driver"], driver, runtime)


def graph_launch_calls(api: dict) -> np.ndarray:
    """Mask of the graph launches: one call, many GPU records (every kernel of the graph shares its id)."""
    return np.where(api["driver"], member(api["cbid"], (514, 515)), member(api["cbid"], (311, 312)))


def valid_times(gpu: dict) -> np.ndarray:
    """GPU records with usable timestamps: CUPTI writes 0 when it could not time a record (no device memory
    for it, cupti_activity.h), and a forced flush may hand over records of work not finished yet."""
    return (gpu["start"] > 0) & (gpu["end"] >= gpu["start"])


class LaunchJoin:
    """Joins GPU records to their launch calls across successive buffers (numpy, no loop per record).

    A kernel's record can come in a later buffer than its launch call (kernel records are per context and
    handed over when the work is done; API records are not), or the reverse. So a GPU record without its
    call waits up to `wait` steps before it goes out without one (NaN launch), and calls are kept `keep`
    steps: a kernel-launch call until its record came, a graph launch for the whole time (all its
    kernels share it). `final` lets nothing wait."""

    def __init__(self, wait: int = 2, keep: int = 4):
        self.wait, self.keep = wait, keep
        self.gpu: dict = {}  # GPU records waiting for their call, with "age" (steps waited)
        self.api: dict = {}  # launch calls kept, with "age"
        self.invalid = 0  # GPU records dropped for unusable timestamps

    def step(self, gpu_parts: list[dict], api_parts: list[dict], *,
             final: bool = False) -> tuple[dict, np.ndarray, dict]:
        """(GPU records to emit, index of each one's call in the returned calls or -1, calls)."""
        gpu = concat([self.gpu] + [{**g, "age": np.zeros(len(g["start"]), np.int64)} for g in gpu_parts])
        if gpu:
            ok = valid_times(gpu)
            self.invalid += int((~ok).sum())
            gpu = {k: v[ok] for k, v in gpu.items()}
        fresh = concat(api_parts)
        if fresh:  # only launch calls are kept; the others (most API records) go now
            fresh = {k: v[launch_calls(fresh)] for k, v in fresh.items()}
            fresh["age"] = np.zeros(len(fresh["start"]), np.int64)
        api = concat([self.api, fresh])
        n = len(gpu["start"]) if gpu else 0
        match = join_launches(gpu["correlation"], api) if n else np.zeros(0, np.int64)
        waiting = (match < 0) & (gpu["age"] < self.wait) if n and not final else np.zeros(n, bool)
        self.gpu = {k: v[waiting] for k, v in gpu.items()} if waiting.any() else {}
        if self.gpu:
            self.gpu["age"] = self.gpu["age"] + 1
        out = {k: v[~waiting] for k, v in gpu.items()} if n and not waiting.all() else {}
        match = match[~waiting]
        self.api = {}
        if api and not final:
            spent = np.zeros(len(api["start"]), bool)
            spent[match[match >= 0]] = True
            keep = (~spent | graph_launch_calls(api)) & (api["age"] + 1 < self.keep)
            if keep.any():
                self.api = {k: v[keep] for k, v in api.items()}
                self.api["age"] = self.api["age"] + 1
        return out, match, api


@dataclass
class ClockSample:
    """One bracket (host, CUPTI, host): offset = host midpoint − CUPTI, error = half the bracket."""

    cupti_ns: int
    offset_ns: int
    error_ns: int


def best_bracket(before: np.ndarray, cupti: np.ndarray, after: np.ndarray) -> ClockSample:
    width = np.asarray(after, np.int64) - np.asarray(before, np.int64)
    i = int(np.argmin(width))
    mid = int(before[i]) + int(width[i]) // 2
    return ClockSample(int(cupti[i]), mid - int(cupti[i]), (int(width[i]) + 1) // 2)


def to_host_clock(ts: np.ndarray, samples: list[ClockSample]) -> np.ndarray:
    """CUPTI ns -> perf_counter ns, the offset interpolated between samples (drift)."""
    ts = np.asarray(ts, np.uint64).astype(np.int64)
    if len(samples) < 2:
        return ts + (samples[0].offset_ns if samples else 0)
    s = sorted(samples, key=lambda c: c.cupti_ns)
    base = s[0].offset_ns  # offsets can be ~1.8e18 (CLOCK_REALTIME): interpolate the deviation only
    deviation = np.interp(ts.astype(np.float64), [c.cupti_ns for c in s], [c.offset_ns - base for c in s])
    return ts + base + np.rint(deviation).astype(np.int64)
