"""Run dirs with exactly known content, written through the real spool writer (overshoot/rundir/spool.py).

`simulate_timeline` computes an engine timeline arithmetically (a virtual clock, no sleeping), so analyzer and
report tests can assert exact numbers; tests that need a live engine thread use tests/synthetic_engine.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from overshoot.rundir.spool import BASE_SCHEMAS, SpoolWriter


@dataclass
class Frames:
    steps: pd.DataFrame
    spans: pd.DataFrame
    gpu: pd.DataFrame


def simulate_timeline(
    n: int,
    *,
    mode: str = "sync",
    cpu_ms: float = 1.0,
    gpu_ms: float = 1.2,
    post_ms: float = 0.2,
    jitter: float = 0.0,
    idle_every: int = 0,
    idle_ms: float = 5.0,
    start_ns: int = 10_000_000_000,
    batch_size: int = 1,
    seed: int = 0,
    phase: str = "decode",
    long_every: int = 0,
    long_cpu_ms: float = 10.0,
    long_gpu_ms: float = 12.0,
) -> Frames:
    """Steps of: busy `cpu_ms` (± jitter), launch GPU work of `gpu_ms`, wait, busy `post_ms`.

    sync: each step waits for its own GPU work; async: record n launches batch n+1 and waits for batch n.
    Waits carry 5 µs of call overhead plus 3 µs wake-up, like a real future. With `long_every`, every such
    step is a "prefill" that launches its GPU work (`long_gpu_ms`) at once and then stays busy for
    `long_cpu_ms` (a launch-bound eager prefill, as two CUDA events see it).
    """
    rng = np.random.default_rng(seed)
    t = float(start_ns)
    gpu_free = 0.0
    pending = None
    steps, spans, gpu = [], [], []
    for i in range(n):
        if idle_every and i and i % idle_every == 0:
            spans.append((-1, "idle", "idle", int(t), int(idle_ms * 1e6)))
            t += idle_ms * 1e6
        begin = t
        busy = cpu_ms * 1e6 * (1.0 + jitter * rng.uniform(-1.0, 1.0))
        long = bool(long_every) and i % long_every == long_every - 1
        if long:
            busy = long_cpu_ms * 1e6
            spans.append((i, "busy", "launch", int(t), int(busy)))
            g_start = max(t, gpu_free)
            gpu_free = g_start + long_gpu_ms * 1e6
            t += busy
        else:
            spans.append((i, "busy", "schedule", int(t), int(busy)))
            t += busy
            g_start = max(t, gpu_free)
            gpu_free = g_start + gpu_ms * 1e6
        gpu.append((i, int(g_start), int(gpu_free)))
        awaited = gpu_free if mode == "sync" else (pending if pending is not None else t)
        pending = gpu_free
        wait_start = t + 5_000
        wait_end = max(wait_start, awaited) + 3_000
        spans.append((i, "wait", "gpu", int(wait_start), int(wait_end - wait_start)))
        spans.append((i, "busy", "update", int(wait_end), int(post_ms * 1e6)))
        t = wait_end + post_ms * 1e6
        steps.append((i, int(begin), int(t), int(wait_end - wait_start), batch_size, batch_size,
                      "prefill" if long else phase))
    return Frames(
        pd.DataFrame(steps, columns=BASE_SCHEMAS["steps"].names),
        pd.DataFrame(spans, columns=BASE_SCHEMAS["spans"].names),
        pd.DataFrame(gpu, columns=BASE_SCHEMAS["gpu"].names),
    )


def write_run(
    path: Path,
    frames: Frames,
    *,
    pid: int = 4242,
    tag: str = "engine",
    meta: dict | None = None,
    chunk_rows: int = 256,
    extra: dict[str, list] | None = None,
    info: dict | None = None,
) -> Path:
    """Write one recorder's tables as spool chunks of `chunk_rows` rows (plus meta.json and recorder json)."""
    spool = path / "spool"
    spool.mkdir(parents=True, exist_ok=True)
    writer = SpoolWriter(spool, f"{pid}-{tag}")
    steps = frames.steps.assign(**(extra or {}))
    for table, df in (("steps", steps), ("spans", frames.spans), ("gpu", frames.gpu)):
        base = BASE_SCHEMAS[table]
        schema = base if table != "steps" else pa.Schema.from_pandas(df, preserve_index=False)
        if table == "steps":
            schema = pa.schema([base.field(c) if c in base.names else schema.field(c) for c in df.columns])
        for lo in range(0, len(df), chunk_rows):
            part = df.iloc[lo : lo + chunk_rows]
            writer.write(table, pa.RecordBatch.from_pandas(part, schema=schema, preserve_index=False))
    writer.close()
    process = {"pid": pid, "thread": tag, "engine": "simulated", "argv": ["simulate"], **(info or {})}
    (spool / f"{pid}-{tag}.json").write_text(json.dumps(process))
    meta_path = path / "meta.json"
    if meta is not None or not meta_path.exists():
        meta_path.write_text(json.dumps({"engine": "simulated", **(meta or {})}))
    return path


@dataclass
class KernelTimeline:
    frames: Frames
    kernels: pd.DataFrame  # the kernels table (KERNELS_SCHEMA columns)
    busy_ms: np.ndarray  # per step: the GPU busy time launched in it (truth)
    idle_share: np.ndarray  # per step: GPU idle (before + inside) over the step (truth)
    step_ms: np.ndarray


