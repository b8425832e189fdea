"""CUPTI collector probe on a CUDA GPU: is every kernel found, on the host clock, and what does it cost?

    python benchmarks/cupti_probe.py                        # A B C here, D in a second process
    python benchmarks/cupti_probe.py --sections AB --launches 5000 --rounds 2
    python benchmarks/cupti_probe.py --help                 # works without CUDA (nothing GPU is imported)

A correctness of overshoot.record.cupti.CuptiCollector as the kernel sampler drives it (enable/disable on
  this thread, collect() on a drain thread every 50 ms, collect(final=True) at the end): 200 eager ops, each
  bracketed by torch.cuda.Event and perf_counter_ns; 5 replays each of two 10-kernel CUDA graphs (one
  captured before the first enable, one while enabled); 20 driver-API kernels (torch jiterator,
  cuLaunchKernel); 3 pinned host-to-device copies and 3 cudaMemsetAsync. Each must come out exactly once,
  with its launch call inside its perf_counter bracket, its GPU time inside its event bracket, graph kernels
  sharing the graph launch's correlation id.
B cost: `--launches` tiny launches a round, the collector off and on alternating (`--rounds` pairs): CPU ns a
  launch off and on, enable()/disable() time on the launching thread, collect() time per 1000 GPU records.
C clock: describe()'s bracket error; cuptiGetTimestamp bracketed from Python by perf_counter_ns (equal clocks
  when the CLOCK_MONOTONIC callback is in effect) and by time.time_ns; the offset over a few seconds (drift).
D torch.profiler(activities=[CUDA]) for comparison, in its own process (one CUPTI client a process): CPU ns a
  launch with it on, its start, stop and event-processing times.

Prints a table last (checks marked ok/FAIL; exit status 1 when one fails); writes cupti_probe.json under
--out.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

pc = time.perf_counter_ns
N_EAGER, N_REPLAYS, GRAPH_OPS, N_DRIVER, N_COPIES = 200, 5, 10, 20, 3


def mapped(fragment: str) -> str | None:
    """Path of a library this process has mapped whose name contains `fragment`."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip().split(" ")[-1]
                if fragment in path:
                    return path
    except OSError:
        pass
    return None


def merge(parts: list[dict]) -> dict[str, Any]:
    """Concatenate collect() outputs (lists and arrays alike)."""
    import numpy as np

    parts = [p for p in parts if p]
    if not parts:
        return {}
    return {k: (sum((p[k] for p in parts), []) if isinstance(parts[0][k], list)
                else np.concatenate([p[k] for p in parts])) for k in parts[0]}


class Drain:
    """collect() every `seconds` on a thread of its own, as record/kernel_timing.KernelSampler does."""

    def __init__(self, col, seconds: float = 0.05):
        self.col, self.parts, self.errors = col, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(seconds,), daemon=True)
        self._thread.start()

    def _loop(self, seconds: float) -> None:
        while not self._stop.wait(seconds):
            try:
                self.parts.append(self.col.collect())
            except Exception as e:  # noqa: BLE001 - reported in the results
                self.errors.append(repr(e))

    def finish(self) -> dict:
        self._stop.set()
        self._thread.join()
        self.parts.append(self.col.collect(final=True))
        return merge(self.parts)


def capture_graph(torch, t, n_ops: int = GRAPH_OPS):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as torch recommends
        for _ in range(3):
            t.add_(1.0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n_ops):
            t.mul_(1.0001)
    torch.cuda.synchronize()
    return graph


def driver_kernel(torch):
    """A kernel launched through the driver API (cuLaunchKernel): torch's jiterator, or None."""
    try:
        fn = torch.cuda.jiterator._create_jit_fn("template <typename T> T ovs_twice(T x) { return x * 2; }")
        x = torch.ones(256, device="cuda")
        fn(x)
        torch.cuda.synchronize()
        return lambda: fn(x)
    except Exception as e:  # noqa: BLE001
        print("jiterator unavailable:", e, flush=True)
        return None


def memsetter(torch):
    """cudaMemsetAsync through the libcudart torch mapped (torch's zero_() is a kernel, not a memset)."""
    path = mapped("libcudart.so")
    if not path:
        return None
    fn = ctypes.CDLL(path).cudaMemsetAsync
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return lambda t: fn(t.data_ptr(), 0, t.numel() * t.element_size(),
                        torch.cuda.current_stream().cuda_stream)


