"""CUPTI activity buffers parsed on the CPU: buffers built byte by byte with the documented 13.0 layouts
(the same offsets the collector reads on the GPU), walked, parsed, sizes learned, kernels joined to their
launch calls across collects (NaN launch when the call never comes), the collector's output columns; and the
C shim compiles with the system compiler and exports what native.py binds. No libcupti, no CUDA: the GPU
side is proven on the H200 (benchmarks/cupti_probe.py)."""

from __future__ import annotations

import ctypes
import shutil
import struct
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

from overshoot.record.cupti import native, records
from overshoot.record.cupti.records import (
    CUPTI_13_0,
    CUPTI_13_5,
    KIND_CONCURRENT_KERNEL,
    KIND_DRIVER,
    KIND_MEMCPY,
    KIND_MEMSET,
    KIND_RUNTIME,
)

needs_cc = pytest.mark.skipif(native.find_c_compiler() is None, reason="no C compiler")


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


@needs_cc
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
    assert abs(now - time.perf_counter_ns()) < 5_000_000  # the same clock as perf_counter_ns


def test_unavailable_reason_without_cuda_is_one_line():
    from overshoot.record.cupti import unavailable_reason

    had_torch = "torch" in sys.modules
    reason = unavailable_reason(cuda=False)
    assert reason and "\n" not in reason and "CUDA GPU" in reason
    assert ("torch" in sys.modules) == had_torch  # answering must not import torch


def test_unavailable_reason_needs_a_shim_build_not_a_compiler(tmp_path, monkeypatch):
    """With CUDA and libcupti present, kernel timing is refused only when the shim can be neither found in
    the cache nor compiled: a machine that built it once needs no compiler any more."""
    from overshoot.record.cupti import unavailable_reason

    monkeypatch.setattr(native, "find_libcupti", lambda: "libcupti.so.13")  # the GPU machine's answer
    monkeypatch.setenv("OVERSHOOT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CC", raising=False)
    assert unavailable_reason(cuda=True) == "no C compiler (cc, gcc, clang or $CC) to build the CUPTI shim"
    monkeypatch.undo()
    if native.find_c_compiler() is None:
        return
    monkeypatch.setenv("OVERSHOOT_CACHE", str(tmp_path / "cache"))
    native.build_shim()  # built once, with a compiler
    monkeypatch.setattr(native, "find_libcupti", lambda: "libcupti.so.13")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CC", raising=False)
    assert unavailable_reason(cuda=True) is None


def test_a_zeroed_tail_ends_the_walk_and_an_empty_buffer_parses_to_empty_columns():
    offsets, kinds = records.walk(api(1, 2, 3) + bytes(512), CUPTI_13_0.sizes)
    assert offsets.tolist() == [0] and kinds.tolist() == [KIND_RUNTIME]
    gpu, calls = records.parse(b"", CUPTI_13_0, *records.walk(b"", CUPTI_13_0.sizes))
    assert len(gpu["start"]) == 0 and len(calls["cbid"]) == 0 and gpu["start"].dtype == np.uint64


def test_an_unknown_kind_or_a_cut_record_is_refused():
    buf = bytearray(api(1, 2, 3) + kernel(4, 5, 6, 3))
    struct.pack_into("<I", buf, 40, 99)
    with pytest.raises(records.LayoutError):
        records.walk(bytes(buf), CUPTI_13_0.sizes)
    with pytest.raises(records.LayoutError):
        records.walk(api(1, 2, 3) + kernel(4, 5, 6, 3)[:-8], CUPTI_13_0.sizes)


def test_13_5_records_are_larger_with_the_same_offsets():
    big = CUPTI_13_5.sizes[KIND_CONCURRENT_KERNEL]
    tail = b"\xee" * (big - 216)  # the fields 13.5 added
    buf = api(10, 20, 5) + kernel(30, 40, 3, 5) + tail + api(50, 60, 6, cbid=307, driver=True)
    offsets, kinds = records.walk(buf, CUPTI_13_5.sizes)
    assert kinds.tolist() == [KIND_RUNTIME, KIND_CONCURRENT_KERNEL, KIND_DRIVER]
    gpu, calls = records.parse(buf, CUPTI_13_5, offsets, kinds)
    assert gpu["start"].tolist() == [30] and gpu["correlation"].tolist() == [5]
    assert calls["cbid"].tolist() == [211, 307]
    with pytest.raises(records.LayoutError):  # the 13.0 table must not walk it
        records.walk(buf, CUPTI_13_0.sizes)
    # CUPTI's walk stopped by an incomplete record: the last size is unknown and not learned
    assert records.learn_sizes(offsets[:2], kinds[:2], None) == {KIND_RUNTIME: 40}


def parsed(*recs):
    buf = b"".join(recs)
    return records.parse(buf, CUPTI_13_0, *records.walk(buf, CUPTI_13_0.sizes))


