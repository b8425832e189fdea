"""GPU idle by host work (overshoot/analysis/idle.py) against a truth painted instant by instant: on timelines
whose kernels and spans are set (tests/run_factory), each microsecond is marked GPU-busy by every kernel
interval and given the label of the innermost span over it; the report's split of the GPU idle by label
must match that painting."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from run_factory import simulate_kernel_timeline, write_kernel_run
from test_gpu_truth import CASES

from overshoot.report.table import build_report
from overshoot.rundir.reader import load_run

GRID_NS = 1_000


def paint(kernels: pd.DataFrame, spans: pd.DataFrame, lo_ns: int, hi_ns: int, *,
          grid_ns: int = GRID_NS) -> tuple[np.ndarray, np.ndarray]:
    """A grid of `grid_ns` cells over [lo_ns, hi_ns): per cell whether a kernel ran (every kernel interval
    marks it busy) and the label of the innermost span over it (inside a wait everything stays the wait)."""
    start, end = int(lo_ns), int(hi_ns)
    n = (end - start) // grid_ns
    busy = np.zeros(n, bool)
    for s, e in zip(kernels["gpu_start_ns"], kernels["gpu_end_ns"], strict=True):
        busy[max((s - start) // grid_ns, 0):max((e - start) // grid_ns, 0)] = True
    label = np.full(n, "unlabelled", dtype=object)
    wait_depth = np.zeros(n, bool)
    # outer spans first, so the inner ones paint over them
    order = spans.assign(end=spans["start_ns"] + spans["dur_ns"]).sort_values(["start_ns", "end"],
                                                                              ascending=[True, False])
    for row in order.itertuples(index=False):
        lo, hi = max((row.start_ns - start) // grid_ns, 0), max((row.end - start) // grid_ns, 0)
        name = f"wait:{row.label}" if row.kind == "wait" else row.label
        free = ~wait_depth[lo:hi]
        label[lo:hi][free] = name
        if row.kind == "wait":
            wait_depth[lo:hi] = True
    return busy, label


def painted(kernels: pd.DataFrame, spans: pd.DataFrame, lo_ns: int, hi_ns: int, *,
            grid_ns: int = GRID_NS) -> dict[str, float]:
    """GPU idle ns per label in [lo_ns, hi_ns), by painting a grid (paint)."""
    busy, label = paint(kernels, spans, lo_ns, hi_ns, grid_ns=grid_ns)
    return {name: float(((label == name) & ~busy).sum() * grid_ns) for name in set(label[~busy])}


def known_truth(timeline, windows: list[tuple[int, int]] | None = None) -> tuple[dict, dict, int]:
    """The painted GPU idle per label over the instants whose GPU state the kernel records know, and over the
    steps known whole; and the count of those steps. Known: inside a window (the whole run when there are
    none), from its first recorded kernel's start (the GPU may still run earlier, unrecorded work before)
    until its end (the run's: its last kernel's end); a step counts where it lies inside a window."""
    steps, kernels, spans = timeline.frames.steps, timeline.kernels, timeline.frames.spans
    lo, hi = int(steps["start_ns"].min()), int(steps["end_ns"].max())
    busy, label = paint(kernels, spans, lo, hi)
    launch = kernels["launch_start_ns"].to_numpy()
    bounds = windows or [(lo, hi + 1)]
    every, whole, n_whole = {}, {}, 0
    for w_lo, w_hi in bounds:
        mine = kernels[(launch >= w_lo) & (launch < w_hi)]
        first = int(mine["gpu_start_ns"].min())
        close = w_hi if windows else int(mine["gpu_end_ns"].max())
        inside = steps[(steps["start_ns"] >= w_lo) & (steps["end_ns"] <= w_hi)]
        for s, e in zip(inside["start_ns"], inside["end_ns"], strict=True):
            a, b = max(s, first), min(e, close)
            cells = slice((a - lo) // GRID_NS, (b - lo) // GRID_NS)
            is_whole = (a, b) == (s, e)
            n_whole += is_whole
            for name in set(label[cells][~busy[cells]]):
                ns = float(((label[cells] == name) & ~busy[cells]).sum() * GRID_NS)
                every[name] = every.get(name, 0.0) + ns
                if is_whole:
                    whole[name] = whole.get(name, 0.0) + ns
    return every, whole, n_whole


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("case", ["launch-bound", "mixed", "gpu-bound"])
def test_gpu_idle_by_host_work_matches_a_painted_truth(tmp_path, case, mode):
    timeline = simulate_kernel_timeline(120, mode=mode, **CASES[case])
    spans = timeline.frames.spans
    # a nested span: "sample" fills the first half of every update span
    updates = spans[spans["label"] == "update"]
    nested = updates.assign(label="sample", dur_ns=updates["dur_ns"] // 2)
    timeline.frames.spans = pd.concat([spans, nested], ignore_index=True).sort_values("start_ns",
                                                                                       kind="stable")
    run = load_run(write_kernel_run(tmp_path / f"{case}-{mode}", timeline))
    (group,) = build_report(run)["groups"]
    got = {r["label"]: r for r in group["gpu_idle_by_label"]}
    # (the first step's idle before its first kernel is unknown to kernel records, and so is the last one's
    # after the last kernel's end: both count in the shares only)
    every, whole, steps = known_truth(timeline)
    assert group["gpu_idle_by_label_steps"][0] == steps and steps >= 118
    total = sum(every.values())
    for name, ns in every.items():
        if whole.get(name, 0.0) / steps < 1_000:  # under 1 µs a step: the grid's resolution
            continue
        assert name in got, (name, got)
        assert got[name]["ms"] * 1e6 == pytest.approx(whole[name] / steps, abs=1_500), name
        assert got[name]["share_pct"] == pytest.approx(100 * ns / total, abs=1.0), name
    if total / steps < 1_000:  # GPU-bound and async: the GPU never idles, and nothing is split
        assert got == {}, got
        return
    assert sum(r["share_pct"] for r in got.values()) == pytest.approx(100.0, abs=1e-6)
    if case == "launch-bound":  # the GPU waits on the launch calls: their label leads
        assert group["gpu_idle_by_label"][0]["label"] == "launch"
        assert group["gpu_idle_by_label"][0]["share_pct"] > 45  # 0.3 of its 0.4 ms, of ~0.6 ms idle


def test_only_known_idle_is_split_and_a_run_without_kernels_says_so(tmp_path):
    """Windows of 10 steps: only the idle inside a window counts, from its first kernel's start (the GPU's
    state before it was not recorded) to its end, its last step's tail included (work launched after the
    window cannot run before its end); per step, the figures equal the whole run's. Without kernel records
    the key is empty and --by-label says why."""
    import json
    import subprocess
    import sys

    timeline = simulate_kernel_timeline(200, mode="async", **CASES["launch-bound"])
    starts, ends = timeline.frames.steps["start_ns"].to_numpy(), timeline.frames.steps["end_ns"].to_numpy()
    windows = [(int(starts[i]), int(ends[i + 9])) for i in (20, 120)]
    run = load_run(write_kernel_run(tmp_path / "sampled", timeline, windows=windows))
    (group,) = build_report(run)["groups"]
    whole = load_run(write_kernel_run(tmp_path / "whole", simulate_kernel_timeline(
        200, mode="async", **CASES["launch-bound"])))
    (every,) = build_report(whole)["groups"]
    by = {r["label"]: r["ms"] for r in group["gpu_idle_by_label"]}
    by_every = {r["label"]: r["ms"] for r in every["gpu_idle_by_label"]}
    assert group["gpu_idle_by_label_steps"] == [18, 2]  # a window's first step is known from its first kernel
    known, whole, n = known_truth(timeline, windows)
    for label, ns in whole.items():
        assert by[label] * 1e6 == pytest.approx(ns / n, abs=1_500), label
    assert by.keys() == by_every.keys()
    for label, ms in by_every.items():  # the same steady steps, a step at a time
        assert by[label] == pytest.approx(ms, abs=0.002), label
    events = tmp_path / "events"
    from run_factory import write_run

    write_run(events, timeline.frames)
    command = [sys.executable, "-m", "overshoot", "report", str(events), "--by-label"]
    result = subprocess.run([*command, "--json"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["groups"][0]["gpu_idle_by_label"] == []
    text = subprocess.run(command, capture_output=True, text=True).stdout
    assert "GPU idle by host work: no kernel records" in text


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_one_step_windows_split_the_idle_after_the_first_kernel(tmp_path, mode):
    """A costly collector (an eager engine under CUPTI) gets windows of one step: no step's GPU state is
    known whole, but from its first kernel's start to its end it is. The shares match a painting of those
    stretches; ms a step is not given (None, '-' in the table) and the report says why."""
    import json
    import subprocess
    import sys

    timeline = simulate_kernel_timeline(100, mode=mode, **CASES["launch-bound"])
    starts, ends = timeline.frames.steps["start_ns"].to_numpy(), timeline.frames.steps["end_ns"].to_numpy()
    windows = [(int(starts[i]), int(ends[i])) for i in range(5, 100, 10)]
    run_dir = write_kernel_run(tmp_path / "run", timeline, windows=windows)
    command = [sys.executable, "-m", "overshoot", "report", str(run_dir), "--by-label"]
    done = subprocess.run([*command, "--json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (group,) = json.loads(done.stdout)["groups"]
    assert group["gpu_idle_by_label_steps"] == [0, 10]
    every, whole, n = known_truth(timeline, windows)
    assert n == 0 and whole == {}
    total = sum(every.values())
    got = {r["label"]: r for r in group["gpu_idle_by_label"]}
    assert got.keys() == {k for k, v in every.items() if v / 10 >= 1_000}
    for label, ns in every.items():
        if label in got:
            assert got[label]["ms"] is None
            assert got[label]["share_pct"] == pytest.approx(100 * ns / total, abs=1.0), label
    assert group["gpu_idle_by_label"][0]["label"] == "launch"
    text = subprocess.run(command, capture_output=True, text=True).stdout
    assert "has its GPU state known whole (one-step windows)" in text, text
    assert "GPU idles most while the thread is in 'launch'" in text, text


def test_a_group_without_a_window_borrows_the_split_of_its_shape_elsewhere(tmp_path):
    """A costly collector's windows fall where its budget allows: here one in the warm-up before the first
    load level and one in the first level, none in the second. The first level's split is its own window's;
    the second borrows that of every instrumented step of its phase and batch size (the warm-up's and the
    first level's), marked borrowed; the shares match a painting of those windows' known instants."""
    import json
    import subprocess
    import sys

    timeline = simulate_kernel_timeline(200, mode="async", **CASES["launch-bound"])
    starts, ends = timeline.frames.steps["start_ns"].to_numpy(), timeline.frames.steps["end_ns"].to_numpy()
    windows = [(int(starts[5]), int(ends[12])), (int(starts[60]), int(ends[69]))]
    bounds = [int(starts[40]), int(starts[120]), int(ends[-1]) + 1]
    meta = {"levels": [{"concurrency": c, "start_ns": bounds[k], "end_ns": bounds[k + 1]}
                       for k, c in enumerate((1, 2))]}  # fmt: skip
    run_dir = write_kernel_run(tmp_path / "run", timeline, windows=windows, meta=meta)
    command = [sys.executable, "-m", "overshoot", "report", str(run_dir), "--by-label"]
    done = subprocess.run([*command, "--json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    first, second = sorted(json.loads(done.stdout)["groups"], key=lambda g: g["concurrency"])
    assert (first["gpu_idle_by_label_borrowed"], first["gpu_idle_by_label_steps"]) == (False, [9, 1])
    assert (second["gpu_idle_by_label_borrowed"], second["gpu_idle_by_label_steps"]) == (True, [16, 2])
    for group, known in ((first, windows[1:]), (second, windows)):
        every, whole, n = known_truth(timeline, known)
        total = sum(every.values())
        got = {r["label"]: r for r in group["gpu_idle_by_label"]}
        assert got and got.keys() <= every.keys()
        for label, ns in every.items():
            if whole.get(label, 0.0) / n < 1_000:
                continue
            assert got[label]["share_pct"] == pytest.approx(100 * ns / total, abs=1.0), label
            assert got[label]["ms"] * 1e6 == pytest.approx(whole[label] / n, abs=1_500), label
    assert second["gpu_idle_by_label"][0]["label"] == "launch"
    text = " ".join(subprocess.run(command, capture_output=True, text=True).stdout.split())
    assert "borrowed: decode @ 2 requests, batch 4 (18 steps): no instrumented step" in text, text
    assert "decode @ 2 requests, batch 4 (borrowed) 0.30 52%" in text, text
    assert "thread is in 'launch' (52% of its idle, borrowed)" in text, text


def test_compare_sets_the_idle_split_of_two_runs_side_by_side(tmp_path):
    """Launch calls of 20 µs against 10 µs, each enqueuing a 5 µs kernel: the GPU idles 15 µs against 5 µs in
    each of the step's 20 launch calls, 0.3 against 0.1 ms a step in 'launch'; the comparison shows both."""
    import json
    import os
    import subprocess
    import sys

    dirs = []
    for name, launch_us in (("slow", 20.0), ("fast", 10.0)):
        params = {**CASES["launch-bound"], "launch_us": launch_us}
        timeline = simulate_kernel_timeline(120, mode="sync", **params)
        dirs.append(str(write_kernel_run(tmp_path / name, timeline)))
    command = [sys.executable, "-m", "overshoot", "report", dirs[0], "--compare", dirs[1], "--by-label"]
    result = subprocess.run([*command, "--json"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(result.stdout)["compare"]
    launch = next(r for r in row["gpu_idle_by_label"] if r["label"] == "launch")
    assert launch["a"] == pytest.approx(0.3, abs=0.002) and launch["b"] == pytest.approx(0.1, abs=0.002)
    assert launch["delta"] == pytest.approx(-66.7, abs=1.0)
    text = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    assert "GPU idle in: launch" in text.stdout, text.stdout


def test_export_writes_the_idle_split_step_by_step(tmp_path):
    """`overshoot export --what idle`: a row per step and label, read back with pandas; each step's labels add
    up to its known idle, 'launch' holds 0.3 ms of each (20 calls of 20 µs around 5 µs kernels); an events
    run writes no rows and says why."""
    import subprocess
    import sys

    from run_factory import write_run

    timeline = simulate_kernel_timeline(60, mode="sync", **CASES["launch-bound"])
    run_dir = write_kernel_run(tmp_path / "run", timeline)
    out = tmp_path / "idle.parquet"
    done = subprocess.run([sys.executable, "-m", "overshoot", "export", str(run_dir), "-o", str(out),
                           "--what", "idle"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    table = pd.read_parquet(out)
    assert list(table.columns) == ["pid", "thread", "step", "label", "idle_ms", "step_idle_ms", "known_ms",
                                   "step_ms"]
    assert str(table["step"].dtype) == "int64" and str(table["idle_ms"].dtype) == "float64"
    sums = table.groupby("step").agg(idle=("idle_ms", "sum"), known=("step_idle_ms", "first"),
                                     known_ms=("known_ms", "first"), step_ms=("step_ms", "first"))
    assert np.allclose(sums["idle"], sums["known"], atol=1e-9)
    # the first step's GPU state is known from its first kernel on, the last one's up to its last kernel's end
    partial = sums.index[sums["known_ms"] < sums["step_ms"]]
    assert list(partial) == [0, 59] and len(sums) == 60
    assert np.allclose(sums["known_ms"].drop(partial), sums["step_ms"].drop(partial))
    launch = table[(table["label"] == "launch") & ~table["step"].isin(partial)]
    assert len(launch) == 58 and np.allclose(launch["idle_ms"], 0.3, atol=1e-6)
    write_run(tmp_path / "events", timeline.frames)
    empty = subprocess.run([sys.executable, "-m", "overshoot", "export", str(tmp_path / "events"), "-o",
                            str(tmp_path / "e.parquet"), "--what", "idle"], capture_output=True, text=True)
    assert empty.returncode == 0 and "0 rows); no step with its GPU idle known" in empty.stderr


def test_the_dataset_export_holds_the_idle_table(tmp_path):
    """`export --dataset`: the idle table beside the others, read back as a hive-partitioned dataset."""
    import subprocess
    import sys

    timeline = simulate_kernel_timeline(40, mode="sync", **CASES["launch-bound"])
    run_dir = write_kernel_run(tmp_path / "run", timeline)
    done = subprocess.run([sys.executable, "-m", "overshoot", "export", str(run_dir), "--dataset",
                           str(tmp_path / "ds")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    idle = pd.read_parquet(tmp_path / "ds" / "idle")
    assert {"step", "label", "idle_ms", "step_idle_ms", "run", "rank"} <= set(idle.columns)
    whole = idle[idle["known_ms"] == idle["step_ms"]]
    assert whole["step"].nunique() == 38 and (whole.loc[whole["label"] == "launch", "idle_ms"] > 0.29).all()


def test_kernels_of_another_process_leave_the_split_empty_and_the_report_says_why(tmp_path):
    """An engine core whose worker process launches the kernels: the split covers the primary timeline's
    process only, and --by-label says so rather than "no kernel records"."""
    import subprocess
    import sys

    import pyarrow as pa
    from run_factory import write_run

    from overshoot.rundir.spool import BASE_SCHEMAS, SpoolWriter

    timeline = simulate_kernel_timeline(40, mode="sync", **CASES["launch-bound"])
    run_dir = write_run(tmp_path / "run", timeline.frames)
    writer = SpoolWriter(run_dir / "spool", "999-worker")
    writer.write("kernels", pa.RecordBatch.from_pandas(timeline.kernels, schema=BASE_SCHEMAS["kernels"],
                                                       preserve_index=False))
    writer.close()
    run = load_run(run_dir)
    assert set(run.kernels["pid"]) == {999}
    report = build_report(run)
    assert report["groups"][0]["gpu_idle_by_label"] == []
    note = report["gpu_idle_by_label_note"]
    assert "come from other processes than the primary timeline's (pid 4242" in note
    text = subprocess.run([sys.executable, "-m", "overshoot", "report", str(run_dir), "--by-label"],
                          capture_output=True, text=True).stdout
    assert "the kernel records come from other processes" in " ".join(text.split())


def test_end_to_end_through_the_recorder_and_the_sampler(tmp_path):
    """The recorder's own output, not a written run: a synchronous engine loop (schedule 50 µs, four launch
    calls of 30 µs each enqueuing a 20 µs kernel on a virtual device, a wait for the device, update 20 µs)
    recorded in sampled mode with a collector that sees kernels only inside its windows, over two load
    levels. Every decode group gets kernel data of its own or borrowed; the split of each step's GPU idle
    matches a painting of every kernel the device ran (recorded or not) under the recorded spans, within
    3 µs a label."""
    from synthetic_engine import spin, spin_until
    from test_kernel_timing import LAUNCH_NS, VirtualCollector

    from overshoot import Recorder
    from overshoot.analysis.analyze import summarize
    from overshoot.export import table_of
    from overshoot.record.kernel_timing import KernelSampler
    from overshoot.rundir.meta import update_meta

    class Device(VirtualCollector):
        """Keeps every kernel it ran, the truth, beside what the collector saw."""

        def __init__(self):
            super().__init__()
            self.ran: list[tuple[int, int]] = []

        def launch(self, gpu_free: int, kernel_ns: int = 20_000) -> int:
            t = perf_counter_ns()
            start = max(t + 2_000, gpu_free)
            spin(LAUNCH_NS)
            self.ran.append((start, start + kernel_ns))
            if self.on:
                self.recorded((t, t + LAUNCH_NS, start, start + kernel_ns))
            return start + kernel_ns

    from time import perf_counter_ns

    device = Device()
    rec = Recorder(tmp_path / "run", engine="virtual", gpu_timing="sampled")
    rec._sampler = KernelSampler(rec, device, window_steps=8, min_gap=16, budget=0.5, drain_seconds=0.05)
    bounds, gpu_free = [], 0
    for level, steps in ((1, 150), (2, 150)):
        bounds.append(perf_counter_ns())
        for _ in range(steps):
            rec.step_begin(batch_size=level, num_tokens=level, phase="decode")
            with rec.busy("schedule"):
                spin(50_000)
            with rec.busy("launch"):
                for _ in range(4):
                    gpu_free = device.launch(gpu_free)
            with rec.wait("gpu"):
                spin_until(gpu_free)
            with rec.busy("update"):
                spin(20_000)
    rec.step_end()
    bounds.append(perf_counter_ns())
    rec.close()
    update_meta(tmp_path / "run", {"levels": [
        {"concurrency": c, "start_ns": bounds[k], "end_ns": bounds[k + 1]} for k, c in enumerate((1, 2))]})
    run = load_run(tmp_path / "run")
    groups = summarize(run).groups
    assert set(groups["gpu_timing"]) <= {"sampled", "borrowed"}, groups[["concurrency", "gpu_timing"]]
    idle = table_of(run, "idle")
    assert idle["step"].nunique() >= 10
    truth_kernels = pd.DataFrame(device.ran, columns=["gpu_start_ns", "gpu_end_ns"])
    steps = run.steps.set_index("step")
    for step, rows in idle.groupby("step"):
        # (a window's first step is known from its first kernel's start: the part its known_ms leaves out)
        hi = steps.loc[step, "end_ns"]
        lo = hi - round(rows["known_ms"].iloc[0] * 1e6)
        assert lo >= steps.loc[step, "start_ns"]
        # (a 0.1 µs grid: the recorded times are anywhere between cells, and a 1 µs one rounds each of the
        # step's dozen span and kernel edges by up to 1 µs, 3 µs on one label now and then)
        truth = painted(truth_kernels, run.spans, int(lo), int(hi), grid_ns=100)
        got = dict(zip(rows["label"], rows["idle_ms"] * 1e6, strict=True))
        for name in set(truth) | set(got):
            assert got.get(name, 0.0) == pytest.approx(truth.get(name, 0.0), abs=3_000), (step, name)
