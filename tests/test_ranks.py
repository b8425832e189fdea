"""Multi-rank engines on a timeline whose answer is set: an engine core and two tensor-parallel workers,
rank 1 computing a fixed time longer each step (the others wait for it in collectives), read back through
load_run, the report (--json, the terminal) and the dataset export, with the clock alignment's bounds."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from run_factory import Frames, KernelTimeline, simulate_timeline, write_kernel_run, write_run

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


KERNELS_A_STEP, KERNEL_FILL, KERNEL_OFFSET_MS = 8, 0.75, 0.02


def _rank_kernels(sent: int, compute_ns: float, meet: int) -> list[tuple]:
    """A rank's kernels of one step: KERNELS_A_STEP evenly spaced over its compute, each KERNEL_FILL of its
    slot (the first KERNEL_OFFSET_MS after the step's start, each launched 5 µs before it starts), then the
    all-reduce's kernel until the ranks meet (NCCL's kernel runs while the rank waits: GPU busy)."""
    slot = compute_ns / KERNELS_A_STEP
    rows = []
    for j in range(KERNELS_A_STEP):
        start = sent + int(KERNEL_OFFSET_MS * MS + j * slot)
        end = start + int(KERNEL_FILL * slot)
        rows.append(("kernel", "gemm", 7, 0, start - 5_000, start - 2_000, start, end))
    if meet > sent + compute_ns:
        start = sent + int(compute_ns)
        rows.append(("kernel", "allreduce", 7, 0, start - 5_000, start - 2_000, start, meet))
    return rows


def write_tp_run(path, *, worker_clock_shift_ns: int = 0, worker_boot: str = BOOT, kernels: bool = False,
                 windows: dict[int, tuple[int, int]] | None = None) -> None:
    """Engine core pid 100; workers pid 101 (rank 0) and 102 (rank 1). Each engine step schedules, sends
    the step to both workers and waits for rank 0's reply. A worker step: execute_model, in which it
    computes and then meets the other rank in one all-reduce; rank 1 computes STRAGGLE_MS longer.
    `worker_clock_shift_ns`: the workers' monotonic clocks read that much later (another host). `kernels`:
    each worker records its kernels (_rank_kernels), over the whole run or, with `windows` {rank: (first
    step, last step)}, in a kernel-timing window of its own from the first step's start to the step after
    the last one's start."""
    core_steps, core_spans, workers, gpus = [], [], {0: ([], []), 1: ([], [])}, {0: [], 1: []}
    launched = {0: [], 1: []}
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
            launched[rank] += _rank_kernels(sent + shift, compute[rank], meet + shift)
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
        clock = _clock(-worker_clock_shift_ns, boot=worker_boot)
        options = dict(pid=101 + rank, extra=facts, info={"clock": clock})
        worker = frames(steps, spans, gpus[rank])
        if not kernels:
            write_run(path, worker, **options)
            continue
        own = None
        if windows is not None:  # from the first step's start to the start of the step after the last
            first, last = windows[rank]
            own = [(steps[first][1], steps[last + 1][1])]
        table = pd.DataFrame(launched[rank], columns=BASE_SCHEMAS["kernels"].names)
        write_kernel_run(path, KernelTimeline(worker, table, *([np.zeros(0)] * 3)), windows=own, **options)


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


def _rank_truth() -> dict[int, dict]:
    """Each rank's GPU over a steady step cycle (one step's start to the next's), from write_tp_run's
    construction: the period, the GPU busy (its compute kernels, rank 0's all-reduce kernel while it waits
    for rank 1) and the idle by what the worker was in: gaps between compute kernels inside execute_model,
    the 0.3 ms after the ranks met (in the collective's wait span), 0.1 ms of the step after the span, and
    the rest of the cycle between its steps (the engine core's update, schedule and dispatch)."""
    period = 0.5 + DISPATCH_MS + COMPUTE_MS + STRAGGLE_MS + 0.3 + DISPATCH_MS + 0.2
    out = {}
    for rank, compute in ((0, COMPUTE_MS), (1, COMPUTE_MS + STRAGGLE_MS)):
        busy = KERNEL_FILL * compute + (COMPUTE_MS + STRAGGLE_MS - compute)
        labels = {"execute_model": (1 - KERNEL_FILL) * compute, "wait:collective": 0.3, "unlabelled": 0.1,
                  "between_steps": period - (COMPUTE_MS + STRAGGLE_MS + 0.3 + 0.1)}
        assert sum(labels.values()) == pytest.approx(period - busy)
        out[rank] = {"period": period, "busy": busy, "labels": labels}
    return out


