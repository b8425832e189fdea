"""The shim's launch-call callback (calls.c) driven as CUPTI drives it, with CUpti_CallbackData built byte by
byte: entries and exits paired by correlation id on each thread, nested runtime/driver launches, exits
without an entry, the switch loop through a stand-in cuptiEnableCallback, and a whole collect() that joins
kernel records from an activity buffer to the calls; then Session and the collector end to end against a
stand-in libcupti (fake_cupti.c). No libcupti, no CUDA: the GPU side is checked on the H200
(docs/benchmarks.md)."""

from __future__ import annotations

import ctypes
import struct
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from test_cupti_records import fresh_shim, kernel, memcpy

from overshoot.record.cupti import native, records
from overshoot.record.cupti.records import CUPTI_13_0, DOMAIN_DRIVER, DOMAIN_RUNTIME

ENTER, EXIT = 0, 1


@pytest.fixture
def shim(tmp_path) -> native.Shim:
    if native.find_c_compiler() is None:
        pytest.skip("no C compiler")
    return fresh_shim(native.build_shim(str(tmp_path)), tmp_path)  # its own call arrays


def callback(shim: native.Shim, domain: int, cbid: int, site: int, correlation: int) -> None:
    """What CUPTI does at a call's entry or exit: the shim's callback with a CUpti_CallbackData."""
    data = bytearray(72)
    struct.pack_into("<I", data, 0, site)
    struct.pack_into("<I", data, 64, correlation)
    raw = (ctypes.c_uint8 * 72).from_buffer(data)
    shim.lib.ovs_api_callback(None, domain, cbid, ctypes.addressof(raw))


def launch(shim, correlation, *, runtime=True, driver=True):
    """A torch launch (cudaLaunchKernel, which calls cuLaunchKernel with the same correlation id) or, with
    runtime=False, a Triton one (cuLaunchKernel alone)."""
    if runtime:
        callback(shim, DOMAIN_RUNTIME, 211, ENTER, correlation)
    if driver:
        callback(shim, DOMAIN_DRIVER, 307, ENTER, correlation)
        callback(shim, DOMAIN_DRIVER, 307, EXIT, correlation)
    if runtime:
        callback(shim, DOMAIN_RUNTIME, 211, EXIT, correlation)


def test_nested_launches_pair_by_correlation_and_are_timed_on_the_host_clock(shim):
    before = time.perf_counter_ns()
    launch(shim, 7)
    launch(shim, 8, runtime=False)
    after = time.perf_counter_ns()
    calls = shim.take_calls()
    assert calls.dtype == records.CALL_DTYPE
    # the torch launch is its runtime call (the driver call inside it is not kept), Triton's its driver call
    assert calls["correlation"].tolist() == [7, 8]
    assert calls["driver"].tolist() == [0, 1] and calls["cbid"].tolist() == [211, 307]
    assert (calls["start"] <= calls["end"]).all()
    assert before <= calls["start"].min() and calls["end"].max() <= after
    assert set(calls["thread_id"].tolist()) == {threading.get_native_id()}
    assert len(shim.take_calls()) == 0  # taken once


def test_an_exit_without_its_entry_is_counted_not_recorded_and_stale_entries_do_not_block(shim):
    callback(shim, DOMAIN_RUNTIME, 211, EXIT, 5)  # callbacks switched on while this call ran
    for correlation in range(100, 130):  # entries whose exits never come (switched off mid-call)
        callback(shim, DOMAIN_DRIVER, 307, ENTER, correlation)
    launch(shim, 9, runtime=False)
    calls = shim.take_calls()
    assert calls["correlation"].tolist() == [9]
    assert shim.calls_stats()["calls_unpaired"] == 1


def test_each_thread_pairs_its_own_calls(shim):
    callback(shim, DOMAIN_DRIVER, 307, ENTER, 1)  # this thread's call, still running
    worker = threading.Thread(target=lambda: launch(shim, 2, runtime=False))
    worker.start()
    worker.join()
    callback(shim, DOMAIN_DRIVER, 307, EXIT, 1)
    calls = shim.take_calls()
    assert calls["correlation"].tolist() == [2, 1]
    assert calls["thread_id"][0] == worker.native_id and calls["thread_id"][1] == threading.get_native_id()


