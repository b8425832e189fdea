"""`overshoot report` / `export` as a user runs them: a real subprocess on real run dirs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
from rich.console import Console
from run_factory import simulate_timeline, write_run
from synthetic_engine import SyntheticConfig, record_synthetic

from overshoot.report.table import build_report, render
from overshoot.rundir.meta import update_meta
from overshoot.rundir.reader import load_run

REPO = Path(__file__).resolve().parents[1]


def overshoot(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "COLUMNS": "120",
    }
    return subprocess.run(
        [sys.executable, "-m", "overshoot", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and lines[0].startswith("overshoot")
    for needle in needles:
        assert needle in lines[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Two runs recorded by the synthetic engine through the real Recorder: a GPU-bound one with a load level
    and client data (as `overshoot run` leaves them), and a CPU-bound one."""
    root = tmp_path_factory.mktemp("runs")
    a, b = root / "a", root / "b"
    record_synthetic(a, SyntheticConfig(mode="async", steps=300, cpu_ms=0.2, device_ms=0.35, seed=1))
    record_synthetic(b, SyntheticConfig(mode="async", steps=300, cpu_ms=0.4, device_ms=0.2, seed=1))
    for run in (a, b):
        steps = load_run(run).steps
        level = {
            "concurrency": 1,
            "start_ns": int(steps["start_ns"].min()),
            "end_ns": int(steps["end_ns"].max()),
        }
        update_meta(run, {"levels": [level]})
    client = pd.DataFrame(
        {
            "concurrency": pd.array([1] * 4, dtype="int32"),
            "request": range(4),
            "start_ns": [0, 10**9, 2 * 10**9, 3 * 10**9],
            "end_ns": [10**9, 2 * 10**9, 3 * 10**9, 4 * 10**9],
            "ttft_ms": [20.0, 22.0, 21.0, 25.0],
            "latency_ms": [1000.0] * 4,
            "prompt_tokens": pd.array([128] * 4, dtype="int32"),
            "completion_tokens": pd.array([100] * 4, dtype="int32"),
            "ok": [True] * 4,
            "error": [""] * 4,
        }
    )
    client.to_parquet(a / "client.parquet")
    return {"a": a, "b": b}


def test_report_prints_table_verdicts_and_client_stats(runs):
    result = overshoot("report", runs["a"])
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "decode @ 1 request, batch 4:" in out and "of steps CPU-bound; the thread never waited in" in out
    assert "a 10% faster GPU step would shorten steps by" in out
    assert "client side, per concurrency level" in out and "scheduling: async" in out


def test_report_json_and_what_if_options(runs):
    result = overshoot("report", runs["b"], "--json", "--what-if", "gpu=-20%", "--warmup", "10")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["mode"] == "async" and data["what_ifs"] == ["gpu-20%"] and data["warmup_steps"] == 10
    (group,) = data["groups"]
    assert group["steps"] == 290 and group["cpu_bound_pct"] > 90
    assert abs(group["what_if_pct"]["gpu-20%"]) < 0.5  # CPU-bound: a faster GPU buys nothing
    assert data["client"] == []


def test_compare_shows_both_runs_with_deltas(runs):
    result = overshoot("report", runs["a"], "--compare", runs["b"])
    assert result.returncode == 0, result.stderr
    assert "A = a  vs  B = b" in result.stdout and "CPU-bound %" in result.stdout and "pts" in result.stdout
    data = json.loads(overshoot("report", runs["a"], "--compare", runs["b"], "--json").stdout)
    (row,) = data["compare"]
    steps = row["step_ms_median"]
    assert steps["delta"] == pytest.approx(100 * (steps["b"] - steps["a"]) / steps["a"])
    assert row["cpu_bound_pct"]["b"] > row["cpu_bound_pct"]["a"]


