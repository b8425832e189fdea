"""CUPTI activity buffers parsed on the CPU: buffers built byte by byte with the documented 13.0 layouts
(the same offsets the collector reads on the GPU), walked, parsed, sizes learned, kernels joined to their
launch calls; and the C shim compiles with the system compiler. The GPU side is proven on the H200
(benchmarks/gpu_truth.py collector)."""

from __future__ import annotations

import ctypes
import shutil
import struct

import numpy as np
import pytest

from overshoot.record.cupti import native, records
from overshoot.record.cupti.records import (
    CUPTI_13_0,
    KIND_CONCURRENT_KERNEL,
    KIND_DRIVER,
    KIND_MEMCPY,
    KIND_MEMSET,
    KIND_RUNTIME,
)


def kernel(start, end, stream, corr, name_ptr=0xABC):
    rec = bytearray(CUPTI_13_0.sizes[KIND_CONCURRENT_KERNEL])
    struct.pack_into("<I", rec, 0, KIND_CONCURRENT_KERNEL)
    struct.pack_into("<QQ", rec, 16, start, end)
    struct.pack_into("<I", rec, 48, stream)
    struct.pack_into("<I", rec, 92, corr)
    struct.pack_into("<Q", rec, 104, name_ptr)
    return bytes(rec)


def memcpy(start, end, stream, corr, copy_kind=1):
    rec = bytearray(CUPTI_13_0.sizes[KIND_MEMCPY])
    struct.pack_into("<IB", rec, 0, KIND_MEMCPY, copy_kind)
    struct.pack_into("<QQ", rec, 16, start, end)
    struct.pack_into("<II", rec, 40, stream, corr)
    return bytes(rec)


def memset(start, end, stream, corr):
    rec = bytearray(CUPTI_13_0.sizes[KIND_MEMSET])
    struct.pack_into("<I", rec, 0, KIND_MEMSET)
    struct.pack_into("<QQ", rec, 16, start, end)
    struct.pack_into("<II", rec, 40, stream, corr)
    return bytes(rec)


def api(start, end, corr, cbid=211, driver=False):
    rec = bytearray(40)
    struct.pack_into("<II", rec, 0, KIND_DRIVER if driver else KIND_RUNTIME, cbid)
    struct.pack_into("<QQ", rec, 8, start, end)
    struct.pack_into("<II", rec, 28, 1234, corr)
    return bytes(rec)


def test_walk_parse_and_join_a_buffer():
    buf = (api(100, 110, 7) + kernel(120, 150, 3, 7) + api(200, 230, 8, cbid=311) + kernel(240, 250, 3, 8)
           + kernel(250, 270, 3, 8) + memcpy(300, 320, 5, 9, copy_kind=2) + api(290, 295, 9, cbid=41)
           + memset(330, 331, 5, 10) + api(400, 401, 11, cbid=307, driver=True) + bytes(64))  # zeroed tail
    offsets, kinds = records.walk(buf, CUPTI_13_0.sizes)
    assert kinds.tolist() == [KIND_RUNTIME, KIND_CONCURRENT_KERNEL, KIND_RUNTIME, KIND_CONCURRENT_KERNEL,
                              KIND_CONCURRENT_KERNEL, KIND_MEMCPY, KIND_RUNTIME, KIND_MEMSET, KIND_DRIVER]
    gpu, calls = records.parse(buf, CUPTI_13_0, offsets, kinds)
    assert gpu["gpu_kind"].tolist() == [records.KERNEL] * 3 + [records.MEMCPY, records.MEMSET]
    assert gpu["start"].tolist() == [120, 240, 250, 300, 330]
    assert gpu["end"].tolist() == [150, 250, 270, 320, 331]
    assert gpu["stream"].tolist() == [3, 3, 3, 5, 5] and gpu["copy_kind"].tolist()[3] == 2
    assert calls["cbid"].tolist() == [211, 311, 41, 307] and calls["driver"].tolist() == [False] * 3 + [True]
    match = records.join_launches(gpu["correlation"], calls)
    # both kernels of graph launch 8 share its call; the set (correlation 10) has no call in this buffer
    assert calls["start"][match[match >= 0]].tolist() == [100, 200, 200, 290]
    assert match.tolist()[-1] == -1


def test_a_runtime_call_wins_over_the_driver_call_it_makes():
    gpu = np.array([5], np.uint32)
    calls = {"correlation": np.array([5, 5], np.uint32), "driver": np.array([True, False]),
             "start": np.array([10, 20], np.uint64)}
    assert records.join_launches(gpu, calls).tolist() == [1]


def test_sizes_are_learned_and_a_bad_table_is_refused():
    buf = kernel(1, 2, 3, 4) + api(5, 6, 4) + kernel(7, 8, 3, 9)
    offsets, kinds = records.walk(buf, CUPTI_13_0.sizes)
    assert records.learn_sizes(offsets, kinds, len(buf)) == {KIND_CONCURRENT_KERNEL: 216, KIND_RUNTIME: 40}
    with pytest.raises(records.LayoutError):
        records.walk(buf, {KIND_CONCURRENT_KERNEL: 256, KIND_RUNTIME: 40})
    with pytest.raises(records.LayoutError):
        records.learn_sizes(np.array([0, 216, 400]), np.array([10, 10, 10]), 616)
    assert records.layout_for_version(130001) is CUPTI_13_0 and records.layout_for_version(120800) is None


def test_clock_brackets_and_mapping():
    before = np.array([1000, 2000, 3000])
    after = np.array([1100, 2010, 3500])
    cupti = np.array([50, 955, 1950])
    sample = records.best_bracket(before, cupti, after)
    assert (sample.offset_ns, sample.error_ns) == (2005 - 955, 5)
    later = records.ClockSample(1_000_955, 2005 - 955 + 100, 5)  # 100 ns drift over 1 ms of CUPTI time
    mapped = records.to_host_clock(np.array([955, 500_955, 1_000_955]), [sample, later])
    assert (mapped - np.array([955, 500_955, 1_000_955])).tolist() == [1050, 1100, 1150]


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_the_shim_compiles_and_keeps_its_buffer_pool(tmp_path):
    shim = native.Shim(native.build_shim(str(tmp_path)))
    assert native.build_shim(str(tmp_path)) == shim.path  # cached by source hash
    assert shim.lib.ovs_configure(1 << 16, 2) == 2
    buffer, size, most = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_size_t()
    shim.lib.ovs_buffer_requested(ctypes.byref(buffer), ctypes.byref(size), ctypes.byref(most))
    assert buffer.value and size.value == 1 << 16
    data = kernel(10, 20, 1, 2) + api(1, 5, 2)
    ctypes.memmove(buffer.value, data, len(data))
    shim.lib.ovs_buffer_completed(None, 0, buffer.value, size.value, len(data))
    ((addr, valid),) = shim.take_completed()
    assert (addr, valid) == (buffer.value, len(data))
    offsets, kinds = shim.walk(addr, valid, CUPTI_13_0.sizes)
    assert offsets.tolist() == [0, 216] and kinds.tolist() == [KIND_CONCURRENT_KERNEL, KIND_RUNTIME]
    shim.lib.ovs_recycle(addr)
    assert shim.stats()["completed"] == 1 and shim.take_completed() == []
    now = shim.lib.ovs_monotonic_ns()
    import time

    assert abs(now - time.perf_counter_ns()) < 5_000_000  # the same clock as perf_counter_ns


def test_unavailable_reason_without_cuda_is_one_line():
    from overshoot.record.cupti import unavailable_reason

    reason = unavailable_reason(cuda=False)
    assert reason and "\n" not in reason and "CUDA GPU" in reason