def test_the_arrays_grow_and_are_handed_over_whole(shim):
    for correlation in range(1, 150_001):  # past the first array's 65,536 calls, twice
        launch(shim, correlation, runtime=False)
    first = shim.take_calls()
    launch(shim, 200_000, runtime=False)
    second = shim.take_calls()
    assert first["correlation"].tolist() == list(range(1, 150_001))
    assert second["correlation"].tolist() == [200_000]
    assert shim.calls_stats() == {"calls_lost": 0, "calls_unpaired": 0, "calls_pending": 0}


def test_the_switch_enables_every_launch_call_id_in_one_c_loop(shim):
    seen = []
    enable = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32)(
        lambda on, sub, domain, cbid: seen.append((on, sub, domain, cbid)) or (7 if cbid == 311 else 0))
    ids = records.launch_call_ids()
    shim.setup_calls(ctypes.cast(enable, ctypes.c_void_p).value, 0xBEEF, ids)
    assert shim.switch_calls(True) == 7  # CUPTI's first error comes back; the other ids are still switched
    assert seen == [(1, 0xBEEF, d, c) for d, c in ids]
    seen.clear()
    assert shim.switch_calls(False) == 7 and {s[0] for s in seen} == {0} and len(seen) == len(ids)
    assert (DOMAIN_RUNTIME, 311) in ids and (DOMAIN_DRIVER, 307) in ids and (DOMAIN_RUNTIME, 41) in ids
    assert not any(c == 1 for _, c in ids)  # cudaGetDevice and the like: no callback


def test_collect_joins_buffered_kernels_to_the_callbacks_calls(shim):
    """A whole collect(): kernel and copy records in an activity buffer that CUPTI hands over through the
    shim's buffer callbacks, their launches through the call callback; launch times are the callback's host
    times, GPU times go through the session's clock."""
    from overshoot.record.cupti.collector import CuptiCollector
    from overshoot.record.cupti.session import Session

    session = Session.__new__(Session)
    session.shim, session.layout, session.validated, session.notes = shim, CUPTI_13_0, True, []
    session.monotonic, session.clock, session.calls, session.names = True, [], True, {0xABC: "gemm"}
    session.cupti = SimpleNamespace(call=lambda name, *args: 0)  # cuptiActivityFlushAll: nothing held back
    t0 = time.perf_counter_ns()
    launch(shim, 7)
    t1 = time.perf_counter_ns()
    callback(shim, DOMAIN_RUNTIME, 41, ENTER, 8)  # cudaMemcpyAsync
    callback(shim, DOMAIN_RUNTIME, 41, EXIT, 8)
    t2 = time.perf_counter_ns()
    payload = kernel(10_000, 12_000, 3, 7) + memcpy(12_500, 13_000, 3, 8) + kernel(14_000, 15_000, 3, 99)
    buf, size, _ = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_size_t()
    shim.lib.ovs_buffer_requested(ctypes.byref(buf), ctypes.byref(size), ctypes.byref(_))
    ctypes.memmove(buf.value, payload, len(payload))
    shim.lib.ovs_buffer_completed(None, 0, buf, size.value, len(payload))
    collector = CuptiCollector()
    collector._session = session
    cols = collector.collect(final=True)
    order = np.argsort(cols["gpu_start_ns"])  # parse groups kernels, copies and sets
    cols = {k: (v.take(order) if hasattr(v, "take") and not isinstance(v, np.ndarray) else v[order])
            for k, v in cols.items()}
    assert cols["correlation"].tolist() == [7, 8, 99]
    assert cols["kind"].to_pylist() == ["kernel", "memcpy", "kernel"]
    assert cols["name"].to_pylist()[0] == "gemm"
    assert cols["gpu_start_ns"].tolist() == [10_000, 12_500, 14_000]
    start, end = cols["launch_start_ns"], cols["launch_end_ns"]
    assert t0 <= start[0] <= end[0] <= t1 and t1 <= start[1] <= end[1] <= t2
    assert np.isnan(start[2]) and np.isnan(end[2])  # no call carried 99
    assert len(shim.take_calls()) == 0  # collect took them


