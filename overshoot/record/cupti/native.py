"""The native side of kernel timing: find libcupti, compile the C shim (shim.c, calls.c) once; ctypes.

The shim is compiled once per source and platform by record/cbuild.py (the system C compiler, a cache
directory). libcupti: the copy torch already loaded if any, else the nvidia wheel's for torch's CUDA major
(13: `nvidia-cuda-cupti`, nvidia/cu13/lib/libcupti.so.13; 12: `nvidia-cuda-cupti-cu12`,
nvidia/cuda_cupti/lib/libcupti.so.12), else a CUDA toolkit's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
from pathlib import Path

import numpy as np

from overshoot.record.cbuild import compile_cached, find_c_compiler  # noqa: F401 (native.find_c_compiler)
from overshoot.record.cupti.records import CALL_DTYPE, LayoutError

SHIM_SOURCES = (Path(__file__).with_name("shim.c"), Path(__file__).with_name("calls.c"))
CUPTI_SUCCESS, CUPTI_ERROR_MAX_LIMIT_REACHED, CUPTI_ERROR_INVALID_KIND = 0, 12, 21


class CuptiError(RuntimeError):
    """A CUPTI call that failed; the message names the call and CUPTI's reason."""


def build_shim(out_dir: str | None = None) -> str:
    """Path of the compiled shim, compiling it if this source and platform have no build yet."""
    return compile_cached(SHIM_SOURCES, stem="libovs_cupti_shim", libs=("-lpthread",), what="the CUPTI shim",
                          out_dir=out_dir)


_STAT_NAMES = ["requested", "completed", "allocated", "alloc_failed", "dropped_records",
               "outstanding", "last_request_tid", "last_complete_tid", "lost",
               "null_completed", "complete_tids_differ", "first_complete_tid"]



