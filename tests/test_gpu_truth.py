"""GPU truth inside the step, on timelines whose answer is set (tests/run_factory.simulate_kernel_timeline):
per-step GPU busy and idle from kernel records, the starvation verdict, sampled kernel timing, and the
kernel-by-kernel what-if against an actual rerun with shorter kernels or less CPU work."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from run_factory import simulate_kernel_timeline, simulate_timeline, write_kernel_run, write_run

from overshoot.analysis.analyze import steps_table, summarize
from overshoot.analysis.whatif import WhatIf
from overshoot.rundir.reader import load_run

GPU_FASTER, CPU_FASTER = WhatIf("gpu", -0.10), WhatIf("cpu", -0.10)
CASES = {
    # eager and launch-bound: 20 launches of 20 us each enqueue 5 us kernels: the GPU idles ~85%
    "launch-bound": dict(kernels=20, kernel_us=5.0, launch_us=20.0),
    # one launch enqueues 2 ms of GPU work (a graph): the CPU waits
    "gpu-bound": dict(kernels=20, kernel_us=100.0, launch_us=1.0, pre_ms=0.1, post_ms=0.05),
    # CPU and GPU close: some steps each way
    "mixed": dict(kernels=20, kernel_us=30.0, launch_us=25.0, pre_ms=0.1, post_ms=0.05),
}
# One CUDA graph a step: one launch call enqueues 200 kernels; its CPU work and GPU work close.
GRAPH = dict(kernels=200, kernel_us=4.0, launch_us=20.0, per_launch=200, pre_ms=0.6, post_ms=0.2)


def _run(tmp_path, name, **kwargs):
    timeline = simulate_kernel_timeline(200, **kwargs)
    return timeline, load_run(write_kernel_run(tmp_path / name, timeline))


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_busy_idle_and_verdict_match_the_truth(tmp_path, case, mode):
    truth, run = _run(tmp_path, f"{case}-{mode}", mode=mode, **CASES[case])
    table = steps_table(run)
    assert (table["gpu_timing"] == "kernels").all() and (table["kernels"] == 20).all()
    assert np.allclose(table["gpu_busy_ms"], truth.busy_ms, atol=1e-6)
    launch_ms = CASES[case]["launch_us"] * 20 / 1e3
    assert np.allclose(table["launch_ms"], launch_ms, atol=1e-6)
    error_pts = 100 * np.abs(table["gpu_idle_share"].to_numpy()[1:] - truth.idle_share[1:])
    assert error_pts.max() < 2.0, error_pts.max()
    expected = truth.idle_share[1:] > 0.05
    assert (table["cpu_bound"].to_numpy()[1:].astype(bool) == expected).mean() > 0.98
    group = summarize(run).groups.iloc[0]
    true_idle = 100 * (truth.idle_share[1:] * truth.step_ms[1:]).sum() / truth.step_ms[1:].sum()
    assert group["gpu_idle_pct"] == pytest.approx(true_idle, abs=2.0)
    assert group["gpu_busy_ms_median"] == pytest.approx(np.median(truth.busy_ms), abs=1e-6)
    assert group["gpu_idle_in_step_pct"] is not None and not np.isnan(group["gpu_idle_in_step_pct"])


def test_launch_bound_steps_are_cpu_bound_although_events_show_a_busy_gpu(tmp_path):
    """The product's old blind spot: the GPU interval spans the step, so events alone see ~no idle; kernel
    records see the GPU ~85% idle, every step CPU-bound, and the report says so."""
    truth, run = _run(tmp_path, "eager", mode="async", **CASES["launch-bound"])
    group = summarize(run).groups.iloc[0]
    assert group["cpu_bound_pct"] == pytest.approx(100.0, abs=1)
    assert group["gpu_idle_pct"] > 80 and group["gpu_idle_in_step_pct"] > 30
    events_only = load_run(write_run(tmp_path / "events", truth.frames))
    blind = summarize(events_only).groups.iloc[0]
    assert blind["gpu_idle_pct"] < group["gpu_idle_pct"] - 30 and pd.isna(blind["gpu_idle_in_step_pct"])
    assert blind["gpu_timing"] == "events" and group["gpu_timing"] == "kernels"


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_replay_matches_a_rerun(tmp_path, case, mode):
    """What-if from the kernel timeline against an actual rerun: kernels 10% shorter, or the CPU's spans and
    the gaps between launches 10% shorter; within 3% of the rerun's mean step."""
    truth, run = _run(tmp_path, "base", mode=mode, **CASES[case])
    summary = summarize(run, what_ifs=[GPU_FASTER, CPU_FASTER])
    assert "replay" in " ".join(summary.notes)
    _assert_what_ifs_match_reruns(summary.groups.iloc[0], truth, mode, CASES[case])


