"""GPU truth inside the step, proven against set durations and an independent kernel timeline (issue 21).

    python benchmarks/gpu_truth.py synthetic [--steps 300] [--out DIR]     # needs CUDA
    python benchmarks/gpu_truth.py engine --flags="--graph eager --kernels torch" [--batch 1]   # one config

synthetic: an engine loop whose GPU work is `torch.cuda._sleep` kernels of set durations and whose CPU work is
busy-spins of set lengths between the launches, sync (each step waits for its own work) and async (for the
previous step's), from launch-bound to GPU-bound. Recorded through the Recorder with kernel timing (CUPTI);
overshoot's per-step GPU busy, idle share and CPU-bound share are compared with (a) the settings and (b)
torch.profiler's kernel timeline of the same loop in a separate process (one CUPTI client per process). The
what-ifs are compared with actual reruns with kernels 10% shorter and with the CPU's spins 10% shorter.

engine: the reference engine in-process, greedy decode at a fixed batch: median decode step of plain steps
(no instrumentation) and torch.profiler's kernel busy time per decode step (union of kernel/copy intervals
over the profiled generation / its decode steps), hence the GPU idle share 1 - busy / step. This is the
independent measurement case_study_table.py prints beside overshoot's figures. Prints JSON on stdout.

Prints a table last; writes gpu_truth.json under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

# name: kernels a step, kernel us, CPU spin us between launches, CPU us before the launches, after the wait
CASES = {
    "launch-bound": dict(kernels=40, kernel_us=5.0, gap_us=25.0, pre_us=150.0, post_us=100.0),
    "mixed": dict(kernels=40, kernel_us=25.0, gap_us=20.0, pre_us=100.0, post_us=50.0),
    "gpu-bound": dict(kernels=40, kernel_us=60.0, gap_us=2.0, pre_us=100.0, post_us=50.0),
}


def spin(us: float) -> None:
    end = time.perf_counter_ns() + int(us * 1e3)
    while time.perf_counter_ns() < end:
        pass


def cycles_per_us() -> float:
    """torch.cuda._sleep cycles per microsecond on this GPU (events around a long sleep)."""
    import torch

    torch.cuda._sleep(1_000_000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rates = []
    for _ in range(5):
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        rates.append(10_000_000 / (start.elapsed_time(end) * 1e3))
    return statistics.median(rates)


def engine_loop(rec, *, mode: str, steps: int, kernels: int, kernel_us: float, gap_us: float, pre_us: float,
                post_us: float, cycles: float, profiler=None, lead_s: float = 0.0) -> int:
    """The synthetic engine. `rec` may be None (plain); `profiler` steps once per step when given. With
    `lead_s`, the loop first runs unobserved-by-kernels steps until the recorder's kernel timing is set up
    (at most `lead_s` seconds), then `steps` more: the steps before its first window are its plain
    reference (what the collector costs each launch), as in a served engine's first fraction of a second.
    Returns how many steps ran before it was ready."""
    import torch

    stream = torch.cuda.current_stream()
    sleep_cycles = int(kernel_us * cycles)
    pending = None
    lead_until = time.perf_counter() + lead_s if rec and lead_s else 0.0
    done_steps = lead_steps = 0
    while done_steps < steps:
        if lead_until and (rec.kernel_timing_state() == "ready" or time.perf_counter() > lead_until):
            lead_until = 0.0
        done_steps += not lead_until
        lead_steps += bool(lead_until)
        if rec:
            rec.step_begin(batch_size=1, num_tokens=1, phase="decode")
            rec.busy_begin("schedule")
        spin(pre_us)
        if rec:
            rec.busy_end()
            rec.gpu_begin(stream)
            rec.busy_begin("launch")
        for _ in range(kernels):
            torch.cuda._sleep(sleep_cycles)
            spin(gap_us)
        done = torch.cuda.Event()
        done.record(stream)
        if rec:
            rec.busy_end()
            rec.gpu_end(stream)
        awaited = done if mode == "sync" else pending
        pending = done
        if awaited is not None:
            if rec:
                rec.wait_begin("gpu")
            awaited.synchronize()
            if rec:
                rec.wait_end()
        if rec:
            rec.busy_begin("update")
        spin(post_us)
        if rec:
            rec.busy_end()
        if profiler is not None:
            profiler.step()
    if pending is not None:
        pending.synchronize()
    if rec:
        rec.step_end()
    return lead_steps


def run_case(rec, case: str, mode: str, steps: int, cycles: float, *, gpu: float = 1.0,
             cpu: float = 1.0, lead_s: float = 0.0) -> int:
    """`steps` steps of a case's loop, its kernels scaled by `gpu` and its CPU spins by `cpu`."""
    p = CASES[case]
    return engine_loop(rec, mode=mode, steps=steps, kernels=p["kernels"], kernel_us=p["kernel_us"] * gpu,
                       gap_us=p["gap_us"] * cpu, pre_us=p["pre_us"] * cpu, post_us=p["post_us"] * cpu,
                       cycles=cycles, lead_s=lead_s)


