"""Where a GPU timing mode's cost on a synchronous engine goes, term by term, side by side in one process.

    python benchmarks/sync_decomposition.py [--config step-triton-sync] [--budget-s 150] [--modes off,events]

A synchronous step adds every µs of the engine thread's work to the step, so each term shows in the decode
step's median. Rounds of 16 tokens at batch 1 rotate over: plain; `bare`, two CUDA events around
`Engine.launch` with no recorder; `bare-query`, the same plus querying the step before's pair inside
`launch` (what resolving events on the launch path would cost); and each `--modes` entry through the hooks
(`off`: the hooks and the recorder with no GPU timing). Every way's steps are stamped alike at
`Engine.step`; printed per way: the median round ratio against plain [5-95% of rounds] and the median decode
step's difference from plain's. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOKENS, PROMPT = 16, 64


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="step-triton-sync")
    parser.add_argument("--budget-s", type=float, default=120.0)
    parser.add_argument("--modes", default="off,events")
    parser.add_argument("--out", default="benchmarks/results/sync_decomposition.json")
    args = parser.parse_args()

    import torch

    import reference_engine.engine as engine_module
    from benchmarks.case_study_table import CONFIGS
    from benchmarks.hook_overhead import HookedMode, StepClock, timed_round
    from reference_engine.__main__ import build_parser, config_from_args

    flags = CONFIGS[args.config][1]
    scheduling = [] if "--no-async-scheduling" in flags else ["--async-scheduling"]
    serve = build_parser().parse_args(["serve", "--preset", "qwen3-4b", "--max-model-len", "160",
                                       "--max-num-seqs", "8", *flags, *scheduling])
    engine = engine_module.Engine(config_from_args(serve))
    timed_round(engine, 1, TOKENS, PROMPT)

    launch = engine_module.Engine.launch
    pool = [torch.cuda.Event(enable_timing=True) for _ in range(512)]
    at = [0]

    def bare_launch(self, batch, inputs):
        i = at[0] = (at[0] + 2) % 512
        pool[i].record(self.stream)
        out = launch(self, batch, inputs)
        pool[i + 1].record(self.stream)
        return out

    def bare_query_launch(self, batch, inputs):
        out = bare_launch(self, batch, inputs)
        j = (at[0] - 2) % 512  # the step before's pair: done, as the recorder would resolve it
        if pool[j + 1].query():
            pool[j].elapsed_time(pool[j + 1])
        return out

    clock = StepClock(engine_module.Engine)
    modes = [m for m in args.modes.split(",") if m]
    tmp = Path(tempfile.mkdtemp(prefix="overshoot-decomp-"))
    hooked = {mode: HookedMode(tmp / mode, mode) for mode in modes}
    ways = ["plain", "bare", "bare-query", *modes]
    times: dict[str, list[float]] = {w: [] for w in ways}
    steps: dict[str, list[float]] = {w: [] for w in ways}
    start, rounds = time.time(), 0
    while time.time() - start < args.budget_s:
        for way in ways[rounds % len(ways):] + ways[:rounds % len(ways)]:
            if way in hooked:
                times[way].append(hooked[way].round(engine, 1, TOKENS, PROMPT))
            else:
                engine_module.Engine.launch = {"plain": launch, "bare": bare_launch,
                                               "bare-query": bare_query_launch}[way]
                try:
                    times[way].append(timed_round(engine, 1, TOKENS, PROMPT))
                finally:
                    engine_module.Engine.launch = launch
            steps[way].extend(clock.take())
        rounds += 1
    clock.close()
    for mode in hooked.values():
        mode.close()

    plain_step = statistics.median(steps["plain"])
    print(f"{args.config}: {rounds} rounds of {TOKENS} tokens, plain {statistics.median(times['plain']):.3f} "
          f"ms/token, decode step median {plain_step:.1f} µs")
    out = {"config": args.config, "rounds": rounds, "plain_step_us": plain_step, "ways": {}}
    for way in ways[1:]:
        ratios = sorted(a / b for a, b in zip(times[way], times["plain"], strict=False))
        low, high = ratios[int(0.05 * len(ratios))], ratios[int(0.95 * len(ratios))]
        delta = statistics.median(steps[way]) - plain_step
        out["ways"][way] = {"median_ratio": statistics.median(ratios), "step_delta_us": delta}
        print(f"  {way:>10}: round ratio median {statistics.median(ratios):.4f} [{low:.4f}-{high:.4f}]; "
              f"decode step {delta:+.1f} µs ({100 * delta / plain_step:+.2f}%)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