class Shim:
    """ctypes view of the compiled shim."""

    def __init__(self, path: str):
        self.path = path
        L = self.lib = ctypes.CDLL(path)
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        L.ovs_monotonic_ns.restype = ctypes.c_uint64
        L.ovs_monotonic_ns.argtypes = []
        L.ovs_configure.restype = ctypes.c_long
        L.ovs_configure.argtypes = [sz, sz]
        L.ovs_set_dropped_fn.argtypes = [vp]
        L.ovs_set_dropped_fn.restype = None
        L.ovs_buffer_requested.argtypes = [ctypes.POINTER(vp), ctypes.POINTER(sz), ctypes.POINTER(sz)]
        L.ovs_buffer_requested.restype = None
        L.ovs_buffer_completed.argtypes = [vp, ctypes.c_uint32, vp, sz, sz]
        L.ovs_buffer_completed.restype = None
        L.ovs_take_completed.argtypes = [ctypes.POINTER(vp), ctypes.POINTER(sz), sz]
        L.ovs_take_completed.restype = sz
        L.ovs_num_completed.restype = sz
        L.ovs_buffer_size.restype = sz
        L.ovs_recycle.argtypes = [vp]
        L.ovs_recycle.restype = None
        L.ovs_release_free.restype = sz
        L.ovs_stats.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
        L.ovs_stats.restype = None
        i64p = np.ctypeslib.ndpointer(np.int64, flags="C_CONTIGUOUS")
        u64p = np.ctypeslib.ndpointer(np.uint64, flags="C_CONTIGUOUS")
        i32p = np.ctypeslib.ndpointer(np.int32, flags="C_CONTIGUOUS")
        u32p = np.ctypeslib.ndpointer(np.uint32, flags="C_CONTIGUOUS")
        L.ovs_clock_pairs.argtypes = [vp, ctypes.c_int, i64p, u64p, i64p]
        L.ovs_clock_pairs.restype = ctypes.c_int
        L.ovs_walk.argtypes = [vp, sz, u32p, ctypes.c_int, i64p, i32p, sz]
        L.ovs_walk.restype = ctypes.c_long
        L.ovs_gather.argtypes = [vp, i64p, sz, sz, sz, vp]
        L.ovs_gather.restype = None
        L.ovs_calls_setup.argtypes = [vp, vp, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint32),
                                      ctypes.c_int]
        L.ovs_calls_setup.restype = ctypes.c_int
        L.ovs_calls_switch.argtypes = [ctypes.c_int]
        L.ovs_calls_switch.restype = ctypes.c_int
        L.ovs_calls_swap.argtypes = [ctypes.POINTER(vp), ctypes.POINTER(sz)]
        L.ovs_calls_swap.restype = sz
        L.ovs_calls_release.argtypes = [vp, sz]
        L.ovs_calls_release.restype = None
        L.ovs_calls_stats.argtypes = [ctypes.POINTER(ctypes.c_int64)]
        L.ovs_calls_stats.restype = None
        L.ovs_api_callback.argtypes = [vp, ctypes.c_int, ctypes.c_uint32, vp]
        L.ovs_api_callback.restype = None

    def fnptr(self, name: str) -> int:
        return ctypes.cast(getattr(self.lib, name), ctypes.c_void_p).value

    def stats(self) -> dict:
        arr = (ctypes.c_int64 * 12)()
        self.lib.ovs_stats(arr, 12)
        return dict(zip(_STAT_NAMES, list(arr), strict=True))

    def take_completed(self, max_n: int = 4096) -> list[tuple[int, int]]:
        bufs = (ctypes.c_void_p * max_n)()
        valid = (ctypes.c_size_t * max_n)()
        n = self.lib.ovs_take_completed(bufs, valid, max_n)
        return [(int(bufs[i] or 0), int(valid[i])) for i in range(n)]

    def take_all_completed(self) -> list[tuple[int, int]]:
        """Every buffer CUPTI has handed over so far: (address, valid bytes)."""
        buffers = []
        while chunk := self.take_completed():
            buffers += chunk
        return buffers

    def recycle(self, buffers: list[tuple[int, int]]) -> None:
        """Buffers taken with take_completed back to the shim's pool."""
        for addr, _ in buffers:
            if addr:
                self.lib.ovs_recycle(addr)

    def walk(self, addr: int, valid: int, sizes: dict) -> tuple[np.ndarray, np.ndarray]:
        table = np.zeros(64, np.uint32)
        for k, s in sizes.items():
            if 0 <= k < 64:
                table[k] = s
        max_n = valid // 8 + 1
        offs = np.empty(max_n, np.int64)
        kinds = np.empty(max_n, np.int32)
        n = self.lib.ovs_walk(addr, valid, table, 64, offs, kinds, max_n)
        if n < 0:
            raise LayoutError(f"native walk failed at byte {-n - 1}")
        return offs[:n].copy(), kinds[:n].copy()

    def gather(self, buf: np.ndarray, offsets: np.ndarray, field_offset: int, size: int) -> np.ndarray:
        """The `size` bytes at each offset + field_offset of `buf`, packed (records.parse's byte gather in C,
        without the GIL)."""
        offsets = np.ascontiguousarray(offsets, np.int64)
        out = np.empty(len(offsets) * size, np.uint8)
        if len(offsets):
            self.lib.ovs_gather(buf.ctypes.data, offsets, len(offsets), field_offset, size, out.ctypes.data)
        return out

    def setup_calls(self, enable_fnptr: int, subscriber: int, domain_cbids: list[tuple[int, int]]) -> None:
        """The (domain, cbid) pairs `switch_calls` turns on and off through cuptiEnableCallback."""
        n = len(domain_cbids)
        domains = (ctypes.c_int * n)(*(d for d, _ in domain_cbids))
        cbids = (ctypes.c_uint32 * n)(*(c for _, c in domain_cbids))
        if self.lib.ovs_calls_setup(enable_fnptr, subscriber, domains, cbids, n) != 0:
            raise RuntimeError(f"too many call ids for the shim: {n}")

    def switch_calls(self, on: bool) -> int:
        """CUPTI's first error code (0: every call id switched)."""
        return self.lib.ovs_calls_switch(1 if on else 0)

    def take_calls(self) -> np.ndarray:
        """The launch calls recorded since the last take (records.CALL_DTYPE), copied out of the shim."""
        ptr, capacity = ctypes.c_void_p(), ctypes.c_size_t()
        n = self.lib.ovs_calls_swap(ctypes.byref(ptr), ctypes.byref(capacity))
        try:
            if not n:
                return np.zeros(0, CALL_DTYPE)
            raw = (ctypes.c_uint8 * (n * CALL_DTYPE.itemsize)).from_address(ptr.value)
            return np.frombuffer(raw, CALL_DTYPE).copy()
        finally:
            if ptr.value:
                self.lib.ovs_calls_release(ptr, capacity.value)

    def calls_stats(self) -> dict:
        arr = (ctypes.c_int64 * 3)()
        self.lib.ovs_calls_stats(arr)
        return {"calls_lost": arr[0], "calls_unpaired": arr[1], "calls_pending": arr[2]}

    def clock_pairs(self, ts_fnptr: int, n: int):
        b = np.empty(n, np.int64)
        c = np.empty(n, np.uint64)
        a = np.empty(n, np.int64)
        rc = self.lib.ovs_clock_pairs(ts_fnptr, n, b, c, a)
        if rc != 0:
            raise RuntimeError(f"cuptiGetTimestamp failed: {rc}")
        return b, c, a


def _torch_cuda_major() -> int | None:
    t = sys.modules.get("torch")
    v = getattr(getattr(t, "version", None), "cuda", None) if t else None
    try:
        return int(str(v).split(".")[0]) if v else None
    except ValueError:
        return None


def _mapped_libcupti() -> str | None:
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.rstrip().split(" ")[-1]
                if "/libcupti.so" in p and os.path.exists(p):
                    return p
    except OSError:
        pass
    return None


