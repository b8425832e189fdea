"""The max-plus scan and reductions of the what-if replay (analysis/maxplus.py) against plain step loops."""

from __future__ import annotations

import numpy as np
import pytest

from overshoot.analysis import maxplus

SIZE = maxplus.SIZE


def _random(rng: np.random.Generator, n: int) -> maxplus.Matrix:
    m = [[rng.exponential(1e5, n) for _ in range(SIZE)] for _ in range(SIZE)]
    for row in m:
        for entry in row:
            entry[rng.random(n) < 0.2] = maxplus.NEG
    return m


def _step_loop(m: maxplus.Matrix) -> np.ndarray:
    """t after each step, one matrix-vector product a step from (0, -inf, -inf)."""
    state = np.array([0.0, maxplus.NEG, maxplus.NEG])
    out = []
    for i in range(len(m[0][0])):
        a = np.array([[m[r][c][i] for c in range(SIZE)] for r in range(SIZE)])
        state = (a + state[None, :]).max(axis=1)
        out.append(state[0])
    return np.array(out)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 64, 1001])
def test_scan_and_end_equal_the_step_loop(n):
    m = _random(np.random.default_rng(n), n)
    levels = maxplus.reduction_levels(m)
    times = maxplus.thread_times(m, levels)
    assert np.allclose(times, _step_loop(m), rtol=1e-12)
    assert np.array_equal(times, maxplus.thread_times(m))
    assert maxplus.final_time(m) == maxplus.final_time_of(levels)
    assert maxplus.final_time(m) == pytest.approx(times[-1] if n else 0.0, rel=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_mix_recomposes_only_the_edges_to_the_same_bit(seed):
    """mixed_final_time, from both sides' reductions whole or kept for the mixes, equals final_time of the
    mixed matrices exactly (the same products), for picks in long runs (the edges only), short runs (the
    plain way) and none."""
    rng = np.random.default_rng(seed)
    n = 3_001
    a, b = _random(rng, n), _random(rng, n)
    side_a, side_b = (maxplus.Reduction(maxplus.reduction_levels(m)) for m in (a, b))
    long_runs = np.repeat(rng.random(60) < 0.5, 51)[:n]
    picks = [long_runs, ~long_runs, rng.random(n) < 0.5, np.zeros(n, bool), np.ones(n, bool)]
    kept_a = side_a.kept_for(picks[:2], side_a=True)
    kept_b = side_b.kept_for(picks[:2], side_a=False)
    assert not kept_a.whole and not kept_b.whole
    assert side_b.kept_for(picks, side_a=False).whole  # a pick that changes side every few steps
    for k, pick in enumerate(picks):
        mixed = [
            [np.where(pick, x, y) for x, y in zip(ra, rb, strict=True)] for ra, rb in zip(a, b, strict=True)
        ]
        expected = maxplus.final_time(mixed)
        assert maxplus.mixed_final_time(side_a, side_b, pick) == expected
        if k < 2:
            assert maxplus.mixed_final_time(kept_a, kept_b, pick) == expected