def section_a(torch, col) -> dict:
    import numpy as np

    x = torch.zeros(4096, device="cuda")
    graph_a = capture_graph(torch, torch.zeros(4096, device="cuda"))  # before CUPTI is set up
    drv = driver_kernel(torch)
    memset = memsetter(torch)
    pinned = torch.ones(1 << 20, pin_memory=True)
    dst = torch.empty(1 << 20, device="cuda")
    ev0 = [torch.cuda.Event(enable_timing=True) for _ in range(N_EAGER)]
    ev1 = [torch.cuda.Event(enable_timing=True) for _ in range(N_EAGER)]
    x.add_(1.0)
    torch.cuda.synchronize()

    t = pc()
    col.enable()  # first call: CUPTI set up for the process
    first_enable_ms = (pc() - t) / 1e6
    drain = Drain(col)
    before, after = np.zeros(N_EAGER, np.int64), np.zeros(N_EAGER, np.int64)
    w_eager = pc()
    for i in range(N_EAGER):
        ev0[i].record()
        before[i] = pc()
        x.add_(1.0)
        after[i] = pc()
        ev1[i].record()
    w_eager = (w_eager, pc())
    graph_b = capture_graph(torch, torch.zeros(4096, device="cuda"))  # captured while enabled
    replays = []
    for name, graph in (("A", graph_a), ("B", graph_b)):
        for _ in range(N_REPLAYS):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            b = pc()
            graph.replay()
            replays.append((name, b, pc(), e0, e1))
            e1.record()
    w_drv = pc()
    for _ in range(N_DRIVER if drv else 0):
        drv()
    w_drv = (w_drv, pc())
    w_copy = pc()
    for _ in range(N_COPIES):
        dst.copy_(pinned, non_blocking=True)
    memset_rc = [memset(dst) for _ in range(N_COPIES)] if memset else []
    w_copy = (w_copy, pc())
    time.sleep(0.2)  # a few drain-thread collects while work is in flight
    torch.cuda.synchronize()
    t = pc()
    col.disable()
    disable_us = (pc() - t) / 1e3
    rows = drain.finish()
    info = col.describe()
    err = int(info.get("clock_error_ns") or 0)
    kind = np.asarray(rows.get("kind", []), dtype=object)
    names = np.asarray(rows.get("name", []), dtype=object)
    launch = np.asarray(rows.get("launch_start_ns", []), np.float64)
    launch_end = np.asarray(rows.get("launch_end_ns", []), np.float64)
    corr = np.asarray(rows.get("correlation", []), np.int64)
    g0 = np.asarray(rows.get("gpu_start_ns", []), np.int64)
    g1 = np.asarray(rows.get("gpu_end_ns", []), np.int64)

    def within(window) -> np.ndarray:
        return (launch >= window[0] - err) & (launch <= window[1] + err)

    res: dict[str, Any] = {"first_enable_ms": first_enable_ms, "disable_us": disable_us,
                           "rows": int(len(kind)), "rows_without_launch": int(np.isnan(launch).sum()),
                           "duplicate_rows": int(len(corr) - len(set(zip(corr.tolist(), g0.tolist(),
                                                                          strict=True)))),
                           "drain_errors": drain.errors, "collects": len(drain.parts)}
    eager = np.flatnonzero(within(w_eager) & (kind == "kernel"))
    eager = eager[np.argsort(launch[eager])]
    e = {"found": int(len(eager)), "expected": N_EAGER, "names": sorted(set(names[eager].tolist()))[:3]}
    if len(eager) == N_EAGER:
        event_ns = np.array([ev0[i].elapsed_time(ev1[i]) * 1e6 for i in range(N_EAGER)])
        dur = (g1[eager] - g0[eager]).astype(np.float64)
        e.update(kernel_ns_median=float(np.median(dur)), event_ns_median=float(np.median(event_ns)),
                 longer_than_event=int((dur > event_ns + 1000).sum()),
                 launch_outside_bracket=int(((launch[eager] < before - err)
                                             | (launch_end[eager] > after + err)).sum()),
                 gpu_before_launch=int((g0[eager] < launch[eager]).sum()),
                 launch_call_ns_median=float(np.median(launch_end[eager] - launch[eager])),
                 launch_to_gpu_ns_median=float(np.median(g0[eager] - launch[eager])))
    res["eager"] = e
    graphs: dict[str, Any] = {}
    for name, b, a, e0, e1 in replays:
        sel = np.flatnonzero(within((b, a)) & (kind == "kernel"))
        span = float(g1[sel].max() - g0[sel].min()) if len(sel) else float("nan")
        g = graphs.setdefault(name, {"kernels": [], "launch_ids": [], "span_within_event": True})
        g["kernels"].append(int(len(sel)))
        g["launch_ids"].append(int(len(np.unique(corr[sel]))))
        g["span_within_event"] &= bool(span <= e0.elapsed_time(e1) * 1e6 + 1000)
    res["graphs"] = graphs
    sel = within(w_drv) & (kind == "kernel")
    res["driver_kernels"] = {"found": int(sel.sum()), "expected": N_DRIVER if drv else 0,
                             "names": sorted(set(names[sel].tolist()))[:2]}
    sel = within(w_copy)
    res["copies"] = {"memcpy": int((sel & (kind == "memcpy")).sum()),
                     "memset": int((sel & (kind == "memset")).sum()), "memset_rc": memset_rc,
                     "expected_memset": N_COPIES if memset else 0,
                     "names": sorted(set(names[sel].tolist()))}
    res["describe"] = info
    return res


