"""Multi-rank engines on a timeline whose answer is set: an engine core and two tensor-parallel workers,
rank 1 computing a fixed time longer each step (the others wait for it in collectives), read back through
load_run, the report (--json, the terminal) and the dataset export, with the clock alignment's bounds."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest
from run_factory import Frames, simulate_timeline, write_run

from overshoot.analysis.analyze import summarize
from overshoot.rundir.clocks import align, resolved
from overshoot.rundir.reader import load_run
from overshoot.rundir.spool import BASE_SCHEMAS

STEPS, COMPUTE_MS, STRAGGLE_MS, DISPATCH_MS = 60, 4.0, 3.0, 0.2
MS = 1_000_000
BOOT = "boot-a"


def _clock(offset_ns: int, *, boot: str = BOOT, error_ns: int = 50, slew_ns: int = 0) -> dict:
    """Process clock samples: wall = monotonic + offset (the second sample slewed)."""
    return {"boot_id": boot, "samples": [
        {"mono_ns": 1_000, "wall_ns": 1_000 + offset_ns, "error_ns": error_ns},
        {"mono_ns": 9 * 10**9, "wall_ns": 9 * 10**9 + offset_ns + slew_ns, "error_ns": error_ns}]}


def write_tp_run(path, *, worker_clock_shift_ns: int = 0, worker_boot: str = BOOT) -> None:
    """Engine core pid 100; workers pid 101 (rank 0) and 102 (rank 1). Each engine step schedules, sends
    the step to both workers and waits for rank 0's reply. A worker step: execute_model, in which it
    computes and then meets the other rank in one all-reduce; rank 1 computes STRAGGLE_MS longer.
    `worker_clock_shift_ns`: the workers' monotonic clocks read that much later (another host)."""
    core_steps, core_spans, workers, gpus = [], [], {0: ([], []), 1: ([], [])}, {0: [], 1: []}
    t = 10**10
    for i in range(STEPS):
        begin = t
        core_spans.append((i, "busy", "schedule", t, int(0.5 * MS)))
        t += int(0.5 * MS)
        sent = t + int(DISPATCH_MS * MS)
        compute = {0: COMPUTE_MS * MS, 1: (COMPUTE_MS + STRAGGLE_MS) * MS}
        meet = sent + max(compute.values())
        for rank, (steps, spans) in workers.items():
            shift = worker_clock_shift_ns
            end = meet + int(0.3 * MS)
            waited = int(meet - sent - compute[rank]) + int(0.3 * MS)
            spans.append((i, "busy", "execute_model", sent + shift, end - sent))
            spans.append((i, "wait", "collective", sent + int(compute[rank]) + shift, waited))
            steps.append((i, sent + shift, end + int(0.1 * MS) + shift, waited, None, 8, None))
            gpus[rank].append((i, sent + int(0.1 * MS) + shift, meet + shift))
        reply = meet + int(0.3 * MS) + int(DISPATCH_MS * MS)
        core_spans.append((i, "wait", "worker_result", t, reply - t))
        t = reply + int(0.2 * MS)
        core_spans.append((i, "busy", "update_from_output", reply, int(0.2 * MS)))
        core_steps.append((i, begin, t, reply - (begin + int(0.5 * MS)), 4, 8, "decode"))
    names = BASE_SCHEMAS["steps"].names

    def frames(steps, spans, gpu=()) -> Frames:
        return Frames(pd.DataFrame(steps, columns=names),
                      pd.DataFrame(spans, columns=BASE_SCHEMAS["spans"].names),
                      pd.DataFrame(list(gpu), columns=BASE_SCHEMAS["gpu"].names))

    write_run(path, frames(core_steps, core_spans), pid=100, info={"clock": _clock(0)})
    for rank, (steps, spans) in workers.items():
        facts = {"rank": [rank] * STEPS, "world_size": [2] * STEPS, "tp": [2] * STEPS}
        write_run(path, frames(steps, spans, gpus[rank]), pid=101 + rank, extra=facts,
                  info={"clock": _clock(-worker_clock_shift_ns, boot=worker_boot)})