def simulate_kernel_timeline(
    n: int,
    *,
    mode: str = "async",
    kernels: int = 20,
    kernel_us: float = 5.0,
    launch_us: float = 20.0,
    pre_ms: float = 0.2,
    post_ms: float = 0.1,
    latency_us: float = 4.0,
    start_ns: int = 10_000_000_000,
    batch_size: int = 4,
    phase: str = "decode",
    collector_us: float = 0.0,
    instrumented: np.ndarray | None = None,
    per_launch: int = 1,
) -> KernelTimeline:
    """An engine whose GPU work is `kernels` launches a step, each a host call of `launch_us` that enqueues a
    kernel of `kernel_us`; a kernel starts at max(its launch + `latency_us`, the previous kernel's end).
    Each step: busy `pre_ms`, the launches, a wait (sync: for its own batch; async: for the previous one),
    busy `post_ms`. The truth is computed here, arithmetically: per-step GPU busy and idle share.
    `collector_us`: what kernel timing adds to each launch call of the `instrumented` steps (bool per step;
    None: every step), as CUPTI's callbacks do. `per_launch`: kernels a launch call enqueues (a CUDA graph's
    launch: one call, one correlation, many kernels)."""
    t = float(start_ns)
    gpu_free = 0.0
    pending_end: float | None = None
    steps, spans, gpu, rows = [], [], [], []
    busy, idle_share, step_ms = [], [], []
    last_batch_end = None
    corr = 0
    for i in range(n):
        begin = t
        call_us = launch_us + (collector_us if instrumented is None or instrumented[i] else 0.0)
        spans.append((i, "busy", "schedule", int(t), int(pre_ms * 1e6)))
        t += pre_ms * 1e6
        launch_start = t
        first = None
        for k in range(kernels):
            if k % per_launch == 0:  # a launch call
                corr += 1
                call_start = t
                t += call_us * 1e3
            k_start = max(call_start + latency_us * 1e3, gpu_free)
            gpu_free = k_start + kernel_us * 1e3
            first = k_start if first is None else first
            rows.append(("kernel", "k", 7, corr, int(call_start), int(t), int(k_start), int(gpu_free)))
        spans.append((i, "busy", "launch", int(launch_start), int(t - launch_start)))
        gpu.append((i, int(first), int(gpu_free)))
        awaited = gpu_free if mode == "sync" else pending_end
        pending_end = gpu_free
        wait_ns = 0.0
        if awaited is not None:
            wait_start = t + 2_000
            wait_end = max(wait_start, awaited) + 1_000
            spans.append((i, "wait", "gpu", int(wait_start), int(wait_end - wait_start)))
            wait_ns = wait_end - wait_start
            t = wait_end
        spans.append((i, "busy", "update", int(t), int(post_ms * 1e6)))
        t += post_ms * 1e6
        steps.append((i, int(begin), int(t), int(wait_ns), batch_size, batch_size, phase))
        work = kernels * kernel_us * 1e3
        before = 0.0 if last_batch_end is None else max(first - last_batch_end, 0.0)
        inside = (gpu_free - first) - work
        last_batch_end = gpu_free
        busy.append(work / 1e6)
        step_ms.append((t - begin) / 1e6)
        idle_share.append((before + inside) / (t - begin))
    frames = Frames(
        pd.DataFrame(steps, columns=BASE_SCHEMAS["steps"].names),
        pd.DataFrame(spans, columns=BASE_SCHEMAS["spans"].names),
        pd.DataFrame(gpu, columns=BASE_SCHEMAS["gpu"].names),
    )
    table = pd.DataFrame(rows, columns=BASE_SCHEMAS["kernels"].names)
    return KernelTimeline(frames, table, np.array(busy), np.array(idle_share), np.array(step_ms))


def write_kernel_run(path: Path, timeline: KernelTimeline, *,
                     windows: list[tuple[int, int]] | None = None, **options) -> Path:
    """write_run plus the kernels table (only those launched inside `windows` when given) and the windows."""
    write_run(path, timeline.frames, **options)
    kernels = timeline.kernels
    if windows is not None:
        launch = kernels["launch_start_ns"].to_numpy()
        keep = np.zeros(len(kernels), bool)
        for lo, hi in windows:
            keep |= (launch >= lo) & (launch < hi)
        kernels = kernels[keep]
    writer = SpoolWriter(path / "spool", f"{options.get('pid', 4242)}-{options.get('tag', 'engine')}")
    schema = BASE_SCHEMAS["kernels"]
    writer.write("kernels", pa.RecordBatch.from_pandas(kernels, schema=schema, preserve_index=False))
    if windows is not None:
        frame = pd.DataFrame(windows, columns=["start_ns", "end_ns"])
        writer.write("kernel_windows", pa.RecordBatch.from_pandas(
            frame, schema=BASE_SCHEMAS["kernel_windows"], preserve_index=False))
    writer.close()
    return path


def write_sweep(path: Path, *, cpu_ms: float, seed: int, levels: tuple[int, ...], n: int = 240) -> Path:
    """An async run (GPU 1.2 ms a step, CPU `cpu_ms` ± 30%) split evenly into load levels."""
    frames = simulate_timeline(n, mode="async", cpu_ms=cpu_ms, gpu_ms=1.2, post_ms=0.2, jitter=0.3, seed=seed)
    starts = frames.steps["start_ns"]
    per = n // len(levels)
    bounds = [int(starts[k * per]) for k in range(len(levels))] + [int(starts.iloc[-1]) + 10**9]
    meta = {"levels": [{"concurrency": c, "start_ns": bounds[k], "end_ns": bounds[k + 1]}
                       for k, c in enumerate(levels)]}  # fmt: skip
    return write_run(path, frames, meta=meta)