def test_export_parquet_csv_with_exact_schema(runs, tmp_path):
    out = tmp_path / "steps.parquet"
    result = overshoot("export", runs["a"], "-o", out)
    assert result.returncode == 0, result.stderr
    schema = {f.name: str(f.type) for f in pq.read_schema(out)}
    assert schema == {
        "run_id": "string",
        "pid": "int64",
        "thread": "string",
        "step": "int64",
        "start_ns": "int64",
        "step_ms": "double",
        "busy_ms": "double",
        "wait_ms": "double",
        "batch_size": "int32",
        "num_tokens": "int32",
        "phase": "string",
        "gpu_ms": "double",
        "gpu_idle_before_ms": "double",
        "gpu_busy_ms": "double",
        "gpu_idle_in_step_ms": "double",
        "kernels": "double",
        "launch_ms": "double",
        "gpu_idle_ms": "double",
        "gpu_idle_share": "double",
        "gpu_timing": "string",
        "cpu_bound": "bool",
        "thread_never_waited": "bool",
        "concurrency": "int32",
        "load_window": "string",
    }
    df = pd.read_parquet(out)
    # async: the last record only waits, so it has no GPU work; the first GPU work has no gap before it
    assert len(df) == 300 and df["gpu_ms"].isna().sum() == 1 and df["gpu_idle_before_ms"].isna().sum() == 2
    assert str(df["batch_size"].dtype) == "int32" and str(df["thread_never_waited"].dtype) == "bool"
    # the verdict is unknown (null) where the step has no GPU data: the first and the last
    assert df["cpu_bound"].isna().sum() == 2 and df["cpu_bound"].dropna().isin([True, False]).all()
    assert df["gpu_busy_ms"].isna().all()  # events only: GPU busy inside the steps is unknown, never 0
    spans = tmp_path / "spans.csv"
    assert overshoot("export", runs["a"], "-o", spans, "--what", "spans").returncode == 0
    spans_df = pd.read_csv(spans)
    assert list(spans_df.columns) == ["pid", "thread", "step", "kind", "label", "start_ns", "dur_ns"]
    recorded = load_run(runs["a"]).spans
    assert len(spans_df) == len(recorded) and set(spans_df["kind"]) == {"busy", "wait"}
    assert {"schedule", "prepare", "launch", "update", "device"} <= set(spans_df["label"])
    gpu = tmp_path / "gpu.parquet"
    assert overshoot("export", runs["a"], "-o", gpu, "--what", "gpu").returncode == 0
    assert pd.read_parquet(gpu)["gpu_ms"].round(6).eq(0.35).all()
    # an empty table says why it is empty instead of leaving a file of 0 rows to be taken for a bug
    kernels = overshoot("export", runs["a"], "-o", tmp_path / "k.parquet", "--what", "kernels")
    assert kernels.returncode == 0 and len(pd.read_parquet(tmp_path / "k.parquet")) == 0
    assert "(parquet, 0 rows); no kernel records in this run" in kernels.stderr