def test_the_straggler_and_what_it_cost_are_found_from_per_rank_steps(tmp_path):
    write_tp_run(tmp_path)
    summary = summarize(load_run(tmp_path))
    assert summary.primary == (100, "engine")  # the engine core, though the workers step as often
    ranks = summary.ranks
    assert len(ranks.per_rank) == 2 * STEPS and ranks.per_rank["tokens_match"].all()
    group = ranks.groups.iloc[0]
    assert group["slowest_rank"] == 1 and group["slowest_pct"] == 100
    assert group["imbalance_ms_median"] == pytest.approx(STRAGGLE_MS, abs=1e-6)
    per = group["per_rank"]
    assert per[0]["collective_ms"] - per[1]["collective_ms"] == pytest.approx(STRAGGLE_MS, abs=1e-6)
    assert per[1]["compute_ms"] == pytest.approx(COMPUTE_MS + STRAGGLE_MS, abs=1e-6)
    # each rank's GPU interval stays on its step, and the engine step gets first start .. last end
    assert ranks.per_rank["gpu_ms"].to_numpy() == pytest.approx(COMPUTE_MS + STRAGGLE_MS - 0.1)
    assert summary.steps["gpu_ms"].to_numpy() == pytest.approx(COMPUTE_MS + STRAGGLE_MS - 0.1)
    # both ranks leave the all-reduce together: a spread of zero, within its bound (one boot: 2 x 50 ns)
    assert group["spread_ms_median"] == pytest.approx(0.0, abs=1e-9) and group["unresolved_pct"] == 100
    assert group["spread_error_ms"] == pytest.approx(100e-6)


def test_workers_on_another_clock_are_aligned_with_a_bound(tmp_path):
    shift = 7 * 10**9  # the workers' monotonic clock reads 7 s later; the wall clocks agree
    write_tp_run(tmp_path, worker_clock_shift_ns=shift, worker_boot="boot-b")
    run = load_run(tmp_path)
    alignment = align(run.processes, 100)
    assert alignment[101].offset_ns == -shift and alignment[101].basis.startswith("wall clock")
    assert alignment[101].error_ns == 100  # both brackets; no slew
    ranks = summarize(run).ranks
    # on the engine core's clock each worker finishes before the reply it sends
    finish = ranks.per_rank.set_index(["step", "rank"])["finish_ns"]
    core = run.spans[(run.spans["pid"] == 100) & (run.spans["label"] == "worker_result")].set_index("step")
    reply = core["start_ns"] + core["dur_ns"]
    assert (finish.xs(0, level="rank") < reply.to_numpy()).all()
    assert (reply.to_numpy() - finish.xs(0, level="rank") < 1 * MS).all()


def test_clock_bounds():
    processes = [{"pid": 1, "clock": _clock(0)}, {"pid": 2, "clock": _clock(5, boot="x", slew_ns=400)},
                 {"pid": 3, "clock": _clock(0)}, {"pid": 4}]
    a = align(processes, 1)
    assert a[3].offset_ns == 0 and a[3].error_ns == 50 and a[3].basis == "shared monotonic"
    assert a[2].offset_ns == 205 and a[2].error_ns == 50 + 50 + 400  # mean offset; slew in the bound
    assert a[4].error_ns is None and a[4].basis == "unknown"
    assert resolved(600, 500) and not resolved(400, 500) and not resolved(10**9, None)


def test_report_json_terminal_and_dataset(tmp_path):
    run_a, run_b = tmp_path / "run-a", tmp_path / "run-b"
    write_tp_run(run_a)
    write_tp_run(run_b)
    cli = [sys.executable, "-m", "overshoot"]
    report = json.loads(subprocess.run([*cli, "report", str(run_a), "--json"], capture_output=True, text=True,
                                       check=True).stdout)
    (group,) = report["ranks"]
    assert group["slowest_rank"] == 1 and [r["rank"] for r in group["per_rank"]] == [0, 1]
    text = subprocess.run([*cli, "report", str(run_a), "--width", "140"], capture_output=True, text=True,
                          check=True).stdout
    assert "per rank" in text and "rank 1" in text
    dataset = tmp_path / "ds"
    for run in (run_a, run_b, run_a):  # a run exported again replaces its own partitions
        subprocess.run([*cli, "export", str(run), "--dataset", str(dataset)], capture_output=True, check=True)
    steps = pd.read_parquet(dataset / "steps")
    counts = steps.groupby(["run", "rank"], observed=True).size()
    assert counts.to_dict() == {(r, k): STEPS for r in ("run-a", "run-b") for k in (-1, 0, 1)}
    ranks = pd.read_parquet(dataset / "ranks")
    assert len(ranks) == 2 * 2 * STEPS and set(ranks["rank"].astype(int)) == {0, 1}
    bad = subprocess.run([*cli, "export", str(run_a)], capture_output=True, text=True)
    assert bad.returncode != 0 and "--output FILE or --dataset DIR" in bad.stderr
    out = tmp_path / "r.parquet"
    single = subprocess.run([*cli, "export", str(run_a), "--what", "ranks", "-o", str(out)],
                            capture_output=True, text=True)
    assert single.returncode == 0 and len(pd.read_parquet(out)) == 2 * STEPS
    one_rank = tmp_path / "one-rank"
    write_run(one_rank, simulate_timeline(20))
    refused = subprocess.run([*cli, "export", str(one_rank), "--what", "ranks", "-o", str(out)],
                             capture_output=True, text=True)
    assert refused.returncode == 1 and refused.stderr.strip().splitlines() == [
        "overshoot export: error: --what ranks: this run has no per-rank steps (a single-rank engine)"]