def test_kernels_wait_two_collects_for_their_launch_call_then_go_without():
    join = records.LaunchJoin(wait=2, keep=4)
    # collect 1: a kernel whose call comes next time, one that never gets one, a non-launch call
    g1, a1 = parsed(kernel(120, 150, 3, 7), kernel(130, 160, 3, 99), api(1, 2, 50, cbid=1))
    out, match, calls = join.step([g1], [a1])
    assert not out
    # collect 2: the call of 7 arrives, with a graph launch (8) and the first of its kernels
    g2, a2 = parsed(api(100, 110, 7), api(200, 230, 8, cbid=311), kernel(240, 250, 3, 8))
    out, match, calls = join.step([g2], [a2])
    assert sorted(out["correlation"].tolist()) == [7, 8]
    assert sorted(calls["start"][match].tolist()) == [100, 200]
    assert 1 not in join.api["cbid"].tolist()  # only launch calls are kept
    assert join.api["correlation"].tolist() == [8]  # the kernel launch's call is spent, the graph's kept
    # collect 3: another kernel of graph launch 8; 99 has waited two collects and goes without a call
    g3, _ = parsed(kernel(250, 270, 3, 8))
    out, match, calls = join.step([g3], [])
    by_corr = dict(zip(out["correlation"].tolist(), match.tolist(), strict=True))
    assert calls["start"][by_corr[8]] == 200 and by_corr[99] == -1
    assert not join.gpu


def test_final_lets_nothing_wait_and_unusable_timestamps_are_dropped():
    join = records.LaunchJoin()
    g, a = parsed(kernel(0, 0, 3, 1), kernel(200, 100, 3, 2), kernel(10, 20, 3, 3), api(1, 2, 4, cbid=41))
    out, match, calls = join.step([g], [a], final=True)
    assert out["correlation"].tolist() == [3] and match.tolist() == [-1]
    assert join.invalid == 2 and not join.gpu and not join.api


def test_the_collector_returns_kernels_table_columns_on_the_host_clock():
    """Names and kinds come as dictionary codes (no Python string a record on the drain thread, which
    holds the GIL) and are written as the same strings."""
    from overshoot.record.cupti.collector import CuptiCollector
    from overshoot.record.writer import kernel_batch

    session = SimpleNamespace(monotonic=True, clock=[], calls=False, name=lambda p: f"kernel@{p:x}")
    g, a = parsed(api(100, 110, 7), kernel(120, 150, 3, 7), memcpy(300, 320, 5, 9, copy_kind=2),
                  memset(330, 331, 5, 10), api(325, 328, 10, cbid=51))
    out, match, calls = records.LaunchJoin().step([g], [a], final=True)
    cols = CuptiCollector._rows(session, out, match, calls)
    assert cols["kind"].to_pylist() == ["kernel", "memcpy", "memset"]
    assert cols["name"].to_pylist() == ["kernel@abc", "memcpy DtoH", "memset"]
    assert cols["name"].type.value_type == "string" and len(cols["name"].dictionary) == 3
    batch = kernel_batch(cols)
    assert batch.column(batch.schema.get_field_index("name")).to_pylist() == cols["name"].to_pylist()
    assert batch.column(batch.schema.get_field_index("kind")).type == "string"
    assert cols["launch_start_ns"][[0, 2]].tolist() == [100.0, 325.0] and np.isnan(cols["launch_end_ns"][1])
    assert cols["gpu_start_ns"].dtype == np.int64 and cols["gpu_end_ns"].tolist() == [150, 320, 331]
    assert cols["stream"].dtype == np.int64 and cols["correlation"].tolist() == [7, 9, 10]
    assert {len(v) for v in cols.values()} == {3}


@pytest.fixture(scope="module")
def shim_build(tmp_path_factory):
    if native.find_c_compiler() is None:
        pytest.skip("no C compiler")
    return native.build_shim(str(tmp_path_factory.mktemp("shim")))


def fresh_shim(path, tmp_path) -> native.Shim:
    copy = tmp_path / "shim.so"
    shutil.copy(path, copy)  # another path: another dlopen, its own buffer pool
    return native.Shim(str(copy))


def test_the_shim_exports_what_native_binds(shim_build):
    lib = ctypes.CDLL(shim_build)
    for name in ("ovs_monotonic_ns", "ovs_configure", "ovs_set_dropped_fn", "ovs_buffer_requested",
                 "ovs_buffer_completed", "ovs_take_completed", "ovs_num_completed", "ovs_buffer_size",
                 "ovs_recycle", "ovs_release_free", "ovs_stats", "ovs_clock_pairs", "ovs_walk",
                 "ovs_gather", "ovs_api_callback", "ovs_calls_setup", "ovs_calls_switch", "ovs_calls_swap",
                 "ovs_calls_release", "ovs_calls_stats"):
        assert hasattr(lib, name), name