def test_export_chrome_trace_has_engine_and_gpu_tracks(runs, tmp_path):
    out = tmp_path / "trace.json"
    result = overshoot("export", runs["a"], "-o", out, "--format", "chrome")
    assert result.returncode == 0, result.stderr
    events = json.loads(out.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {"thread MainThread", "GPU (MainThread)"}  # the recording thread of the synthetic engine
    by_cat = pd.Series([e["cat"] for e in events if e["ph"] == "X"]).value_counts().to_dict()
    kinds = load_run(runs["a"]).spans["kind"].value_counts().to_dict()
    assert by_cat == {"busy": kinds["busy"], "wait": kinds["wait"], "step": 300, "gpu": 299}
    steps = [e for e in events if e.get("cat") == "step"]
    gpu = [e for e in events if e.get("cat") == "gpu"]
    assert {e["tid"] for e in steps} != {e["tid"] for e in gpu}
    assert all(e["dur"] > 0 and e["ts"] >= 0 for e in steps + gpu)


def test_bad_input_gives_one_line_and_nonzero_exit(runs, tmp_path):
    assert_one_line_error(overshoot("report", tmp_path / "missing"), "not found")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(overshoot("report", tmp_path / "empty"))
    (tmp_path / "nospool" / "spool").mkdir(parents=True)
    assert_one_line_error(overshoot("report", tmp_path / "nospool"), "no steps recorded")
    assert_one_line_error(overshoot("report", runs["a"], "--bogus"), "--bogus")
    assert_one_line_error(overshoot("report", runs["a"], "--what-if", "gpu=fast"), "--what-if")
    assert_one_line_error(
        overshoot("export", runs["a"], "-o", tmp_path / "no" / "dir" / "x.parquet"), "cannot write"
    )
    assert_one_line_error(
        overshoot("export", runs["a"], "-o", tmp_path / "x.parquet", "--what", "nope"), "--what"
    )
    assert_one_line_error(overshoot("export", runs["a"], "-o", tmp_path / "x", "--format", "xls"), "--format")


def test_corrupt_and_truncated_chunks(tmp_path):
    frames = simulate_timeline(100, mode="sync")
    corrupt = write_run(tmp_path / "corrupt", frames)
    for chunk in (corrupt / "spool").glob("*.steps.*.arrow"):
        chunk.write_bytes(b"garbage, not arrow" * 10)
    assert_one_line_error(overshoot("report", corrupt), "no steps recorded")
    truncated = write_run(tmp_path / "truncated", frames, chunk_rows=30)
    (chunk,) = (truncated / "spool").glob("*.steps.*.arrow")
    chunk.write_bytes(chunk.read_bytes()[:-200])
    result = overshoot("report", truncated, "--json")
    assert result.returncode == 0, result.stderr
    assert "truncated after 3 chunks" in result.stderr and "Traceback" not in result.stderr
    assert json.loads(result.stdout)["groups"][0]["steps"] == 90


RECORD_FOREVER = textwrap.dedent("""
    import sys, time
    from overshoot import Recorder
    rec = Recorder(sys.argv[1], engine="killed", flush_steps=20)
    i = 0
    while True:
        rec.step_begin(batch_size=2, num_tokens=2, phase="decode")
        with rec.busy("schedule"):
            time.sleep(0.0005)
        with rec.wait("gpu"):
            time.sleep(0.0005)
        i += 1
""")


def test_report_reads_a_run_killed_with_sigkill(tmp_path):
    run = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", RECORD_FOREVER, str(run)], env=env)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not list(run.glob("spool/*.steps.*.arrow")):
            time.sleep(0.05)
        time.sleep(0.3)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    result = overshoot("report", run, "--json")
    assert result.returncode == 0, result.stderr
    (group,) = json.loads(result.stdout)["groups"]
    assert group["batch_size"] == 2 and group["steps"] >= 20 and group["thread_never_waited_pct"] == 0
    assert group["cpu_bound_pct"] is None and group["gpu_timing"] == "none"  # no GPU data: unknown, not 0


def test_help_has_examples_and_nothing_imports_torch(runs):
    top = overshoot("--help")
    assert top.returncode == 0 and all(c in top.stdout for c in ("report", "export", "run"))
    for command in ("report", "export"):
        result = overshoot(command, "--help")
        assert (
            result.returncode == 0 and "Examples" in result.stdout and "overshoot " + command in result.stdout
        )
    # --help loads neither pandas nor torch nor the run command; report and export never load torch
    probe = (
        "import sys; from overshoot.cli import main; main(['--help']); "
        "assert not any(m in sys.modules for m in ('pandas', 'torch', 'overshoot.run.command')), 'help'; "
        "main(['report', sys.argv[1], '--json']); main(['export', sys.argv[1], '-o', sys.argv[2]]); "
        "assert 'torch' not in sys.modules, 'report/export'"
    )
    out = runs["a"].parent / "probe.parquet"
    result = subprocess.run(
        [sys.executable, "-c", probe, str(runs["a"]), str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr
    assert out.exists()


def test_report_rendered_to_a_fixed_width_console(tmp_path):
    frames = simulate_timeline(100, mode="sync", cpu_ms=1.0, gpu_ms=1.2, post_ms=0.2)
    report = build_report(load_run(write_run(tmp_path / "fixed", frames)))
    console = Console(width=100, record=True, color_system=None)
    render(report, console)
    text = console.export_text()
    expected_rows = [
        "phase  batch steps   ms   ms   ms   ms    ms bound idle step gpu-10% cpu-10%",
        "decode     1   100 2.40 2.40 1.21 1.20 1.20*  100%  50%    ?   -5.0%   -5.0%",
    ]
    for row in expected_rows:
        assert row in text, text
    assert (
        "decode @ batch 1: CPU busy 50% of the step; 100% of steps CPU-bound; the thread never waited in 0%; "
        "GPU idle 50% (between steps; inside them unknown: CUDA events only); a 10% faster GPU "
        "step would shorten steps by 5.0%; a 10% faster CPU work per step would shorten steps by 5.0%"
    ) in " ".join(text.split())


def test_narrow_console_drops_what_if_columns_before_cutting_numbers(tmp_path):
    """At 80 columns a report with load levels and two what-ifs does not fit: the what-if columns go (their
    numbers stay in the verdict lines), and the level column and every number survive intact."""
    frames = simulate_timeline(100, mode="sync", cpu_ms=1.0, gpu_ms=1.2, post_ms=0.2)
    starts = frames.steps["start_ns"]
    levels = [
        {"concurrency": 1, "start_ns": int(starts[0]), "end_ns": int(starts[50])},
        {"concurrency": 16, "start_ns": int(starts[50]), "end_ns": int(starts.iloc[-1]) + 10**9},
    ]
    report = build_report(load_run(write_run(tmp_path / "levels", frames, meta={"levels": levels})))
    narrow, wide = (Console(width=w, record=True, color_system=None) for w in (80, 120))
    render(report, narrow)
    render(report, wide)
    narrow_text, wide_text = narrow.export_text(), wide.export_text()
    assert "level phase  batch steps" in narrow_text and "…" not in narrow_text
    assert "   16 decode     1    50 2.40 2.40 1.21 1.20 1.20*  100%" in narrow_text
    assert "gpu-10% cpu-10%" not in narrow_text and "what-if columns left out" in narrow_text
    assert "gpu-10% cpu-10%" in wide_text and "what-if columns left out" not in wide_text


def test_report_prints_disabled_and_failed_hooks_under_the_table(tmp_path, capsys):
    frames = simulate_timeline(40, mode="sync")
    hooks = [
        {"target": "engine:Engine.step", "role": "step", "status": "installed", "reason": "", "pid": 1},
        {"target": "engine:Engine.schedule_v2", "role": "busy", "status": "disabled",
         "reason": "engine has no attribute Engine.schedule_v2", "pid": 1},
        {"target": "engine:Engine.schedule", "role": "busy", "status": "installed",
         "reason": "facts disabled: KeyError: 'num_seqs'", "pid": 1},
        {"target": "engine:Engine.launch", "role": "gpu", "status": "disabled", "reason": "old", "pid": 1},
        {"target": "engine:Engine.launch", "role": "gpu", "status": "installed", "reason": "", "pid": 2},
        {"target": "other:Loop.run", "role": "step", "status": "pending", "reason": "", "pid": 1},
    ]  # fmt: skip
    run = write_run(tmp_path / "hooked", frames, meta={"hooks": hooks})
    report = build_report(load_run(run))
    assert [(p["target"], p["status"]) for p in report["hook_problems"]] == [
        ("engine:Engine.schedule_v2", "disabled"),
        ("engine:Engine.schedule", "failed"),
    ]  # launch is installed in process 2; a pending target is no problem of the hooks
    console = Console(width=200, record=True, color_system=None)
    render(report, console)
    lines = [line.rstrip() for line in console.export_text().splitlines()]
    at = next(i for i, line in enumerate(lines) if line.startswith("hooks disabled or failed"))
    assert lines[at] == (
        "hooks disabled or failed (2): engine:Engine.schedule_v2 (busy) disabled: engine has no attribute "
        "Engine.schedule_v2; engine:Engine.schedule (busy) failed: facts disabled: KeyError: 'num_seqs'"
    )
    # right under the table's last row, before the verdicts
    assert lines[at - 1].startswith("decode") and lines[at + 1].startswith("GPU ms*")
    assert lines[at + 2].startswith("- decode @ batch 1")

    result = overshoot("report", run)
    assert result.returncode == 0, result.stderr
    assert "hooks disabled or failed (2): engine:Engine.schedule_v2 (busy) disabled" in result.stdout
    assert overshoot("report", run, "--json").stdout.count('"status": "disabled"') == 1
    clean = overshoot("report", write_run(tmp_path / "clean", frames, meta={"hooks": hooks[:1]}))
    assert clean.returncode == 0 and "hooks disabled" not in clean.stdout


def test_steps_before_the_first_level_are_warm_up(tmp_path):
    frames = simulate_timeline(100, mode="sync")
    starts = frames.steps["start_ns"]
    levels = [
        {"concurrency": 1, "start_ns": int(starts[20]), "end_ns": int(starts[50])},
        {"concurrency": 2, "start_ns": int(starts[60]), "end_ns": int(starts[95])},
    ]
    run = write_run(tmp_path / "r", frames, meta={"levels": levels})
    out = tmp_path / "steps.csv"
    assert overshoot("export", run, "-o", out).returncode == 0
    window = pd.read_csv(out).set_index("step")["load_window"]
    assert (window.loc[:19] == "warmup").all() and (window.loc[20:49] == "level").all()
    assert (window.loc[50:59] == "outside").all() and (window.loc[95:] == "outside").all()
    result = overshoot("report", run)
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "20 warm-up steps (before the first load level) and 15 steps outside every load level are not" \
        " summarised" in text
    assert "no load level" not in text
    # No step inside any level: the groups are the steps themselves, labelled by their window.
    after = int(starts.iloc[-1])
    late = [{"concurrency": 4, "start_ns": after + 10**9, "end_ns": after + 10**10}]
    report = build_report(load_run(write_run(tmp_path / "late", frames, meta={"levels": late})))
    (group,) = report["groups"]
    assert group["load_window"] == "warmup" and group["title"] == "decode @ warm-up, batch 1"
    console = Console(width=120, record=True, color_system=None)
    render(report, console)
    assert "warm-up decode" in console.export_text()


def test_hygiene_version_sign_width_and_no_negative_zero(tmp_path):
    version = overshoot("--version")
    assert version.returncode == 0 and version.stdout.strip() == "overshoot 0.1.0"
    assert_one_line_error(overshoot("report", tmp_path, "--what-if", "gpu=10"), "give the sign", "gpu=-10%")
    # GPU-bound async steps: a 10% faster CPU buys -0.02%, which must print as 0.0%, not -0.0%
    frames = simulate_timeline(200, mode="async", cpu_ms=0.5, gpu_ms=1.2, post_ms=0.02, jitter=0.3, seed=1)
    starts = frames.steps["start_ns"]
    levels = [
        {"concurrency": 1, "start_ns": int(starts[0]), "end_ns": int(starts[100])},
        {"concurrency": 16, "start_ns": int(starts[100]), "end_ns": int(starts.iloc[-1]) + 10**9},
    ]
    run = write_run(tmp_path / "r", frames, meta={"levels": levels})
    labels = [f"{side}{change}%" for side in ("gpu", "cpu") for change in ("-10", "+10", "-20", "+20")]
    what_ifs = [arg for label in labels for arg in ("--what-if", label.replace("u", "u=", 1))]
    piped = overshoot("report", run, *what_ifs)  # stdout is a pipe: the whole table, not COLUMNS=120 of it
    assert piped.returncode == 0, piped.stderr
    header = next(line for line in piped.stdout.splitlines() if line.startswith("level phase"))
    assert header.split()[-8:] == labels and len(header) > 120
    assert "what-if columns left out" not in piped.stdout
    narrow = overshoot("report", run, *what_ifs, "--width", "80")
    assert "what-if columns left out" in narrow.stdout and max(map(len, narrow.stdout.splitlines()[:6])) <= 80
    compared = overshoot("report", run, "--compare", run)
    for text in (piped.stdout, compared.stdout):
        assert "-0.0" not in text and "-0%" not in text and "0.0%" in text


def test_interrupted_run_says_so_first(tmp_path):
    frames = simulate_timeline(60, mode="sync")
    run = write_run(tmp_path / "r", frames, meta={"status": "interrupted"})
    result = overshoot("report", run)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].startswith("interrupted run (meta.json status 'interrupted')")
    data = build_report(load_run(run))
    assert data["status"] == "interrupted" and data["status_line"].startswith("interrupted run")
    update_meta(run, {"status": "ok"})
    console = Console(width=120, record=True, color_system=None)
    render(build_report(load_run(run)), console)
    assert console.export_text().startswith("verdict: ")  # no status line: the verdict comes first
