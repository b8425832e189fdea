"""`overshoot plot`: the PNG files, read back (format, size, the panels each file says it drew)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from run_factory import write_sweep
from test_cli import REPO, assert_one_line_error, overshoot

pytest.importorskip("matplotlib")
from PIL import Image  # noqa: E402  (a dependency of matplotlib)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("plot")
    a = write_sweep(root / "a", cpu_ms=0.8, seed=1, levels=(1, 2))
    return a, write_sweep(root / "b", cpu_ms=1.1, seed=2, levels=(2, 4))


def _panels(path) -> tuple[Image.Image, list[dict]]:
    image = Image.open(path)
    image.load()
    return image, json.loads(image.info["Description"])["panels"]


def test_plot_compare_writes_three_pngs_with_every_panel(runs, tmp_path):
    a, b = runs
    out = tmp_path / "plots"
    result = overshoot("plot", a, "--compare", b, "-o", out)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["cpu_vs_gpu.png", "groups.png", "timeline.png"]

    image, panels = _panels(out / "timeline.png")
    assert image.format == "PNG" and image.size == (1200, 800)  # one 12 x 4 in panel per run, 100 dpi
    assert [p["title"] for p in panels] == ["A = a: step timeline", "B = b: step timeline"]
    assert all(p["lines"] == 4 for p in panels)  # step, CPU busy, GPU interval, GPU idle
    assert all(p["patches"] == 2 for p in panels)  # one shaded span per load level
    pixels = np.asarray(image.convert("L"), dtype=float)
    assert pixels.std() > 10  # drawn, not a blank canvas

    image, panels = _panels(out / "cpu_vs_gpu.png")
    assert image.size == (1200, 600)
    titles = [f"{n} = {n.lower()}: CPU busy vs GPU interval per step" for n in "AB"]
    assert [p["title"] for p in panels] == titles
    assert all(p["collections"] == 2 and p["lines"] == 1 for p in panels)  # a scatter per level, y = x

    image, panels = _panels(out / "groups.png")
    assert [p["title"] for p in panels] == [
        f"{n} = {n.lower()}: per group, CPU busy by label and wait (left), GPU idle by host work (right)"
        for n in "AB"
    ]
    # two groups each: bars for schedule, update, unlabelled, wait and GPU idle
    assert [p["patches"] for p in panels] == [2 * 5, 2 * 5]
    assert "wrote " in result.stderr and "timeline.png" in result.stderr


def test_plot_without_matplotlib_says_how_to_get_it(runs, tmp_path):
    probe = (
        "import sys; sys.modules['matplotlib'] = None; from overshoot.cli import main; "
        "sys.exit(main(['plot', sys.argv[1], '-o', sys.argv[2]]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe, str(runs[0]), str(tmp_path / "out")],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert result.returncode == 1
    assert_one_line_error(result, "matplotlib", "pip install 'overshoot[plot]'")
    assert not (tmp_path / "out").exists()


def test_the_gpu_idle_bar_is_split_by_host_work_where_kernel_records_tell(tmp_path):
    """A launch-bound run with kernel records: the group's GPU idle bar stacks one hatched part per label the
    thread was in (schedule, launch, update, unlabelled; the wait in the grey rest), the busy bar the same
    four labels and the wait: 4 + 1 + 4 + 1 patches."""
    from run_factory import simulate_kernel_timeline, write_kernel_run
    from test_gpu_truth import CASES

    run_dir = write_kernel_run(tmp_path / "eager", simulate_kernel_timeline(120, mode="sync",
                                                                          **CASES["launch-bound"]))
    result = overshoot("plot", run_dir, "-o", tmp_path / "plots")
    assert result.returncode == 0, result.stderr
    _, (panel,) = _panels(tmp_path / "plots" / "groups.png")
    assert panel["patches"] == 4 + 1 + 4 + 1, panel

