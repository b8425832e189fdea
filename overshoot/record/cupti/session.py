"""CUPTI set up once per process (Session): libcupti, the C shim, the timestamp source, the activity-buffer
callbacks, the launch-call callback's subscriber and the record layout, and the switches of what is recorded.

CUPTI's state is per process (one activity client, one callback subscriber, callbacks that cannot be
unregistered), so the collectors of successive recorders share one Session, one enabled at a time
(collector.py). Where CUPTI refuses the subscriber (another tool holds it) or OVERSHOOT_CUPTI_CALLS=activity,
launch calls come from CUPTI's runtime and driver API activity records instead.
"""

from __future__ import annotations

import ctypes
import os
import threading

import numpy as np

from overshoot.record.cupti import native, records
from overshoot.record.cupti.records import (
    KIND_CONCURRENT_KERNEL,
    KIND_DRIVER,
    KIND_MEMCPY,
    KIND_MEMSET,
    KIND_RUNTIME,
)
from overshoot.record.errors import KernelTimingError

BUFFER_BYTES = 8 << 20
PREALLOCATED_BUFFERS = 8
GPU_KINDS = (KIND_CONCURRENT_KERNEL, KIND_MEMCPY, KIND_MEMSET)
API_KINDS = (KIND_RUNTIME, KIND_DRIVER)
API_FILTER = {True: "launch, graph, copy and set calls only, by CUPTI callbacks (C)",
              False: "all runtime+driver API activity records; launch, graph, copy, set calls kept (numpy)"}
VALIDATE_RECORDS = 4096  # CUPTI's own walk of this many records checks the size table


class Session:
    """CUPTI set up once per process: library, shim, timestamp source, buffer callbacks, layout."""

    _lock = threading.Lock()
    _instance: Session | None = None
    enabled_once = False  # CUPTI's first activity enable in this process has happened

    @classmethod
    def get(cls) -> Session:
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
