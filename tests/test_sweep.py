"""The crossover line of a load sweep (overshoot/analysis/sweep.py): where decode steps turn CPU-bound, and
what it says of levels without GPU times (no verdict there: neither under the threshold nor the turn)."""

from __future__ import annotations

from overshoot.analysis.sweep import crossover


def group(level: int, cpu_bound: float | None, *, phase: str = "decode", steps: int = 100) -> dict:
    return {"concurrency": level, "batch_size": level, "phase": phase, "steps": steps,
            "cpu_bound_pct": cpu_bound, "busy_ms_median": 1.0, "gpu_ms_median": 1.0}


def text(*groups: dict) -> str:
    return crossover(list(groups))["text"]


def test_the_turn_is_the_first_level_at_or_over_the_threshold():
    result = crossover([group(1, 2.0), group(2, 49.0), group(4, 50.0), group(8, 90.0)])
    assert (result["level"], result["batch_size"]) == (4, 4)
    assert result["text"] == ("crossover: decode steps turn CPU-bound at 4 requests, batch 4 (50% of steps), "
                              "from 49% at 2 requests, batch 2")


def test_no_turn_and_a_turn_at_the_lowest_level():
    assert text(group(1, 3.0), group(4, 20.0)) == (
        "crossover: none; decode steps stay under 50% CPU-bound at every level from 1 to 4 requests "
        "(most: 20% at 4 requests, batch 4)")
    assert text(group(1, 80.0), group(4, 99.0)) == (
        "crossover: decode steps are CPU-bound from the lowest level on: 80% of steps at 1 request, batch 1")


def test_without_gpu_times_the_crossover_is_unknown_not_none():
    result = crossover([group(1, None), group(4, None)])
    assert result["level"] is None
    assert result["text"] == ("crossover: unknown; no level's decode steps have GPU times, so none has a "
                              "CPU-bound verdict")


def test_levels_without_gpu_times_are_named_and_never_taken_for_under_the_threshold():
    assert text(group(1, None), group(2, 10.0), group(4, 20.0)) == (
        "crossover: none; decode steps stay under 50% CPU-bound at every level with GPU times from 2 to 4 "
        "requests (most: 20% at 4 requests, batch 4); unknown at 1 request (no GPU times)")
    # the turn may lie at the unknown level before it: not "from the lowest level on", not "from n% at ..."
    assert text(group(1, None), group(2, 70.0)) == (
        "crossover: decode steps are CPU-bound from the lowest level with GPU times on: 70% of steps at "
        "2 requests, batch 2; unknown at 1 request (no GPU times)")
    assert text(group(1, 5.0), group(2, None), group(4, 60.0)) == (
        "crossover: decode steps turn CPU-bound at 4 requests, batch 4 (60% of steps), from 5% at 1 request, "
        "batch 1; unknown at 2 requests (no GPU times)")


def test_the_main_phase_stands_for_a_level_by_its_largest_group():
    result = crossover([group(1, 0.0, steps=90), group(1, 99.0, steps=10), group(2, 10.0),
                        group(2, 100.0, phase="prefill", steps=500)])
    assert result["phase"] == "decode" and result["level"] is None
    assert crossover([group(1, 0.0)]) is None  # one level: no sweep