def recorded(case: str, mode: str, args, cycles: float, *, gpu_timing: str) -> dict:
    """One recorded run; overshoot's figures for its steps (the first 20 dropped as warm-up)."""
    from overshoot import Recorder
    from overshoot.analysis.analyze import summarize
    from overshoot.analysis.whatif import WhatIf
    from overshoot.rundir.reader import load_run

    p = CASES[case]
    run_dir = Path(tempfile.mkdtemp(prefix=f"gpu-truth-{case}-{mode}-"))
    rec = Recorder(run_dir, engine=f"synthetic-{mode}", gpu_timing=gpu_timing, cuda=True)
    lead = run_case(rec, case, mode, args.steps, cycles, lead_s=10.0)
    rec.close()
    run = load_run(run_dir)
    # Sampled mode opens its first window as soon as the collector is ready, and spaces the next by its
    # budget (often past this run's end): its warm-up stops there, so that the window's steps count. Kernels
    # mode keeps the 20: the steps after them and before its window are its plain reference.
    warmup = 20 if gpu_timing == "kernels" else min(20, lead)
    # The rerun shortens the spins by 10%, not the launch calls: the CPU what-if that matches it shortens the
    # CPU work by 10% x (spin / CPU busy) of this run.
    busy_ms = float(summarize(run, warmup_steps=warmup, mode=mode).groups.iloc[0]["busy_ms_median"])
    spin_ms = (p["pre_us"] + p["kernels"] * p["gap_us"] + p["post_us"]) / 1e3
    cpu_share = min(spin_ms / busy_ms, 1.0)
    what_ifs = [WhatIf("gpu", -0.10), WhatIf("cpu", -0.10 * cpu_share)]
    summary = summarize(run, warmup_steps=warmup, mode=mode, what_ifs=what_ifs)
    g = summary.groups.iloc[0]
    steps = summary.steps
    return {
        "step_ms": float(steps["step_ms"].mean()),
        "step_ms_median": float(g["step_ms_median"]),
        "gpu_busy_ms": float(g["gpu_busy_ms_median"]) if g["gpu_busy_ms_median"] == g["gpu_busy_ms_median"]
        else None,
        "gpu_idle_pct": float(g["gpu_idle_pct"]),
        "gpu_idle_in_step_pct": None if g["gpu_idle_in_step_pct"] != g["gpu_idle_in_step_pct"]
        else float(g["gpu_idle_in_step_pct"]),
        "cpu_bound_pct": float(g["cpu_bound_pct"]),
        "thread_never_waited_pct": float(g["thread_never_waited_pct"]),
        "whatif_gpu_pct": float(g["whatif:gpu-10%"]),
        "whatif_cpu_pct": float(g[f"whatif:{what_ifs[1].label}"]),
        "cpu_whatif_share": cpu_share,
        "kernel_steps": int(g["kernel_steps"]),
        # what kernel timing added to each launch call, as the run measured it (None: no plain steps)
        "collector_us": _collector_us(steps),
        "steps": int(g["steps"]),
        # truth from the settings, per step of this run: the set kernel time over its own step time
        "set_idle_pct": 100 * (1 - p["kernels"] * p["kernel_us"] / 1e3 / steps["step_ms"]).mean(),
        "set_cpu_bound_pct": 100 * float(
            ((1 - p["kernels"] * p["kernel_us"] / 1e3 / steps["step_ms"]) > 0.05).mean()),
    }