def launch_loop(torch, y, launches: int) -> float:
    """Host ns a launch of `launches` tiny eager kernels (the sync after the timed part)."""
    t0 = pc()
    for _ in range(launches):
        y.add_(1.0)
    t1 = pc()
    torch.cuda.synchronize()
    return (t1 - t0) / launches


def section_b(torch, col, launches: int, rounds: int) -> dict:
    import numpy as np

    y = torch.zeros(1, device="cuda")

    def loop() -> float:
        torch.cuda.synchronize()
        return launch_loop(torch, y, launches)

    loop()
    col.enable()  # CUPTI's per-kernel setup outside the timed rounds
    loop()
    col.disable()
    col.collect(final=True)
    off, on, switches = [], [], []
    for r in range(2 * rounds):
        if r % 2 == 0:
            off.append(loop())
            continue
        t = pc()
        col.enable()
        enable_us = (pc() - t) / 1e3
        on.append(loop())
        t = pc()
        col.disable()
        disable_us = (pc() - t) / 1e3
        t = pc()
        rows = col.collect(final=True) or {"kind": [], "launch_start_ns": np.zeros(0)}
        collect_ms = (pc() - t) / 1e6
        n = len(rows["kind"])
        switches.append({"enable_us": enable_us, "disable_us": disable_us, "collect_ms": collect_ms,
                         "gpu_records": n, "without_launch": int(np.isnan(rows["launch_start_ns"]).sum()),
                         "collect_ms_per_1000": collect_ms * 1000 / max(n, 1)})
    med = statistics.median
    return {"launches": launches, "rounds": rounds, "ns_per_launch_off": med(off),
            "ns_per_launch_on": med(on), "added_ns_per_launch": med(on) - med(off), "off": off, "on": on,
            "switches": switches,
            "enable_us_median": med(s["enable_us"] for s in switches),
            "disable_us_median": med(s["disable_us"] for s in switches),
            "collect_ms_per_1000_median": med(s["collect_ms_per_1000"] for s in switches)}


