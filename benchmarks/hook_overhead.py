"""What overshoot's hooks cost the reference engine, measured side by side in one process.

    python benchmarks/hook_overhead.py          # qwen3-4b, one graph a step, async, batch 1 and 4
    python benchmarks/hook_overhead.py --preset tiny --tokens 32     # smoke run (on a CPU: eager)

One engine generates the same greedy requests in alternating rounds without and with the hooks
(engine_hooks.reference.SPEC installed in this process by the patcher, a Recorder writing a run directory,
CUDA events on the engine's stream), so both ways share the weights, the graphs and the machine's state.
Reported per batch: ms per generated token (median over rounds) each way and the hooked / plain ratio, after
a short hooked generation opened the recorder (a once-a-process cost, not a per-step one). Each hooked round's
run directory is then read back: every decode step recorded (the opening generation's one included), with its
GPU interval on CUDA.
Prints a table last; writes hook_overhead.json under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from engine_hooks import patcher  # noqa: E402
from engine_hooks.reference import SPEC  # noqa: E402
from overshoot.analysis.steps import joined_steps  # noqa: E402
from overshoot.record.recorder import Recorder  # noqa: E402
from overshoot.rundir.reader import load_run  # noqa: E402
from reference_engine.config import Config  # noqa: E402
from reference_engine.engine import Engine, SamplingParams  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_round(engine: Engine, batch: int, tokens: int, prompt_len: int) -> float:
    """ms per generated token of a request: one generation of `batch` requests."""
    prompts = [[(17 * i + j) % 1000 + 3 for j in range(prompt_len)] for i in range(batch)]
    sync()
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
    sync()
    return (time.perf_counter() - start) / tokens * 1e3


def hooked_round(engine: Engine, run_dir: Path, batch: int, tokens: int, prompt_len: int) -> float:
    """timed_round with the hooks installed for it (and removed after: the next round runs plain)."""
    opened: list[Recorder] = []

    def factory(name: str, process_info: dict) -> Recorder:
        opened.append(Recorder(run_dir, engine=name, process_info=process_info))
        return opened[-1]

    statuses = patcher.install(SPEC, recorder_factory=factory)
    if any(s.status != "installed" for s in statuses):
        raise SystemExit(f"hooks not installed: {statuses}")
    try:
        # The recorder opens at the first hooked call (run directory, spool files): once a process, so a
        # short generation opens it before the timed one, which then measures the hooks' cost per step.
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
        return timed_round(engine, batch, tokens, prompt_len)
    finally:
        patcher.reset()
        for rec in opened:
            rec.close()


def check_run(run_dir: Path, cuda: bool) -> dict:
    """Decode steps recorded in a hooked round's run directory, and how many have a GPU interval."""
    steps = joined_steps(load_run(run_dir))
    decode = steps[steps["phase"] == "decode"]
    return {"decode_steps": int(len(decode)),
            "with_gpu": int(decode["gpu_ms"].notna().sum()) if cuda else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-4b")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--tokens", type=int, default=128, help="generated tokens per request and round")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="rounds each way, alternating")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    try:
        batches = [int(b) for b in args.batches.split(",")]
        base = Config(preset=args.preset, max_model_len=args.prompt_len + args.tokens + 8)
    except ValueError as exc:
        parser.error(str(exc))
    cuda = base.device == "cuda"
    config = base.replace(graph="step", async_scheduling=True) if cuda else base
    engine = Engine(config)
    engine.generate([[5, 6, 7]] * max(batches), SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    out = {"preset": args.preset, "device": torch.cuda.get_device_name() if cuda else "cpu",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "graph": config.graph,
           "async": config.async_scheduling, "tokens": args.tokens, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        for batch in batches:
            timed_round(engine, batch, args.tokens, args.prompt_len)  # graphs of this batch size captured
            plain, hooked, checks = [], [], []
            for i in range(args.rounds):
                plain.append(timed_round(engine, batch, args.tokens, args.prompt_len))
                run_dir = Path(tmp) / f"b{batch}-r{i}"
                hooked.append(hooked_round(engine, run_dir, batch, args.tokens, args.prompt_len))
                checks.append(check_run(run_dir, cuda))
            row = {"batch": batch, "plain_ms": statistics.median(plain),
                   "hooked_ms": statistics.median(hooked), "plain_rounds": plain, "hooked_rounds": hooked,
                   "runs": checks}
            row["ratio"] = row["hooked_ms"] / row["plain_ms"]
            out["rows"].append(row)
            print(f"b={batch}: plain {row['plain_ms']:.3f}, hooked {row['hooked_ms']:.3f} ms/token",
                  flush=True)
    engine.shutdown()
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "hook_overhead.json").write_text(json.dumps(out, indent=2))
    print(f"\n{args.preset} on {out['device']} ({out['date']}), graph={config.graph} async="
          f"{config.async_scheduling}, {args.tokens} tokens a request, median of {args.rounds} rounds each "
          f"way")
    print(f"{'batch':>5} {'plain ms/token':>15} {'hooked ms/token':>16} {'ratio':>7} "
          f"{'decode steps recorded':>22}")
    for row in out["rows"]:
        recorded = ", ".join(
            str(c["decode_steps"]) + ("" if c["with_gpu"] is None else f" ({c['with_gpu']} with GPU)")
            for c in row["runs"][:2])
        print(f"{row['batch']:>5} {row['plain_ms']:>15.3f} {row['hooked_ms']:>16.3f} {row['ratio']:>7.3f} "
              f"{recorded:>22}")


if __name__ == "__main__":
    main()