def _assert_what_ifs_match_reruns(group, unobserved, mode: str, params: dict) -> None:
    """The group's what-ifs within 3 points of actual reruns of the engine, as it runs unobserved, with 10%
    shorter kernels and with 10% less CPU work (its spans and the gaps between launches)."""
    base = unobserved.step_ms.mean()
    gpu = simulate_kernel_timeline(200, mode=mode, **{**params, "kernel_us": params["kernel_us"] * 0.9})
    cpu_params = {**params, "launch_us": params["launch_us"] * 0.9,
                  "pre_ms": params.get("pre_ms", 0.2) * 0.9, "post_ms": params.get("post_ms", 0.1) * 0.9}
    cpu = simulate_kernel_timeline(200, mode=mode, **cpu_params)
    for label, rerun in ((GPU_FASTER.label, gpu), (CPU_FASTER.label, cpu)):
        true_pct = 100 * (rerun.step_ms.mean() / base - 1)
        assert group[f"whatif:{label}"] == pytest.approx(true_pct, abs=3.0), (label, true_pct)


def _sampled(tmp_path, name: str, mode: str, params: dict, *, collector_us: float = 0.0):
    """A run whose kernels were recorded in windows of 10 steps every 50, each of its launch calls
    `collector_us` longer inside them (what CUPTI adds), and the same engine's steps unobserved."""
    inside = np.zeros(200, bool)
    spans = [(first, first + 9) for first in range(5, 190, 50)]
    for first, last in spans:
        inside[first:last + 1] = True
    recorded = simulate_kernel_timeline(200, mode=mode, collector_us=collector_us, instrumented=inside,
                                        **params)
    starts, ends = recorded.frames.steps["start_ns"].to_numpy(), recorded.frames.steps["end_ns"].to_numpy()
    windows = [(int(starts[first]), int(ends[last])) for first, last in spans]
    run = load_run(write_kernel_run(tmp_path / name, recorded, windows=windows))
    return run, simulate_kernel_timeline(200, mode=mode, **params)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_sampled_what_ifs_match_a_rerun(tmp_path, case, mode):
    """Kernels in windows: a plain step's GPU work changes with a what-if as its group's instrumented steps'
    does (a GPU-bound step's with its kernels, a launch-bound one's with its launches). Taking every plain
    interval as launch-bound once projected -1.9% for 10% faster kernels on GPU-bound sync steps (-9.3%)."""
    run, unobserved = _sampled(tmp_path, f"{case}-{mode}", mode, CASES[case])
    group = summarize(run, what_ifs=[GPU_FASTER, CPU_FASTER]).groups.iloc[0]
    assert group["gpu_timing"] == "sampled"
    _assert_what_ifs_match_reruns(group, unobserved, mode, CASES[case])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_graph_launch_is_one_launch_call(tmp_path, mode):
    """200 kernels of one graph launch share its launch call: the collector's cost is per call (60 µs here,
    recovered whole, not spread over the kernels), and the sampled what-ifs match the reruns."""
    run, unobserved = _sampled(tmp_path, mode, mode, GRAPH, collector_us=60.0)
    table = steps_table(run)
    inside = table[table["gpu_timing"] == "kernels"]
    assert (inside["kernels"] == 200).all()
    assert np.allclose(inside["launch_ms"], (20.0 + 60.0) / 1e3)  # one call a step, counted once
    summary = summarize(run, what_ifs=[GPU_FASTER, CPU_FASTER])
    assert "kernel timing made each launch call 60.0 µs longer" in " ".join(summary.notes)
    _assert_what_ifs_match_reruns(summary.groups.iloc[0], unobserved, mode, GRAPH)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_what_kernel_timing_adds_to_each_launch_is_measured_and_taken_out(tmp_path, mode):
    """CUPTI lengthens every launch call inside the windows (here by 6 µs on 25 µs calls, the share it adds
    to an eager engine's launches). The run measures it from instrumented against plain steps, says so, and
    projects the engine as it runs unobserved: uncorrected, the mixed sync step's 10% faster kernels read
    -0.3% against -7.9%, its instrumented steps having turned launch-bound."""
    run, unobserved = _sampled(tmp_path, mode, mode, CASES["mixed"], collector_us=6.0)
    summary = summarize(run, what_ifs=[GPU_FASTER, CPU_FASTER])
    assert "kernel timing made each launch call 6.0 µs longer" in " ".join(summary.notes)
    # the fit is read over the steps replayed as recorded: the others are meant to differ (async: 3.5% before)
    fit = next(note for note in summary.notes if "reproduces the recorded step time" in note)
    assert float(fit.split("within ")[1].split("%")[0]) <= 1.0, fit
    _assert_what_ifs_match_reruns(summary.groups.iloc[0], unobserved, mode, CASES["mixed"])
    every = summarize(load_run(write_kernel_run(tmp_path / f"{mode}-all", unobserved)), what_ifs=[GPU_FASTER])
    assert any("every step of 1 group(s) was instrumented" in note and "GPU idle share" in note
               for note in every.notes)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kernels_mode_after_its_lead_reads_the_group_as_the_engine_runs_unobserved(tmp_path, mode):
    """Kernels mode: plain steps before its one window (the collector's set-up), then every step with launch
    calls 6 µs longer. The group's GPU idle is the unobserved engine's (step times from the lead, GPU busy
    from the window); an instrumented step's own row keeps what it measured, inflated where the longer
    launches starved its GPU (docs/concepts.md)."""
    lead = 20
    inside = np.zeros(200, bool)
    inside[lead:] = True
    params = CASES["mixed"]
    recorded = simulate_kernel_timeline(200, mode=mode, collector_us=6.0, instrumented=inside, **params)
    steps = recorded.frames.steps
    window = (int(steps["start_ns"].iloc[lead]), int(steps["end_ns"].iloc[-1]))
    run = load_run(write_kernel_run(tmp_path / mode, recorded, windows=[window]))
    unobserved = simulate_kernel_timeline(200, mode=mode, **params)
    group = summarize(run).groups.iloc[0]
    share, step_ms = unobserved.idle_share[1:], unobserved.step_ms[1:]
    true_idle = 100 * (share * step_ms).sum() / step_ms.sum()
    assert group["gpu_idle_pct"] == pytest.approx(true_idle, abs=1.0)
    rows = steps_table(run)
    measured = (rows["gpu_timing"] == "kernels").to_numpy()
    assert measured.sum() == 200 - lead
    own = rows["gpu_idle_share"].to_numpy()[measured]
    assert np.allclose(own, recorded.idle_share[measured], atol=0.02)  # what each instrumented step measured
    assert 100 * (own - unobserved.idle_share[measured]).max() > (10 if mode == "async" else 1)


