"""The case study's table on the reference engine: per configuration, overshoot's decode step and GPU idle.

    python benchmarks/case_study_table.py [--preset qwen3-4b] [--configs eager-torch,...] [--out DIR]

Each configuration is one `overshoot run` (its own server lifetime, hooks injected, one request at a time,
fixed output length with ignore_eos), then `overshoot report --json` of that run directory. Printed per
configuration, for the decode steps at one request: median step, GPU idle waiting on the CPU (share of the
step), CPU busy share, CPU-bound steps, and the client's tokens/s per request. The configurations walk the
case study's path on our engine: no graphs -> a graph per model forward (vLLM's default) -> one CUDA graph
per whole step, each with the torch and the Triton decode kernels, all with async scheduling, plus the
one-graph step without async scheduling, eager steps with host-side speculative decoding, and speculative
decoding inside the one-graph step (drafts, verification and acceptance on the device). On a CPU (tiny
preset) GPU idle is n/a: no CUDA events.

`--gpu-timing` picks overshoot's GPU timing in the server (default auto: sampled kernel records on a GPU).
`--truth` adds, per configuration, an independent measurement in a separate process
(benchmarks/gpu_truth.py engine): torch.profiler's kernel busy time per decode step over the server's
plain decode step.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
CONFIGS = {  # name: (label, reference_engine serve flags)
    "eager-torch": ("no graphs, torch kernels", ["--graph", "eager", "--kernels", "torch"]),
    # A launch per layer, as in the case study (and as measured in docs/benchmarks.md): with every layer in
    # one launch an eager step launches ~8 kernels and is no longer CPU-bound.
    "eager-triton": ("no graphs, Triton decode kernels", ["--graph", "eager", "--kernels", "triton",
                                                         "--no-one-launch-layers"]),
    "eager-triton-one-launch": ("no graphs, Triton, every layer in one launch",
                                ["--graph", "eager", "--kernels", "triton"]),
    "model-torch": ("graph per model forward, torch", ["--graph", "model", "--kernels", "torch"]),
    "model-triton": ("graph per model forward, Triton", ["--graph", "model", "--kernels", "triton"]),
    "step-torch": ("one graph per step, torch", ["--graph", "step", "--kernels", "torch"]),
    "step-triton": ("one graph per step, Triton", ["--graph", "step", "--kernels", "triton"]),
    "step-triton-sync": ("one graph per step, Triton, sync", ["--graph", "step", "--kernels", "triton",
                                                              "--no-async-scheduling"]),
    # Speculative decoding as a general engine does it: host-side drafts and acceptance around eager steps.
    "eager-triton-spec4": ("no graphs, Triton, 4 prompt-lookup drafts, sync",
                           ["--graph", "eager", "--kernels", "triton", "--spec-tokens", "4",
                            "--no-async-scheduling"]),
    # The case study's change: drafting, verification and acceptance inside the one graph per step.
    "step-triton-spec4": ("one graph per step, Triton, 4 prompt-lookup drafts on the device",
                          ["--graph", "step", "--kernels", "triton", "--spec-tokens", "4", "--drafter",
                           "device"]),
}


def run_config(name: str, args: argparse.Namespace) -> dict:
    """One server lifetime under `overshoot run`; the decode group at one request from its report."""
    label, flags = CONFIGS[name]
    out = args.out / name
    serve = [sys.executable, "-m", "reference_engine", "serve", "--preset", args.preset, *flags,
             "--port", "{port}"]
    if "--no-async-scheduling" not in flags:
        serve.append("--async-scheduling")
    cli = [sys.executable, "-m", "overshoot.cli"]
    run = [*cli, "run", "--concurrency", "1", "--max-tokens", str(args.max_tokens), "--requests",
           str(args.requests), "--prompt-tokens", str(args.prompt_tokens), "--engine", "reference",
           "--gpu-timing", args.gpu_timing, "--out", str(out), "--", *serve]
    started = time.perf_counter()
    done = subprocess.run(run, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        return {"name": name, "label": label, "error": f"overshoot run exited {done.returncode}: {tail[0]}"}
    report = subprocess.run([*cli, "report", str(out), "--json"], cwd=ROOT, capture_output=True, text=True)
    if report.returncode != 0:
        return {"name": name, "label": label, "error": f"overshoot report exited {report.returncode}"}
    data = json.loads(report.stdout)
    decode = [g for g in data["groups"]
              if g["phase"] == "decode" and g["concurrency"] == 1 and g["load_window"] == "level"]
    client = [c for c in data.get("client") or [] if c.get("concurrency") == 1]
    row = {"name": name, "label": label, "seconds": round(time.perf_counter() - started, 1),
           "tok_s_per_request": client[0].get("tokens_per_s_per_request") if client else None}
    if not decode:
        return row | {"error": "no decode steps at one request in the report"}
    group = max(decode, key=lambda g: g["steps"])
    keys = ("steps", "step_ms_median", "gpu_idle_pct", "gpu_idle_in_step_pct", "gpu_busy_ms_median",
            "cpu_share_pct", "cpu_bound_pct", "thread_never_waited_pct", "gpu_ms_median", "kernels_median",
            "kernel_steps", "gpu_timing", "spec_tokens_mean")
    row |= {key: group.get(key) for key in keys}
    top = max(group.get("gpu_idle_by_label") or [], key=lambda r: r["share_pct"], default=None)
    lent = " (borrowed)" if group.get("gpu_idle_by_label_borrowed") else ""  # no window of its own
    row["idle_in"] = f"{top['label']} {top['share_pct']:.0f}%{lent}" if top else None
    if args.truth:
        row |= profiler_truth(flags, args)
        if row.get("profiler_busy_ms") and row.get("step_ms_median"):
            # the profiler's kernel time a decode step over this server's plain decode step: its own process
            # generates without the HTTP server and its step is faster, so its step time is no step time here
            row["profiler_idle_pct"] = 100 * (1 - row["profiler_busy_ms"] / row["step_ms_median"])
            # overshoot's idle share is time-weighted: over the plain steps' mean it compares like with like
            mean = plain_decode_step_mean(out)
            if mean:
                row["plain_step_ms_mean"] = mean
                row["profiler_idle_mean_pct"] = 100 * (1 - row["profiler_busy_ms"] / mean)
    return row


def plain_decode_step_mean(run_dir: Path) -> float | None:
    """Mean step of the decode steps at one request that ran without the collector (the steps whose time
    overshoot's GPU idle share is taken over)."""
    from overshoot.analysis.analyze import summarize
    from overshoot.rundir.reader import load_run

    steps = summarize(load_run(run_dir)).steps
    at_one = (steps["phase"] == "decode") & (steps["concurrency"] == 1) & (steps["load_window"] == "level")
    plain = steps[at_one & steps["gpu_timing"].isin(["estimate", "borrowed", "events"])]
    return float(plain["step_ms"].mean()) if len(plain) else None


def profiler_truth(flags: list[str], args: argparse.Namespace) -> dict:
    """torch.profiler's GPU idle share of the same configuration, in a process of its own."""
    engine_flags = [*flags] + ([] if "--no-async-scheduling" in flags else ["--async-scheduling"])
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_truth.py"), "engine", "--preset", args.preset,
         f"--flags={' '.join(engine_flags)}", "--tokens", str(min(args.max_tokens, 64)),
         "--prompt-len", str(args.prompt_tokens)],
        cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        return {"truth_error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    truth = json.loads(done.stdout.strip().splitlines()[-1])
    return {"profiler_idle_pct": truth["profiler_idle_pct"],
            "profiler_busy_ms": truth["profiler_busy_ms_per_step"]}


def fmt(value, spec: str, missing: str = "n/a") -> str:
    return missing if value is None else format(value, spec)


def print_table(rows: list[dict], preset: str, gpu_timing: str) -> None:
    print(f"\n{preset}, one request, decode steps (overshoot report, --gpu-timing {gpu_timing}), async "
          "scheduling unless noted")
    print("| configuration | decode step ms | GPU busy ms | GPU idle % (inside steps) "
          "| torch.profiler idle %: plain steps' mean (median) | CPU-bound steps % | thread never waited % "
          "| GPU idle mostly in | tok/s per request |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['label']} | error: {r['error']} | | | | | | | |")
            continue
        inside = fmt(r.get("gpu_idle_in_step_pct"), ".1f", "?")
        busy = fmt(r.get("gpu_busy_ms_median"), ".3f")
        print(f"| {r['label']} | {fmt(r['step_ms_median'], '.3f')} | {busy} "
              f"| {fmt(r['gpu_idle_pct'], '.1f')} ({inside}) "
              f"| {fmt(r.get('profiler_idle_mean_pct'), '.1f', '-')} "
              f"({fmt(r.get('profiler_idle_pct'), '.1f', '-')}) "
              f"| {fmt(r['cpu_bound_pct'], '.0f')} | {fmt(r.get('thread_never_waited_pct'), '.0f')} "
              f"| {r.get('idle_in') or '-'} | {fmt(r['tok_s_per_request'], '.0f')} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-4b")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated of {', '.join(CONFIGS)}")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("runs") / "case_study_table")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--gpu-timing", default="auto", help="auto, events, kernels, sampled or off")
    parser.add_argument("--truth", action="store_true",
                        help="also measure each configuration with torch.profiler (GPU only)")
    args = parser.parse_args()
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        print(f"case_study_table: unknown configuration {unknown or names}; known: {', '.join(CONFIGS)}",
              file=sys.stderr)
        return 2
    args.out = args.out.resolve()
    rows = []
    for name in names:
        rows.append(run_config(name, args))
        print(f"{name}: {json.dumps(rows[-1])}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    print_table(rows, args.preset, args.gpu_timing)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
