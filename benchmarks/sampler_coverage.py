"""Sampled kernel timing over a served load sweep, on a virtual clock: what its windows cost and which groups
get kernel data.

    python benchmarks/sampler_coverage.py [--levels 1,2,4,8] [--requests 32] [--budget 0.005]

A closed-loop sweep (each level keeps its concurrency in flight; a request's output is 64-192 tokens, seeded)
gives the step sequence a continuous-batching engine runs: a prefill step per admission, decode steps whose
batch is the requests in flight. The real KernelSampler opens and closes windows over it; a step inside a
window runs (1 + ratio) x its plain length and each switch costs its set time, so the cost is known exactly.
Per collector profile (an eager engine under CUPTI, ~3x; a graph engine, ~3%) it prints the windows, the
instrumented steps, the cost over the run against the budget, and the share of decode steps whose group
(level, phase, batch size) has kernel data of its own, or of its shape at another level (what the analyzer
borrows). No GPU: the profiles are set, from the costs measured on the H200 (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from overshoot import Recorder  # noqa: E402
from overshoot.record import kernel_timing  # noqa: E402
from overshoot.record.kernel_timing import KernelSampler  # noqa: E402

# (name, slowdown of a step inside a window, one switch's cost in ns)
PROFILES = (
    ("eager torch under CUPTI (x4 steps, 0.1 ms switches)", 3.0, 100_000),
    ("the same, 2 ms switches", 3.0, 2_000_000),
    ("eager Triton (+12%, 0.1 ms switches)", 0.12, 100_000),
    ("one graph a step (+3%, 0.1 ms switches)", 0.03, 100_000),
)


def sweep(levels: list[int], requests: int, seed: int = 0) -> list[tuple[int, str, int]]:
    """(level, phase, batch size) of every step of a closed-loop sweep."""
    rnd = random.Random(seed)
    steps = []
    for level in levels:
        left, running = requests, []
        while left or running:
            admit = min(level - len(running), left)
            if admit > 0:
                left -= admit
                steps.append((level, "prefill", admit))
                running += [rnd.randint(64, 192) for _ in range(admit)]
            steps.append((level, "decode", len(running)))
            running = [r - 1 for r in running if r > 1]
    return steps


def step_ns(phase: str, batch: int) -> int:
    return 2_000_000 if phase == "prefill" else 1_000_000 + 20_000 * batch


class Clock:
    def __init__(self):
        self.now = 10**12

    def __call__(self) -> int:
        return self.now


class TimedCollector:
    """Records nothing; each switch moves the virtual clock by its cost."""

    def __init__(self, clock: Clock, switch_ns: int):
        self.clock, self.switch_ns = clock, switch_ns

    def describe(self) -> dict:
        return {"backend": "virtual"}

    def enable(self) -> None:
        self.clock.now += self.switch_ns

    def disable(self) -> None:
        self.clock.now += self.switch_ns

    def collect(self, *, final: bool = False) -> None:
        return None

    def close(self) -> None:
        pass


def play(steps, *, ratio: float, switch_ns: int, budget: float) -> tuple[list[bool], float, int]:
    """Instrumented flag per step, the windows' cost over the plain run, and the windows opened."""
    clock = Clock()
    real_clock, kernel_timing.perf_counter_ns = kernel_timing.perf_counter_ns, clock  # the sampler's clock
    try:
        return _play(steps, clock, ratio=ratio, switch_ns=switch_ns, budget=budget)
    finally:
        kernel_timing.perf_counter_ns = real_clock


def _play(steps, clock: Clock, *, ratio: float, switch_ns: int,
          budget: float) -> tuple[list[bool], float, int]:
    with tempfile.TemporaryDirectory() as tmp:
        rec = Recorder(Path(tmp) / "run", engine="virtual", gpu_timing="sampled")
        sampler = KernelSampler(rec, TimedCollector(clock, switch_ns), mode="sampled", budget=budget,
                                drain_seconds=60)
        while sampler.state() != "ready":
            time.sleep(0.001)
        inside, total, plain = [], 0, 0
        for _, phase, batch in steps:
            t = sampler.at_step(clock.now, batch, phase)
            on = sampler._on
            clock.now = t + int(step_ns(phase, batch) * ((1 + ratio) if on else 1))
            inside.append(on)
            plain += step_ns(phase, batch)
        total = clock.now - 10**12
        windows = sampler.windows
        sampler.close()
        rec.close()
    return inside, total / plain - 1, windows


def coverage(steps, inside: list[bool]) -> tuple[float, float]:
    """Shares of decode steps whose group has instrumented steps, and whose group or shape has."""
    own = {s for s, on in zip(steps, inside, strict=True) if on}
    shapes = {(phase, batch) for _, phase, batch in own}
    decode = [s for s in steps if s[1] == "decode"]
    return (sum(s in own for s in decode) / len(decode),
            sum((s[1], s[2]) in shapes for s in decode) / len(decode))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument("--requests", type=int, default=32, help="requests per level")
    ap.add_argument("--budget", type=float, default=0.005)
    args = ap.parse_args()
    steps = sweep([int(x) for x in args.levels.split(",")], args.requests)
    decode = [s for s in steps if s[1] == "decode"]
    print(f"{len(steps)} steps ({len(decode)} decode) over levels {args.levels}, budget {args.budget:.2%}")
    print(f"{'collector':52} {'windows':>7} {'inst.':>6} {'cost':>7} {'own':>5} {'+borrowed':>9}")
    for name, ratio, switch_ns in PROFILES:
        inside, cost, windows = play(steps, ratio=ratio, switch_ns=switch_ns, budget=args.budget)
        covered, borrowed = coverage(steps, inside)
        print(f"{name:52} {windows:7d} {sum(inside):6d} {cost:7.2%} {covered:5.0%} {borrowed:9.0%}")


if __name__ == "__main__":
    main()