def test_sampled_kernel_timing_takes_busy_from_windows_and_step_times_from_plain_steps(tmp_path):
    """Kernels recorded in windows of 10 steps out of 50. Plain steps get the verdict from their own step time
    and the group's GPU busy; inside-idle stays unknown (null) for them; the group says 'sampled'."""
    truth = simulate_kernel_timeline(200, mode="async", **CASES["launch-bound"])
    starts = truth.frames.steps["start_ns"].to_numpy()
    ends = truth.frames.steps["end_ns"].to_numpy()
    windows = [(int(starts[i]), int(ends[i + 9])) for i in range(5, 200 - 10, 50)]
    run = load_run(write_kernel_run(tmp_path / "sampled", truth, windows=windows))
    table = steps_table(run)
    inside = table["gpu_timing"] == "kernels"
    assert inside.sum() == 10 * len(windows)
    plain = table[~inside]
    assert plain["gpu_busy_ms"].isna().all() and plain["gpu_idle_in_step_ms"].isna().all()
    assert (table.loc[~inside, "gpu_timing"].iloc[1:] == "estimate").all()
    group = summarize(run, what_ifs=[CPU_FASTER]).groups.iloc[0]
    assert group["gpu_timing"] == "sampled" and group["kernel_steps"] == 10 * len(windows)
    true_idle = 100 * (truth.idle_share[1:] * truth.step_ms[1:]).sum() / truth.step_ms[1:].sum()
    assert group["gpu_idle_pct"] == pytest.approx(true_idle, abs=2.0)
    assert group["cpu_bound_pct"] > 98
    rerun = simulate_kernel_timeline(200, mode="async", **{**CASES["launch-bound"], "launch_us": 18.0,
                                                           "pre_ms": 0.18, "post_ms": 0.09})
    assert group["whatif:cpu-10%"] == pytest.approx(100 * (rerun.step_ms.mean() / truth.step_ms.mean() - 1),
                                                    abs=3.0)


