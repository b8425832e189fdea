"""`overshoot run` as a user runs it: a real subprocess that starts the real reference server (tiny, CPU) on
127.0.0.1 with hooks, drives load, stops it; then `overshoot report` / `export` on the run dir."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[1]
REFERENCE_TARGETS = {
    "step",
    "schedule",
    "prepare_inputs",
    "launch",
    "wait_for_results",
    "update_requests",
    "wait_for_work",
}


def cli_env() -> dict:
    return {
        **os.environ,
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "COLUMNS": "150",
    }


def overshoot(*args, timeout: float = 150, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "overshoot", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cli_env(),
        cwd=cwd,
    )


def meta_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "meta.json").read_text())


def assert_gone(pid: int) -> None:
    """The server's process was stopped (and reaped by `overshoot run`)."""
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def assert_clean_error(result: subprocess.CompletedProcess, needle: str) -> None:
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    first = result.stderr.strip().splitlines()[0]
    assert first.startswith("overshoot run: error:") and needle in first, result.stderr


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """One embedded-default run shared by the end-to-end checks: levels 1 and 4, 4 requests each, plus an
    extra hook spec whose target was "renamed" (it must disable itself while the server keeps serving)."""
    root = tmp_path_factory.mktemp("sweep")
    renamed = root / "renamed_spec.py"
    renamed.write_text(
        textwrap.dedent("""
        from engine_hooks import EngineSpec, HookTarget
        RENAMED = HookTarget("reference_engine.engine", "Engine.schedule_v2", "busy")
        SPEC = EngineSpec("renamed", (), "", (RENAMED,))
    """)
    )
    run_dir = root / "run"
    result = overshoot(
        "run",
        "--concurrency",
        "1,4",
        "--max-tokens",
        32,
        "--requests",
        4,
        "--prompt-tokens",
        64,
        "--hooks",
        f"{renamed}:SPEC",
        "--out",
        run_dir,
    )
    return run_dir, result


def test_run_end_to_end_reports_and_exports(sweep, tmp_path):
    run_dir, result = sweep
    assert result.returncode == 0, result.stdout + result.stderr
    assert "server ready" in result.stdout and "overshoot report" in result.stdout
    meta = meta_of(run_dir)
    assert meta["status"] == "ok" and meta["exit_status"] == 0 and meta["engine"] == "reference"
    assert meta["async_scheduling"] is False  # the embedded default command has no --async-scheduling
    assert [level["concurrency"] for level in meta["levels"]] == [1, 4]
    assert all(level["start_ns"] < level["end_ns"] for level in meta["levels"])
    assert_gone(meta["server_pid"])

    report = overshoot("report", run_dir)
    assert report.returncode == 0, report.stderr
    assert "decode" in report.stdout
    out = tmp_path / "steps.parquet"
    export = overshoot("export", run_dir, "-o", out)
    assert export.returncode == 0, export.stderr
    steps = pd.read_parquet(out)
    client = pd.read_parquet(run_dir / "client.parquet")

    assert client.groupby("concurrency").size().to_dict() == {1: 4, 4: 4}
    assert client["ok"].all() and (client["completion_tokens"] == 32).all()
    assert (client["ttft_ms"] < client["latency_ms"]).all()
    # One event per token (the reference server, no drafts): 31 gaps per request, percentiles in order.
    assert (client["token_events"] == 32).all() and (client["itl_ms"].map(len) == 31).all()
    assert (client["itl_ms_p50"] <= client["itl_ms_p90"]).all()
    assert (client["itl_ms_p90"] <= client["itl_ms_p99"]).all()
    decode = steps[steps["phase"] == "decode"]
    for level in (1, 4):
        in_level = decode[decode["concurrency"] == level]
        tokens = int(client.loc[client["concurrency"] == level, "completion_tokens"].sum())
        assert level in set(in_level["batch_size"]), in_level["batch_size"].value_counts()
        # Each request's first token comes from its prefill step; the rest need decode steps of <= level rows.
        assert len(in_level) >= (tokens - 4) / level
        assert in_level["batch_size"].max() <= level
    assert (steps["wait_ms"] > 0).any()
    # the prompt calibration and the first level's warm-up requests ran before level 1: warm-up steps
    first = steps.sort_values("start_ns").drop_duplicates("load_window")["load_window"].tolist()
    assert first[:2] == ["warmup", "level"]
    assert steps["concurrency"].isna().eq(steps["load_window"] != "level").all()


