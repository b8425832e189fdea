"""CuptiCollector: the default kernel-timing collector (record/kernel_timing.py's Collector protocol).

Costs by caller:
- engine thread, at a step boundary: `enable()` / `disable()` switch three CUPTI activity kinds (kernels,
  copies, sets) and the launch callbacks (one C loop); never a synchronize or a flush. The first `enable()`
  of the process also sets CUPTI up (Session: load libcupti, build or load the shim, register callbacks;
  0.3 s with a first build of the shim).
- engine thread, while enabled: CUPTI's work at every launch, and the shim's launch callback (calls.c): it
  records the launch, graph launch, copy and set calls only, with their correlation ids, in C.
- drain thread, every ~0.5 s: `collect()` flushes completed buffers, walks them in C, parses with numpy,
  takes the shim's calls and joins each kernel to its call by correlation id (records.LaunchJoin): no
  Python per record, only per buffer and per unique kernel name. A GPU record whose call has not arrived
  waits up to two collects, then goes out with NaN launch times; `final` forces the flush and lets nothing
  wait.
CUPTI is set up once per process (session.py) and shared by the collectors of successive recorders, one
enabled at a time. Where CUPTI refuses the callback's subscriber, the calls come from CUPTI's runtime and
driver API activity records instead: every call is recorded and the launches are picked out in numpy, at
several times the cost.
"""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import pyarrow as pa

from overshoot.record.cupti import native, records
from overshoot.record.cupti.records import (
    KIND_NAMES,
    MEMCPY_KINDS,
)
from overshoot.record.cupti.session import API_FILTER, BUFFER_BYTES, PREALLOCATED_BUFFERS, Session
from overshoot.record.errors import KernelTimingError
from overshoot.record.writer import column, int_column

CARRY_COLLECTS = 2  # GPU records wait this many collects for their launch record before going without
KEEP_CALLS_COLLECTS = 4  # launch calls wait this many for their GPU records (kernels lag by the queue)
# The drain thread parses a buffer's records in slices and sleeps this long between slices and stages: a
# thread that holds the GIL makes the engine thread wait up to the switch interval (5 ms) before it is
# forced to let go, and an engine that launches a step late leaves the GPU idle. The sleep lets a waiting
# engine thread take the GIL at once.
PARSE_SLICE = 8192
GIL_YIELD_S = 0.0002


def unavailable_reason(*, cuda: bool) -> str | None:
    """One line saying why CUPTI kernel timing cannot run here, or None when it can."""
    if not cuda:
        return "needs a CUDA GPU and none was found; use --gpu-timing events (or off)"
    if not native.find_libcupti():
        return ("libcupti not found: install nvidia-cuda-cupti (CUDA 13; nvidia-cuda-cupti-cu12 for CUDA "
                "12), e.g. pip install 'overshoot[cupti]'")
    try:
        native.build_shim()  # once per machine and source; a build in the cache needs no compiler
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    return None