def test_no_gpu_data_means_an_unknown_verdict_not_cpu_bound(tmp_path):
    frames = simulate_timeline(50, mode="async", cpu_ms=1.0, gpu_ms=0.5)
    frames.gpu = frames.gpu.iloc[:0]
    summary = summarize(load_run(write_run(tmp_path / "cpu", frames)), what_ifs=[CPU_FASTER])
    group = summary.groups.iloc[0]
    assert pd.isna(group["cpu_bound_pct"]) and pd.isna(group["gpu_idle_pct"])
    assert group["gpu_timing"] == "none"
    assert group["thread_never_waited_pct"] > 90
    # async without GPU times: steps that never waited are limited by the CPU, so a faster CPU shows a gain
    # (an upper bound, as the note says)
    assert group["whatif:cpu-10%"] < -5


def test_steps_without_a_batch_are_not_a_group(tmp_path):
    frames = simulate_timeline(60, mode="sync")
    frames.steps.loc[::3, "batch_size"] = 0
    summary = summarize(load_run(write_run(tmp_path / "empty", frames)), what_ifs=[GPU_FASTER])
    assert summary.groups["batch_size"].tolist() == [1]
    assert any("20 steps with no batch" in note for note in summary.notes)


def test_the_top_line_names_the_verdict_the_dominant_label_and_the_best_change(tmp_path):
    from overshoot.report.table import build_report

    truth, run = _run(tmp_path, "eager", mode="async", **CASES["launch-bound"])
    (line,) = build_report(run)["top_lines"]
    # launch-bound: the spans are schedule 0.2 ms, launch 0.4 ms (0.3 of it GPU idle: 20 kernels of 5 µs in
    # 20 calls of 20 µs), update 0.1 ms: the GPU idles ~0.6 ms a step, half of it in 'launch'
    assert line.startswith("decode @ batch 4: CPU-bound: 100% of steps CPU-bound")
    assert "the GPU idles most while the thread is in 'launch' (50% of its idle)" in line
    assert "largest gain: cpu-10%" in line
    events_only = load_run(write_run(tmp_path / "events", truth.frames))
    (line,) = build_report(events_only)["top_lines"]  # no kernel records: the CPU's busy split instead
    assert "'launch' is 57% of CPU busy" in line
    gpu = load_run(write_kernel_run(tmp_path / "gpu", simulate_kernel_timeline(200, **CASES["gpu-bound"])))
    (line,) = build_report(gpu)["top_lines"]
    assert "GPU-bound" in line and "largest gain: gpu-10%" in line and "'launch'" not in line
    frames = simulate_timeline(50)
    frames.gpu = frames.gpu.iloc[:0]
    (line,) = build_report(load_run(write_run(tmp_path / "cpu", frames)))["top_lines"]
    assert "no GPU data" in line and "CPU-bound:" not in line


