"""The live view of `overshoot run` (overshoot/run/live.py): the same figures as the final report's load sweep
table, a panel under the progress bars on a terminal, plain lines elsewhere."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn
from run_factory import write_sweep

from overshoot.report.sections import sweep_table
from overshoot.report.table import build_report
from overshoot.run import live
from overshoot.run.load import LoadResults
from overshoot.rundir.reader import load_run


def _client(levels: list[dict]) -> list[dict]:
    """Two finished requests of 100 tokens per level, inside the level's window."""
    rows = []
    for level in levels:
        start = level["start_ns"]
        for i in range(2):
            rows.append({
                "concurrency": level["concurrency"], "request": i, "start_ns": start + i * 10**8,
                "end_ns": start + (i + 5) * 10**8, "ttft_ms": 20.0, "latency_ms": 500.0, "prompt_tokens": 64,
                "completion_tokens": 100, "ok": True, "error": "",
            })  # fmt: skip
    return rows


@pytest.fixture
def finished(tmp_path):
    run_dir = write_sweep(tmp_path / "r", cpu_ms=1.0, seed=4, levels=(1, 2, 4))
    levels = load_run(run_dir).meta["levels"]
    results = LoadResults(rows=_client(levels), levels=levels)
    results.write(run_dir)
    return run_dir, results


def _rows(text: str) -> list[str]:
    """The data rows of a rendered sweep table (lines that start with a level number)."""
    return [" ".join(line.split()) for line in text.splitlines() if line.strip()[:1].isdigit()]


def test_live_panel_shows_the_final_reports_numbers(finished):
    run_dir, results = finished
    report = build_report(load_run(run_dir))
    view = live.LiveView(run_dir, results, per_level=lambda c: 2)
    view.refresh()
    assert view.rows == report["levels"] and len(view.rows) == 3
    assert [r["tokens_per_s"] for r in view.rows] == pytest.approx([200 / 0.6] * 3)  # 200 tokens in 0.6 s
    panel = Console(width=100, record=True, color_system=None)
    panel.print(view.table())
    final = Console(width=100, record=True, color_system=None)
    final.print(sweep_table(report["levels"], title=""))
    live_rows = [row.split(" ", 2) for row in _rows(panel.export_text().replace("│", " "))]
    assert [f"{level} {rest}" for level, requests, rest in live_rows] == _rows(final.export_text())
    assert all(requests == "2/2" for _, requests, _ in live_rows)


def test_running_level_ends_now_and_plain_lines(finished):
    run_dir, results = finished
    levels = [dict(lv) for lv in results.levels]
    levels[-1]["end_ns"] = None  # level 4 still running
    rows = live.snapshot(run_dir, levels, results.rows)
    assert rows == build_report(load_run(run_dir))["levels"]
    view = live.LiveView(run_dir, LoadResults(rows=results.rows, levels=levels), per_level=lambda c: 8)
    view.refresh()
    out = Console(file=io.StringIO(), width=80, color_system=None)
    view.print_plain(out)
    view.print_plain(out)  # at most one line per PLAIN_EVERY_S
    (line,) = out.file.getvalue().splitlines()
    four = rows[-1]
    assert line == (
        f"concurrency 4: 2/8 requests, so far {four['steps']} steps, median step "
        f"{four['step_ms_median']:.2f} ms, CPU-bound {four['cpu_bound_pct']:.0f}%, GPU idle "
        f"{four['gpu_idle_pct']:.0f}%, 333.3 tok/s"
    )
    assert live.snapshot(run_dir / "nothing", levels, []) == []


def test_progress_bars_with_the_panel_under_them(finished):
    run_dir, results = finished
    view = live.LiveView(run_dir, results, per_level=lambda c: 2)
    console = Console(file=io.StringIO(), width=100, force_terminal=True, record=True, color_system=None)
    progress = live.LiveProgress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), console=console, view=view,
        auto_refresh=False,
    )  # fmt: skip
    progress.add_task("concurrency 4", total=2, completed=1)
    console.print(*progress.get_renderables())
    waiting = console.export_text()
    assert "concurrency 4" in waiting and "1/2" in waiting and "waiting for the first steps" in waiting
    view.refresh()
    console.print(*progress.get_renderables())
    text = console.export_text()
    assert "live: per level" in text and len(_rows(text.replace("│", " "))) == 3