def test_first_token_arrives_with_the_prefill_not_later(sweep):
    """TTFT is the first token event, which the prefill step produces: at one request in flight it arrives
    before the request's first decode step ends, i.e. TTFT < queueing + prefill + first decode step (for 3 of
    the 4 requests: a busy 2-core machine may delay one event). Steps and client share the host's clock."""
    run_dir, _ = sweep
    from overshoot.rundir.reader import load_run

    run = load_run(run_dir)
    steps = run.steps.sort_values("start_ns")
    margins = []
    for r in run.client[run.client["concurrency"] == 1].itertuples():
        arrival = r.start_ns + r.ttft_ms * 1e6
        later = steps[steps["start_ns"] >= r.start_ns]
        prefill = later[later["phase"] == "prefill"].iloc[0]
        decode = later[(later["phase"] == "decode") & (later["start_ns"] >= prefill["end_ns"])].iloc[0]
        assert arrival > prefill["start_ns"]
        margins.append(decode["end_ns"] - arrival)  # > 0: TTFT below prefill + first decode step
    assert len(margins) == 4 and sorted(margins)[1] > 0, margins
    report = json.loads(overshoot("report", run_dir, "--json").stdout)
    level = report["client"][0]
    assert level["itl_ms_p50"] <= level["itl_ms_p90"] <= level["itl_ms_p99"]
    assert "ITL" in sweep[1].stdout  # the client table of the run's report


def test_live_view_and_by_label_on_the_real_engine(sweep):
    """The live view's snapshot of the finished run dir is the report's load sweep table; the by-label split
    of each group adds up to its median busy time; piped output got no progress bars."""
    from overshoot.run.live import snapshot

    run_dir, result = sweep
    assert result.returncode == 0 and "━" not in result.stdout
    report = json.loads(overshoot("report", run_dir, "--json").stdout)
    client = pd.read_parquet(run_dir / "client.parquet").to_dict("records")
    rows = snapshot(run_dir, meta_of(run_dir)["levels"], client)
    assert [r["concurrency"] for r in rows] == [1, 4] and rows == report["levels"]
    assert report["crossover"]["phase"] == "decode"
    # no GPU on this CPU engine: no CPU-bound verdict, so no crossover either way
    assert report["crossover"]["text"].startswith("crossover: unknown; ")
    for group in report["groups"]:
        labels = {r["label"] for r in group["busy_by_label"]}
        assert {"schedule", "prepare_inputs", "launch"} <= labels, group["title"]
        split = sum(r["ms"] for r in group["busy_by_label"])
        assert split == pytest.approx(group["busy_ms_median"], rel=1e-9) and split > 0


def test_run_records_spans_and_hook_status(sweep):
    run_dir, result = sweep
    from overshoot.rundir.reader import load_run

    run = load_run(run_dir)
    waits = run.spans[run.spans["kind"] == "wait"]
    assert len(waits) > 0 and set(waits["label"]) == {"wait_for_results"}
    assert {"schedule", "prepare_inputs", "launch", "update_requests"} <= set(run.spans["label"])
    hooks = meta_of(run_dir)["hooks"]
    installed = {h["target"].split("Engine.")[1] for h in hooks if h["status"] == "installed"}
    assert installed == REFERENCE_TARGETS
    # The renamed target: disabled with one clear line, in meta.json, the server log and the run's output.
    renamed = [h for h in hooks if h["target"].endswith("Engine.schedule_v2")]
    assert renamed and all(h["status"] == "disabled" and "not found" in h["reason"] for h in renamed)
    assert "hook reference_engine.engine:Engine.schedule_v2 (busy) disabled" in result.stdout
    # ... and under the report's table, in `overshoot run`'s report and in `overshoot report`'s
    line = "hooks disabled or failed (1): reference_engine.engine:Engine.schedule_v2 (busy) disabled:"
    assert line in " ".join(result.stdout.split())
    report = overshoot("report", run_dir)
    assert report.returncode == 0 and line in " ".join(report.stdout.split()), report.stdout + report.stderr
    log = (run_dir / "server.log").read_text()
    assert log.count("overshoot: hook reference_engine.engine:Engine.schedule_v2") == 1