def test_a_cpu_bound_async_step_whose_own_work_ended_by_its_wait_stays_async(tmp_path):
    """Launch calls of 31 µs against 30 µs kernels: the async engine's own batch has ended by the time the
    thread reaches its wait, which never blocks. Those waits cannot tell sync from async, so the run's
    scheduling hint decides; and the replay keeps each wait on the batch before, as the engine does, so
    10% less CPU work gains its 10% (it read -4.4%: a faster CPU turned the replay synchronous)."""
    params = dict(kernels=20, kernel_us=30.0, launch_us=31.0, pre_ms=0.1, post_ms=0.05)
    truth = simulate_kernel_timeline(200, mode="async", **params)
    run = load_run(write_kernel_run(tmp_path / "r", truth, meta={"async_scheduling": True}))
    summary = summarize(run, what_ifs=[GPU_FASTER, CPU_FASTER])
    assert (summary.mode.mode, summary.mode.source) == ("async", "meta")
    assert "hardly ever blocked" in summary.mode.detail
    _assert_what_ifs_match_reruns(summary.groups.iloc[0], truth, "async", params)
    assert summary.groups.iloc[0]["whatif:cpu-10%"] == pytest.approx(-10.0, abs=0.5)



@pytest.mark.parametrize("case", ["launch-bound", "mixed"])
def test_a_level_without_a_window_borrows_gpu_busy_from_its_shape_at_another_level(tmp_path, case):
    """Sampled windows follow (phase, batch size), not load levels: a shape first seen at one level gets no
    window at the next. That level's group takes GPU busy from the same phase and batch size's instrumented
    steps elsewhere ("borrowed"), not from the events (45% idle read against 86% true, launch-bound); its
    verdict, idle and what-ifs then match the truth as a group with windows of its own does."""
    truth = simulate_kernel_timeline(300, mode="async", **CASES[case])
    starts, ends = truth.frames.steps["start_ns"].to_numpy(), truth.frames.steps["end_ns"].to_numpy()
    windows = [(int(starts[i]), int(ends[i + 9])) for i in (10, 70)]  # level 1 only
    levels = [{"concurrency": 1, "start_ns": int(starts[0]), "end_ns": int(starts[150])},
              {"concurrency": 2, "start_ns": int(starts[150]), "end_ns": int(ends[-1]) + 1}]
    run = load_run(write_kernel_run(tmp_path / case, truth, windows=windows, meta={"levels": levels}))
    summary = summarize(run, what_ifs=[GPU_FASTER, CPU_FASTER])
    level1, level2 = (summary.groups.iloc[i] for i in range(2))
    assert (level1["concurrency"], level1["gpu_timing"]) == (1, "sampled")
    assert (level2["concurrency"], level2["gpu_timing"], level2["kernel_steps"]) == (2, "borrowed", 0)
    assert (steps_table(run)["gpu_timing"].iloc[150:] == "borrowed").all()
    later = slice(150, 300)
    true_idle = 100 * (truth.idle_share[later] * truth.step_ms[later]).sum() / truth.step_ms[later].sum()
    assert level2["gpu_idle_pct"] == pytest.approx(true_idle, abs=2.0)
    assert level2["gpu_busy_ms_median"] == pytest.approx(np.median(truth.busy_ms), abs=1e-6)
    assert pd.isna(level2["gpu_idle_in_step_pct"])  # no instrumented step of its own: not split
    true_bound = 100 * (truth.idle_share[later] > 0.05).mean()
    assert level2["cpu_bound_pct"] == pytest.approx(true_bound, abs=2.0)
    _assert_what_ifs_match_reruns(level2, simulate_kernel_timeline(300, mode="async", **CASES[case]), "async",
                                  CASES[case])
    assert any("GPU busy borrowed: decode @ 2 requests, batch 4 had no kernel-timing window" in note
               for note in summary.notes)
    from overshoot.report.table import build_report

    report = build_report(run)
    assert "GPU busy" in report["groups"][0]["verdict"]
    assert "sampled: 20 of 150 steps instrumented" in report["groups"][0]["verdict"]
    verdict = report["groups"][1]["verdict"]
    assert f"GPU idle {level2['gpu_idle_pct']:.0f}% (between and inside steps, from GPU busy" in verdict
    assert "CUDA events only" not in verdict
    assert "borrowed from 20 instrumented steps of its phase and batch size elsewhere in the run)" in verdict
    assert level2["gpu_busy_steps"] == 20


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_group_with_too_few_instrumented_steps_takes_the_collectors_cost_measured_on_the_others(
        tmp_path, mode):
    """CUPTI lengthens each launch call inside windows by 6 µs. Level 1 has two windows of 10 steps, so its
    group measures that; level 2's only window is 2 steps (an early one, shortened to the budget), too few
    to measure, so it takes level 1's figure: its instrumented steps are replayed as the engine runs
    unobserved and its what-ifs match the reruns (uncorrected, the mixed sync step's 10% faster kernels read
    about 0 against -7.9%: its two instrumented steps look launch-bound)."""
    params = CASES["mixed"]
    inside = np.zeros(300, bool)
    spans = [(10, 19), (70, 79), (200, 201)]
    for first, last in spans:
        inside[first:last + 1] = True
    recorded = simulate_kernel_timeline(300, mode=mode, collector_us=6.0, instrumented=inside, **params)
    starts, ends = recorded.frames.steps["start_ns"].to_numpy(), recorded.frames.steps["end_ns"].to_numpy()
    windows = [(int(starts[first]), int(ends[last])) for first, last in spans]
    levels = [{"concurrency": 1, "start_ns": int(starts[0]), "end_ns": int(starts[150])},
              {"concurrency": 2, "start_ns": int(starts[150]), "end_ns": int(ends[-1]) + 1}]
    run = load_run(write_kernel_run(tmp_path / mode, recorded, windows=windows, meta={"levels": levels}))
    summary = summarize(run, what_ifs=[GPU_FASTER, CPU_FASTER])
    level2 = summary.groups.iloc[1]
    assert (level2["concurrency"], level2["gpu_timing"], level2["kernel_steps"]) == (2, "sampled", 2)
    _assert_what_ifs_match_reruns(level2, simulate_kernel_timeline(300, mode=mode, **params), mode, params)


