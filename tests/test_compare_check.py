"""`report --compare` (one-sided groups, bootstrap noise) and `overshoot check` (exit codes for CI)."""

from __future__ import annotations

import json

import pytest
from rich.console import Console
from run_factory import write_sweep
from test_cli import assert_one_line_error, overshoot

from overshoot.analysis import noise
from overshoot.cli import main
from overshoot.report import compare as cmp
from overshoot.report.table import analyse
from overshoot.rundir.reader import load_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cmp")
    return {
        # base: GPU-bound (CPU 0.8 ms against GPU 1.2 ms); same: the same engine, another seed;
        # slow: the CPU 40% slower, past the GPU, and a level 4 that base does not have
        "base": write_sweep(root / "base", cpu_ms=0.8, seed=1, levels=(1, 2)),
        "same": write_sweep(root / "same", cpu_ms=0.8, seed=2, levels=(1, 2)),
        "slow": write_sweep(root / "slow", cpu_ms=1.12, seed=3, levels=(2, 4)),
    }


def _compare(a, b):
    ra, sa = analyse(load_run(a))
    rb, sb = analyse(load_run(b))
    rows = cmp.compare(ra, rb, samples_a=noise.summary_samples(sa), samples_b=noise.summary_samples(sb))
    return ra, rb, rows


def test_compare_keeps_groups_of_one_run_and_says_what_is_noise(runs):
    ra, rb, rows = _compare(runs["base"], runs["slow"])
    assert [(r["concurrency"], r["in"]) for r in rows] == [(1, "a"), (2, "both"), (4, "b")]
    one_sided, both, only_b = rows
    assert one_sided["step_ms_median"]["b"] is None and one_sided["step_ms_median"]["delta"] is None
    assert only_b["step_ms_median"]["a"] is None and only_b["step_ms_median"]["b"] > 0
    step = both["step_ms_median"]
    low, high = step["interval"]
    assert 0 < low < step["delta"] < high and step["beyond_noise"] is True
    assert both["busy_ms_median"]["beyond_noise"] is True and both["cpu_bound_pct"]["delta"] > 30
    assert both["gpu_ms_median"]["beyond_noise"] is False  # the GPU work is the same 1.2 ms
    labels = {r["label"]: r for r in both["busy_by_label"]}
    assert labels["schedule"]["delta"] > 25 and abs(labels["update"]["delta"]) < 5
    # the same engine, another seed: nothing outside the noise, every interval holds zero
    _, _, same = _compare(runs["base"], runs["same"])
    for row in same:
        for metric in ("step_ms_median", "busy_ms_median", "cpu_bound_pct"):
            low, high = row[metric]["interval"]
            assert low <= 0 <= high and row[metric]["beyond_noise"] is False, (row["title"], metric)
    console = Console(width=200, record=True, color_system=None)
    cmp.render_compare(ra, rb, rows, console, by_label=True)
    text = console.export_text()
    assert "decode @ 1 request, batch 1 (only in A)" in text
    assert "decode @ 4 requests, batch 1 (only in B)" in text
    assert "outside" in text and "busy: schedule" in text and noise.METHOD in " ".join(text.split())
    assert "-0.0" not in text


def test_bootstrap_is_seeded_and_bounded():
    import numpy as np

    rng = np.random.default_rng(5)
    a = {"step_ms": rng.normal(10, 1, 20_000), "busy_ms": rng.normal(5, 1, 20_000),
         "gpu_ms": np.full(20_000, np.nan), "cpu_bound": np.zeros(20_000), "idle": np.full(20_000, np.nan)}
    b = {k: v * 1.02 if k == "step_ms" else v for k, v in a.items()}  # fmt: skip
    first = noise.delta_intervals(a, b, np.random.default_rng(noise.SEED))
    again = noise.delta_intervals(a, b, np.random.default_rng(noise.SEED))
    assert first == again and first["gpu_ms_median"] is None and first["gpu_idle_pct"] is None
    low, high = first["step_ms_median"]
    assert low < 2.0 < high and high - low < 1  # +2% exactly, 20,000 steps a run
    tiny = {k: v[:5] for k, v in a.items()}
    assert noise.delta_intervals(tiny, b, np.random.default_rng(0))["step_ms_median"] is None


