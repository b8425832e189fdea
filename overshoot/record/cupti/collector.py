"""CuptiCollector: the default kernel-timing collector (record/kernel_timing.py's Collector protocol).

Costs by caller:
- engine thread, at a step boundary: `enable()` / `disable()` switch CUPTI's activity kinds (a few ctypes
  calls); never a synchronize or a flush. Then CUPTI itself adds work to every launch while enabled
  (measured by benchmarks/cupti_probe.py: about 1 µs a launch on the H200).
- drain thread, every ~0.5 s: `collect()` flushes completed buffers, walks them in C, parses with numpy,
  joins each kernel to its launch call by correlation id: no Python per record.
CUPTI's state is per process (one activity client, callbacks that cannot be unregistered), so it is set up
once per process (`_Session`) and shared by the collectors of successive recorders, one enabled at a time.
All runtime and driver API records are taken; only those of calls that put work on the GPU (launches,
graph launches, copies, sets) are joined to kernels, the rest are dropped when parsed.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from overshoot.record.cupti import native, records
from overshoot.record.cupti.records import (
    DRIVER_LAUNCH_CBIDS,
    KIND_CONCURRENT_KERNEL,
    KIND_DRIVER,
    KIND_MEMCPY,
    KIND_MEMSET,
    KIND_NAMES,
    KIND_RUNTIME,
    MEMCPY_KINDS,
    RUNTIME_LAUNCH_CBIDS,
)
from overshoot.record.errors import KernelTimingError

BUFFER_BYTES = 8 << 20
PREALLOCATED_BUFFERS = 8
GPU_KINDS = (KIND_CONCURRENT_KERNEL, KIND_MEMCPY, KIND_MEMSET)
CARRY_COLLECTS = 2  # GPU records wait this many collects for their launch record before going without


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
        self.clock = [self.sample_clock()]
        self.names: dict[int, str] = {}

    def sample_clock(self, n: int = 200) -> records.ClockSample:
        before, cupti, after = self.shim.clock_pairs(self.cupti.fnptr("cuptiGetTimestamp"), n)
        return records.best_bracket(before, cupti, after)

    def set_enabled(self, on: bool) -> None:
        # All runtime and driver calls are recorded and the launches picked out in numpy: switching the
        # others off one by one (cuptiActivityEnableRuntimeApi) made each launch cost more, not less
        # (+3.1 against +1.3 µs a launch on the H200, 2026-12-03).
        for kind in GPU_KINDS + (KIND_RUNTIME, KIND_DRIVER):
            self.cupti.call("cuptiActivityEnable" if on else "cuptiActivityDisable", kind)

    def offsets(self, addr: int, valid: int) -> tuple[np.ndarray, np.ndarray]:
        """Record offsets of one buffer: the C size walk, checked once against CUPTI's own walk."""
        if self.layout is None or not self.validated:
            theirs = self.cupti.next_record_offsets(addr, valid)
            learned = records.learn_sizes(*theirs, valid)
            if self.layout is None:
                self.layout = records.CUPTI_13_0.with_sizes(learned, f"learned (CUPTI {self.version})")
            try:
                ours = self.shim.walk(addr, valid, self.layout.sizes)
                same = all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))
            except records.LayoutError:
                same = False
            if not same:
                self.notes.append(f"record sizes learned: {learned}")
                self.layout = self.layout.with_sizes({**self.layout.sizes, **learned}, self.layout.name + "+")
            self.validated = True
            return theirs
        return self.shim.walk(addr, valid, self.layout.sizes)

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
        self._carried: list[tuple[int, dict]] = []  # GPU records still waiting for their launch record
        self._api: dict = {}  # launch records not yet matched (a kernel's record may come later)
        self._lock = threading.Lock()

    def _ready(self) -> _Session:
        if self._session is None:
            self._session = _Session.get()
        return self._session

    def describe(self) -> dict:
        s = self._session
        if s is None:
            return {"backend": "cupti"}
        return {"backend": "cupti (native shim)", "libcupti": s.cupti.path, "cupti_version": s.version,
                "layout": s.layout.name if s.layout else None,
                "clock": "CLOCK_MONOTONIC callback" if s.monotonic else "CUPTI clock, mapped",
                "clock_error_ns": max(c.error_ns for c in s.clock), "notes": list(s.notes),
                "shim": s.shim.stats()}

    def enable(self) -> None:
        try:
            self._ready().set_enabled(True)
        except native.CuptiError as e:
            raise KernelTimingError(str(e)) from None

    def disable(self) -> None:
        if self._session is not None:
            self._session.set_enabled(False)

    def collect(self, *, final: bool = False) -> dict | None:
        s = self._session
        if s is None:
            return None
        with self._lock:
            s.cupti.call("cuptiActivityFlushAll", 1 if final else 0)
            gpu_parts, api_parts = [], []
            buffers = []
            while chunk := s.shim.take_completed():
                buffers += chunk
            try:
                for addr, valid in buffers:
                    if addr and valid:
                        view = np.ctypeslib.as_array((ctypes.c_uint8 * valid).from_address(addr))
                        offsets = s.offsets(addr, valid)
                        gpu, api = records.parse(view, s.layout or records.CUPTI_13_0, *offsets)
                        gpu_parts.append(gpu)
                        api_parts.append(api)
            finally:
                for addr, _ in buffers:
                    if addr:
                        s.shim.lib.ovs_recycle(addr)
            if not s.monotonic:
                s.clock.append(s.sample_clock())
            return self._columns(s, gpu_parts, api_parts, final=final)

    def _columns(self, s: _Session, gpu_parts: list[dict], api_parts: list[dict], *,
                 final: bool) -> dict | None:
        """Join the GPU records to their launch calls. A record whose call has not arrived yet (another
        buffer) waits up to CARRY_COLLECTS collects; calls are kept as long, since the kernels of one graph
        launch share theirs and may come in later buffers."""
        gpu = records.concat([g for _, g in self._carried] + gpu_parts)
        gpu_age = np.concatenate([np.full(len(g["start"]), age) for age, g in self._carried]
                                 + [np.zeros(len(g["start"]), np.int64) for g in gpu_parts]) if gpu else None
        fresh_api = records.concat(api_parts)
        if fresh_api:  # keep the calls that put work on the GPU; the others (most of them) go now
            launch = np.where(fresh_api["driver"], np.isin(fresh_api["cbid"], list(DRIVER_LAUNCH_CBIDS)),
                              np.isin(fresh_api["cbid"], list(RUNTIME_LAUNCH_CBIDS)))
            fresh_api = {k: v[launch] for k, v in fresh_api.items()}
            fresh_api["age"] = np.zeros(len(fresh_api["start"]), np.int64)
        api = records.concat([self._api, fresh_api])
        self._carried = []
        out = None
        if gpu:
            match = records.join_launches(gpu["correlation"], api)
            waiting = (match < 0) & (gpu_age < CARRY_COLLECTS) if not final else np.zeros(len(match), bool)
            if waiting.any():
                self._carried = [(int(gpu_age[waiting].min()) + 1, {k: v[waiting] for k, v in gpu.items()})]
            keep = ~waiting
            if keep.any():
                out = self._rows(s, {k: v[keep] for k, v in gpu.items()}, match[keep], api)
        if api and not final:
            api["age"] = api["age"] + 1
            young = api["age"] <= CARRY_COLLECTS
            self._api = {k: v[young] for k, v in api.items()}
        else:
            self._api = {}
        return out

    @staticmethod
    def _rows(s: _Session, gpu: dict, match: np.ndarray, api: dict) -> dict:
        if s.monotonic:
            def to_host(x: np.ndarray) -> np.ndarray:
                return x.astype(np.int64)
        else:
            def to_host(x: np.ndarray) -> np.ndarray:
                return records.to_host_clock(x, s.clock)
        has = match >= 0
        launch_start = np.full(len(match), np.nan)
        launch_end = np.full(len(match), np.nan)
        if has.any():
            launch_start[has] = to_host(api["start"][match[has]])
            launch_end[has] = to_host(api["end"][match[has]])
        return {"kind": [KIND_NAMES[k] for k in gpu["gpu_kind"].tolist()],
                "name": CuptiCollector._names(s, gpu), "stream": gpu["stream"].astype(np.int64),
                "correlation": gpu["correlation"].astype(np.int64), "launch_start_ns": launch_start,
                "launch_end_ns": launch_end, "gpu_start_ns": to_host(gpu["start"]),
                "gpu_end_ns": to_host(gpu["end"])}

    @staticmethod
    def _names(s: _Session, gpu: dict) -> list[str]:
        pointers, inverse = np.unique(gpu["name_ptr"], return_inverse=True)
        names = np.array([s.name(p) for p in pointers.tolist()], dtype=object)[inverse.ravel()]
        copies = gpu["gpu_kind"] == records.MEMCPY
        names[copies] = ["memcpy " + MEMCPY_KINDS.get(k, "?") for k in gpu["copy_kind"][copies].tolist()]
        names[gpu["gpu_kind"] == records.MEMSET] = "memset"
        return names.tolist()

    def close(self) -> None:
        """Drop what is left. CUPTI's callbacks stay registered (they cannot be removed): a later
        collector in this process reuses them."""
        self._carried, self._api = [], {}