def test_steps_are_instrumented_only_where_every_launching_process_recorded(tmp_path):
    """A multiprocess engine: two workers (one per GPU) launch the kernels of the engine core's steps, each
    sampling windows of its own, 20-29 and 25-34. Only steps 25-29 have every kernel recorded: there GPU
    busy is the union of both workers' kernels (20 of 5 µs); steps where one worker was not recording are
    not instrumented (their busy would read half)."""
    import pyarrow as pa

    from overshoot.rundir.spool import BASE_SCHEMAS, SpoolWriter

    timeline = simulate_kernel_timeline(60, mode="async", **CASES["launch-bound"])
    run_dir = write_run(tmp_path / "run", timeline.frames)
    starts, ends = timeline.frames.steps["start_ns"].to_numpy(), timeline.frames.steps["end_ns"].to_numpy()
    kernels = timeline.kernels
    launch = kernels["launch_start_ns"].to_numpy()
    half = np.arange(len(kernels)) % 2
    for worker, first in ((0, 20), (1, 25)):
        lo, hi = int(starts[first]), int(ends[first + 9])
        writer = SpoolWriter(run_dir / "spool", f"{1000 + worker}-worker")
        mine = kernels[(half == worker) & (launch >= lo) & (launch < hi)]
        writer.write("kernels", pa.RecordBatch.from_pandas(mine, schema=BASE_SCHEMAS["kernels"],
                                                           preserve_index=False))
        writer.write("kernel_windows", pa.RecordBatch.from_pandas(
            pd.DataFrame([(lo, hi)], columns=["start_ns", "end_ns"]), schema=BASE_SCHEMAS["kernel_windows"],
            preserve_index=False))
        writer.close()
    steps = summarize(load_run(run_dir), warmup_steps=0).steps
    measured = steps[steps["gpu_timing"] == "kernels"]
    assert sorted(measured["step"]) == list(range(25, 30))
    assert np.allclose(measured["gpu_busy_ms"], 0.1)