class CuptiCollector:
    """Kernel, copy and set records with their launch calls, on the host perf_counter_ns clock."""

    def __init__(self):
        self._session: Session | None = None
        self._join = records.LaunchJoin(wait=CARRY_COLLECTS, keep=KEEP_CALLS_COLLECTS)
        self._enabled = False
        self._lock = threading.Lock()  # collect() against close()
        self.setup_ns = 0  # the process's first enable: CUPTI set-up and its first activity enable
        self.prepare_ns = 0  # the same set-up done by prepare(), on the drain thread
        self.flush_all_ns = 0  # inside cuptiActivityFlushAll (ctypes: without the GIL), of collect()'s time

    def _ready(self) -> Session:
        if self._session is None:
            s = Session.get()
            # tops the buffer pool up again after an earlier collector's close(); no-op when full
            s.shim.lib.ovs_configure(BUFFER_BYTES, PREALLOCATED_BUFFERS)
            self._session = s
        return self._session

    def describe(self) -> dict:
        s = self._session
        if s is None:
            return {"backend": "cupti"}
        return {"backend": "cupti (native shim)", "libcupti": s.cupti.path, "cupti_version": s.version,
                "layout": s.layout.name if s.layout else None, "api_filter": API_FILTER[s.calls],
                "clock": "CLOCK_MONOTONIC callback" if s.monotonic else "CUPTI clock, mapped",
                "clock_error_ns": max(c.error_ns for c in s.clock), "notes": list(s.notes),
                "invalid_records": self._join.invalid, "flush_all_ms": self.flush_all_ns / 1e6,
                "shim": {**s.shim.stats(), **(s.shim.calls_stats() if s.calls else {})}}

    def prepare(self) -> None:
        """Drain thread, before sampled mode's first window: CUPTI's once-a-process set-up and its first
        enable, which attaches to the context (50-240 ms in the served engine on the H200), off the engine
        thread. What the engine launches in between is recorded and dropped here."""
        t = time.perf_counter_ns()
        try:
            s = self._ready()
            if not Session.enabled_once:
                s.set_enabled(True)
                s.set_enabled(False)
                Session.enabled_once = True
                s.cupti.call("cuptiActivityFlushAll", 1)
                s.shim.recycle(s.shim.take_all_completed())
                if s.calls:
                    s.shim.take_calls()
        except native.CuptiError as e:
            raise KernelTimingError(str(e)) from None
        finally:
            self.prepare_ns += time.perf_counter_ns() - t

    def enable(self) -> None:
        """Engine thread, step boundary: three activity kinds and the launch callbacks switched on, ~0.08 ms
        (the first call also sets CUPTI up for the process, see Session). Never synchronizes or flushes."""
        first = not Session.enabled_once
        t = time.perf_counter_ns()
        try:
            self._ready().set_enabled(True)
        except native.CuptiError as e:
            raise KernelTimingError(str(e)) from None
        if first:  # CUPTI attaches to the context here: tens to hundreds of ms, once a process
            Session.enabled_once = True
            self.setup_ns += time.perf_counter_ns() - t
        self._enabled = True

    def disable(self) -> None:
        """Engine thread, step boundary: switches the kinds off; records already made are collected later."""
        if self._session is not None:
            self._enabled = False
            self._session.set_enabled(False)

    def collect(self, *, final: bool = False) -> dict | None:
        """Drain thread: flush, parse every completed buffer, join to launch calls; kernels-table columns
        on the host clock, or None when there is nothing. `final` forces CUPTI to hand over every buffer
        and lets no record wait for its call."""
        s = self._session
        if s is None:
            return None
        with self._lock:
            t = time.perf_counter_ns()
            s.cupti.call("cuptiActivityFlushAll", 1 if final else 0)  # 1: CUPTI_ACTIVITY_FLAG_FLUSH_FORCED
            self.flush_all_ns += time.perf_counter_ns() - t
            gpu_parts, api_parts = [], []
            buffers = s.shim.take_all_completed()
            try:
                for addr, valid in buffers:
                    if addr and valid:
                        view = np.ctypeslib.as_array((ctypes.c_uint8 * valid).from_address(addr))
                        offsets, kinds = s.offsets(addr, valid)
                        for lo in range(0, len(offsets), PARSE_SLICE):
                            gpu, api = records.parse(view, s.layout or records.CUPTI_13_0,
                                                     offsets[lo:lo + PARSE_SLICE], kinds[lo:lo + PARSE_SLICE],
                                                     copy=s.shim.gather)
                            gpu_parts.append(gpu)  # parse copies: the buffer can go back to the pool
                            api_parts.append(api)
                            time.sleep(GIL_YIELD_S)
            finally:
                s.shim.recycle(buffers)
            if s.calls:  # after the flush: every call of a kernel flushed so far has returned
                api_parts.append(records.call_columns(s.shim.take_calls()))
            if not s.monotonic:
                s.clock.append(s.sample_clock())
            gpu, match, calls = self._join.step(gpu_parts, api_parts, final=final)
            time.sleep(GIL_YIELD_S)
            return self._rows(s, gpu, match, calls) if gpu else None

    @staticmethod
    def _rows(s: Session, gpu: dict, match: np.ndarray, api: dict) -> dict:
        def host(x: np.ndarray) -> np.ndarray:
            return x.astype(np.int64)

        def mapped(x: np.ndarray) -> np.ndarray:
            return records.to_host_clock(x, s.clock)

        to_host = host if s.monotonic else mapped
        # the shim's calls are timed on the host clock already; API activity records on CUPTI's
        call_to_host = host if s.calls else to_host
        has = match >= 0
        launch_start = np.full(len(match), np.nan)
        launch_end = np.full(len(match), np.nan)
        if has.any():
            launch_start[has] = call_to_host(api["start"][match[has]])
            launch_end[has] = call_to_host(api["end"][match[has]])
        kind = pa.DictionaryArray.from_arrays(int_column(gpu["gpu_kind"]),
                                              column(list(KIND_NAMES), pa.string(), nullable=False))
        return {"kind": kind, "name": CuptiCollector._names(s, gpu), "stream": gpu["stream"].astype(np.int64),
                "correlation": gpu["correlation"].astype(np.int64), "launch_start_ns": launch_start,
                "launch_end_ns": launch_end, "gpu_start_ns": to_host(gpu["start"]),
                "gpu_end_ns": to_host(gpu["end"])}

    @staticmethod
    def _names(s: Session, gpu: dict) -> pa.DictionaryArray:
        """Each record's kernel name (copies: "memcpy HtoD"...; sets: "memset") as codes into the distinct
        names: no Python string a record on this thread, which holds the GIL the engine thread needs."""
        kernels = gpu["gpu_kind"] == records.KERNEL
        pointers, inverse = np.unique(gpu["name_ptr"][kernels], return_inverse=True)
        words = [s.name(p) for p in pointers.tolist()]
        codes = np.zeros(len(kernels), np.int32)
        codes[kernels] = inverse.ravel()
        copies = gpu["gpu_kind"] == records.MEMCPY
        if copies.any():
            copy_kinds, which = np.unique(gpu["copy_kind"][copies], return_inverse=True)
            codes[copies] = len(words) + which.ravel()
            words += ["memcpy " + MEMCPY_KINDS.get(k, "?") for k in copy_kinds.tolist()]
        sets = gpu["gpu_kind"] == records.MEMSET
        if sets.any():
            codes[sets] = len(words)
            words.append("memset")
        return pa.DictionaryArray.from_arrays(int_column(codes), column(words, pa.string(), nullable=False))

    def close(self) -> None:
        """Drop what is left and free the idle buffers. CUPTI's callbacks stay registered: CUPTI has no
        call that unregisters them (nor the timestamp callback), so the session stays for the process and a
        later collector reuses it."""
        s = self._session
        if s is not None and self._enabled:
            try:
                self.disable()
            except native.CuptiError:
                pass
        with self._lock:
            self._join = records.LaunchJoin(wait=CARRY_COLLECTS, keep=KEEP_CALLS_COLLECTS)
            if s is not None:
                s.shim.lib.ovs_release_free()  # buffers CUPTI still holds are never freed
