"""The steps table contract and the summary, on run dirs with exactly known content (tests/run_factory.py)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from run_factory import simulate_timeline, write_run

from overshoot.analysis.analyze import STEP_COLUMNS, steps_table, summarize
from overshoot.rundir.reader import load_run

DTYPES = {
    "run_id": "str",
    "pid": "int64",
    "thread": "str",
    "step": "int64",
    "start_ns": "int64",
    "step_ms": "float64",
    "busy_ms": "float64",
    "wait_ms": "float64",
    "batch_size": "int32",
    "num_tokens": "int32",
    "phase": "str",
    "gpu_ms": "float64",
    "gpu_idle_before_ms": "float64",
    "gpu_busy_ms": "float64",
    "gpu_idle_in_step_ms": "float64",
    "kernels": "float64",
    "launch_ms": "float64",
    "gpu_idle_ms": "float64",
    "gpu_idle_share": "float64",
    "gpu_timing": "str",
    "cpu_bound": "boolean",
    "thread_never_waited": "bool",
}


def test_steps_table_columns_dtypes_and_values(tmp_path):
    frames = simulate_timeline(50, mode="sync", cpu_ms=1.0, gpu_ms=1.2, post_ms=0.2)
    run = load_run(write_run(tmp_path / "r1", frames, extra={"spec_tokens": list(range(50))}))
    table = steps_table(run)
    assert list(table.columns) == STEP_COLUMNS + ["spec_tokens"]
    assert {c: str(table[c].dtype) for c in STEP_COLUMNS} == DTYPES
    assert (table["run_id"] == "r1").all() and (table["pid"] == 4242).all()
    assert table["spec_tokens"].tolist() == list(range(50))
    # busy 1.0 + wait (5 µs overhead + 1.2 ms GPU + 3 µs wake-up... measured from the wait start) + 0.2
    assert table["step_ms"].iloc[5] == pytest.approx(1.0 + 0.005 + (1.2 - 0.005) + 0.003 + 0.2, abs=1e-6)
    assert np.allclose(table["busy_ms"] + table["wait_ms"], table["step_ms"])
    assert np.allclose(table["gpu_ms"], 1.2)
    # sync: the GPU idles from its end to the next launch = wake-up + update + next schedule
    assert np.isnan(table["gpu_idle_before_ms"].iloc[0])
    assert np.allclose(table["gpu_idle_before_ms"].iloc[1:], 0.003 + 0.2 + 1.0, atol=1e-5)
    # the GPU idles 1.2 of every 2.4 ms, waiting for the CPU: CPU-bound (the first step has nothing before it)
    assert pd.isna(table["cpu_bound"].iloc[0]) and table["cpu_bound"].iloc[1:].all()
    assert np.allclose(table["gpu_idle_share"].iloc[1:], 1.203 / 2.403, atol=1e-4)
    assert not table["thread_never_waited"].any() and (table["gpu_timing"].iloc[1:] == "events").all()
    assert table["gpu_busy_ms"].isna().all() and table["gpu_idle_in_step_ms"].isna().all()


def test_idle_time_is_not_gpu_waiting_on_cpu(tmp_path):
    frames = simulate_timeline(40, mode="sync", idle_every=10, idle_ms=7.0)
    table = steps_table(load_run(write_run(tmp_path / "r", frames)))
    after_idle = table["step"].isin([10, 20, 30])
    # after an idle span the gap counts from the idle end: only the step's own 1.0 ms of CPU work
    assert np.allclose(table.loc[after_idle, "gpu_idle_before_ms"], 1.0, atol=1e-5)
    assert np.allclose(table.loc[~after_idle, "gpu_idle_before_ms"].iloc[1:], 1.203, atol=1e-5)


def test_concurrency_levels_warmup_and_threshold(tmp_path):
    frames = simulate_timeline(100, mode="async", cpu_ms=1.5, gpu_ms=1.0)
    starts = frames.steps["start_ns"]
    levels = [
        {"concurrency": 1, "start_ns": int(starts[0]), "end_ns": int(starts[40])},
        {"concurrency": 4, "start_ns": int(starts[40]), "end_ns": int(starts[90])},
    ]
    run = load_run(write_run(tmp_path / "r", frames, meta={"levels": levels}))
    table = steps_table(run)
    assert list(table.columns) == STEP_COLUMNS + ["concurrency", "load_window"]
    assert str(table["concurrency"].dtype) == "Int32" and str(table["load_window"].dtype) == "str"
    assert table["concurrency"].iloc[:40].eq(1).all() and table["concurrency"].iloc[40:90].eq(4).all()
    assert table["concurrency"].iloc[90:].isna().all()
    assert table["load_window"].iloc[:90].eq("level").all()
    assert table["load_window"].iloc[90:].eq("outside").all()
    warm = steps_table(run, warmup_steps=5)
    assert len(warm) == 100 - 5 * 3  # per level, and the steps outside every level form their own group
    assert 40 not in set(warm["step"]) and 45 in set(warm["step"])
    summary = summarize(run)  # the 10 steps outside every level stay out of the groups, and it is said
    assert summary.groups["concurrency"].tolist() == [1, 4] and summary.groups["steps"].tolist() == [40, 50]
    assert any("10 steps outside every load level" in note for note in summary.notes)
    # async and CPU-bound: waits are 8 µs of overhead, so the threshold decides the thread's view ...
    assert steps_table(run)["thread_never_waited"].iloc[1:].all()
    assert not steps_table(run, cpu_bound_ms=0.001)["thread_never_waited"].iloc[1:].any()
    # ... but not the verdict: the GPU idles 1/3 of each step (1.0 of 1.5 ms busy), waiting for launches
    for threshold_ms in (0.02, 0.001):
        assert steps_table(run, cpu_bound_ms=threshold_ms)["cpu_bound"].iloc[1:].all()
    assert not steps_table(run, cpu_bound_share=0.5)["cpu_bound"].iloc[1:].any()


def test_primary_timeline_is_the_thread_with_most_steps(tmp_path):
    path = tmp_path / "r"
    write_run(path, simulate_timeline(30, mode="sync"), pid=100, tag="engine")
    write_run(path, simulate_timeline(5, mode="sync", cpu_ms=9.0), pid=200, tag="worker")
    run = load_run(path)
    table = steps_table(run)
    assert table.groupby("pid").size().to_dict() == {100: 30, 200: 5}
    summary = summarize(run)
    assert summary.primary == (100, "engine")
    assert int(summary.groups["steps"].sum()) == 30
    assert any("200/worker: 5 steps" in note for note in summary.notes)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_mode_detected_from_data(tmp_path, mode):
    run = load_run(write_run(tmp_path / "r", simulate_timeline(60, mode=mode)))
    summary = summarize(run)
    assert (summary.mode.mode, summary.mode.source) == (mode, "data")
    assert summarize(run, mode="async" if mode == "sync" else "sync").mode.source == "option"


def test_blocked_waits_decide_the_mode_over_a_hint(tmp_path):
    """A sync engine that blocks on its own work reads as sync from the data even where the run's hint says
    async (a wrong flag must not turn every projection asynchronous)."""
    frames = simulate_timeline(60, mode="sync", cpu_ms=0.5, gpu_ms=1.0)
    summary = summarize(load_run(write_run(tmp_path / "r", frames, meta={"async_scheduling": True})))
    assert (summary.mode.mode, summary.mode.source) == ("sync", "data")
    assert "of steps that blocked" in summary.mode.detail


def test_mode_hint_without_gpu_times(tmp_path):
    frames = simulate_timeline(20, mode="async")
    frames.gpu = frames.gpu.iloc[:0]
    meta = {"command": ["python", "-m", "reference_engine", "serve", "--async-scheduling"]}
    summary = summarize(load_run(write_run(tmp_path / "r", frames, meta=meta)))
    assert (summary.mode.mode, summary.mode.source) == ("async", "meta")


def test_summary_groups_and_shares(tmp_path):
    path = tmp_path / "r"
    frames = simulate_timeline(200, mode="async", cpu_ms=1.0, gpu_ms=1.1, jitter=0.3, seed=3)
    frames.steps.loc[100:, "batch_size"] = 4
    run = load_run(write_run(path, frames))
    summary = summarize(run, warmup_steps=10)
    groups = summary.groups.set_index("batch_size")
    assert groups["steps"].to_dict() == {1: 90, 4: 100}
    table = steps_table(run, warmup_steps=10)
    b4 = table[table["batch_size"] == 4]
    assert groups.loc[4, "step_ms_median"] == pytest.approx(b4["step_ms"].median())
    assert groups.loc[4, "step_ms_p90"] == pytest.approx(b4["step_ms"].quantile(0.9))
    assert groups.loc[4, "cpu_bound_pct"] == pytest.approx(100 * b4["cpu_bound"].mean())
    idle_share = 100 * b4["gpu_idle_before_ms"].sum() / b4["step_ms"].sum()
    assert groups.loc[4, "gpu_idle_pct"] == pytest.approx(idle_share)
    assert groups.loc[4, "cpu_share_pct"] == pytest.approx(100 * b4["busy_ms"].sum() / b4["step_ms"].sum())
    # async alignment holds in this timeline: the thread's view and the GPU-idle-before share agree
    assert abs(groups.loc[4, "thread_never_waited_pct"] - groups.loc[4, "gpu_idle_steps_pct"]) < 11
    assert not any("disagree" in note for note in summary.notes)


def test_disagreeing_views_are_reported(tmp_path):
    frames = simulate_timeline(100, mode="async", cpu_ms=1.5, gpu_ms=1.0)
    # Make the GPU start right when the previous work ends (no idle) although the thread never waits:
    gpu = frames.gpu
    duration = gpu["gpu_end_ns"] - gpu["gpu_start_ns"]
    gpu["gpu_start_ns"] = gpu["gpu_start_ns"].iloc[0] + duration.cumsum().shift(1, fill_value=0)
    gpu["gpu_end_ns"] = gpu["gpu_start_ns"] + duration
    summary = summarize(load_run(write_run(tmp_path / "r", frames)), mode="async")
    assert any("disagree" in note for note in summary.notes)


def test_cpu_bound_steps_with_little_gpu_idle_between_them_get_a_note(tmp_path):
    """An eager engine that is launch-bound: its GPU interval spans each step (kernels trickle in as the CPU
    launches them), so the GPU barely idles between steps although no step waits. The note says where the
    waiting is; a GPU-bound timeline gets no such note."""
    frames = simulate_timeline(100, mode="sync", cpu_ms=1.0, gpu_ms=0.001)
    steps, gpu = frames.steps, frames.gpu
    gpu["gpu_start_ns"] = steps["start_ns"] + 20_000  # first kernel soon after the step starts
    gpu["gpu_end_ns"] = steps["end_ns"] - 20_000  # the last one ends while the thread updates requests
    summary = summarize(load_run(write_run(tmp_path / "eager", frames)))
    group = summary.groups.iloc[0]
    # Events alone cannot see the gaps between kernels: the verdict is "not CPU-bound" (GPU idle between
    # steps under 5%), the thread never waited, and the note says what events miss.
    assert group["thread_never_waited_pct"] == 100 and group["gpu_idle_pct"] < 10
    assert group["cpu_bound_pct"] == 0 and group["gpu_timing"] == "events"
    assert pd.isna(group["gpu_idle_in_step_pct"])
    assert any("waiting on launches inside the steps" in note for note in summary.notes)
    bound = summarize(load_run(write_run(tmp_path / "gpu", simulate_timeline(100, cpu_ms=0.2, gpu_ms=1.0))))
    assert not any("waiting on launches inside" in note for note in bound.notes)


def test_steps_without_gpu_have_null_gpu_columns(tmp_path):
    frames = simulate_timeline(20, mode="sync")
    frames.gpu = frames.gpu.iloc[:0]
    run = load_run(write_run(tmp_path / "r", frames))
    table = steps_table(run)
    assert table["gpu_ms"].isna().all() and table["gpu_idle_before_ms"].isna().all()
    summary = summarize(run)
    assert summary.mode.source == "default" and pd.isna(summary.groups["gpu_idle_pct"].iloc[0])


def test_worker_gpu_intervals_join_the_engine_steps(tmp_path):
    """A multiprocess executor: the engine thread runs the steps and waits on a worker whose recorder has no
    steps. The worker's GPU intervals (recorded outside any step) join the step during which they started;
    two per step (forward, sampling) merge into first start .. last end; one outside every step stays out."""
    import threading
    from time import perf_counter_ns

    from overshoot.record.recorder import Recorder

    engine = Recorder(tmp_path, engine="test", thread_tag="engine")
    marks: list[tuple[int, int]] = []
    for _ in range(3):
        engine.step_begin(batch_size=2, phase="decode")
        t0 = perf_counter_ns()
        with engine.wait("worker_result"):
            marks.append((t0, perf_counter_ns()))
            while perf_counter_ns() - t0 < 200_000:
                pass
    engine.step_end()
    outside = perf_counter_ns()

    def worker() -> None:
        rec = Recorder(tmp_path, engine="test", thread_tag="worker")
        for t0, _ in marks:  # host-clock GPU times (as the CUDA event ring gives them), inside each step
            rec.gpu_span(t0 + 10_000, t0 + 60_000)
            rec.gpu_span(t0 + 70_000, t0 + 90_000)
        rec.gpu_span(outside + 1_000, outside + 2_000)
        rec.close()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    engine.close()
    table = steps_table(load_run(tmp_path))
    assert list(table["thread"]) == ["engine"] * 3
    assert table["gpu_ms"].tolist() == pytest.approx([0.08] * 3)
    assert table["gpu_idle_before_ms"].notna().sum() == 2  # the first GPU work has nothing before it