def reruns(case: str, mode: str, args, cycles: float, *, chunk: int = 25) -> dict[str, float]:
    """Median step (ms) of the plain loop and of its reruns with kernels 10% shorter and with the CPU's
    spins 10% shorter, each recorded with events. The three run in alternating chunks of `chunk` steps
    whose order rotates, so that the machine's drift over the minute (several % on a busy-spinning loop)
    falls on all three alike instead of on whichever ran last."""
    from overshoot import Recorder
    from overshoot.analysis.analyze import summarize
    from overshoot.rundir.reader import load_run

    scales = {"plain": (1.0, 1.0), "gpu": (0.9, 1.0), "cpu": (1.0, 0.9)}
    root = Path(tempfile.mkdtemp(prefix=f"gpu-truth-reruns-{case}-{mode}-"))
    recs = {name: Recorder(root / name, engine=f"synthetic-{mode}", gpu_timing="events", cuda=True)
            for name in scales}
    names = list(scales)
    for i in range(max(1, args.steps // chunk)):
        for name in names[i % 3:] + names[:i % 3]:
            gpu, cpu = scales[name]
            run_case(recs[name], case, mode, chunk, cycles, gpu=gpu, cpu=cpu)
    out = {}
    for name, rec in recs.items():
        rec.close()
        # the first step of each chunk waits on nothing (async): medians, and the first 20 steps dropped
        group = summarize(load_run(root / name), warmup_steps=20, mode=mode).groups.iloc[0]
        out[name] = float(group["step_ms_median"])
    return out


def profiled(case: str, mode: str, steps: int, cycles: float) -> dict:
    """torch.profiler (CUDA activity) over the same loop, run in a fresh process: kernel busy per step."""
    code = (
        f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); "
        "from benchmarks.gpu_truth import _profile_main; "
        f"print(json.dumps(_profile_main({case!r}, {mode!r}, {steps}, {cycles!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _kernel_busy_ms(prof) -> float:
    """Union of the profiled kernels', copies' and sets' device intervals, in ms."""
    intervals = sorted(
        (e.time_range.start, e.time_range.end) for e in prof.events()
        if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start
    )
    busy, cur_start, cur_end = 0.0, None, None
    for start, end in intervals:
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        busy += cur_end - cur_start
    return busy / 1e3  # FunctionEvent times are in us


def _profile_main(case: str, mode: str, steps: int, cycles: float) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    p = CASES[case]
    kwargs = dict(mode=mode, kernels=p["kernels"], kernel_us=p["kernel_us"], gap_us=p["gap_us"],
                  pre_us=p["pre_us"], post_us=p["post_us"], cycles=cycles)
    engine_loop(None, steps=20, **kwargs)  # warm-up
    t0 = time.perf_counter()
    engine_loop(None, steps=steps, **kwargs)
    torch.cuda.synchronize()
    plain_ms = (time.perf_counter() - t0) * 1e3 / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine_loop(None, steps=steps, **kwargs)
        torch.cuda.synchronize()
    busy = _kernel_busy_ms(prof) / steps
    return {"plain_step_ms": plain_ms, "profiler_busy_ms": busy,
            "profiler_idle_pct": 100 * (1 - busy / plain_ms)}


def _collector_us(steps) -> float | None:
    cost = steps["_collector_ns"].to_numpy("float64") if "_collector_ns" in steps.columns else None
    return None if cost is None or np.isnan(cost).all() else float(np.nanmedian(cost) / 1e3)


def synthetic(args) -> list[dict]:
    cycles = cycles_per_us()
    rows = []
    for case in CASES:
        for mode in ("sync", "async"):
            base = recorded(case, mode, args, cycles, gpu_timing="kernels")
            rerun = reruns(case, mode, args, cycles)
            plain = {"step_ms_median": rerun["plain"]}
            sampled = recorded(case, mode, args, cycles, gpu_timing="sampled")
            prof = profiled(case, mode, args.steps, cycles)
            # The profiler's kernel busy over this process's plain steps (medians: a busy-spinning thread on
            # a shared host is preempted now and then, which moves means more than medians).
            prof["idle_pct_here"] = 100 * (1 - prof["profiler_busy_ms"] / plain["step_ms_median"])
            rows.append({
                "case": case, "mode": mode, "base": base, "sampled": sampled, "plain": plain,
                "profiler": prof,
                "rerun_gpu_pct": 100 * (rerun["gpu"] / rerun["plain"] - 1),
                "rerun_cpu_pct": 100 * (rerun["cpu"] / rerun["plain"] - 1),
            })
            print(json.dumps(rows[-1]), flush=True)
    return rows


def print_synthetic(rows: list[dict]) -> None:
    print("\nGPU busy ms (overshoot | torch.profiler), GPU idle % (kernels | sampled | set | profiler busy "
          "over plain steps), CPU-bound % (overshoot | set), what-if % (projected from the kernels run | "
          "rerun, medians; and projected from the sampled run), the µs each run measured kernel timing to "
          "add to each launch call, and each run's instrumented steps (kernels | sampled)")
    head = (f"{'case':13} {'mode':5} {'step ms':>7} {'busy':>6} {'prof':>6} {'idle k':>6} {'idle s':>6} "
            f"{'set':>5} {'prof':>5} {'bound':>5} {'set':>5} {'gpu-10 proj/rerun':>17} "
            f"{'cpu proj/rerun':>15} {'sampled gpu/cpu':>15} {'µs/launch k|s':>13} {'steps k|s':>9}")
    print(head)
    for r in rows:
        b, s, prof = r["base"], r["sampled"], r["profiler"]
        print(f"{r['case']:13} {r['mode']:5} {b['step_ms_median']:7.3f} {b['gpu_busy_ms']:6.3f} "
              f"{prof['profiler_busy_ms']:6.3f} {b['gpu_idle_pct']:6.1f} "
              f"{s['gpu_idle_pct']:6.1f} {s['set_idle_pct']:5.1f} {prof['idle_pct_here']:5.1f} "
              f"{b['cpu_bound_pct']:5.0f} {b['set_cpu_bound_pct']:5.0f} "
              f"{b['whatif_gpu_pct']:+8.1f}/{r['rerun_gpu_pct']:+7.1f} {b['whatif_cpu_pct']:+7.1f}/"
              f"{r['rerun_cpu_pct']:+6.1f} {s['whatif_gpu_pct']:+7.1f}/{s['whatif_cpu_pct']:+6.1f} "
              f"{_us(b['collector_us']):>6}|{_us(s['collector_us']):<6} "
              f"{b['kernel_steps']:>4}|{s['kernel_steps']:<4}")


def _us(value: float | None) -> str:
    return "-" if value is None else format(value, ".2f")


def engine_truth(flags: list[str], *, preset: str, batch: int, tokens: int, prompt_len: int,
                 rounds: int) -> dict:
    """Plain time and torch.profiler's kernel busy per decode step of the reference engine (the engine's own
    step count: a speculative step makes several tokens)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from reference_engine.__main__ import build_parser, config_from_args
    from reference_engine.engine import Engine, SamplingParams

    engine = Engine(config_from_args(build_parser().parse_args(["serve", "--preset", preset, *flags])))
    prompts = [[(17 * i + j) % 1000 + 3 for j in range(prompt_len)] for i in range(batch)]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    engine.generate(prompts, params)  # warm-up, graph capture

    def generate() -> int:
        """Decode steps of one generation."""
        before = engine.stats.decode_steps
        engine.generate(prompts, params)
        torch.cuda.synchronize()
        return engine.stats.decode_steps - before

    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        steps = generate()
        times.append((time.perf_counter() - t0) * 1e3 / steps)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        steps = generate()
    busy = _kernel_busy_ms(prof) / steps  # the prefill's small share included (see "note")
    step = statistics.median(times)
    engine.shutdown()
    return {"plain_ms_per_step": step, "profiler_busy_ms_per_step": busy, "decode_steps": steps,
            "tokens_per_step": tokens / steps, "profiler_idle_pct": 100 * (1 - busy / step),
            "note": "per decode step: prefill included, decode dominates"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    s = sub.add_parser("synthetic")
    s.add_argument("--steps", type=int, default=300)
    s.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    e = sub.add_parser("engine")
    e.add_argument("--flags", default="--graph eager --kernels torch")
    e.add_argument("--preset", default="qwen3-4b")
    e.add_argument("--batch", type=int, default=1)
    e.add_argument("--tokens", type=int, default=64)
    e.add_argument("--prompt-len", type=int, default=128)
    e.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("gpu_truth.py needs torch with CUDA", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("gpu_truth.py needs a CUDA GPU", file=sys.stderr)
        return 1
    if args.what == "engine":
        print(json.dumps(engine_truth(args.flags.split(), preset=args.preset, batch=args.batch,
                                      tokens=args.tokens, prompt_len=args.prompt_len, rounds=args.rounds)))
        return 0
    rows = synthetic(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_truth.json").write_text(json.dumps(rows, indent=2))
    print_synthetic(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
