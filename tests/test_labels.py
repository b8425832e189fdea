"""CPU busy time by label (overshoot/analysis/labels.py) on runs with exactly known spans."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from rich.console import Console
from run_factory import Frames, simulate_timeline, write_run

from overshoot.analysis.labels import exclusive_busy
from overshoot.report.table import build_report, render
from overshoot.rundir.reader import load_run


def test_labels_split_the_median_busy_time_exactly(tmp_path):
    # Per step: busy "schedule" 1.0 ms, a 5 µs gap (busy, no span), the wait, busy "update" 0.2 ms.
    frames = simulate_timeline(200, mode="sync", cpu_ms=1.0, gpu_ms=1.2, post_ms=0.2)
    (group,) = build_report(load_run(write_run(tmp_path / "r", frames)))["groups"]
    by = {r["label"]: r for r in group["busy_by_label"]}
    assert list(by) == ["schedule", "update", "unlabelled"]  # largest share first
    assert by["schedule"]["ms"] == pytest.approx(1.0, abs=1e-6)
    assert by["update"]["ms"] == pytest.approx(0.2, abs=1e-6)
    assert by["unlabelled"]["ms"] == pytest.approx(0.005, abs=1e-6)
    assert sum(r["ms"] for r in by.values()) == pytest.approx(group["busy_ms_median"], abs=1e-9)
    assert sum(r["share_pct"] for r in by.values()) == pytest.approx(100.0)


def test_labels_add_up_with_jitter_levels_and_nested_spans(tmp_path):
    """Jittered steps (median of sums != sum of medians) and spans nested two deep: the split still adds up
    to each group's median busy time, and each instant counts once, for its innermost busy span; busy time
    inside a wait is wait."""
    base = simulate_timeline(300, mode="async", cpu_ms=1.0, gpu_ms=0.9, post_ms=0.2, jitter=0.5, seed=3)
    spans = base.spans.copy()
    sched = spans[spans["label"] == "schedule"]
    # "launch" nested in the last 40% of each schedule span, "copy" nested in the middle of that launch
    tail = (sched["dur_ns"] * 0.4).astype("int64")
    launch = sched.assign(label="launch", start_ns=sched["start_ns"] + sched["dur_ns"] - tail, dur_ns=tail)
    copy = launch.assign(label="copy", start_ns=launch["start_ns"] + launch["dur_ns"] // 4,
                         dur_ns=launch["dur_ns"] // 2)  # fmt: skip
    waits = spans[spans["kind"] == "wait"]
    inside_wait = waits.assign(kind="busy", label="poll", start_ns=waits["start_ns"] + 1000,
                               dur_ns=np.maximum(waits["dur_ns"] - 2000, 0))  # fmt: skip
    nested = pd.concat([spans, launch, copy, inside_wait]).sort_values(["start_ns", "dur_ns"],
                                                                       ascending=[True, False])  # fmt: skip
    starts = base.steps["start_ns"]
    levels = [
        {"concurrency": 1, "start_ns": int(starts[0]), "end_ns": int(starts[150])},
        {"concurrency": 4, "start_ns": int(starts[150]), "end_ns": int(starts.iloc[-1]) + 10**9},
    ]
    frames = Frames(base.steps, nested.reset_index(drop=True), base.gpu)
    report = build_report(load_run(write_run(tmp_path / "r", frames, meta={"levels": levels})))
    assert len(report["groups"]) == 2
    for group in report["groups"]:
        by = {r["label"]: r for r in group["busy_by_label"]}
        assert set(by) == {"schedule", "launch", "copy", "update", "unlabelled"}  # "poll" is wait time
        assert sum(r["ms"] for r in by.values()) == pytest.approx(group["busy_ms_median"], rel=1e-9)
        # schedule keeps 60% of its span, launch 40% minus the copy's half: 20% each for launch and copy
        assert by["launch"]["share_pct"] == pytest.approx(by["copy"]["share_pct"], rel=0.02)
        assert by["schedule"]["share_pct"] == pytest.approx(3 * by["copy"]["share_pct"], rel=0.02)
    # per-label means add up to the mean busy time of the group's steps
    steps = load_run(tmp_path / "r").steps
    busy_ms = (steps["end_ns"] - steps["start_ns"] - steps["wait_ns"]) / 1e6
    first = report["groups"][0]
    assert sum(r["mean_ms"] for r in first["busy_by_label"]) == pytest.approx(busy_ms[:150].mean(), rel=1e-6)


def test_exclusive_busy_of_nested_spans():
    # step 0: busy A [0, 100) holds busy B [10, 30) and a wait [40, 60) that holds busy C [45, 50);
    # step 1: busy D [200, 250) on its own. Recorded in end order, as a recorder writes them.
    spans = pd.DataFrame({
        "step": [0, 0, 0, 0, 1], "kind": ["busy", "busy", "wait", "busy", "busy"],
        "label": ["B", "C", "gpu", "A", "D"],
        "start_ns": [10, 45, 40, 0, 200], "dur_ns": [20, 5, 20, 100, 50],
    })  # fmt: skip
    step, code, own, names = exclusive_busy(spans)
    label = [names[c] for c in code]
    assert sorted(zip(step.tolist(), label, own.tolist(), strict=True)) == [
        (0, "A", 60), (0, "B", 20), (1, "D", 50)
    ]


def test_by_label_table_in_the_terminal(tmp_path):
    frames = simulate_timeline(100, mode="sync", cpu_ms=1.0, gpu_ms=1.2, post_ms=0.2)
    report = build_report(load_run(write_run(tmp_path / "r", frames)))
    console = Console(width=120, record=True, color_system=None)
    render(report, console, by_label=True)
    text = console.export_text()
    assert "CPU busy by label" in text
    assert "decode @ batch 1 1.21 1.00 83% 0.20 17% 0.01 0%" in " ".join(text.split())
    plain = Console(width=120, record=True, color_system=None)
    render(report, plain)
    assert "CPU busy by label" not in plain.export_text()