def test_the_drain_path_never_imports_pandas():
    """pyarrow's `pa.array`, even of a numpy array, imports pandas on first use: ~0.3 s with the GIL held,
    which on the H200 was the drain thread's slowest delivery and slowed the engine's next steps. The
    collector's columns, the sampler's row filter and the kernels batch are built from buffers instead."""
    import subprocess
    import sys
    from pathlib import Path

    code = """
import sys
from types import SimpleNamespace
import numpy as np
from test_cupti_records import api, kernel, memcpy, parsed
from overshoot.record.cupti import records
from overshoot.record.cupti.collector import CuptiCollector
from overshoot.record.kernel_timing import _take
from overshoot.record.writer import kernel_batch
session = SimpleNamespace(monotonic=True, clock=[], calls=True, name=lambda p: "gemm")
g, a = parsed(api(100, 110, 7), kernel(120, 150, 3, 7), memcpy(300, 320, 5, 9, copy_kind=2))
out, match, calls = records.LaunchJoin().step([g], [a], final=True)
cols = CuptiCollector._rows(session, out, match, calls)
cols = {k: _take(v, np.array([1, 0])) for k, v in cols.items()}
batch = kernel_batch(cols)
assert batch.num_rows == 2 and cols["name"].to_pylist() == ["memcpy DtoH", "gemm"], cols["name"]
print("pandas" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize("calls", ["callbacks", "activity"])
def test_session_and_collector_against_a_stand_in_libcupti(tmp_path, calls):
    """The GPU-only glue on the CPU: Session's set-up (library, shim, timestamp source, buffer callbacks,
    subscriber), prepare() on another thread, enable/disable, a forced collect, through a stand-in libcupti
    (tests/fake_cupti.c) with CUPTI 13.0's record and callback layouts; launch calls from the callback, or
    from API activity records when OVERSHOOT_CUPTI_CALLS=activity. One process each: CUPTI is per process."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    compiler = native.find_c_compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    lib = tmp_path / "libcupti.so"
    subprocess.run([compiler, "-O1", "-shared", "-fPIC", "-o", str(lib), str(Path(__file__).with_name(
        "fake_cupti.c"))], check=True)
    code = """
import ctypes, os, threading, time
from overshoot.record.cupti.collector import CuptiCollector
fake = ctypes.CDLL(os.environ["OVERSHOOT_CUPTI_LIB"])
fake.fake_launch.restype = ctypes.c_uint32
fake.fake_launch.argtypes = [ctypes.c_int, ctypes.c_uint64]
name = ctypes.create_string_buffer(b"gemm_kernel")
collector = CuptiCollector()
prepare = threading.Thread(target=collector.prepare)
prepare.start(); prepare.join()
fake.fake_launch(1, ctypes.addressof(name))  # collector off: not recorded
collector.enable()
t0 = time.perf_counter_ns()
ids = [fake.fake_launch(1, ctypes.addressof(name)), fake.fake_launch(0, ctypes.addressof(name))]
t1 = time.perf_counter_ns()
collector.disable()
cols = collector.collect(final=True)
assert cols["correlation"].tolist() == ids, (cols["correlation"], ids)
assert cols["name"].to_pylist() == ["gemm_kernel"] * 2
start, end = cols["launch_start_ns"], cols["launch_end_ns"]
late = 500 if os.environ["OVERSHOOT_CUPTI_CALLS"] == "activity" else 0  # the stand-in's API records end
assert all(t0 <= s <= e <= t1 + late for s, e in zip(start, end)), (t0, start, end, t1)  # 500 ns late
assert (cols["gpu_start_ns"] > end).all()
info = collector.describe()
assert collector.prepare_ns > 0 and collector.setup_ns == 0 and info["clock"] == "CLOCK_MONOTONIC callback"
print(info["api_filter"])
"""
    env = {**os.environ, "OVERSHOOT_CUPTI_LIB": str(lib), "OVERSHOOT_CACHE": str(tmp_path / "cache"),
           "OVERSHOOT_CUPTI_CALLS": calls}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("callbacks" in done.stdout) == (calls == "callbacks"), done.stdout