@pytest.mark.parametrize("n", [300, 301])
def test_median_and_share_replicates_are_what_resampling_gives(n, monkeypatch):
    """The order-statistic (Beta) draws of the median and the binomial draws of a share have the same
    distribution as medians and shares of real resamples with replacement."""
    import numpy as np

    monkeypatch.setattr(noise, "RESAMPLES", 4000)
    x = np.random.default_rng(1).lognormal(0, 0.5, n)
    resampled = x[np.random.default_rng(3).integers(0, n, (4000, n))]
    quantiles = [2.5, 25, 50, 75, 97.5]
    fast = np.percentile(noise._median(x, np.random.default_rng(2)), quantiles)
    assert fast == pytest.approx(np.percentile(np.median(resampled, axis=1), quantiles), rel=0.01)
    flags = (x > 1).astype(float)
    share = np.percentile(noise._share(flags, np.random.default_rng(2)), quantiles)
    assert share == pytest.approx(np.percentile(100 * (resampled > 1).mean(axis=1), quantiles), abs=1.0)


def test_check_limits_in_process(runs, capsys):
    assert main(["check", str(runs["base"]), "--max-cpu-bound", "60%", "--max-gpu-idle", "50"]) == 0
    assert capsys.readouterr().out.strip() == "ok: 2 groups within the limits"
    assert main(["check", str(runs["slow"]), "--baseline", str(runs["base"]), "--max-regression", "3%"]) == 1
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert line.startswith("decode @ 2 requests, batch 1: median step ")
    assert "above --max-regression 3%" in line and "outside the noise" in line
    assert main(["check", str(runs["same"]), "--baseline", str(runs["base"]), "--max-regression", "3%"]) == 0
    assert "2 compared with the baseline" in capsys.readouterr().out
    assert main(["check", str(runs["base"]), "--max-cpu-bound", "5%", "--min-steps", "1000"]) == 2
    assert "--min-steps" in capsys.readouterr().err


def test_check_exit_codes_as_ci_sees_them(runs, tmp_path, capsys):
    broken = overshoot("check", runs["slow"], "--max-cpu-bound", "10%", "--max-gpu-idle", "1%")
    assert broken.returncode == 1, broken.stderr
    lines = broken.stdout.strip().splitlines()
    report = json.loads(overshoot("report", runs["slow"], "--json").stdout)
    expected = sum(g["cpu_bound_pct"] > 10 for g in report["groups"])
    expected += sum(g["gpu_idle_pct"] > 1 for g in report["groups"])
    assert len(lines) == expected == 4, lines
    assert sum("above --max-cpu-bound 10%" in line for line in lines) == 2
    for args, needle in (
        ((runs["base"],), "no limit given"),
        ((runs["base"], "--max-regression", "3%"), "needs --baseline"),
        ((runs["base"], "--max-cpu-bound", "ten"), "bad --max-cpu-bound 'ten'"),
        ((tmp_path / "missing", "--max-cpu-bound", "5%"), "run dir not found"),
    ):
        assert main(["check", *map(str, args)]) == 2, args
        err = capsys.readouterr().err.strip()
        assert err.startswith("overshoot check: error: ") and needle in err and "\n" not in err
    bad = overshoot("check", tmp_path / "missing", "--max-cpu-bound", "5%")
    assert bad.returncode == 2
    assert_one_line_error(bad, "run dir not found")


def test_a_limit_on_a_figure_the_run_lacks_breaks_instead_of_passing(tmp_path, capsys):
    """CPU-bound and GPU idle need GPU times: a run without any cannot be checked against those limits (exit
    2, one line), and a group without them in a run that has them breaks with a line saying why, since a gate
    that passed on missing data would gate nothing (it read "ok: ... within the limits"). The regression
    limit, which needs no GPU, still passes."""
    from run_factory import simulate_timeline, write_run

    frames = simulate_timeline(120, mode="sync", cpu_ms=1.0, gpu_ms=0.5)
    frames.gpu = frames.gpu.iloc[:0]
    run = write_run(tmp_path / "cpu", frames)
    for option in ("--max-cpu-bound", "--max-gpu-idle"):
        assert main(["check", str(run), option, "10%"]) == 2
        error = capsys.readouterr().err.strip()
        assert error == f"overshoot check: error: {option}: {run} has no GPU times to check"
    assert main(["check", str(run), "--baseline", str(run), "--max-regression", "3%"]) == 0
    capsys.readouterr()
    # the same engine where the batch-2 steps lost their GPU times: only that group breaks, saying why
    frames = simulate_timeline(240, mode="sync", cpu_ms=1.0, gpu_ms=0.5)
    frames.steps.loc[120:, "batch_size"] = 2
    frames.gpu = frames.gpu[frames.gpu["step"] < 120]
    mixed = write_run(tmp_path / "mixed", frames)
    assert main(["check", str(mixed), "--max-cpu-bound", "100%", "--max-gpu-idle", "100%"]) == 1
    assert capsys.readouterr().out.strip().splitlines() == [
        "decode @ batch 2: CPU-bound unknown (no GPU times), so --max-cpu-bound 100% cannot be checked",
        "decode @ batch 2: GPU idle unknown (no GPU times), so --max-gpu-idle 100% cannot be checked",
    ]
