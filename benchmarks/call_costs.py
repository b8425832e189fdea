"""What the hooks cost each engine call inside real steps: plain, hooked and pass-through rounds, one process.

    python benchmarks/call_costs.py [--config eager-torch] [--preset tiny] [--rounds 90] [--gpu-timing events]

The hooks cost a call several times more inside a real engine's step than around a stub in a tight loop
(the engine's own work leaves the recorder's code and data out of the caches), so this measures them where
they run. The reference engine's six hooked methods are wrapped once more from outside (a Python timer, the
same in every way, so it cancels out of the differences), and rounds of 32 tokens rotate over three ways:
plain; hooked (engine_hooks.reference.SPEC and a Recorder); and pass-through (the same hooks with recording
off in this thread: the wrappers' own cost). Printed per method: the plain median call and each way's
difference from it; `step` includes the others and the step boundary. Runs on the CPU (the tiny preset,
eager torch) and on CUDA with any configuration of benchmarks/case_study_table.py.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

METHODS = ("step", "schedule", "prepare_inputs", "launch", "wait_for_results", "update_requests")
WAYS = ("plain", "hooked", "through")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="eager-torch")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--rounds", type=int, default=90)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--gpu-timing", default="events")
    args = parser.parse_args()

    import torch

    from benchmarks.case_study_table import CONFIGS
    from engine_hooks import patcher, wrappers
    from engine_hooks.reference import SPEC
    from overshoot.record import hotpath
    from overshoot.record.recorder import Recorder
    from reference_engine.__main__ import build_parser, config_from_args
    from reference_engine.engine import Engine, SamplingParams

    flags = list(CONFIGS[args.config][1])
    if torch.cuda.is_available() and "--no-async-scheduling" not in flags:
        flags.append("--async-scheduling")
    engine = Engine(config_from_args(build_parser().parse_args(
        ["serve", "--preset", args.preset, "--max-model-len", str(args.tokens + 48), "--max-num-seqs", "8",
         *flags])))
    prompt, params = [[(17 + j) % 1000 + 3 for j in range(16)]], SamplingParams(max_tokens=args.tokens,
                                                                                  ignore_eos=True)
    engine.generate(prompt, params)  # warm-up (graphs, caches)
    recorders: list[Recorder] = []

    def factory(name: str, info: dict) -> Recorder:
        if not recorders:
            recorders.append(Recorder(tempfile.mkdtemp(), engine=name, process_info=info,
                                      gpu_timing=args.gpu_timing))
        return recorders[0]

    times = {way: {m: [] for m in METHODS} for way in WAYS}

    def timed(way: str) -> dict:
        """Wrap the (hooked or plain) methods from outside; returns the originals to put back."""
        originals = {m: getattr(Engine, m) for m in METHODS}
        for m, f in originals.items():
            def outer(*a, _f=f, _out=times[way][m], **k):
                t = time.perf_counter_ns()
                result = _f(*a, **k)
                _out.append(time.perf_counter_ns() - t)
                return result
            setattr(Engine, m, outer)
        return originals

    for i in range(args.rounds):
        for way in WAYS[i % 3:] + WAYS[:i % 3]:
            if way != "plain":
                patcher.install(SPEC, recorder_factory=factory)
                if recorders:
                    recorders[0].resume()
                if way == "through":
                    wrappers._tls.rec = None  # recording off in this thread: calls pass straight through
            originals = timed(way)
            try:
                engine.generate(prompt, params)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
            finally:
                for m, f in originals.items():
                    setattr(Engine, m, f)
                if way != "plain":
                    if recorders:
                        recorders[0].pause()
                    patcher.reset()
    for rec in recorders:
        rec.close()
    print(f"{args.config}, preset {args.preset}, {args.rounds} rounds of {args.tokens} tokens, GPU timing "
          f"{args.gpu_timing}, hot path {hotpath.describe()}; median call, µs")
    print(f"{'method':<18}{'plain':>10}{'hooked':>10}{'through':>10}")
    for m in METHODS:
        plain, hooked, through = (statistics.median(times[w][m]) / 1e3 for w in WAYS)
        print(f"{m:<18}{plain:>10.2f}{hooked - plain:>+10.2f}{through - plain:>+10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
