"""What the Recorder costs the engine thread, measured against a bare loop in the same run.

    python benchmarks/recorder_overhead.py [--steps 50000] [--batches 200] [--json results.json]

Rows (ns per iteration: median and best over timed batches of 200 iterations, minus the bare loop's; the
recorder flushes untimed between batches so its buffers keep their real size):
- span (begin/end): one `busy_begin(label)` + `busy_end()` pair, the allocation-free form hooks use;
- span (with): one `with rec.busy(label):` block (cached context manager);
- step, 4 spans: `step_begin(...)` with facts + schedule/prepare/launch busy spans + one wait span;
- step incl. flushes: one long run with the defaults (flush every 256 steps or 1 s): flush cost amortized;
- hooks: the reference engine's hook spec (engine_hooks/reference.py: six wrapped calls a step, facts of the
  batch) around a stub engine whose calls do nothing, against the same stub unhooked: what the hook layer
  and the recorder together cost an engine thread a step, flushes held off (a synchronous engine's flushes
  run inside its waits);
- on CUDA: the step plus `gpu_begin(stream)` / `gpu_end(stream)` on an explicit stream, and the raw
  `Event.record(stream)` / `Event.record()` (current stream) calls for comparison, plus the driver's own
  `cuEventRecord` through ctypes (what a record costs below torch).
Goal: <= 500 ns per span and <= 4000 ns per step including the two CUDA event records.
The hot path is hot.c where it compiles; `OVERSHOOT_HOTPATH=python` measures the Python one it replaces.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import tempfile
import timeit
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from overshoot import Recorder  # noqa: E402

BATCH_STEPS = 200  # timed together, then flushed untimed: below the default flush_steps (256)


class Cost(NamedTuple):
    median: float
    best: float

    def __sub__(self, other):
        return Cost(self.median - other.median, self.best - other.best)


def ns_per_iter(stmt: str, names: dict, n: int, repeats: int, *, between=None) -> Cost:
    """The one timing loop: median and best over `repeats` timed runs of `stmt` executed n times, in ns per
    execution. timeit compiles the statement into its own loop (no call per iteration is measured) and
    pauses the GC while timing. `between` runs untimed after each run (the recorder's flush): a huge
    never-flushed buffer would measure memory growth instead."""
    timer = timeit.Timer(stmt, globals=names)
    samples = []
    for _ in range(repeats):
        samples.append(timer.timeit(n) * 1e9 / n)
        if between is not None:
            between()
    return Cost(statistics.median(samples), min(samples))


# The measured statements; names come from the recorder (or stream and events) in `names` below.
SPAN_PAIR = "busy_begin('schedule'); busy_end()"
SPAN_WITH = "with busy('schedule'): pass"
STEP = """
step_begin(batch_size=4, num_tokens=4, phase='decode')
busy_begin('schedule'); busy_end()
busy_begin('prepare'); busy_end()
busy_begin('launch'); busy_end()
wait_begin('gpu'); wait_end()
"""
STEP_GPU = """
step_begin(batch_size=4, num_tokens=4, phase='decode')
busy_begin('schedule'); busy_end()
busy_begin('prepare'); busy_end()
busy_begin('launch'); gpu_begin(stream); gpu_end(stream); busy_end()
wait_begin('gpu'); wait_end()
"""


def names(rec, **more) -> dict:
    """What the statements call: the recorder's bound methods, looked up once like an engine's hook does."""
    calls = ("busy", "busy_begin", "busy_end", "wait_begin", "wait_end", "step_begin", "gpu_begin", "gpu_end")
    return {name: getattr(rec, name) for name in calls} | more


def measure(args) -> list[tuple[str, Cost, str]]:
    rows: list[tuple[str, Cost, str]] = []
    batch, repeats = BATCH_STEPS, args.batches
    base = ns_per_iter("pass", {}, batch, repeats)
    rows.append(("bare loop (per iteration)", base, "reference"))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)

        def on_recorder(name: str, stmt: str, n: int, *, in_step: bool = False, **options) -> Cost:
            """stmt on a fresh recorder, flushed untimed between the timed runs, minus the bare loop."""
            rec = Recorder(tmp / name, engine="bench", **options)
            if in_step:
                rec.step_begin()
            cost = ns_per_iter(stmt, names(rec), n, repeats, between=rec.flush) - base
            rec.close()
            return cost

        n_spans = 4 * batch  # within the span buffer (16 x flush_steps)
        rows.append(("span (busy_begin/busy_end)", on_recorder("pairs", SPAN_PAIR, n_spans, in_step=True),
                     "<= 500"))
        rows.append(("span (with rec.busy(label))", on_recorder("with", SPAN_WITH, n_spans, in_step=True),
                     "<= 500"))
        per_step = on_recorder("steps", STEP, batch)
        rows.append(("step + 4 spans, CPU only", per_step, ""))
        rec = Recorder(tmp / "flush", engine="bench")  # defaults: flush every 256 steps or 1 s
        long_run = ns_per_iter(STEP, names(rec), args.steps, 3) - base
        rec.close()
        rows.append((f"step + 4 spans incl. flushes ({args.steps} steps)", long_run, "amortized"))
        rows.append(("  of which flushing, per step", long_run - per_step, ""))
        hooks = measure_hooks(tmp, batch, repeats)
        rows.append(("hooks: reference spec on a stub engine, a step", hooks, ""))
        if args.cuda:
            rows += measure_cuda(tmp, batch, repeats, base)
    return rows


class _Batch:
    num_seqs = num_tokens = 4
    phase = "decode"
    spec_tokens = 0


class StubEngine:
    """The reference engine's step, calls and return values, doing nothing else."""

    stream = None  # no CUDA events: the gpu role finds no stream

    def step(self):
        batch = self.schedule()
        inputs = self.prepare_inputs(batch)
        future = self.launch(batch, inputs)
        tokens = self.wait_for_results(future)
        self.update_requests(future, tokens)

    def schedule(self):
        return _Batch

    def prepare_inputs(self, batch):
        return None

    def launch(self, batch, inputs):
        return None

    def wait_for_results(self, future):
        return None

    def update_requests(self, future, tokens):
        return None

    def wait_for_work(self):
        return None


def measure_hooks(tmp: Path, batch: int, repeats: int) -> Cost:
    """StubEngine.step hooked by the reference spec minus unhooked, timed in alternating runs."""
    import types
    from dataclasses import replace

    from engine_hooks import patcher
    from engine_hooks.reference import SPEC

    module = types.ModuleType("overshoot_stub_engine")
    module.Engine = StubEngine
    sys.modules[module.__name__] = module
    spec = replace(SPEC, targets=tuple(replace(t, module=module.__name__) for t in SPEC.targets))
    rec = Recorder(tmp / "hooks", engine="bench", gpu_timing="off", flush_steps=batch * (repeats + 1),
                   flush_seconds=3600)
    engine = StubEngine()
    plain, hooked = [], []
    try:
        for _ in range(repeats):  # alternating, so the machine's drift falls on both alike
            plain.append(ns_per_iter("step()", {"step": engine.step}, batch, 1).median)
            patcher.install(spec, recorder_factory=lambda _engine, _info: rec)
            hooked.append(ns_per_iter("step()", {"step": engine.step}, batch, 1).median)
            patcher.reset()
    finally:
        patcher.reset()
        rec.close()
        del sys.modules[module.__name__]
    return Cost(statistics.median(hooked), min(hooked)) - Cost(statistics.median(plain), min(plain))


def measure_cuda(tmp: Path, batch: int, repeats: int, base: Cost) -> list[tuple[str, Cost, str]]:
    import torch

    from overshoot.record.cuda_events import native_record

    stream = torch.cuda.Stream()
    rows = []
    rec = Recorder(tmp / "gpu", engine="bench", cuda=True)  # ring + clock anchor set up outside the timing
    gpu_names = names(rec, stream=stream)
    ns_per_iter(STEP_GPU, gpu_names, batch, 1, between=rec.flush)  # warm-up
    per_step = ns_per_iter(STEP_GPU, gpu_names, batch, repeats, between=rec.flush) - base
    rows.append(("step + 4 spans + gpu_begin/gpu_end (CUDA)", per_step, "<= 4000"))
    rec.close()
    # Cycle through 256 events, as the recorder's ring does (the C-level next() is part of every row).
    pool = [torch.cuda.Event(enable_timing=True) for _ in range(256)]
    for event in pool:
        event.record(stream)  # creates the CUDA event (lazy until its first record)
    events = itertools.cycle(pool)
    handles = itertools.cycle([event.cuda_event for event in pool])
    raw = {"events": events, "handles": handles, "stream": stream, "record": native_record(torch.cuda.Event),
           "cu_record": driver_event_record()}
    variants = [
        ("Event.record(stream), raw", "next(events).record(stream)"),
        ("C-level record(event, stream) (torch path)", "record(next(events), stream)"),
        ("Event.record() current stream, raw", "next(events).record()"),
    ]
    if raw["cu_record"] is not None:
        variants.append(("driver cuEventRecord(handle, stream), ctypes",
                         "cu_record(next(handles), stream.cuda_stream)"))
    with torch.cuda.stream(stream):
        ns_per_iter(variants[0][1], raw, 512, 1, between=torch.cuda.synchronize)  # warm-up
        for name, stmt in variants:
            cost = ns_per_iter(stmt, raw, batch, repeats, between=torch.cuda.synchronize) - base
            rows.append((name, cost, ""))
    return rows


def driver_event_record():
    """The CUDA driver's cuEventRecord through ctypes (None without libcuda): how much of a record is torch's.
    On an H200 host it cost 1387 ns against 1498 for torch's C-level record, so the recorder keeps torch's."""
    import ctypes

    try:
        record = ctypes.CDLL("libcuda.so.1").cuEventRecord
    except OSError:
        return None
    record.argtypes, record.restype = (ctypes.c_void_p, ctypes.c_void_p), ctypes.c_int
    return record


def check_cuda_times(tmp: Path) -> list[str]:
    """GPU intervals as recorded vs CUDA-event timing of the same matmuls, and host-clock placement."""
    import torch

    from overshoot.rundir.reader import load_run

    stream = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device="cuda")
    with torch.cuda.stream(stream):
        for _ in range(3):
            a @ a
        ref0, ref1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ref0.record(stream)
        for _ in range(20):
            a @ a
        ref1.record(stream)
    ref1.synchronize()
    matmul_ms = ref0.elapsed_time(ref1) / 20
    rec = Recorder(tmp / "check", engine="bench", cuda=True, flush_steps=16)
    for _ in range(100):
        rec.step_begin()
        with rec.busy("launch"), torch.cuda.stream(stream):
            rec.gpu_begin(stream)
            a @ a
            a @ a
            rec.gpu_end(stream)
        with rec.wait("gpu"):
            stream.synchronize()
    rec.close()
    run = load_run(tmp / "check")
    joined = run.gpu.merge(run.steps, on=["pid", "thread", "step"])
    gpu_ms = (joined["gpu_end_ns"] - joined["gpu_start_ns"]) / 1e6
    launch = run.spans[run.spans["label"] == "launch"].set_index("step")["start_ns"]
    lead_us = (joined["gpu_start_ns"] - joined["step"].map(launch)) / 1e3  # GPU start after launch began
    tail_us = (joined["end_ns"] - joined["gpu_end_ns"]) / 1e3  # step end after GPU end
    info = run.processes[0]["gpu_events"]
    ratio = gpu_ms.median() / (2 * matmul_ms)
    return [
        f"matmul 4096^3 fp32: {matmul_ms:.3f} ms by CUDA events; recorded gpu_ms per step (2 matmuls): "
        f"median {gpu_ms.median():.3f} ms = {ratio:.3f} x expected; {len(joined)}/100 steps",
        f"host-clock placement: GPU start - launch start median {lead_us.median():.1f} us "
        f"(min {lead_us.min():.1f}); step end - GPU end median {tail_us.median():.1f} us "
        f"(min {tail_us.min():.1f})",
        f"ring: {info}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50_000, help="steps of the long run with flushes")
    parser.add_argument("--batches", type=int, default=200, help=f"timed batches of {BATCH_STEPS} steps")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    try:
        import torch

        args.cuda = torch.cuda.is_available()
        device = torch.cuda.get_device_name() if args.cuda else "CPU only"
    except ImportError:
        args.cuda, device = False, "CPU only (no torch)"
    rows = measure(args)
    notes = []
    if args.cuda:
        with tempfile.TemporaryDirectory() as tmp:
            notes = check_cuda_times(Path(tmp))
    cpu = platform.processor() or platform.machine()
    from overshoot.record import hotpath

    print(f"recorder overhead | python {platform.python_version()} | {cpu} | {device} | hot path "
          f"{hotpath.describe()}")
    print(f"{'what (ns per iteration)':48s} {'median':>8s} {'best':>8s}  goal")
    for name, ns, goal in rows:
        print(f"{name:48s} {ns.median:8.0f} {ns.best:8.0f}  {goal}")
    for line in notes:
        print(line)
    if args.json:
        table = [{"what": name, "median_ns": round(ns.median, 1), "best_ns": round(ns.best, 1), "goal": goal}
                 for name, ns, goal in rows]
        args.json.write_text(json.dumps({"device": device, "rows": table, "notes": notes}, indent=2))


if __name__ == "__main__":
    main()
