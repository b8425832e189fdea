"""The recorder against a synthetic engine whose truth is known: CPU-bound share, waits, busy, GPU times."""

from __future__ import annotations

import numpy as np
import pytest
from synthetic_engine import SyntheticConfig, _draws, record_synthetic

from overshoot.rundir.reader import load_run

THRESHOLD_MS = 0.02

# Device times chosen so that roughly half of the steps are CPU-bound: a share near 0 or 1 proves nothing.
CASES = {
    "sync": dict(mode="sync", cpu_ms=0.3, device_ms=0.11),
    "async": dict(mode="async", cpu_ms=0.3, device_ms=0.36),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def recorded(request, tmp_path_factory):
    cfg = SyntheticConfig(steps=400, seed=3, **CASES[request.param])
    run_dir = tmp_path_factory.mktemp(f"synthetic-{request.param}")
    truth = record_synthetic(run_dir, cfg, flush_steps=64)
    return cfg, truth, load_run(run_dir)


def test_cpu_bound_fraction_matches_the_truth(recorded):
    cfg, truth, run = recorded
    true_share = truth.cpu_bound_fraction(THRESHOLD_MS)
    assert 0.2 < true_share < 0.8, f"{cfg.mode}: the case should mix CPU- and GPU-bound steps ({true_share})"
    measured_share = float((run.steps["wait_ns"] <= THRESHOLD_MS * 1e6).mean())
    assert abs(measured_share - true_share) <= 0.02, (cfg.mode, measured_share, true_share)


def test_waits_and_busy_time_match_per_step(recorded):
    cfg, truth, run = recorded
    steps = run.steps.sort_values("step")
    assert steps["step"].tolist() == [t.step for t in truth.truth]
    needed = np.array([t.wait_needed_ns for t in truth.truth])
    wait_error = steps["wait_ns"].to_numpy() - needed
    # The recorded wait is the spin plus the timer's own few hundred ns. The truth's own clock reads can be
    # preempted on a loaded 2-core machine, so a rare step may look short; more than 2% would be a real bug.
    assert np.median(np.abs(wait_error)) < 3_000 and (wait_error <= -2_000).mean() <= 0.02
    busy = (steps["end_ns"] - steps["start_ns"] - steps["wait_ns"]).to_numpy()
    true_busy = np.array([t.busy_ns for t in truth.truth])
    assert np.median(np.abs(busy - true_busy)) < 3_000
    planned = np.array([t.planned_busy_ns for t in truth.truth])
    assert (busy >= planned * 0.99).all()  # spinning never ends early


def test_gpu_intervals_are_the_virtual_devices(recorded):
    cfg, truth, run = recorded
    expected = [(t.step, t.device_start_ns, t.device_end_ns) for t in truth.truth if t.device_start_ns]
    got = list(run.gpu[["step", "gpu_start_ns", "gpu_end_ns"]].itertuples(index=False, name=None))
    assert got == expected
    starts = run.gpu["gpu_start_ns"].to_numpy()
    assert (starts[1:] >= run.gpu["gpu_end_ns"].to_numpy()[:-1]).all()  # in order, never overlapping
    # sync: every record launches; async: all but the last (which only awaits the batch launched before it)
    assert len(run.gpu) == len(run.steps) - (cfg.mode == "async")


def test_idle_periods_end_steps_and_async_drains_before_idle(tmp_path):
    cfg = SyntheticConfig(mode="async", steps=60, idle_every=20, idle_ms=0.5, cpu_ms=0.2, device_ms=0.2)
    truth = record_synthetic(tmp_path, cfg)
    run = load_run(tmp_path)
    idle = run.spans[run.spans["kind"] == "idle"]
    assert len(idle) == 2 and (idle["step"] == -1).all() and (idle["dur_ns"] >= 500_000).all()
    steps = run.steps.set_index("step")
    for start in idle["start_ns"]:
        before = steps[steps["end_ns"] <= start].iloc[-1]
        after = steps[steps["start_ns"] >= start].iloc[0]
        assert before.name + 1 == after.name
    # The record before each idle period launches nothing (it only awaits the last batch).
    launched = {t.step for t in truth.truth if t.device_start_ns is not None}
    assert set(range(60)) - launched == {19, 39, 59} and len(run.gpu) == 57


def test_cpu_draws_do_not_depend_on_device_time():
    base = SyntheticConfig(steps=50, seed=7, device_ms=0.3)
    faster = SyntheticConfig(steps=50, seed=7, device_ms=0.27)
    assert _draws(base)[0] == _draws(faster)[0]
    assert _draws(base)[0] != _draws(SyntheticConfig(steps=50, seed=8))[0]
    with pytest.raises(ValueError):
        SyntheticConfig(mode="overlapped")
