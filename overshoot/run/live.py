"""The live view of `overshoot run`: per load level, steps so far, median step, CPU-bound and GPU idle shares,
output tokens/s, read from what the engine's recorders have flushed (they flush at least once a second while
steps run: Recorder flush_seconds) and refreshed about once a second.

The figures are the report's own: the snapshot runs the report's analysis (analysis/sweep.py level_rows) on
the run directory as it stands, so once everything is flushed the panel shows the final report's load sweep
table. A terminal gets a rich panel under the progress bars; other output (CI logs, pipes) gets plain lines.
The analysis runs in a worker thread and backs off when it gets slow (at most ~10% of one core), so that the
load client's timing and the measured server are left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console, Group
from rich.panel import Panel
from rich.progress import Progress
from rich.text import Text

from overshoot.report.fmt import fmt_num, pct

REFRESH_S = 1.0
MAX_LOAD_SHARE = 0.1  # the refresh interval grows so that the analysis takes at most this share of the time
MAX_REFRESH_S = 30.0  # a very long run: still a refresh every half minute
PLAIN_EVERY_S = 10.0  # plain output: one line per level at most this often (and when a level ends)


def snapshot(
    run_dir: Path, levels: list[dict], client_rows: list[dict], *, now_ns: int | None = None
) -> list[dict]:
    """The load sweep rows (analysis/sweep.py level_rows) of the run dir as flushed so far; a level still
    running ends now. [] while no step is recorded."""
    import pandas as pd

    from overshoot.analysis.analyze import summarize
    from overshoot.analysis.sweep import level_rows
    from overshoot.report.table import client_stats
    from overshoot.run.load import LoadResults
    from overshoot.rundir.meta import RunDirError
    from overshoot.rundir.reader import load_run

    try:
        run = load_run(run_dir)
    except RunDirError:  # nothing flushed yet
        return []
    now = time.perf_counter_ns() if now_ns is None else now_ns
    closed = [dict(lv, end_ns=now if lv.get("end_ns") is None else lv["end_ns"]) for lv in levels]
    run.meta = dict(run.meta or {}, levels=closed)
    if not closed:
        return []
    client = LoadResults(rows=list(client_rows)).frame() if client_rows else pd.DataFrame()
    return level_rows(summarize(run), client_stats(client))


class LiveView:
    """Holds the latest snapshot; `refresh_forever` renews it about once a second."""

    def __init__(self, run_dir: Path, results, *, per_level: Callable[[int], int | None]):
        self.run_dir = run_dir
        self.results = results  # LoadResults, filled by the load client as it runs
        self.per_level = per_level  # requests planned per level (None: timed levels)
        self.rows: list[dict] = []
        self.error = ""
        self._printed: dict[int, float] = {}
        self._wake: asyncio.Event | None = None

    def level_done(self) -> None:
        """A level ended: refresh now rather than at the next tick."""
        if self._wake is not None:
            self._wake.set()

    def requests(self) -> dict[int, str]:
        """'done/planned' requests per level."""
        done: dict[int, int] = {}
        for row in list(self.results.rows):
            done[row["concurrency"]] = done.get(row["concurrency"], 0) + 1
        out = {}
        for level in self.results.levels:
            c = level["concurrency"]
            planned = self.per_level(c)
            out[c] = f"{done.get(c, 0)}/{planned}" if planned else str(done.get(c, 0))
        return out

    def refresh(self) -> float:
        """Take a new snapshot (blocking); returns the seconds it took. Never raises: the run goes on."""
        started = time.perf_counter()
        try:
            self.rows = snapshot(self.run_dir, list(self.results.levels), list(self.results.rows))
            self.error = ""
        except Exception as exc:  # a half-written file, a race with the writer: keep the last snapshot
            self.error = f"{type(exc).__name__}: {exc}"
        return time.perf_counter() - started

    async def refresh_forever(self, on_refresh: Callable[[], None] | None = None) -> None:
        self._wake = asyncio.Event()
        first = True
        while True:
            cost = await asyncio.to_thread(self.refresh)
            if first:  # the first snapshot pays for importing pandas: not a cost to back off from
                cost, first = 0.0, False
            if on_refresh is not None:
                on_refresh()
            self._wake.clear()
            pause = min(max(REFRESH_S, cost / MAX_LOAD_SHARE), MAX_REFRESH_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), pause)

    def table(self) -> Panel:
        from overshoot.report.sections import sweep_table

        title = "live: per level, as the engine has flushed its steps" + self._error_note()
        body = Text("waiting for the first steps", style="dim")
        if self.rows:
            body = sweep_table(self.rows, title="", requests=self.requests())
        return Panel.fit(body, title=title, title_align="left")

    def _error_note(self) -> str:
        return f" (last refresh failed: {self.error})" if self.error else ""

    def line(self, row: dict, requests: dict[int, str]) -> str:
        c = row["concurrency"]
        return (
            f"concurrency {c}: {requests.get(c, '-')} requests, so far {row['steps']} steps, median step "
            f"{fmt_num(row['step_ms_median'])} ms, CPU-bound {pct(row['cpu_bound_pct'])}, GPU idle "
            f"{pct(row['gpu_idle_pct'])}, {fmt_num(row['tokens_per_s'], '.1f')} tok/s"
        )

    def print_plain(self, console: Console) -> None:
        """Plain output: the running level's line, at most every PLAIN_EVERY_S. (No line when a level ends:
        its last second may not be flushed yet; the report's load sweep table has the final figures.)"""
        requests = self.requests()
        running = next((lv["concurrency"] for lv in self.results.levels if lv.get("end_ns") is None), None)
        now = time.monotonic()
        for row in self.rows:
            c = row["concurrency"]
            if c == running and now - self._printed.get(c, -PLAIN_EVERY_S) >= PLAIN_EVERY_S:
                self._printed[c] = now
                console.print(self.line(row, requests), highlight=False, markup=False, soft_wrap=True)


class LiveProgress(Progress):
    """The progress bars with the live table under them, in one rich Live display."""

    def __init__(self, *columns, view: LiveView, **options):
        self.view = view  # first: Progress renders once while it is being built
        super().__init__(*columns, **options)

    def get_renderables(self):
        yield Group(self.make_tasks_table(self.tasks), self.view.table())