def section_c(col, seconds: float = 2.0) -> dict:
    session = col._session  # the probe looks inside: CUPTI's own timestamp, sampled the collector's way
    info = col.describe()
    best_mono, best_real = (0, 1 << 62), (0, 1 << 62)
    for _ in range(2000):
        a, m0 = time.time_ns(), pc()
        c = session.cupti.timestamp()
        m1, b = pc(), time.time_ns()
        if m1 - m0 < best_mono[1]:
            best_mono = (c - (m0 + m1) // 2, m1 - m0)
        if b - a < best_real[1]:
            best_real = (c - (a + b) // 2, b - a)
    samples, t0 = [], pc()
    while pc() - t0 < seconds * 1e9:
        samples.append(session.sample_clock())
        time.sleep(0.1)
    offsets = [s.offset_ns for s in samples]
    elapsed = (pc() - t0) / 1e9
    return {"clock": info.get("clock"), "clock_error_ns": info.get("clock_error_ns"),
            "cupti_minus_perf_counter_ns": best_mono[0], "perf_counter_bracket_ns": best_mono[1],
            "cupti_minus_time_ns": best_real[0], "time_ns_bracket_ns": best_real[1],
            "cupti_clock_is": ("CLOCK_MONOTONIC" if abs(best_mono[0]) <= best_mono[1]
                               else "CLOCK_REALTIME" if abs(best_real[0]) <= best_real[1] else "other"),
            "offset_ns_first": offsets[0], "offset_ns_range": max(offsets) - min(offsets),
            "bracket_error_ns_max": max(s.error_ns for s in samples),
            "drift_ns_per_s": (offsets[-1] - offsets[0]) / elapsed}


def section_d(torch, launches: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    y = torch.zeros(1, device="cuda")

    def loop() -> float:
        return launch_loop(torch, y, launches)

    loop()
    off = statistics.median(loop() for _ in range(2))
    runs = []
    for _ in range(2):  # the first start pays for kineto's set-up
        prof = profile(activities=[ProfilerActivity.CUDA])
        t0 = pc()
        prof.__enter__()
        t1 = pc()
        on = loop()
        t2 = pc()
        prof.__exit__(None, None, None)
        t3 = pc()
        events = prof.events()
        t4 = pc()
        runs.append({"start_ms": (t1 - t0) / 1e6, "ns_per_launch_on": on, "stop_ms": (t3 - t2) / 1e6,
                     "events_ms": (t4 - t3) / 1e6, "events": len(events)})
    return {"launches": launches, "ns_per_launch_off": off, "runs": runs,
            "added_ns_per_launch": runs[-1]["ns_per_launch_on"] - off}


def run_here(args) -> dict:
    faulthandler.dump_traceback_later(args.timeout, exit=True)  # stacks, should CUPTI ever deadlock
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("cupti_probe.py needs a CUDA GPU")
    torch.zeros(1, device="cuda").add_(1)
    torch.cuda.synchronize()
    res: dict[str, Any] = {"env": {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
                                   "gpu": torch.cuda.get_device_name(0), "python": sys.version.split()[0],
                                   "libcupti_mapped_by_torch": mapped("/libcupti.so")}}
    if "D" in args.sections:
        res["D"] = section_d(torch, args.launches)
        faulthandler.cancel_dump_traceback_later()
        return res
    from overshoot.record.cupti import CuptiCollector, unavailable_reason

    res["unavailable_reason"] = unavailable_reason(cuda=True)
    col = CuptiCollector()
    for section in "ABC":
        if section not in args.sections:
            continue
        t = pc()
        try:
            if section == "A":
                res["A"] = section_a(torch, col)
            elif section == "B":
                res["B"] = section_b(torch, col, args.launches, args.rounds)
            else:
                if col._session is None:
                    col.enable()
                    col.disable()
                res["C"] = section_c(col)
        except Exception:  # noqa: BLE001 - one section's failure is a result, the others still run
            import traceback

            res[f"{section}_error"] = traceback.format_exc()[-2000:]
        res[f"{section}_s"] = (pc() - t) / 1e9
    res["describe"] = col.describe()
    col.close()
    faulthandler.cancel_dump_traceback_later()
    return res


def run_child(args, sections: str) -> dict:
    """The sections in a process of their own (torch.profiler and our collector cannot share one)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        cmd = [sys.executable, __file__, "--sections", sections, "--launches", str(args.launches),
               "--rounds", str(args.rounds), "--timeout", str(args.timeout), "--json-out", out]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout + 30)
        except subprocess.TimeoutExpired:
            return {f"{sections}_error": f"timed out after {args.timeout + 30} s"}
        if os.path.exists(out):
            return json.loads(Path(out).read_text())
        return {f"{sections}_error": f"exit {done.returncode}: {(done.stdout + done.stderr)[-1500:]}"}


def checks(res: dict) -> list[tuple[str, bool | None, str]]:
    """(what, passed (None: not run), figures)."""
    out: list[tuple[str, bool | None, str]] = []
    a = res.get("A")
    if a:
        e = a["eager"]
        out.append(("A eager kernels found once", e["found"] == e["expected"] and a["duplicate_rows"] == 0,
                    f"{e['found']}/{e['expected']}, duplicates {a['duplicate_rows']}, "
                    f"{a['collects']} collects"))
        if "longer_than_event" in e:
            out.append(("A kernel inside its event bracket", e["longer_than_event"] == 0,
                        f"kernel {e['kernel_ns_median']:.0f} ns, event {e['event_ns_median']:.0f} ns "
                        "(medians)"))
            out.append(("A launch call inside perf_counter bracket",
                        e["launch_outside_bracket"] == 0 and e["gpu_before_launch"] == 0,
                        f"outside {e['launch_outside_bracket']}, GPU before launch {e['gpu_before_launch']}; "
                        f"call {e['launch_call_ns_median']:.0f} ns, "
                        f"launch->GPU {e['launch_to_gpu_ns_median']:.0f} ns"))
        for name, g in a["graphs"].items():
            ok = all(k == GRAPH_OPS for k in g["kernels"]) and all(n == 1 for n in g["launch_ids"])
            out.append((f"A graph {name} kernels/replay, one launch id", ok and g["span_within_event"],
                        f"{g['kernels']} ids {g['launch_ids']} span<=event {g['span_within_event']}"))
        d = a["driver_kernels"]
        out.append(("A driver-API kernels", d["found"] == d["expected"], f"{d['found']}/{d['expected']}"))
        c = a["copies"]
        out.append(("A memcpy / memset", c["memcpy"] == N_COPIES and c["memset"] == c["expected_memset"],
                    f"{c['memcpy']}/{N_COPIES}, {c['memset']}/{c['expected_memset']} {c['names']}"))
        out.append(("A every row has its launch call", a["rows_without_launch"] == 0,
                    f"{a['rows_without_launch']} of {a['rows']} rows without"))
    b = res.get("B")
    if b:
        out.append(("B ns a launch off -> on", None,
                    f"{b['ns_per_launch_off']:.0f} -> {b['ns_per_launch_on']:.0f} "
                    f"(+{b['added_ns_per_launch']:.0f})"))
        out.append(("B enable / disable (engine thread)", None,
                    f"{b['enable_us_median']:.1f} / {b['disable_us_median']:.1f} us"))
        out.append(("B collect (drain thread)", None,
                    f"{b['collect_ms_per_1000_median']:.2f} ms per 1000 records"))
    c = res.get("C")
    if c:
        out.append(("C CUPTI timestamps on perf_counter_ns", c["cupti_clock_is"] == "CLOCK_MONOTONIC"
                    or c["clock"] != "CLOCK_MONOTONIC callback",
                    f"{c['clock']}; CUPTI is {c['cupti_clock_is']} ({c['cupti_minus_perf_counter_ns']} ns, "
                    f"bracket {c['perf_counter_bracket_ns']} ns)"))
        out.append(("C bracket error / offset range / drift", None,
                    f"{c['bracket_error_ns_max']} ns / {c['offset_ns_range']} ns / "
                    f"{c['drift_ns_per_s']:.1f} ns/s"))
    d = res.get("D")
    if d:
        r = d["runs"][-1]
        out.append(("D torch.profiler ns a launch off -> on", None,
                    f"{d['ns_per_launch_off']:.0f} -> {r['ns_per_launch_on']:.0f} "
                    f"(+{d['added_ns_per_launch']:.0f}); start {d['runs'][0]['start_ms']:.0f}/"
                    f"{r['start_ms']:.1f} ms, stop {r['stop_ms']:.0f} ms, events {r['events_ms']:.0f} ms"))
    for key in sorted(k for k in res if k.endswith("_error")):
        out.append((key, False, res[key].strip().splitlines()[-1]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", default="ABCD", help="any of A B C (this process) and D (another)")
    parser.add_argument("--launches", type=int, default=20_000, help="launches a round in B and D")
    parser.add_argument("--rounds", type=int, default=3, help="off/on pairs in B")
    parser.add_argument("--timeout", type=int, default=240, help="seconds before a hung process is dumped")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--json-out", help=argparse.SUPPRESS)  # child process result
    args = parser.parse_args()
    sections = args.sections.upper()
    if args.json_out:  # a child: run what it was given, write it, no table
        Path(args.json_out).write_text(json.dumps(run_here(args), default=str))
        return 0
    own = "".join(s for s in "ABC" if s in sections)
    res: dict[str, Any] = {}
    if own:
        args.sections = own
        res = run_here(args)
    if "D" in sections:
        child = run_child(args, "D")
        res.setdefault("env", child.get("env"))
        res.update({k: v for k, v in child.items() if k != "env"})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cupti_probe.json").write_text(json.dumps(res, indent=1, default=str))
    rows = checks(res)
    print(f"\nCUPTI probe: {res.get('env')}")
    desc = res.get("describe") or {}
    print(f"collector: {desc.get('backend')} {desc.get('libcupti')} CUPTI {desc.get('cupti_version')} "
          f"layout {desc.get('layout')}; notes {desc.get('notes')}")
    width = max((len(w) for w, _, _ in rows), default=10)
    for what, ok, figures in rows:
        mark = "" if ok is None else "ok" if ok else "FAIL"
        print(f"{what:<{width}}  {mark:4}  {figures}")
    return 1 if any(ok is False for _, ok, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