@pytest.mark.parametrize("windows", [None, {0: (10, 19), 1: (30, 39)}], ids=["whole", "own-windows"])
def test_each_rank_gpu_busy_idle_and_where_it_idled(tmp_path, windows):
    """Each worker's kernels on its own GPU: per rank, GPU busy a step cycle, its idle share and what the
    worker was in while its GPU idled, against the construction's truth. With windows of each rank's own that
    never overlap, the engine core's steps have no instrumented step (they need every rank's kernels), while
    each rank still has its own figures."""
    write_tp_run(tmp_path, kernels=True, windows=windows)
    report = json.loads(subprocess.run([sys.executable, "-m", "overshoot", "report", str(tmp_path), "--json"],
                                       capture_output=True, text=True, check=True).stdout)
    (group,) = report["ranks"]
    truth = _rank_truth()
    for r in group["per_rank"]:
        t = truth[r["rank"]]
        known = STEPS if windows is None else 10
        assert r["gpu_cycles"] == known
        assert r["gpu_busy_ms"] == pytest.approx(t["busy"], abs=1e-3)
        # rank 0's all-reduce kernel runs the 3 ms it waits for rank 1; rank 1 never waits
        assert r["collective_kernels_ms"] == pytest.approx(STRAGGLE_MS if r["rank"] == 0 else 0.0, abs=1e-3)
        # (the first known cycle counts from its first kernel on, the run's last to its last kernel's end)
        assert r["gpu_idle_pct"] == pytest.approx(100 * (1 - t["busy"] / t["period"]), abs=1.0)
        got = {x["label"]: x for x in r["gpu_idle_by_label"]}
        assert got.keys() == t["labels"].keys()
        idle = sum(t["labels"].values())
        for label, ms in t["labels"].items():
            assert got[label]["ms"] == pytest.approx(ms, abs=1e-3), (r["rank"], label)
            assert got[label]["share_pct"] == pytest.approx(100 * ms / idle, abs=1.5), (r["rank"], label)
    assert group["per_rank"][1]["gpu_idle_by_label"][0]["label"] == "execute_model"  # 1.75 of 3.15 ms idle
    # (the figures checked above; here the line names the least and the most idle rank and where)
    idle = [r["gpu_idle_pct"] for r in group["per_rank"]]
    said = (f"decode @ batch 4, each rank's own GPU: idle {idle[0]:.0f}% (rank 0) to {idle[1]:.0f}% (rank 1) "
            "of its step cycle; rank 1's GPU idles most while its worker is in 'execute_model' (56% of its "
            "idle)")
    assert report["top_lines"][-1] == said, report["top_lines"]
    (engine,) = report["groups"]
    if windows is None:  # the engine core's step: any GPU busy, the union of both ranks' kernels
        assert engine["gpu_timing"] == "kernels"
    else:
        assert engine["gpu_timing"] != "sampled" and engine.get("gpu_busy_ms_median") is None
    text = subprocess.run([sys.executable, "-m", "overshoot", "report", str(tmp_path), "--width", "160"],
                          capture_output=True, text=True, check=True).stdout
    assert "per rank GPU, from each rank's own kernel records" in text, text
    lines = [" ".join(line.split()) for line in text.splitlines()]
    cycles = STEPS if windows is None else 10
    # (rank 0: execute_model and between_steps tie at 42%)
    assert any(line.startswith(f"decode @ batch 4 0 {cycles} 6.00 3.00 ") for line in lines), text
    assert f"1 {cycles} 5.25 0.00 37% execute_model 56%" in lines, text
    out = tmp_path / "ranks.parquet"
    subprocess.run([sys.executable, "-m", "overshoot", "export", str(tmp_path), "--what", "ranks", "-o",
                    str(out)], capture_output=True, check=True)
    table = pd.read_parquet(out)
    busy = table.dropna(subset=["gpu_busy_ms"]).groupby("rank")["gpu_busy_ms"]
    # (known whole: all but the first cycle of a window, and the whole run's last one)
    assert busy.size().to_dict() == ({0: STEPS - 2, 1: STEPS - 2} if windows is None else {0: 9, 1: 9})
    assert busy.median().to_numpy() == pytest.approx([truth[0]["busy"], truth[1]["busy"]], abs=1e-3)
    assert (table["cycle_ms"].iloc[:-1] > 0).all() and str(table["known_ms"].dtype) == "float64"
    collective = table.dropna(subset=["collective_kernels_ms"]).groupby("rank")["collective_kernels_ms"]
    assert collective.median().to_numpy() == pytest.approx([STRAGGLE_MS, 0.0], abs=1e-3)
    apart = "the kernel-timing windows of the 2 processes that launched kernels never overlapped"
    assert (apart in " ".join(text.split())) == (windows is not None), text