def test_the_c_walk_equals_the_numpy_walk(shim_build, tmp_path):
    shim = fresh_shim(shim_build, tmp_path)
    buf = api(1, 2, 3) + kernel(4, 5, 6, 3) + memcpy(7, 8, 9, 10) + memset(11, 12, 13, 14) + bytes(64)
    raw = (ctypes.c_uint8 * len(buf)).from_buffer_copy(buf)
    ours = shim.walk(ctypes.addressof(raw), len(buf), CUPTI_13_0.sizes)
    theirs = records.walk(buf, CUPTI_13_0.sizes)
    assert all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))
    bad = bytearray(buf)
    struct.pack_into("<I", bad, 40, 99)
    raw = (ctypes.c_uint8 * len(bad)).from_buffer_copy(bytes(bad))
    with pytest.raises(records.LayoutError, match="byte 40"):
        shim.walk(ctypes.addressof(raw), len(bad), CUPTI_13_0.sizes)


def test_the_c_gather_parses_as_the_numpy_gather(shim_build, tmp_path):
    shim = fresh_shim(shim_build, tmp_path)
    buf = (api(100, 110, 7) + kernel(120, 150, 3, 7, name_ptr=0x1234) + memcpy(300, 320, 5, 9, copy_kind=2)
           + api(290, 295, 9, cbid=41, driver=True) + memset(330, 331, 5, 10)
           + kernel(2**40, 2**40 + 9, 4, 11) + bytes(64))
    offsets = records.walk(buf, CUPTI_13_0.sizes)
    ours = records.parse(np.frombuffer(buf, np.uint8).copy(), CUPTI_13_0, *offsets, copy=shim.gather)
    theirs = records.parse(buf, CUPTI_13_0, *offsets)
    for a, b in zip(ours, theirs, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), key
    assert ours[0]["start"].tolist()[1] == 2**40 and ours[0]["name_ptr"].tolist()[0] == 0x1234


def test_the_shim_brackets_a_timestamp_source(shim_build, tmp_path):
    shim = fresh_shim(shim_build, tmp_path)
    offset = 123_456_789
    source = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_uint64))(
        lambda p: (p.__setitem__(0, time.perf_counter_ns() - offset), 0)[1])
    sample = records.best_bracket(*shim.clock_pairs(ctypes.cast(source, ctypes.c_void_p).value, 50))
    assert abs(sample.offset_ns - offset) <= sample.error_ns + 1


def test_the_session_checks_its_size_table_against_cuptis_walk_and_learns_what_it_lacks(shim_build, tmp_path):
    from overshoot.record.cupti.session import Session

    truth = {**CUPTI_13_0.sizes}

    def cupti_walk(addr, valid, limit=None):  # stands in for cuptiActivityGetNextRecord: the true sizes
        offs, kinds = records.walk(ctypes.string_at(addr, valid), truth)
        if limit is not None and len(offs) > limit:
            return offs[:limit], kinds[:limit], None
        return offs, kinds, valid

    session = Session.__new__(Session)
    session.shim, session.version, session.notes = fresh_shim(shim_build, tmp_path), 120800, []
    session.layout, session.validated = None, False
    session.cupti = SimpleNamespace(next_record_offsets=cupti_walk)

    def offsets(buf):
        raw = (ctypes.c_uint8 * len(buf)).from_buffer_copy(buf)
        return session.offsets(ctypes.addressof(raw), len(buf))[0].tolist()

    assert offsets(api(1, 2, 3) + kernel(4, 5, 6, 3) + api(7, 8, 9)) == [0, 40, 256]  # unknown version
    assert session.validated and session.layout.name.startswith("learned")
    assert session.layout.sizes == {KIND_RUNTIME: 40, KIND_CONCURRENT_KERNEL: 216}
    assert offsets(memset(1, 2, 3, 4) + api(1, 2, 3)) == [0, 88]  # a kind first seen later is learned
    assert session.layout.sizes[KIND_MEMSET] == 88
    # CUPTI's walk checks the first VALIDATE_RECORDS records only; a kind first seen beyond them is learned
    # from a whole walk, and every record of the buffer comes out
    from overshoot.record.cupti.session import VALIDATE_RECORDS

    session.layout, session.validated = None, False
    long = api(1, 2, 3) * (VALIDATE_RECORDS + 10) + memcpy(4, 5, 6, 7) + api(8, 9, 10)
    assert len(offsets(long)) == VALIDATE_RECORDS + 12 and session.validated
    assert session.layout.sizes[KIND_MEMCPY] == len(memcpy(4, 5, 6, 7))



def test_member_is_isin():
    rng = np.random.default_rng(0)
    for values, codes in [(rng.integers(0, 700, 5000, dtype=np.uint32), records.RUNTIME_LAUNCH_CBIDS),
                          (rng.integers(0, 12, 300).astype(np.int32), (KIND_RUNTIME, KIND_DRIVER)),
                          (np.array([3, 70_000, 5], np.uint32), (5, 70_000)),  # beyond a table: isin
                          (np.zeros(0, np.int32), (1, 2)), (np.array([1, 2, 9]), ())]:
        assert np.array_equal(records.member(values, codes), np.isin(values, np.fromiter(codes, np.int64)))