@pytest.mark.parametrize(
    "sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"]
)
def test_interrupt_mid_load_stops_server_and_keeps_the_run(tmp_path, sig, code):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "overshoot", "run", "--concurrency", "2", "--max-tokens", "8",
         "--requests", "5000", "--warmup", "0", "--out", str(run_dir)],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(),
        cwd=REPO,
    )
    try:
        deadline = time.monotonic() + 120
        url = None
        for line in proc.stdout:  # "server ready after 1.2 s on http://127.0.0.1:PORT"
            if "server ready after" in line:
                url = line.split(" on ")[-1].strip()
                break
        assert url, proc.communicate()
        # Interrupt once the level has completed requests (the engine's counter, not a fixed sleep: a loaded
        # machine may need seconds for the first one) and steps have been flushed.
        while _tokens_generated(url) < 200 or not list((run_dir / "spool").glob("*.steps.*.arrow")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == code, out + err
    assert "interrupted" in err and "Traceback" not in err
    meta = meta_of(run_dir)
    assert meta["status"] == "interrupted" and meta["exit_status"] == code
    assert_gone(meta["server_pid"])
    assert meta["levels"][0]["end_ns"] is not None
    client = pd.read_parquet(run_dir / "client.parquet")
    assert 0 < len(client) < 5000 and client["ok"].all()
    report = overshoot("report", run_dir)
    assert report.returncode == 0, report.stderr
    assert "decode" in report.stdout


def _tokens_generated(url: str) -> int:
    import urllib.request

    with urllib.request.urlopen(f"{url}/stats", timeout=5) as resp:
        return json.load(resp)["engine"]["tokens_generated"]


def test_bad_command_fails_clearly_and_leaves_a_readable_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    result = overshoot("run", "--out", run_dir, "--", tmp_path / "no-such-server", "--port", "{port}")
    assert_clean_error(result, "cannot start the server")
    assert meta_of(run_dir)["status"] == "failed"
    report = overshoot("report", run_dir)
    assert (
        report.returncode != 0 and "Traceback" not in report.stderr and "no steps recorded" in report.stderr
    )


def test_server_exiting_early_shows_its_log(tmp_path, free_port):
    run_dir = tmp_path / "run"
    server = "import sys; print('cannot load model weights'); sys.exit(3)"
    result = overshoot("run", "--out", run_dir, "--port", free_port, "--", sys.executable, "-c", server)
    assert_clean_error(result, "exited with code 3 before it was ready")
    assert "cannot load model weights" in result.stderr
    assert meta_of(run_dir)["exit_status"] == 1


def test_port_in_use(tmp_path, free_port):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", free_port))
        busy.listen()
        result = overshoot(
            "run", "--port", free_port, "--out", tmp_path / "run", "--", sys.executable, "-c", "0"
        )
    assert_clean_error(result, f"port {free_port} on 127.0.0.1 is in use")


def _leave_time_wait(port: int) -> None:
    """A connection on `port` whose listening side closes first: that side's socket stays in TIME_WAIT."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(1)
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = listener.accept()
            accepted.close()  # the active close: this side (local port `port`) goes to TIME_WAIT
            client.recv(1)


def test_literal_port_in_the_command_then_the_same_port_again_at_once(tmp_path, free_port):
    """A server command with `--port N` (no {port}) is watched on N, not on 8000; right after that run its
    port is free for the next one although a connection on it lingers in TIME_WAIT."""
    server = [sys.executable, "-m", "reference_engine", "serve", "--preset", "tiny", "--device", "cpu",
              "--port", str(free_port)]
    first = overshoot("run", "--concurrency", "1", "--requests", "2", "--max-tokens", "8", "--warmup", "0",
                      "--ready-timeout", "60", "--out", tmp_path / "first", "--", *server)
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"on http://127.0.0.1:{free_port}" in first.stdout
    assert meta_of(tmp_path / "first")["options"]["port"] == free_port
    # Whether the run's own connections linger in TIME_WAIT on the port depends on which side closed
    # first; leave one there for certain, so the next run has to see past it.
    _leave_time_wait(free_port)
    with socket.socket() as plain:  # without SO_REUSEADDR the port reads as taken: TIME_WAIT is there
        with pytest.raises(OSError):
            plain.bind(("127.0.0.1", free_port))
    again = overshoot("run", "--port", free_port, "--out", tmp_path / "again", "--", sys.executable, "-c",
                      "import sys; sys.exit(3)")
    assert_clean_error(again, "exited with code 3 before it was ready")  # not "in use"

    mismatch = overshoot("run", "--port", free_port + 1, "--out", tmp_path / "x", "--", *server)
    assert mismatch.returncode == 2 and len(mismatch.stderr.strip().splitlines()) == 1
    assert f"--port {free_port + 1} but the server command says --port {free_port}" in mismatch.stderr
    bad = overshoot("run", "--out", tmp_path / "x", "--", *server[:-1], "http")
    assert bad.returncode == 2 and "the server command's --port 'http' is not a TCP port" in bad.stderr
    assert not (tmp_path / "x").exists()


def test_embedded_default_on_a_gpu_is_one_graph_per_step_with_async_scheduling():
    from overshoot.run.command import async_scheduling_of
    from overshoot.run.launch import default_command
    from reference_engine.__main__ import build_parser

    def parsed(cuda: bool):
        command = default_command(cuda=cuda, max_num_seqs=8, max_model_len=1024)
        argv = [arg.replace("{port}", "8000") for arg in command[command.index("serve"):]]
        return command, build_parser().parse_args(argv)

    command, gpu = parsed(True)
    assert (gpu.preset, gpu.graph, gpu.async_scheduling, gpu.device) == ("qwen3-4b", "step", True, "cuda")
    assert async_scheduling_of(command) is True
    _, cpu = parsed(False)
    assert (cpu.preset, cpu.graph, cpu.async_scheduling) == ("tiny", "eager", False)


def test_ready_timeout_stops_the_silent_server(tmp_path, free_port):
    run_dir = tmp_path / "run"
    silent = "import time; print('loading forever', flush=True); time.sleep(120)"
    started = time.monotonic()
    result = overshoot(
        "run",
        "--port",
        free_port,
        "--ready-timeout",
        2,
        "--stop-timeout",
        5,
        "--out",
        run_dir,
        "--",
        sys.executable,
        "-c",
        silent,
    )
    assert_clean_error(result, "was not ready after 2 s")
    assert "loading forever" in result.stderr
    assert time.monotonic() - started < 30
    assert_gone(meta_of(run_dir)["server_pid"])


def test_bad_options_fail_before_starting_anything(tmp_path):
    result = overshoot("run", "--concurrency", "1,zero", "--out", tmp_path / "run")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--concurrency" in result.stderr.strip().splitlines()[0]
    assert not (tmp_path / "run").exists()
    result = overshoot("run", "--engine", "sglang", "--out", tmp_path / "run")
    assert result.returncode == 2 and "--engine: unknown engine 'sglang'" in result.stderr
    result = overshoot("run", "--hooks", tmp_path / "missing.py:SPEC", "--out", tmp_path / "run")
    assert result.returncode == 2 and "--hooks: no such file" in result.stderr
    result = overshoot("run", "--bogus")
    assert result.returncode == 2 and result.stderr.strip() == "overshoot run: error: no such option: --bogus"
    result = overshoot("run", "--concurency", "2")
    assert "no such option: --concurency (did you mean --concurrency?)" in result.stderr
    assert not (tmp_path / "run").exists()


def test_run_records_async_scheduling_from_the_server_command():
    from overshoot.run.command import REFERENCE_ASYNC_DEFAULT, async_scheduling_of
    from reference_engine.__main__ import build_parser

    assert build_parser().parse_args(["serve"]).async_scheduling is REFERENCE_ASYNC_DEFAULT
    reference = [sys.executable, "-m", "reference_engine", "serve", "--preset", "tiny"]
    assert async_scheduling_of(reference) is REFERENCE_ASYNC_DEFAULT
    assert async_scheduling_of([*reference, "--async-scheduling"]) is True
    assert async_scheduling_of([*reference, "--async-scheduling", "--no-async-scheduling"]) is False
    vllm = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"]
    assert async_scheduling_of(vllm) is None  # vLLM's default is not ours to guess
    assert async_scheduling_of([*vllm, "--async-scheduling"]) is True


def test_case_study_table_runs_each_configuration_under_overshoot(tmp_path):
    """benchmarks/case_study_table.py: one `overshoot run` per configuration, the report's decode group at one
    request per row (tiny, CPU: no GPU times, so GPU idle is n/a and the thread never waits on a GPU)."""
    script = REPO / "benchmarks" / "case_study_table.py"
    done = subprocess.run(
        [sys.executable, script, "--preset", "tiny", "--configs", "eager-torch,step-torch",
         "--max-tokens", "8", "--requests", "2", "--out", tmp_path / "runs",
         "--json", tmp_path / "rows.json"],
        capture_output=True, text=True, timeout=300, env=cli_env(), cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["name"] for r in rows] == ["eager-torch", "step-torch"]
    for row in rows:
        assert row["steps"] >= 8 and row["step_ms_median"] > 0 and row["gpu_idle_pct"] is None
        # no GPU data on the CPU: the verdict is unknown, not "CPU-bound"; the thread's own view is known
        assert row["cpu_bound_pct"] is None and row["gpu_timing"] == "none"
        assert 0 <= row["thread_never_waited_pct"] <= 100 and row["tok_s_per_request"] > 0
        assert (tmp_path / "runs" / row["name"] / "meta.json").exists()
    # --graph step on a CPU is served eager, and the server says so once at start-up
    notes = [line for line in (tmp_path / "runs" / "step-torch" / "server.log").read_text().splitlines()
             if "no CUDA graph is captured" in line]
    assert len(notes) == 1 and "--graph step needs CUDA: on cpu every step runs eager" in notes[0]
    table = done.stdout.splitlines()
    assert any(line.startswith("| no graphs, torch kernels | ") and "| n/a |" in line for line in table)
    assert any(line.startswith("| one graph per step, torch | ") for line in table)
    bad = subprocess.run([sys.executable, script, "--configs", "eager-fast"], capture_output=True, text=True,
                         timeout=60, env=cli_env())
    assert bad.returncode == 2 and "unknown configuration ['eager-fast']" in bad.stderr


def test_hook_overhead_pairs_rounds_and_times_every_decode_step_of_each_way(tmp_path):
    """benchmarks/hook_overhead.py on the CPU (tiny, eager): plain and hooked rounds alternate; every way's
    decode steps are stamped (each round's prefill and first decode left out), so each mode reports its
    median step against plain's; the hooked recorder saw every decode step of its rounds."""
    rounds, tokens = 3, 8
    done = subprocess.run(
        [sys.executable, REPO / "benchmarks" / "hook_overhead.py", "--preset", "tiny",
         "--configs", "eager-torch", "--modes", "events,off", "--batches", "1", "--tokens", str(tokens),
         "--rounds", str(rounds), "--out", tmp_path],
        capture_output=True, text=True, timeout=300, env=cli_env(), cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads((tmp_path / "hook_overhead.json").read_text())["results"][0]["rows"][0]
    assert row["rounds_done"] == rounds and row["step_us"] > 0
    for mode in ("events", "off"):
        cost = row["modes"][mode]
        # a round of 8 tokens: 8 steps (prefill + 7 decodes), 7 durations between their starts, the first two
        # (prefill, first decode) not counted; the first hooked round's warm-up generation not either
        assert cost["steps"] == rounds * (tokens - 3), cost
        assert cost["step_us"] > 0
        assert cost["step_delta_us"] == pytest.approx(cost["step_us"] - row["step_us"])
        assert cost["run"]["decode_steps"] >= rounds * (tokens - 1)
        assert cost["step_delta_low_pct"] <= cost["step_delta_high_pct"]
    assert "median step" in done.stdout
    # sampled mode's cost as its two noise-free parts: the median step's shift and the windows' own account
    sys.path.insert(0, str(REPO / "benchmarks"))
    from hook_overhead import decomposed

    sampled = {"step_delta_pct": 0.5, "step_delta_low_pct": 0.2, "step_delta_high_pct": 0.9,
               "run": {"accounted": 0.003}}
    assert decomposed(sampled) == ", decomposed +0.80% [+0.50, +1.20] (median step + windows)"
    assert decomposed({**sampled, "run": {"accounted": None}}) == ""
    # the shift paired by round: plain rounds drifting 2.0 -> 3.0 ms a step, each mode round 1% above the
    # plain round of its rotation, so every round reads 1% whatever the drift
    from hook_overhead import round_step_cost

    plain = [[2000.0 + 100 * i + j for j in range(5)] for i in range(11)]
    hooked = [[v * 1.01 for v in one] for one in plain]
    paired = round_step_cost(plain, hooked)
    assert paired["paired_delta_pct"] == pytest.approx(1.0) and paired["paired_rounds"] == 11
    assert paired["paired_low_pct"] == pytest.approx(1.0) and paired["paired_high_pct"] == pytest.approx(1.0)
    assert paired["paired_delta_us"] == pytest.approx(25.02)  # 1% of the middle round's median step
    assert decomposed({**sampled, **paired}) == (
        ", decomposed +1.30% [+1.30, +1.30] (median step paired by round + windows)")
    assert round_step_cost(plain[:2], hooked[:2]) == {}  # too few rounds: the pooled shift stands
    # the host's clock read cost beside the figures it explains (the hooks read it ~15 times a step)
    clock = json.loads((tmp_path / "hook_overhead.json").read_text())["host_clock"]
    assert 0 < clock["perf_counter_ns_ns"] < 100_000
    assert f"perf_counter_ns() {clock['perf_counter_ns_ns']:.0f} ns a call" in done.stdout


@pytest.mark.parametrize("drafter", ["host", "device"])
def test_run_records_the_drafts_of_a_speculating_engine(tmp_path, drafter):
    """A reference server with --spec-tokens: each decode step's spec_tokens (drafts verified) lands in the
    steps table, and num_tokens counts them (batch rows + drafts). The device drafter runs inside the step
    with async scheduling: k draft rows a sequence every decode step."""
    run_dir = tmp_path / "spec"
    device = ["--drafter", "device", "--async-scheduling"] if drafter == "device" else []
    result = overshoot(
        "run", "--concurrency", "1", "--max-tokens", "48", "--requests", "2", "--out", run_dir, "--",
        sys.executable, "-m", "reference_engine", "serve", "--preset", "tiny", "--spec-tokens", "4", *device,
        "--port", "{port}",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = tmp_path / "steps.parquet"
    assert overshoot("export", run_dir, "-o", out).returncode == 0
    decode = pd.read_parquet(out).query("phase == 'decode'")
    assert (decode["spec_tokens"] > 0).any() and decode["spec_tokens"].max() <= 4
    if drafter == "device":
        assert (decode["spec_tokens"] == 4 * decode["batch_size"]).all()
    assert (decode["num_tokens"] == decode["batch_size"] + decode["spec_tokens"]).all()
    report = overshoot("report", run_dir, "--json")
    groups = [g for g in json.loads(report.stdout)["groups"] if g["phase"] == "decode"]
    assert groups and all(0 < g["spec_tokens_mean"] <= 4 for g in groups)
    assert all(0 <= g["accepted_tokens_mean"] <= g["spec_tokens_mean"] for g in groups)
    steps = pd.read_parquet(out)
    decode = steps.query("phase == 'decode'")
    # Async scheduling: a step's update_requests consumes the step before's results, so the first decode step
    # (which consumed the prefill's) records no accepted count.
    assert (decode["accepted_tokens"].fillna(0) <= decode["spec_tokens"]).all()
    assert decode["accepted_tokens"].notna().mean() > 0.9  # all but each request's first decode step
    assert "drafts" in overshoot("report", run_dir).stdout  # the terminal table's drafts/step column
    if drafter == "device":
        return
    bad = subprocess.run([sys.executable, "-m", "reference_engine", "serve", "--spec-tokens", "4", "--graph",
                          "step"], capture_output=True, text=True, timeout=60, env=cli_env())
    assert bad.returncode == 2 and "host drafter needs graph 'eager'" in bad.stderr.strip().splitlines()[-1]
    bad = subprocess.run([sys.executable, "-m", "reference_engine", "serve", "--spec-tokens", "4",
                          "--drafter", "gpu"], capture_output=True, text=True, timeout=60, env=cli_env())
    assert bad.returncode == 2 and "invalid choice: 'gpu'" in bad.stderr.strip().splitlines()[-1]