def test_ranks_without_kernel_records_show_no_gpu_table(tmp_path):
    write_tp_run(tmp_path)
    report = json.loads(subprocess.run([sys.executable, "-m", "overshoot", "report", str(tmp_path), "--json"],
                                       capture_output=True, text=True, check=True).stdout)
    for r in report["ranks"][0]["per_rank"]:
        figures = (r["gpu_cycles"], r["gpu_busy_ms"], r["gpu_idle_pct"], r["gpu_idle_by_label"],
                   r["collective_kernels_ms"])
        assert figures == (0, None, None, [], None)
    text = subprocess.run([sys.executable, "-m", "overshoot", "report", str(tmp_path), "--width", "160"],
                          capture_output=True, text=True, check=True).stdout
    assert "per rank GPU" not in text


def _tp_process(role: str, run_dir: str, steps: int, barriers, slowdown: float) -> None:
    """One process of a two-rank engine through the real Recorder: the engine core (schedules, hands the step
    to the workers, waits for them, updates) or a worker (runs it: four launches on a virtual device, each
    kernel recorded while its KernelSampler's window is on; a collector that slows the launches by
    `slowdown` while on). Steps meet at `barriers` (start, done)."""
    from synthetic_engine import spin, spin_until
    from test_kernel_timing import VirtualCollector

    from overshoot import Recorder
    from overshoot.record.kernel_timing import KernelSampler

    start, done = barriers
    if role == "core":
        rec = Recorder(run_dir, engine="tp-core")
        for _ in range(steps):
            rec.step_begin(batch_size=4, num_tokens=4, phase="decode")
            with rec.busy("schedule"):
                spin(60_000)
            with rec.wait("worker_result"):
                start.wait()
                done.wait()
            with rec.busy("update_from_output"):
                spin(40_000)
        rec.step_end()
        rec.close()
        return
    rank = int(role)
    rec = Recorder(run_dir, engine="tp-worker")
    device = VirtualCollector()
    rec._sampler = KernelSampler(rec, device, window_steps=8, min_gap=64, budget=0.05, drain_seconds=0.05)
    gpu_free = 0
    for i in range(steps):
        start.wait()
        rec.step_begin(batch_size=4, num_tokens=4, phase="decode", rank=rank, world_size=2)
        if i == 0:  # as the hooks do after a worker's first step: its parallel layout
            rec.process_facts(rank=rank, world_size=2)
        with rec.busy("execute_model"):
            for _ in range(4):
                gpu_free = device.launch(gpu_free)
                if device.on:
                    spin(int(slowdown * 30_000))
            spin_until(gpu_free)
        rec.step_end()
        done.wait()
    rec.close()


def test_ranks_in_lockstep_give_the_engine_core_instrumented_steps_end_to_end(tmp_path):
    """Three processes through the real Recorder and KernelSampler: an engine core and two workers whose
    collectors cost differently (launches 10% and 40% slower while on). The workers get their parallel
    layout as process facts, sample in lockstep and say so; most steps either rank instrumented are
    instrumented on both, so the engine core's steps (which need both ranks' kernels) get kernel data, and
    each rank's own GPU figures come from its own windows."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")  # (a fork of a process with threads can deadlock)
    barriers = (context.Barrier(3), context.Barrier(3))
    steps = 1_500
    run_dir = str(tmp_path / "run")
    procs = [context.Process(target=_tp_process, args=(role, run_dir, steps, barriers, slow))
             for role, slow in (("core", 0.0), ("0", 0.1), ("1", 0.4))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    run = load_run(tmp_path / "run")
    timing = {p["rank"]: p["kernel_timing"] for p in run.processes if "rank" in p}
    assert timing[0]["lockstep"] is True and timing[1]["lockstep"] is True
    summary = summarize(run)
    assert summary.primary[0] == next(p["pid"] for p in run.processes if p["engine"] == "tp-core")
    windows = run.kernel_windows
    per_rank = summary.ranks.per_rank
    known = per_rank.dropna(subset=["known_ms"]).groupby("rank").size()
    assert (known >= 40).all(), known
    # the engine core's instrumented steps: inside both ranks' windows
    (group,) = summary.groups.to_dict("records")
    assert group["kernel_steps"] >= 0.75 * known.min(), (group["kernel_steps"], known.to_dict(), len(windows))
    busy = per_rank.dropna(subset=["gpu_busy_ms"]).groupby("rank")["gpu_busy_ms"].median()
    assert (busy > 0.07).all() and (busy < 0.2).all(), busy  # four 20 µs kernels a step, gaps between