def test_the_median_interval_covers_the_true_median():
    """kernels.interval_on_rows: the distribution-free 95% interval of a median covers the true median in
    about 95% of samples (400 samples of 40 skewed values each, two groups at once), and is NaN with fewer
    values than the order statistics need."""
    from overshoot.analysis.kernels import MIN_STEPS_FOR_INTERVAL, interval_on_rows

    rng = np.random.default_rng(1)
    covered = 0
    for _ in range(400):
        values = np.concatenate([rng.lognormal(0.0, 0.5, 40), rng.lognormal(1.0, 0.2, 40)])
        group = np.repeat([0, 1], 40)
        lo, hi, n = interval_on_rows(group, values, np.ones(80, bool))
        assert (n == 40).all()
        covered += int(lo[0] <= 1.0 <= hi[0]) + int(lo[40] <= np.e <= hi[40])
        assert (lo <= hi).all()
    assert 0.92 <= covered / 800 <= 0.99, covered / 800
    few = MIN_STEPS_FOR_INTERVAL - 1
    lo, hi, n = interval_on_rows(np.zeros(few, "int64"), np.arange(few, dtype=float), np.ones(few, bool))
    assert (n == few).all()
    assert np.isnan(lo).all() and np.isnan(hi).all()


def _near_threshold_run(tmp_path):
    """Synchronous steps whose GPU idles ~5%, sampled in windows of 8 steps every 30, the instrumented
    steps' kernels 0.97-1.03x long: the run dir and its kernels."""
    params = dict(kernels=20, kernel_us=100.0, launch_us=1.0, pre_ms=0.06, post_ms=0.04)
    timeline = simulate_kernel_timeline(300, mode="sync", **params)
    starts, ends = timeline.frames.steps["start_ns"].to_numpy(), timeline.frames.steps["end_ns"].to_numpy()
    windows = [(int(starts[i]), int(ends[i + 7])) for i in range(10, 290, 30)]
    kernels = timeline.kernels.copy()
    step_of = np.searchsorted(starts, kernels["launch_start_ns"].to_numpy(), side="right") - 1
    scale = np.random.default_rng(3).uniform(0.97, 1.03, len(starts))[step_of]
    kernels["gpu_end_ns"] = kernels["gpu_start_ns"] + np.round(
        (kernels["gpu_end_ns"] - kernels["gpu_start_ns"]) * scale).astype("int64")
    timeline.kernels = kernels
    return write_kernel_run(tmp_path / "run", timeline, windows=windows), kernels


def test_a_check_that_breaks_on_an_estimate_says_how_far_it_moves(tmp_path):
    """`overshoot check --max-cpu-bound 10%` on a group 16% CPU-bound whose plain steps' verdict rests on the
    GPU busy estimate: the broken line gives the range (16-90%) beside the figure."""
    import subprocess
    import sys

    run_dir, _ = _near_threshold_run(tmp_path)
    command = [sys.executable, "-m", "overshoot", "check", str(run_dir), "--max-cpu-bound", "10%"]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 1, (done.stdout, done.stderr)
    out = " ".join((done.stdout + done.stderr).split())
    assert "% of steps CPU-bound (16-90% as the GPU busy estimate moves within its 95% interval), above " \
           "--max-cpu-bound 10%" in out, out