def find_libcupti(cuda_major: int | None = None) -> list[str]:
    """Candidate libcupti paths, best first.

    CUDA 13 wheel ``nvidia-cuda-cupti`` installs ``nvidia/cu13/lib/libcupti.so.13``;
    CUDA 12 wheel ``nvidia-cuda-cupti-cu12`` installs ``nvidia/cuda_cupti/lib/libcupti.so.12``.
    """
    cands: list[str] = []
    env = os.environ.get("OVERSHOOT_CUPTI_LIB")
    if env:
        cands.append(env)
    m = _mapped_libcupti()  # the copy torch already loaded, if any: always prefer it
    if m:
        cands.append(m)
    major = cuda_major or _torch_cuda_major()
    order = [13, 12] if major in (None, 13) else [12, 13]
    for mj in order:
        for sp in sys.path:
            if not sp or not os.path.isdir(sp):
                continue
            sub = "cu13" if mj >= 13 else "cuda_cupti"
            cands += sorted(glob.glob(os.path.join(sp, "nvidia", sub, "lib", f"libcupti.so.{mj}*")))
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            cands += sorted(glob.glob(os.path.join(root, "extras", "CUPTI", "lib64", "libcupti.so*")))
    lib = ctypes.util.find_library("cupti")
    if lib:
        cands.append(lib)
    seen, out = set(), []
    for c in cands:
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


class Cupti:
    """Minimal ctypes binding of the CUPTI C API subset we need."""

    def __init__(self, path: str):
        self.path = path
        L = self.lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        vp, sz, u32, u8 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32, ctypes.c_uint8
        sig = {
            "cuptiGetVersion": [ctypes.POINTER(u32)],
            "cuptiGetResultString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
            "cuptiGetTimestamp": [ctypes.POINTER(ctypes.c_uint64)],
            "cuptiSetThreadIdType": [ctypes.c_int],
            "cuptiActivityEnable": [ctypes.c_int],
            "cuptiActivityDisable": [ctypes.c_int],
            "cuptiActivityEnableRuntimeApi": [u32, u8],
            "cuptiActivityEnableDriverApi": [u32, u8],
            "cuptiActivityRegisterCallbacks": [vp, vp],
            "cuptiActivityRegisterTimestampCallback": [vp],
            "cuptiActivityFlushAll": [u32],
            "cuptiActivitySetAttribute": [ctypes.c_int, ctypes.POINTER(sz), vp],
            "cuptiActivityGetNextRecord": [vp, sz, ctypes.POINTER(vp)],
            "cuptiActivityGetNumDroppedRecords": [vp, u32, ctypes.POINTER(sz)],
            "cuptiFinalize": [],
            "cuptiSubscribe": [ctypes.POINTER(vp), vp, vp],
            "cuptiEnableCallback": [u32, vp, ctypes.c_int, u32],
        }
        self.missing = []
        for name, args in sig.items():
            fn = getattr(L, name, None)
            if fn is None:
                self.missing.append(name)
                continue
            fn.argtypes = args
            fn.restype = ctypes.c_int

    def err(self, rc: int) -> str:
        s = ctypes.c_char_p()
        try:
            self.lib.cuptiGetResultString(rc, ctypes.byref(s))
            return (s.value or b"").decode(errors="replace")
        except Exception:
            return f"CUPTI error {rc}"

    def call(self, name: str, *args, ok=(CUPTI_SUCCESS,)) -> int:
        rc = getattr(self.lib, name)(*args)
        if rc not in ok:
            raise CuptiError(f"{name} -> {rc} ({self.err(rc)})")
        return rc

    def version(self) -> int:
        v = ctypes.c_uint32()
        self.call("cuptiGetVersion", ctypes.byref(v))
        return int(v.value)

    def timestamp(self) -> int:
        t = ctypes.c_uint64()
        self.call("cuptiGetTimestamp", ctypes.byref(t))
        return int(t.value)

    def fnptr(self, name: str) -> int:
        return ctypes.cast(getattr(self.lib, name), ctypes.c_void_p).value

    def next_record_offsets(self, addr: int, valid: int,
                            limit: int | None = None) -> tuple[np.ndarray, np.ndarray, int | None]:
        """CUPTI's own walk (cuptiActivityGetNextRecord, one ctypes call a record): offsets, kinds, and the
        end of the last record: `valid`, or None when an incomplete record or `limit` records stopped the
        walk (then the last record's size is unknown)."""
        rec = ctypes.c_void_p(None)
        offs, kinds = [], []
        f = self.lib.cuptiActivityGetNextRecord
        end: int | None = valid
        while True:
            if limit is not None and len(offs) >= limit:
                end = None
                break
            rc = f(addr, valid, ctypes.byref(rec))
            if rc == CUPTI_ERROR_MAX_LIMIT_REACHED:
                break
            if rc == CUPTI_ERROR_INVALID_KIND:  # incomplete or invalid record: CUPTI's walk ends here
                end = None
                break
            if rc != CUPTI_SUCCESS:
                raise CuptiError(f"cuptiActivityGetNextRecord -> {rc} ({self.err(rc)})")
            offs.append(rec.value - addr)
            kinds.append(ctypes.c_uint32.from_address(rec.value).value)
        return np.asarray(offs, np.int64), np.asarray(kinds, np.int32), end
