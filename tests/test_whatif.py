"""What-if projections against reruns where the truth is known."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from run_factory import simulate_timeline, write_run

from overshoot.analysis.analyze import summarize
from overshoot.analysis.whatif import WhatIf, parse_what_if
from overshoot.rundir.reader import load_run

GPU_FASTER = WhatIf("gpu", -0.10)
CPU_FASTER = WhatIf("cpu", -0.10)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("gpu=-10%", WhatIf("gpu", -0.10)),
        ("CPU=+5%", WhatIf("cpu", 0.05)),
        ("gpu=-0.2", WhatIf("gpu", -0.2)),
        (" cpu = -25 ", WhatIf("cpu", -0.25)),
    ],
)
def test_parse_what_if(text, expected):
    got = parse_what_if(text)
    assert got.target == expected.target and got.change == pytest.approx(expected.change)


@pytest.mark.parametrize("text", ["gpu", "gpu=", "gpu=abc", "tpu=-10%", "gpu=-100%", "gpu=-10%%", ""])
def test_parse_what_if_rejects_garbage(text):
    with pytest.raises(ValueError, match="--what-if"):
        parse_what_if(text)


def _mean_step_ms(frames) -> float:
    return float((frames.steps["end_ns"] - frames.steps["start_ns"]).mean() / 1e6)


# (mode, cpu ms, gpu ms): GPU-bound, CPU-bound, and near the edge where jitter mixes both kinds of steps.
CASES = [
    ("sync", 1.0, 1.2),
    ("async", 0.6, 1.2),
    ("async", 1.5, 1.2),
    ("async", 1.1, 1.2),
    ("async", 1.2, 1.2),
]


@pytest.mark.parametrize(("mode", "cpu_ms", "gpu_ms"), CASES)
def test_replay_matches_a_rerun_with_shorter_gpu_and_cpu(tmp_path, mode, cpu_ms, gpu_ms):
    """Same seed, same CPU jitter: the rerun differs only by the changed durations."""
    kwargs = dict(mode=mode, cpu_ms=cpu_ms, gpu_ms=gpu_ms, jitter=0.3, seed=7, idle_every=97)
    base = simulate_timeline(400, **kwargs)
    summary = summarize(load_run(write_run(tmp_path / "r", base)), what_ifs=[GPU_FASTER, CPU_FASTER])
    group = summary.groups.iloc[0]
    gpu_rerun = simulate_timeline(400, **{**kwargs, "gpu_ms": gpu_ms * 0.9})
    truth_gpu = 100 * (_mean_step_ms(gpu_rerun) / _mean_step_ms(base) - 1)
    assert group["whatif:gpu-10%"] == pytest.approx(truth_gpu, abs=0.5)
    cpu_rerun = simulate_timeline(400, **{**kwargs, "cpu_ms": cpu_ms * 0.9, "post_ms": 0.2 * 0.9})
    truth_cpu = 100 * (_mean_step_ms(cpu_rerun) / _mean_step_ms(base) - 1)
    assert group["whatif:cpu-10%"] == pytest.approx(truth_cpu, abs=0.5)


def test_gpu_speedup_does_not_reach_cpu_bound_steps(tmp_path):
    base = simulate_timeline(300, mode="async", cpu_ms=2.0, gpu_ms=1.0)
    summary = summarize(load_run(write_run(tmp_path / "r", base)), what_ifs=[GPU_FASTER, CPU_FASTER])
    group = summary.groups.iloc[0]
    assert group["cpu_bound_pct"] > 99
    assert group["whatif:gpu-10%"] == pytest.approx(0.0, abs=0.05)
    assert group["whatif:cpu-10%"] < -8.0


def test_per_step_fallback_without_gpu_times(tmp_path):
    frames = simulate_timeline(100, mode="sync", cpu_ms=1.0, gpu_ms=1.0, post_ms=0.0)
    frames.gpu = frames.gpu.iloc[:0]
    summary = summarize(load_run(write_run(tmp_path / "r", frames)), what_ifs=[GPU_FASTER])
    # sync sum model: step = busy + wait, the wait scaled: (1.0 + 0.9 * 1.003) / 2.003 - 1
    assert summary.groups.iloc[0]["whatif:gpu-10%"] == pytest.approx(100 * (1.9027 / 2.003 - 1), abs=0.1)
    assert any("per-step model" in note for note in summary.notes)


# Synthetic engine (tests/synthetic_engine.py): an engine thread recording through the Recorder, its device
# a virtual in-order timeline. Same seed = the same CPU work, so a rerun differs only by the changed duration.
# Steps of about a millisecond: the recorder's own few microseconds a step, and a writer thread sharing CI's
# two cores, stay well inside the 3% tolerance (at 0.3 ms steps they once took 3.4% of a sync rerun).
SYNTHETIC = {
    "sync": dict(mode="sync", cpu_ms=0.9, device_ms=0.9),
    "async-gpu-bound": dict(mode="async", cpu_ms=0.75, device_ms=1.2),
    "async-edge": dict(mode="async", cpu_ms=0.9, device_ms=0.95),
}


def _median_step_ms(run_dir) -> float:
    steps = load_run(run_dir).steps
    return float((steps["end_ns"] - steps["start_ns"]).median() / 1e6)


def _interleaved_runs(tmp_path, configs: dict, *, chunks: int = 3, steps: int = 100) -> None:
    """Each named config recorded into its own run dir in `chunks` stretches of `steps` steps (the same seed
    each), run in alternating, rotating order: a shared machine's load moves over seconds, and would fall on
    whichever run came last (a rerun's median moved by 3-5% between back-to-back runs under load)."""
    from synthetic_engine import run_synthetic

    from overshoot import Recorder

    names = list(configs)
    recs = {name: Recorder(tmp_path / name, engine=f"synthetic-{configs[name].mode}") for name in names}
    try:
        for i in range(chunks):
            for name in names[i % len(names):] + names[:i % len(names)]:
                run_synthetic(recs[name], replace(configs[name], steps=steps))
    finally:
        for rec in recs.values():
            rec.close()


@pytest.mark.parametrize("case", sorted(SYNTHETIC))
def test_projection_matches_a_synthetic_rerun(tmp_path, case):
    """Per-step projections against a rerun, compared by median step time: a busy-spinning engine thread on a
    shared 2-core machine gets preempted now and then, which moves means far more than medians. The base
    run and the reruns run interleaved (_interleaved_runs)."""
    from synthetic_engine import SyntheticConfig

    params = SYNTHETIC[case]
    overrides = {GPU_FASTER.label: {"device_ms": params["device_ms"] * 0.9},
                 CPU_FASTER.label: {"cpu_ms": params["cpu_ms"] * 0.9}}
    configs = {"base": SyntheticConfig(seed=11, **params)}
    configs |= {label: SyntheticConfig(seed=11, **{**params, **o}) for label, o in overrides.items()}
    _interleaved_runs(tmp_path, configs)
    summary = summarize(load_run(tmp_path / "base"), what_ifs=[GPU_FASTER, CPU_FASTER])
    assert summary.mode.mode == params["mode"]
    never_waited = float(summary.steps["thread_never_waited"].mean())
    if case == "async-edge":  # the case must mix steps that waited for the device and steps that did not
        assert 0.15 < never_waited < 0.85, never_waited
    for what_if in (GPU_FASTER, CPU_FASTER):
        rerun = tmp_path / what_if.label
        projected_ms = float(summary.steps[f"whatif:{what_if.label}"].median())
        assert projected_ms == pytest.approx(_median_step_ms(rerun), rel=0.03), (case, what_if.label)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_max_plus_scan_equals_the_step_loop(seed):
    """The vectorised replay (max-plus prefix scan) gives the loop's step times, on random plans mixing
    steps that await the latest GPU work, the one before, their own, nothing, wait before launching, or
    launch nothing."""
    from overshoot.analysis import maxplus, whatif

    rng = np.random.default_rng(seed)
    n = 5_000
    has_gpu = rng.random(n) > 0.1
    rows = np.arange(n)
    gpu_rows = np.flatnonzero(has_gpu)
    pos = np.searchsorted(gpu_rows, rows) - 1
    previous = np.where(pos >= 0, gpu_rows[np.maximum(pos, 0)], -1)
    before = np.where(pos >= 1, gpu_rows[np.maximum(pos - 1, 0)], -1)
    choice = rng.integers(0, 4, n)
    awaited = np.select([choice == 0, (choice == 1) & has_gpu, choice == 2], [previous, rows, before], -1)
    wait_first = has_gpu & (awaited != rows) & (awaited >= 0) & (rng.random(n) > 0.7)
    plan = whatif._Plan(
        gap=rng.exponential(1e4, n) * (rng.random(n) > 0.8), c0=rng.exponential(2e5, n),
        c1=rng.exponential(1e5, n), c2=rng.exponential(5e4, n), wait_first=wait_first,
        gpu_ns=np.where(has_gpu, rng.exponential(3e5, n), 0.0), has_gpu=has_gpu, kernels=None,
        kernel_step=np.zeros(n, bool), busy_est=np.full(n, np.nan), busy_group=np.full(n, -1),
        awaited=awaited.astype("int64"),
        residual=rng.exponential(3e3, n), fixed_wait=np.where(awaited < 0, rng.exponential(1e4, n), 0.0),
    )
    for cpu, gpu in ((1.0, 1.0), (0.9, 1.0), (1.0, 0.9)):
        d, k = whatif._gpu_terms(plan, cpu_scale=cpu, gpu_scale=gpu)
        assert whatif._step_matrices(plan, d, k, cpu_scale=cpu) is not None
        scanned = whatif._replay(plan, cpu_scale=cpu, gpu_scale=gpu)
        looped = whatif._replay_loop(plan, d, k, cpu_scale=cpu)
        assert np.allclose(scanned, looped, rtol=0, atol=1e-6)
    # Per group (eight random groups, changing step by step, or in runs of 1-80 steps that are folded into
    # one matrix a run: maxplus.segment_products): the reduction's end equals the loop with only that group's
    # steps changed.
    base = whatif._replay(plan, cpu_scale=1.0, gpu_scale=1.0)
    runs = np.repeat(rng.integers(-1, 8, n), rng.integers(1, 80, n))[:n]  # 8 groups: runs are folded
    steps = rng.integers(-1, 8, n)
    # 3 groups in long runs (as project mixes them: only the reduction's nodes at the runs' edges, the
    # unchanged reduction kept only where the mixes read it)
    few = np.repeat(np.resize([0, 1, 2, -1], 40), 125)
    same = maxplus.Reduction(whatif._levels(plan, 1.0, 1.0)).kept_for([few == g for g in range(3)],
                                                                      side_a=False)
    assert not same.whole
    for group_of, w in ((steps, WhatIf("cpu", -0.1)), (steps, WhatIf("gpu", -0.1)),
                        (runs, WhatIf("cpu", -0.1)), (runs, WhatIf("gpu", -0.1)),
                        (few, WhatIf("cpu", -0.1)), (few, WhatIf("gpu", -0.1))):
        levels = (whatif._levels(plan, *whatif._scales(w)), same) if group_of is few else None
        changes = whatif._group_changes(plan, w, group_of, base, base, levels=levels)
        if group_of is few:  # the same products as a plain mix of all steps
            assert np.array_equal(changes, whatif._group_changes(plan, w, group_of, base, base))
        for g in range(int(group_of.max()) + 1):
            scale = np.where(group_of == g, 0.9, 1.0)
            cpu, gpu = (scale, 1.0) if w.target == "cpu" else (1.0, scale)
            d, k = whatif._gpu_terms(plan, cpu_scale=cpu, gpu_scale=gpu)
            looped = whatif._replay_loop(plan, d, k, cpu_scale=cpu)
            assert changes[g] == pytest.approx(looped.sum() - base.sum(), abs=1e-6)
            if w.target == "cpu":
                assert changes[g] <= 1e-9  # a faster CPU in one group never lengthens the timeline


def test_a_group_gets_what_the_timeline_gains_when_only_its_steps_change(tmp_path):
    """Async decode steps (GPU-bound) with a launch-bound prefill every 20 steps, seen through CUDA events
    only. A 10% faster CPU shortens the prefill's own step, but its GPU work (an interval that a faster CPU
    cannot shorten, as far as events tell) still ends when it did, so the next decode step waits the longer:
    the prefill's steps claim a gain the run never gets, and decode steps would read as lengthened. Per
    group, overshoot reports what the whole timeline gains when only that group's steps change, checked
    against reruns where only that group's CPU work is 10% shorter."""
    params = dict(mode="async", cpu_ms=0.6, gpu_ms=1.2, long_every=20, long_cpu_ms=10.0, long_gpu_ms=12.0)
    base = simulate_timeline(400, **params)
    summary = summarize(load_run(write_run(tmp_path / "base", base)), what_ifs=[CPU_FASTER])
    groups = summary.groups.set_index("phase")
    steps = summary.steps
    model_total = steps.groupby("phase")["model_ms"].sum()
    assert (steps["whatif:cpu-10%"] > steps["model_ms"] + 0.5).any()  # a decode step that waits longer
    total = float((base.steps["end_ns"] - base.steps["start_ns"]).sum()) / 1e6
    for phase, rerun_params in (("decode", {"cpu_ms": 0.54, "post_ms": 0.2}),
                                ("prefill", {"long_cpu_ms": 9.0})):
        rerun = simulate_timeline(400, **{**params, **rerun_params})
        gained = float((rerun.steps["end_ns"] - rerun.steps["start_ns"]).sum()) / 1e6 - total
        projected = groups.loc[phase, "whatif:cpu-10%"] / 100 * model_total[phase]
        assert groups.loc[phase, "whatif:cpu-10%"] <= 1e-9
        assert projected == pytest.approx(gained, abs=0.002 * model_total[phase]), phase
