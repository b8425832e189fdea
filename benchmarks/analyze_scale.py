"""Analyzer speed at scale: 1,000,000 steps written in the spool format, then load + summarise.

    python benchmarks/analyze_scale.py [--steps 1000000] [--keep DIR] [--sampled]

Writes a run dir the way the Recorder does (Arrow IPC stream chunks of 256 steps: steps, 3 spans per step,
GPU intervals), then measures in a fresh child process (so the peak RSS is the analyzer's, not the
generator's): load_run, summarize (no what-if), and the two default what-if replays. --sampled adds what
`--gpu-timing sampled` records: every kernel of 8 steps in 256 (3%, 20 launches a step) and the windows.
Goals: load + summarise <= 2 s and <= 1 GB peak RSS (issue 2); with the report's two what-ifs <= 1.5 s and
<= 1 GB (issue 22). Prints measured numbers and goal ratios.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from overshoot.rundir.spool import BASE_SCHEMAS, SpoolWriter  # noqa: E402

CHUNK = 256
GOAL_S, GOAL_MB = 2.0, 1024.0
REPORT_GOAL_S = 1.5  # issue 22: overshoot report with its two default what-ifs


WINDOW, EVERY, KERNELS = 8, 256, 20  # --sampled: steps a window, steps between window starts, launches a step


def write_synthetic_run(path: Path, n: int, seed: int = 0, *, sampled: bool = False) -> None:
    """An async-like engine timeline: CPU busy ~1 ms ± 30 %, GPU ~1.1 ms, 4 batch sizes, vectorised."""
    rng = np.random.default_rng(seed)
    busy = (1e6 * rng.uniform(0.7, 1.3, n)).astype("int64")
    wait = np.maximum(0, (1.1e6 - busy + rng.normal(0, 5e4, n))).astype("int64") + 8_000
    dur = busy + wait
    start = 10**10 + np.concatenate([[0], np.cumsum(dur[:-1])])
    end = start + dur
    launch = start + (busy * 0.8).astype("int64")
    gpu_start = np.maximum(launch, np.concatenate([[0], end[:-1] + 50_000]))
    gpu_end = gpu_start + 1_100_000
    step = np.arange(n, dtype="int64")
    batch = (1 << (step // 1000 % 4)).astype("int32")
    spool = path / "spool"
    spool.mkdir(parents=True, exist_ok=True)
    writer = SpoolWriter(spool, "1000-engine")
    span_step = np.repeat(step, 3)
    kind = np.tile(np.array(["busy", "wait", "busy"], dtype=object), n)
    label = np.tile(np.array(["schedule", "gpu", "update"], dtype=object), n)
    sched = (busy * 0.8).astype("int64")
    span_start = np.stack([start, start + sched, start + sched + wait], axis=1).ravel()
    span_dur = np.stack([sched, wait, busy - sched], axis=1).ravel()
    phase = np.full(n, "decode", dtype=object)
    for lo in range(0, n, CHUNK):
        hi = min(n, lo + CHUNK)
        writer.write(
            "steps",
            pa.RecordBatch.from_arrays(
                [
                    step[lo:hi],
                    start[lo:hi],
                    end[lo:hi],
                    wait[lo:hi],
                    batch[lo:hi],
                    batch[lo:hi],
                    phase[lo:hi],
                ],
                schema=BASE_SCHEMAS["steps"],
            ),
        )
        s, e = 3 * lo, 3 * hi
        writer.write(
            "spans",
            pa.RecordBatch.from_arrays(
                [span_step[s:e], kind[s:e], label[s:e], span_start[s:e], span_dur[s:e]],
                schema=BASE_SCHEMAS["spans"],
            ),
        )
        writer.write(
            "gpu",
            pa.RecordBatch.from_arrays(
                [step[lo:hi], gpu_start[lo:hi], gpu_end[lo:hi]], schema=BASE_SCHEMAS["gpu"]
            ),
        )
    if sampled:
        write_sampled_kernels(writer, start, end, launch, gpu_start, gpu_end)
    writer.close()
    (spool / "1000-engine.json").write_text(json.dumps({"pid": 1000, "thread": "engine", "engine": "scale"}))
    (path / "meta.json").write_text(json.dumps({"engine": "scale"}))


def write_sampled_kernels(writer: SpoolWriter, start, end, launch, gpu_start, gpu_end) -> None:
    """Kernel records of the window steps: KERNELS launch calls of 4 µs, 5 µs apart, from the step's launch;
    their kernels split its GPU interval evenly, back to back."""
    steps = np.flatnonzero(np.arange(len(start)) % EVERY < WINDOW)
    j = np.tile(np.arange(KERNELS), len(steps))
    s = np.repeat(steps, KERNELS)
    width = (gpu_end[s] - gpu_start[s]) // KERNELS
    launch_start = launch[s] + 5_000 * j
    k_start = gpu_start[s] + width * j
    table = pa.RecordBatch.from_arrays(
        [pa.array(["kernel"] * len(s)), pa.array(["k"] * len(s)), np.full(len(s), 7, "int64"),
         np.arange(len(s), dtype="int64"), launch_start, launch_start + 4_000, k_start, k_start + width],
        schema=BASE_SCHEMAS["kernels"])
    for lo in range(0, len(s), CHUNK * KERNELS):
        writer.write("kernels", table.slice(lo, CHUNK * KERNELS))
    first = steps[steps % EVERY == 0]
    last = np.minimum(first + WINDOW - 1, len(start) - 1)
    writer.write("kernel_windows", pa.RecordBatch.from_arrays([start[first], end[last]],
                                                               schema=BASE_SCHEMAS["kernel_windows"]))


def measure(path: Path, *, what_ifs: bool) -> dict:
    """load_run + summarize (with the report's two what-ifs or none), in this fresh process."""
    from overshoot.analysis.analyze import summarize
    from overshoot.analysis.whatif import WhatIf
    from overshoot.rundir.reader import load_run

    t0 = time.perf_counter()
    run = load_run(path)
    t1 = time.perf_counter()
    summary = summarize(run, what_ifs=[WhatIf("gpu", -0.1), WhatIf("cpu", -0.1)] if what_ifs else [])
    t2 = time.perf_counter()
    return {
        "steps": len(run.steps),
        "spans": len(run.spans),
        "load_s": t1 - t0,
        "summarize_s": t2 - t1,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "groups": len(summary.groups),
    }


def child(*args: str) -> dict:
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def report_cli(path: Path) -> dict:
    """`overshoot report RUN` as a user runs it (imports, load, summarise with its two what-ifs, render):
    wall time and the peak RSS of that process alone (this child's only child)."""
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "overshoot", "report", str(path)], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[1])
    wall = time.perf_counter() - t
    if done.returncode != 0:
        raise SystemExit(f"overshoot report failed: {done.stderr.strip()[-500:]}")
    return {"wall_s": wall, "peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--keep", type=Path, help="write (or reuse) the run dir here instead of a temp dir")
    parser.add_argument("--sampled", action="store_true", help="with kernel records of 3%% of the steps")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # child process mode
    parser.add_argument("--what-ifs", action="store_true", help=argparse.SUPPRESS)  # ... with the what-ifs
    parser.add_argument("--report-cli", type=Path, help=argparse.SUPPRESS)  # child: run the CLI
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, what_ifs=args.what_ifs)))
        return
    if args.report_cli:
        print(json.dumps(report_cli(args.report_cli)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = args.keep or Path(tmp) / "scale"
        if not (path / "meta.json").exists():
            t = time.perf_counter()
            write_synthetic_run(path, args.steps, sampled=args.sampled)
            print(f"wrote {args.steps:,} steps to a run dir in {time.perf_counter() - t:.1f} s")
        # Each figure from a fresh process, as the report runs: one summarise, nothing kept from another.
        plain = child("--measure", str(path))
        report = child("--measure", str(path), "--what-ifs")
        cli = child("--report-cli", str(path))
    total = plain["load_s"] + plain["summarize_s"]
    print(f"{'measure':<38}{'value':>12}{'goal':>10}{'ratio':>8}")
    print(f"{'load_run':<38}{plain['load_s']:>11.2f}s")
    print(f"{'summarize (no what-if)':<38}{plain['summarize_s']:>11.2f}s")
    print(f"{'load + summarize':<38}{total:>11.2f}s{GOAL_S:>9.1f}s{total / GOAL_S:>8.2f}")
    print(f"{'peak RSS (load + summarize)':<38}{plain['peak_rss_mb']:>9.0f} MB{GOAL_MB:>7.0f} MB"
          f"{plain['peak_rss_mb'] / GOAL_MB:>8.2f}")
    work = report["load_s"] + report["summarize_s"]
    print(f"{'load + summarize with 2 what-ifs':<38}{work:>11.2f}s{REPORT_GOAL_S:>9.1f}s"
          f"{work / REPORT_GOAL_S:>8.2f}   (overshoot report's work)")
    print(f"{'peak RSS incl. what-ifs':<38}{report['peak_rss_mb']:>9.0f} MB{GOAL_MB:>7.0f} MB"
          f"{report['peak_rss_mb'] / GOAL_MB:>8.2f}")
    print(f"{'overshoot report (the CLI, wall)':<38}{cli['wall_s']:>11.2f}s")
    print(f"{'overshoot report (the CLI, peak RSS)':<38}{cli['peak_rss_mb']:>9.0f} MB{GOAL_MB:>7.0f} MB"
          f"{cli['peak_rss_mb'] / GOAL_MB:>8.2f}")
    print(f"({plain['steps']:,} steps, {plain['spans']:,} spans, {plain['groups']} groups)")
    print("note: the what-ifs replay the timeline as a max-plus scan (analysis/maxplus.py); a group's own")
    print("figure (what the timeline gains when only its steps change) recomposes only the scan's reduction")
    print("nodes at the edges of the group's runs of steps.")


if __name__ == "__main__":
    main()