def test_a_verdict_near_its_threshold_says_how_far_the_estimate_moves_it(tmp_path):
    """Synchronous steps whose GPU idles ~5% (the threshold): plain steps take their GPU busy from windows
    whose steps' kernels run 0.97-1.03x long. The group's CPU-bound and GPU idle shares get a range: each
    plain step recomputed with the GPU busy at the ends of the 95% interval of the instrumented steps'
    median (order statistics of ranks (n - 1.96 sqrt n) / 2 and 1 + (n + 1.96 sqrt n) / 2), computed here
    step by step from the kernel records; the report says it where it spans more than a percent."""
    import json
    import subprocess
    import sys

    run_dir, kernels = _near_threshold_run(tmp_path)
    launch = kernels["launch_start_ns"].to_numpy()
    done = subprocess.run([sys.executable, "-m", "overshoot", "report", str(run_dir), "--json"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (group,) = json.loads(done.stdout)["groups"]
    assert group["gpu_timing"] == "sampled"
    # the truth, from the records: each instrumented step's busy (union of its kernels), their order
    # statistics, every plain step's share at both ends
    run = load_run(run_dir)
    table = steps_table(run)
    inside = (table["gpu_timing"] == "kernels").to_numpy()
    ends_of = run.steps.set_index("step")["end_ns"]
    busy = []
    for lo, hi in zip(table["start_ns"][inside], ends_of.loc[table["step"][inside]], strict=True):
        mine = kernels[(launch >= lo) & (launch < hi)].sort_values("gpu_start_ns")
        reach, total = -1, 0
        for s, e in zip(mine["gpu_start_ns"], mine["gpu_end_ns"], strict=True):
            total += max(e - max(s, reach), 0)
            reach = max(reach, e)
        busy.append(total / 1e6)
    busy, n = np.sort(busy), len(busy)
    low_busy = busy[max(int(np.floor((n - 1.96 * np.sqrt(n)) / 2)), 1) - 1]
    high_busy = busy[min(int(np.ceil(1 + (n + 1.96 * np.sqrt(n)) / 2)), n) - 1]
    step = table["step_ms"].to_numpy()
    plain = (table["gpu_timing"] == "estimate").to_numpy()
    measured_idle = table["gpu_idle_ms"].to_numpy()[inside]
    for end, at in (("low", high_busy), ("high", low_busy)):
        idle = np.maximum(step[plain] - at, 0.0)
        bound = np.concatenate([idle / step[plain] > 0.05, measured_idle / step[inside] > 0.05])
        share = 100 * idle.sum() / step[plain].sum()  # (a sampled group's idle share: its plain steps')
        assert group[f"cpu_bound_pct_{end}"] == pytest.approx(100 * bound.mean(), abs=0.5), end
        assert group[f"gpu_idle_pct_{end}"] == pytest.approx(share, abs=0.05), end
    assert group["cpu_bound_pct_low"] <= group["cpu_bound_pct"] <= group["cpu_bound_pct_high"]
    assert group["gpu_idle_pct_low"] < group["gpu_idle_pct"] < group["gpu_idle_pct_high"]
    assert group["cpu_bound_pct_high"] - group["cpu_bound_pct_low"] > 50  # the edge: the verdict flips
    low, high = group["cpu_bound_pct_low"], group["cpu_bound_pct_high"]
    said = f"({low:.0f}-{high:.0f}% as the GPU busy estimate moves within its 95% interval"
    assert said + ")" in group["verdict"], group["verdict"]
    (top,) = json.loads(done.stdout)["top_lines"]
    assert said + ": not settled)" in top, top


def test_an_estimate_from_a_probe_alone_says_it_has_too_few_steps_for_an_interval(tmp_path):
    """A costly collector's one probe of 3 steps in the warm-up: the level borrows its GPU busy from those 3
    steps, says so, and gives no range (an interval of the median needs 6)."""
    truth = simulate_kernel_timeline(200, mode="async", **CASES["launch-bound"])
    starts, ends = truth.frames.steps["start_ns"].to_numpy(), truth.frames.steps["end_ns"].to_numpy()
    levels = [{"concurrency": 4, "start_ns": int(starts[40]), "end_ns": int(ends[-1]) + 1}]
    run = load_run(write_kernel_run(tmp_path / "probe", truth, windows=[(int(starts[5]), int(ends[7]))],
                                    meta={"levels": levels}))
    from overshoot.report.table import build_report

    (group,) = build_report(run)["groups"]
    assert (group["gpu_timing"], group["gpu_busy_steps"]) == ("borrowed", 3)
    assert group["cpu_bound_pct_low"] is None and group["gpu_idle_pct_high"] is None
    said = "borrowed from 3 instrumented steps of its phase and batch size elsewhere in the run; too few for"
    assert said + " an interval)" in group["verdict"], group["verdict"]
