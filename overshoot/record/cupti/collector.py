"""CuptiCollector: the default kernel-timing collector (record/kernel_timing.py's Collector protocol).

Costs by caller:
- engine thread, at a step boundary: `enable()` / `disable()` switch three CUPTI activity kinds (kernels,
  copies, sets) and the launch callbacks (one C loop); never a synchronize or a flush. The first `enable()`
  of the process also sets CUPTI up (_Session: load libcupti, build or load the shim, register callbacks;
  0.3 s with a first build of the shim).
- engine thread, while enabled: CUPTI's work at every launch, and the shim's launch callback (calls.c): it
  records the launch, graph launch, copy and set calls only, with their correlation ids, in C.
- drain thread, every ~0.5 s: `collect()` flushes completed buffers, walks them in C, parses with numpy,
  takes the shim's calls and joins each kernel to its call by correlation id (records.LaunchJoin): no
  Python per record, only per buffer and per unique kernel name. A GPU record whose call has not arrived
  waits up to two collects, then goes out with NaN launch times; `final` forces the flush and lets nothing
  wait.
CUPTI's state is per process (one activity client, one callback subscriber, callbacks that cannot be
unregistered), so it is set up once per process (`_Session`) and shared by the collectors of successive
recorders, one enabled at a time. Where CUPTI refuses the subscriber (another tool holds it) or
OVERSHOOT_CUPTI_CALLS=activity, the calls come from CUPTI's runtime and driver API activity records
instead: every call is recorded and the launches are picked out in numpy, at several times the cost.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

import numpy as np
import pyarrow as pa

from overshoot.record.cupti import native, records
from overshoot.record.cupti.records import (
    KIND_CONCURRENT_KERNEL,
    KIND_DRIVER,
    KIND_MEMCPY,
    KIND_MEMSET,
    KIND_NAMES,
    KIND_RUNTIME,
    MEMCPY_KINDS,
)
from overshoot.record.errors import KernelTimingError
from overshoot.record.writer import column, int_column

BUFFER_BYTES = 8 << 20
PREALLOCATED_BUFFERS = 8
GPU_KINDS = (KIND_CONCURRENT_KERNEL, KIND_MEMCPY, KIND_MEMSET)
API_KINDS = (KIND_RUNTIME, KIND_DRIVER)
CARRY_COLLECTS = 2  # GPU records wait this many collects for their launch record before going without
KEEP_CALLS_COLLECTS = 4  # launch calls wait this many for their GPU records (kernels lag by the queue)
API_FILTER = {True: "launch, graph, copy and set calls only, by CUPTI callbacks (C)",
              False: "all runtime+driver API activity records; launch, graph, copy, set calls kept (numpy)"}
# The drain thread parses a buffer's records in slices and sleeps this long between slices and stages: a
# thread that holds the GIL makes the engine thread wait up to the switch interval (5 ms) before it is
# forced to let go, and an engine that launches a step late leaves the GPU idle. The sleep lets a waiting
# engine thread take the GIL at once.
PARSE_SLICE = 8192
GIL_YIELD_S = 0.0002
VALIDATE_RECORDS = 4096  # CUPTI's own walk of this many records checks the size table


def unavailable_reason(*, cuda: bool) -> str | None:
    """One line saying why CUPTI kernel timing cannot run here, or None when it can."""
    if not cuda:
        return "needs a CUDA GPU and none was found; use --gpu-timing events (or off)"
    if not native.find_libcupti():
        return ("libcupti not found: install nvidia-cuda-cupti (CUDA 13; nvidia-cuda-cupti-cu12 for CUDA "
                "12), e.g. pip install 'overshoot[cupti]'")
    if native.find_c_compiler() is None:
        return "no C compiler (cc) to build the CUPTI shim"
    return None


class _Session:
    """CUPTI set up once per process: library, shim, timestamp source, buffer callbacks, layout."""

    _lock = threading.Lock()
    _instance: _Session | None = None
    enabled_once = False  # CUPTI's first activity enable in this process has happened

    @classmethod
    def get(cls) -> _Session:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self):
        paths = native.find_libcupti()
        errors = []
        self.cupti = None
        for path in paths:
            try:
                lib = native.Cupti(path)
            except OSError as e:
                errors.append(f"{path}: {e}")
                continue
            if lib.missing:
                errors.append(f"{path}: lacks {', '.join(lib.missing)}")
                continue
            self.cupti = lib
            break
        if self.cupti is None:
            raise KernelTimingError("cannot load libcupti (" + ("; ".join(errors) or "not found") + ")")
        try:
            self.shim = native.Shim(native.build_shim())
        except (RuntimeError, OSError) as e:
            raise KernelTimingError(str(e)) from None
        c = self.cupti
        self.version = c.version()
        self.layout = records.layout_for_version(self.version)
        self.validated = False
        self.notes: list[str] = []
        try:
            c.call("cuptiSetThreadIdType", 1)  # SYSTEM: thread ids are threading.get_native_id()
        except native.CuptiError as e:
            self.notes.append(str(e))
        # Before any kind is enabled (cupti_activity.h): records then come out on CLOCK_MONOTONIC.
        try:
            c.call("cuptiActivityRegisterTimestampCallback", self.shim.fnptr("ovs_monotonic_ns"))
            self.monotonic = True
        except native.CuptiError as e:
            self.monotonic = False
            self.notes.append(f"timestamp callback refused ({e}): CUPTI's clock is mapped")
        self.shim.lib.ovs_set_dropped_fn(c.fnptr("cuptiActivityGetNumDroppedRecords"))
        self.shim.lib.ovs_configure(BUFFER_BYTES, PREALLOCATED_BUFFERS)
        one, size = ctypes.c_uint8(1), ctypes.c_size_t(1)
        try:  # our buffers come zeroed: CUPTI need not clear them on the application's thread
            c.call("cuptiActivitySetAttribute", 5, ctypes.byref(size), ctypes.cast(ctypes.byref(one),
                                                                                   ctypes.c_void_p))
        except native.CuptiError as e:
            self.notes.append(str(e))
        c.call("cuptiActivityRegisterCallbacks", self.shim.fnptr("ovs_buffer_requested"),
               self.shim.fnptr("ovs_buffer_completed"))
        self.calls = False  # launch calls from the shim's callback (else from API activity records)
        if os.environ.get("OVERSHOOT_CUPTI_CALLS", "callbacks") != "activity":
            subscriber = ctypes.c_void_p()
            try:
                c.call("cuptiSubscribe", ctypes.byref(subscriber), self.shim.fnptr("ovs_api_callback"), None)
                self.shim.setup_calls(c.fnptr("cuptiEnableCallback"), subscriber.value,
                                      records.launch_call_ids())
                self.calls = True
            except native.CuptiError as e:
                self.notes.append(f"launch callbacks refused ({e}): API activity records are used")
        self.clock = [self.sample_clock()]
        if self.monotonic and abs(self.clock[0].offset_ns) > self.clock[0].error_ns + 1000:
            # accepted but not in effect (another CUPTI client came first?): map CUPTI's clock instead
            self.monotonic = False
            self.notes.append(f"timestamp callback not in effect (offset {self.clock[0].offset_ns} ns): "
                              "CUPTI's clock is mapped")
        self.names: dict[int, str] = {}

    def sample_clock(self, n: int = 200) -> records.ClockSample:
        before, cupti, after = self.shim.clock_pairs(self.cupti.fnptr("cuptiGetTimestamp"), n)
        return records.best_bracket(before, cupti, after)

    def set_enabled(self, on: bool) -> None:
        # Without the callback, all runtime and driver calls are recorded and the launches picked out in
        # numpy: switching the others off one by one (cuptiActivityEnableRuntimeApi) made each launch cost
        # more, not less (+3.1 against +1.3 µs a launch on the H200, 2026-12-03).
        # Calls are switched on before GPU work and off after it, so a kernel never lacks its call because
        # another thread launched it between two of these switches.
        api = () if self.calls else API_KINDS
        if on and self.calls:
            self._switch_calls(True)
        for kind in (api + GPU_KINDS if on else GPU_KINDS + api):
            self.cupti.call("cuptiActivityEnable" if on else "cuptiActivityDisable", kind)
        if not on and self.calls:
            self._switch_calls(False)

    def _switch_calls(self, on: bool) -> None:
        rc = self.shim.switch_calls(on)
        if rc != native.CUPTI_SUCCESS:
            raise native.CuptiError(f"cuptiEnableCallback -> {rc} ({self.cupti.err(rc)})")

    def offsets(self, addr: int, valid: int) -> tuple[np.ndarray, np.ndarray]:
        """Record offsets of one buffer: the C size walk, checked against CUPTI's own walk of the first
        VALIDATE_RECORDS records of the first buffer (a ctypes call a record: a whole 8 MB buffer took the
        drain thread 0.2-0.6 s on the H200), or of the whole buffer when the prefix does not settle it, and
        again (learning the sizes it lacks) whenever the table does not walk a buffer."""
        if self.validated and self.layout is not None:
            try:
                return self.shim.walk(addr, valid, self.layout.sizes)
            except records.LayoutError:
                pass  # a kind the table lacks: learn its size from CUPTI below rather than lose the buffer
        for limit in (VALIDATE_RECORDS, None):
            walked, offs, kinds, end = self._check(addr, valid, limit)
            if walked is not None:
                self.validated = True
                return walked
            if len(offs) < VALIDATE_RECORDS:  # CUPTI's walk ended before the limit: it was the whole walk
                break
        # no size table walks like CUPTI: take CUPTI's walk, buffer by buffer (slower)
        self.layout = self.layout or records.CUPTI_13_0.with_sizes(
            records.learn_sizes(offs, kinds, end), f"learned (CUPTI {self.version})")
        note = "the size walk disagrees with cuptiActivityGetNextRecord: CUPTI's walk is used"
        if note not in self.notes:
            self.notes.append(note)
        return offs, kinds

    def _check(self, addr: int, valid: int, limit: int | None):
        """The C walk if a size table walks like CUPTI's first `limit` records (else None), and CUPTI's walk:
        offsets, kinds and where its last record ends (None: unknown)."""
        offs, kinds, end = self.cupti.next_record_offsets(addr, valid, limit)
        learned = records.learn_sizes(offs, kinds, end)
        base = self.layout or records.CUPTI_13_0.with_sizes({}, f"learned (CUPTI {self.version})")
        walked = None
        for sizes in (base.sizes, {**base.sizes, **learned}):
            try:
                ours = self.shim.walk(addr, valid, sizes)
            except records.LayoutError:
                continue
            # CUPTI's walk stops at an incomplete record or the limit; ours goes on: theirs must be our prefix
            if len(ours[0]) >= len(offs) and np.array_equal(ours[0][:len(offs)], offs):
                walked = ours
                if sizes is not base.sizes:
                    self.notes.append(f"record sizes learned: {learned}")
                    name = base.name if base.name.startswith("learned") else base.name + "+"
                    self.layout = base.with_sizes(sizes, name)
                break
        return walked, offs, kinds, end

    def name(self, pointer: int) -> str:
        text = self.names.get(pointer)
        if text is None:  # kernel names are CUPTI's strings, alive for the process
            text = ctypes.string_at(pointer).decode(errors="replace") if pointer else ""
            self.names[pointer] = text
        return text


class CuptiCollector:
    """Kernel, copy and set records with their launch calls, on the host perf_counter_ns clock."""

    def __init__(self):
        self._session: _Session | None = None
        self._join = records.LaunchJoin(wait=CARRY_COLLECTS, keep=KEEP_CALLS_COLLECTS)
        self._enabled = False
        self._lock = threading.Lock()  # collect() against close()
        self.setup_ns = 0  # the process's first enable: CUPTI set-up and its first activity enable
        self.prepare_ns = 0  # the same set-up done by prepare(), on the drain thread
        self.flush_all_ns = 0  # inside cuptiActivityFlushAll (ctypes: without the GIL), of collect()'s time

    def _ready(self) -> _Session:
        if self._session is None:
            s = _Session.get()
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
            if not _Session.enabled_once:
                s.set_enabled(True)
                s.set_enabled(False)
                _Session.enabled_once = True
                s.cupti.call("cuptiActivityFlushAll", 1)
                while chunk := s.shim.take_completed():
                    for addr, _ in chunk:
                        if addr:
                            s.shim.lib.ovs_recycle(addr)
                if s.calls:
                    s.shim.take_calls()
        except native.CuptiError as e:
            raise KernelTimingError(str(e)) from None
        finally:
            self.prepare_ns += time.perf_counter_ns() - t

    def enable(self) -> None:
        """Engine thread, step boundary: five ctypes calls into CUPTI, ~0.1 ms (the first call also sets
        CUPTI up for the process, see _Session). Never synchronizes or flushes."""
        first = not _Session.enabled_once
        t = time.perf_counter_ns()
        try:
            self._ready().set_enabled(True)
        except native.CuptiError as e:
            raise KernelTimingError(str(e)) from None
        if first:  # CUPTI attaches to the context here: tens to hundreds of ms, once a process
            _Session.enabled_once = True
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
            buffers = []
            while chunk := s.shim.take_completed():
                buffers += chunk
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
                for addr, _ in buffers:
                    if addr:
                        s.shim.lib.ovs_recycle(addr)
            if s.calls:  # after the flush: every call of a kernel flushed so far has returned
                api_parts.append(records.call_columns(s.shim.take_calls()))
            if not s.monotonic:
                s.clock.append(s.sample_clock())
            gpu, match, calls = self._join.step(gpu_parts, api_parts, final=final)
            time.sleep(GIL_YIELD_S)
            return self._rows(s, gpu, match, calls) if gpu else None

    @staticmethod
    def _rows(s: _Session, gpu: dict, match: np.ndarray, api: dict) -> dict:
        if s.monotonic:
            def to_host(x: np.ndarray) -> np.ndarray:
                return x.astype(np.int64)
        else:
            def to_host(x: np.ndarray) -> np.ndarray:
                return records.to_host_clock(x, s.clock)
        # the shim's calls are timed on the host clock already; API activity records on CUPTI's
        call_to_host = (lambda x: x.astype(np.int64)) if getattr(s, "calls", False) else to_host
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
    def _names(s: _Session, gpu: dict) -> pa.DictionaryArray:
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
