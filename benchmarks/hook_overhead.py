"""What overshoot's hooks cost the reference engine, per GPU timing mode, side by side in one process.

    python benchmarks/hook_overhead.py                # qwen3-4b, one graph a step, async, batch 1 and 4
    python benchmarks/hook_overhead.py --configs eager-torch,step-triton --modes events,sampled,kernels
    python benchmarks/hook_overhead.py --preset tiny --tokens 32 --modes events   # smoke run (CPU: eager)

Per configuration (the case study's, benchmarks/case_study_table.py), one process builds one engine and
generates the same greedy requests in rounds: each round runs plain and hooked with each GPU timing mode, in
an order that rotates from round to round (engine_hooks.reference.SPEC installed by the patcher), so every way
shares the weights, the graphs and the machine's state. Each mode keeps one Recorder (one run directory) over
all its rounds, as a served engine keeps one over a run: sampled mode's windows are spaced over the whole run,
not restarted every round. Between its rounds a mode's recorder is paused (Recorder.pause): CUPTI off, and the
other rounds' time does not count toward its flush interval, so it flushes as often per step as in a served
engine, not once a second of everybody's rounds; the round then waits for the CUPTI drain thread to write its
last records (Recorder.settle) and counts that wait, so that this work does not slow the next round. Reported
per batch and mode, with the round as the unit (plain and hooked of one round are a pair): the ratio of hooked
to plain time summed over rounds (the cost averaged over a run), a 90% bootstrap interval of it over rounds,
and the median of the per-round ratios; and, from every way's decode steps stamped alike (StepClock), the
median step of each mode against plain's, which the rounds' noise does not reach, pooled and paired by round
(the machine's drift over a call cancelled). Each mode's run directory is read back: decode steps recorded,
with a GPU interval, and with kernel records. With --profiler, one last round runs under torch.profiler (CUDA
activity only) for its cost on the same steps (last: it takes over CUPTI). With --attach-check-s, plain rounds
before any mode and after all of them show whether a process with CUPTI attached (all off) runs slower.
Several configurations run one process each.
Prints a table last; writes hook_overhead.json under --out."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_round(engine, batch: int, tokens: int, prompt_len: int) -> float:
    """ms per generated token of a request: one generation of `batch` requests."""
    from reference_engine.engine import SamplingParams

    prompts = [[(17 * i + j) % 1000 + 3 for j in range(prompt_len)] for i in range(batch)]
    sync()
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
    sync()
    return (time.perf_counter() - start) / tokens * 1e3


class StepClock:
    """Stamps every `Engine.step` call with perf_counter_ns (a class-level wrapper under the hooks, the same
    in every way): per-step medians see a mode's cost on a typical decode step, free of the rounds' noise
    (prefill, round set-up, a machine that slows for a second) that the round ratios carry."""

    SKIP = 2  # a round's first steps: its prefill and the first decode

    def __init__(self, engine_cls):
        self.stamps: list[int] = []
        self._cls, self._step = engine_cls, engine_cls.step
        stamps, step = self.stamps, self._step

        def stamped(engine_self):
            stamps.append(time.perf_counter_ns())
            return step(engine_self)

        engine_cls.step = stamped

    def take(self) -> list[float]:
        """Durations (µs) of the steps stamped since the last take, less each round's first ones."""
        stamps, self.stamps[:] = list(self.stamps), []
        return [(b - a) / 1e3 for a, b in zip(stamps[self.SKIP:], stamps[self.SKIP + 1:], strict=False)]

    def close(self) -> None:
        self._cls.step = self._step


class HookedMode:
    """One GPU timing mode's Recorder, kept over all rounds; the hooks are installed around each of its
    rounds only (the plain rounds between run unhooked)."""

    def __init__(self, run_dir: Path, gpu_timing: str):
        self.run_dir, self.gpu_timing = run_dir, gpu_timing
        self.recorder = None
        self.settle_ms = 0.0  # waits for the drain thread's last delivery of a round, summed

    def factory(self, name: str, process_info: dict):
        from overshoot.record.recorder import Recorder

        if self.recorder is None:
            self.recorder = Recorder(self.run_dir, engine=name, process_info=process_info,
                                     gpu_timing=self.gpu_timing)
        return self.recorder

    def round(self, engine, batch: int, tokens: int, prompt_len: int, *, before=None) -> float:
        """timed_round with the hooks installed for it (and removed after: the next round runs plain);
        `before()` is called just before it (after the first round's warm-up generation)."""
        from engine_hooks import patcher
        from engine_hooks.reference import SPEC
        from reference_engine.engine import SamplingParams

        statuses = patcher.install(SPEC, recorder_factory=self.factory)
        if any(s.status != "installed" for s in statuses):
            raise SystemExit(f"hooks not installed: {statuses}")
        try:
            if self.recorder is None:
                # The recorder opens at the first hooked call (run directory, spool files, CUPTI): once a
                # process, so a short generation opens it before the first timed round.
                engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
                # Kernel timing sets its collector up on its drain thread (CUPTI: 50-240 ms) and records
                # from the step after: short generations until then, so the timed rounds are all recorded.
                ready_by = time.perf_counter() + 10.0
                while (self.recorder is not None and self.recorder.kernel_timing_state() == "setting up"
                       and time.perf_counter() < ready_by):
                    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
            else:
                self.recorder.resume()
            if before is not None:
                before()
            per_token = timed_round(engine, batch, tokens, prompt_len)
        finally:
            # CUPTI left on would slow the plain rounds and the other modes' too (kernels mode's one window
            # spans its whole run); the round ended synchronized, so no kernel of it is still running.
            settle_ms = 0.0
            if self.recorder is not None:
                self.recorder.pause()
                # The drain thread delivers and writes the round's last records now. Left to run during the
                # next round it would slow that one (on the H200 the plain rounds after kernels rounds ran
                # 2-4% slower): its time counts in this round instead, as if the engine waited for it all.
                start = time.perf_counter()
                self.recorder.settle()
                settle_ms = (time.perf_counter() - start) * 1e3
                self.settle_ms += settle_ms
            patcher.reset()
        return per_token + settle_ms / tokens

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()


def plain_block(engine, batch: int, args, seconds: float) -> list[float]:
    """Plain rounds for `seconds` (at least 3 when seconds > 0): ms per token of each."""
    times: list[float] = []
    end = time.monotonic() + seconds
    while seconds > 0 and (time.monotonic() < end or len(times) < 3):
        times.append(timed_round(engine, batch, args.tokens, args.prompt_len))
    return times


def profiled_round(engine, batch: int, tokens: int, prompt_len: int) -> float:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]):
        return timed_round(engine, batch, tokens, prompt_len)


def _ms(info: dict, key: str) -> float:
    """A time in ms from a process record's kernel_timing (0 where the mode has no kernel timing)."""
    return float(info.get(key) or 0.0)


def check_run(run_dir: Path, cuda: bool, hooked_ms: float) -> dict:
    """Decode steps recorded in a mode's run directory, with GPU intervals and with kernel records, and what
    the kernel windows cost by the run's own account: the switches (less the collector's once-a-process
    set-up, shown apart) plus the excess of the decode steps from each window's start to 24 steps after its
    end (the sampler's closing and after-window steps) over the mean other one, over `hooked_ms`, the time
    of the mode's timed rounds. A check of the paired rounds that is free of the machine's round-to-round
    noise, and that sees only what the windows cost. (The mean, not the median: step times have a right tail,
    and a sum of affected steps set against the median other step counts that tail as the windows' cost.)"""
    import numpy as np

    from overshoot.analysis.steps import joined_steps
    from overshoot.rundir.reader import load_run

    run = load_run(run_dir)
    steps = joined_steps(run)
    decode = steps[steps["phase"] == "decode"].sort_values("start_ns")
    switch = run.spans[run.spans["label"] == "overshoot:kernel-timing"]["dur_ns"]
    sampler = next((p["kernel_timing"] for p in run.processes if p.get("kernel_timing")), None) or {}
    setup_ms = _ms(sampler, "setup_ms")
    start = decode["start_ns"].to_numpy()
    affected = np.zeros(len(decode), bool)
    for lo, hi in run.kernel_windows[["start_ns", "end_ns"]].itertuples(index=False):
        first, last = np.searchsorted(start, lo), np.searchsorted(start, hi)
        affected[first:last + 24] = True
    ms = decode["step_ms"].to_numpy()
    plain_ms = float(np.mean(ms[~affected])) if (~affected).any() else float("nan")
    # a round's last step ends where the round did (Recorder.pause), not at the mode's next round
    excess_ms = float(ms[affected].sum() - affected.sum() * plain_ms) \
        if affected.any() and (~affected).any() else 0.0
    switch_ms = float(switch.sum() / 1e6)
    # The engine thread's flushes (spans between steps) and the CUPTI drain thread's time: where a mode's
    # cost goes besides the hot path and the windows.
    flushes = run.spans[run.spans["label"] == "overshoot:flush"]
    flush_ms = float(flushes["dur_ns"].sum() / 1e6)
    waits = run.spans[(run.spans["kind"] == "wait") & (run.spans["step"] >= 0)].sort_values("start_ns")
    in_wait = 0
    if len(waits):  # flushes the recorder ran inside a wait (a GPU-bound stretch), off the critical path
        at = np.searchsorted(waits["start_ns"].to_numpy(), flushes["start_ns"].to_numpy(), side="right") - 1
        wait_end = (waits["start_ns"] + waits["dur_ns"]).to_numpy()[np.maximum(at, 0)]
        in_wait = int(((at >= 0) & ((flushes["start_ns"] + flushes["dur_ns"]).to_numpy() <= wait_end)).sum())
    return {"decode_steps": int(len(decode)),
            "with_gpu": int(decode["gpu_ms"].notna().sum()) if cuda else None,
            "with_kernels": int((decode["gpu_timing"] == "kernels").sum()), "switch_ms": switch_ms,
            "switches": int(len(switch)), "setup_ms": setup_ms, "windows_excess_ms": excess_ms,
            "run_ms": hooked_ms, "flush_ms": flush_ms, "flushes": int(len(flushes)),
            "flushes_in_wait": in_wait, "drain_ms": _ms(sampler, "drain_ms"),
            "drain_ms_max": _ms(sampler, "drain_ms_max"), "drain_cpu_ms": _ms(sampler, "drain_cpu_ms"),
            "flush_all_ms": _ms(sampler.get("collector") or {}, "flush_all_ms"),
            "accounted": (switch_ms - setup_ms + excess_ms) / hooked_ms if hooked_ms > 0 else None}


def resampled_rounds(n: int, seed: int):
    """2,000 bootstrap resamples of n rounds (row i: the rounds picked, with replacement, for resample i)."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, n, size=(2000, n))


def paired_cost(plain: list[float], hooked: list[float], *, seed: int = 0) -> dict:
    """Hooked over plain time summed over rounds, its 90% bootstrap interval (rounds resampled as pairs)
    and the median per-round ratio."""
    import numpy as np

    p, h = np.asarray(plain), np.asarray(hooked)
    picks = resampled_rounds(len(p), seed)
    boot = h[picks].sum(axis=1) / p[picks].sum(axis=1)
    boot_median = np.median((h / p)[picks], axis=1)  # robust to a round the machine slowed mid-way
    return {"ratio": float(h.sum() / p.sum()), "low": float(np.quantile(boot, 0.05)),
            "high": float(np.quantile(boot, 0.95)), "median_ratio": float(np.median(h / p)),
            "median_low": float(np.quantile(boot_median, 0.05)),
            "median_high": float(np.quantile(boot_median, 0.95)), "ms": float(np.median(h))}


def pooled(rounds: list[list[float]]) -> list[float]:
    return [step for one in rounds for step in one]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def step_cost(plain_us: list[float], hooked_us: list[float], *, seed: int = 0) -> dict:
    """Median step of the mode's rounds against the plain rounds' (µs and %), its 90% bootstrap interval
    (the steps of each way resampled), with the steps counted."""
    import numpy as np

    plain, hooked = _median(plain_us), _median(hooked_us)
    if plain is None or hooked is None:
        return {"step_us": hooked, "step_delta_us": None, "step_delta_pct": None, "steps": len(hooked_us)}
    rng = np.random.default_rng(seed)
    p, h = np.asarray(plain_us), np.asarray(hooked_us)
    boot = [100 * (np.median(rng.choice(h, len(h))) / np.median(rng.choice(p, len(p))) - 1)
            for _ in range(400)]
    return {"step_us": hooked, "step_delta_us": hooked - plain, "step_delta_pct": 100 * (hooked / plain - 1),
            "step_delta_low_pct": float(np.quantile(boot, 0.05)),
            "step_delta_high_pct": float(np.quantile(boot, 0.95)), "steps": len(hooked_us)}


def round_step_cost(plain_rounds: list[list[float]], hooked_rounds: list[list[float]], *,
                    seed: int = 0) -> dict:
    """The median step's shift paired by round: per rotation, the mode's round's median step over the plain
    round's of the same rotation (minutes apart at most, so the machine's drift over a call, which moves
    the pooled medians by more than the goals' margins, cancels), then the median of those per-round
    shifts (µs and %) with its 90% bootstrap interval over rounds. {} with fewer than 3 rounds of both."""
    import numpy as np

    pairs = [(statistics.median(p), statistics.median(h))
             for p, h in zip(plain_rounds, hooked_rounds, strict=False) if p and h]
    if len(pairs) < 3:
        return {}
    p, h = np.asarray(pairs).T
    pct, us = 100 * (h / p - 1), h - p
    boot = np.median(pct[resampled_rounds(len(pct), seed)], axis=1)
    return {"paired_delta_pct": float(np.median(pct)), "paired_delta_us": float(np.median(us)),
            "paired_low_pct": float(np.quantile(boot, 0.05)),
            "paired_high_pct": float(np.quantile(boot, 0.95)),
            "paired_rounds": len(pairs)}


def decomposed(mode: dict) -> str:
    """A mode's cost over a run as the sum of its two parts, each free of the rounds' noise: the median step's
    shift (every step's hooks; paired by round where there are rounds enough, its 90% interval over rounds,
    else pooled, over steps) and what its kernel-timing windows cost by the run's own account (the excess
    of the steps they slowed, and their switches). '' where either is unknown."""
    run = mode.get("run") or {}
    for keys, which in (
            (("paired_delta_pct", "paired_low_pct", "paired_high_pct"), "median step paired by round"),
            (("step_delta_pct", "step_delta_low_pct", "step_delta_high_pct"), "median step")):
        shift, low, high = (mode.get(key) for key in keys)
        if None not in (shift, low, high, run.get("accounted")):
            windows = 100 * run["accounted"]
            return (f", decomposed {shift + windows:+.2f}% [{low + windows:+.2f}, {high + windows:+.2f}] "
                    f"({which} + windows)")
    return ""


def measure_config(name: str, args) -> dict:
    """One configuration in this process: rounds of plain and each mode, the order rotating."""
    import torch

    from benchmarks.case_study_table import CONFIGS
    from reference_engine.__main__ import build_parser, config_from_args
    from reference_engine.engine import Engine, SamplingParams

    label, flags = CONFIGS[name]
    cuda = torch.cuda.is_available()
    flags = [*flags] + ([] if "--no-async-scheduling" in flags or not cuda else ["--async-scheduling"])
    serve_args = build_parser().parse_args(
        ["serve", "--preset", args.preset, "--max-model-len", str(args.prompt_len + args.tokens + 16),
         "--max-num-seqs", str(max(8, *args.batches)), *flags])
    engine = Engine(config_from_args(serve_args))
    engine.generate([[5, 6, 7]] * max(args.batches), SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    rows = []
    # CUPTI, once attached to the process, stays (its subscriber and callbacks cannot be removed), so the
    # plain rounds after a CUPTI mode's first round run in an attached process. Plain rounds before any and
    # after all of them show whether that alone costs (drift between the two blocks included).
    batch0 = args.batches[0]
    if args.attach_check_s:
        timed_round(engine, batch0, args.tokens, args.prompt_len)  # its graphs captured before the block
    before = plain_block(engine, batch0, args, args.attach_check_s)
    deadline = time.monotonic() + args.budget_s if args.budget_s else None
    with tempfile.TemporaryDirectory() as tmp:
        for batch in args.batches:
            timed_round(engine, batch, args.tokens, args.prompt_len)  # graphs of this batch size captured
            ways = ["plain", *args.modes]
            times: dict[str, list[float]] = {w: [] for w in ways}
            steps_us: dict[str, list[list[float]]] = {w: [] for w in ways}  # a list a round
            clock = StepClock(Engine)
            hooked = {m: HookedMode(Path(tmp) / f"b{batch}-{m}", m) for m in args.modes}
            try:
                for i in range(args.rounds):
                    if deadline and i >= 2 and time.monotonic() > deadline:
                        break  # a time-boxed run keeps the rounds it finished (all ways of each)
                    for way in ways[i % len(ways):] + ways[:i % len(ways)]:
                        clock.take()
                        times[way].append(
                            timed_round(engine, batch, args.tokens, args.prompt_len) if way == "plain"
                            else hooked[way].round(engine, batch, args.tokens, args.prompt_len,
                                                   before=clock.take))
                        steps_us[way].append(clock.take())
            finally:
                clock.close()
                for mode in hooked.values():
                    mode.close()
            rounds = len(times["plain"])
            plain_steps = pooled(steps_us["plain"])
            row = {"config": name, "label": label, "batch": batch, "rounds_done": rounds,
                   "plain_ms": statistics.median(times["plain"]), "rounds": times,
                   "step_us": _median(plain_steps),
                   "modes": {m: {**paired_cost(times["plain"], times[m]),
                                 **step_cost(plain_steps, pooled(steps_us[m])),
                                 **round_step_cost(steps_us["plain"], steps_us[m]),
                                 "run": {**check_run(hooked[m].run_dir, cuda, sum(times[m]) * args.tokens),
                                         "settle_ms": hooked[m].settle_ms}}
                             for m in args.modes}}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "rounds"}), flush=True)
        after = plain_block(engine, batch0, args, args.attach_check_s)
        if before and after:
            rows[0]["attach"] = {"before_ms": statistics.median(before), "after_ms": statistics.median(after),
                                 "rounds": [len(before), len(after)]}
        if args.profiler and cuda:
            for row in rows:
                ms = profiled_round(engine, row["batch"], args.tokens, args.prompt_len)
                row["profiler"] = {"ms": ms, "ratio": ms / row["plain_ms"]}
    engine.shutdown()
    return {"config": name, "rows": rows, "device": torch.cuda.get_device_name() if cuda else "cpu"}


def _threads_account(run: dict) -> str:
    """The engine thread's flushes and the drain thread's work, as shares of the mode's timed rounds."""
    total = run["run_ms"]
    if not total:
        return ""
    text = (f", flushes {100 * run.get('flush_ms', 0.0) / total:.2f}% "
            f"({run.get('flushes_in_wait', 0)} of {run.get('flushes', 0)} inside a wait)")
    if run.get("settle_ms"):
        text += f", waits for the drain thread after rounds {100 * run['settle_ms'] / total:.2f}%"
    if run.get("drain_ms"):
        text += (f", drain thread {100 * run['drain_ms'] / total:.2f}% "
                 f"(CPU {100 * run.get('drain_cpu_ms', 0.0) / total:.2f}%, "
                 f"longest {run['drain_ms_max']:.1f} ms; "
                 f"{100 * run.get('flush_all_ms', 0.0) / total:.2f}% in CUPTI's flush, without the GIL)")
    return text


def host_clock(calls: int = 200_000) -> dict:
    """The host's clock source and what one perf_counter_ns() costs (the recorder reads it ~15 times a step:
    on a clock source without a vDSO fast path each read is a system call, and the hooks' cost with it)."""
    try:
        source = Path("/sys/devices/system/clocksource/clocksource0/current_clocksource").read_text().strip()
    except OSError:
        source = None
    now, best = time.perf_counter_ns, math.inf
    for _ in range(5):
        start = now()
        for _ in range(calls):
            now()
        best = min(best, (now() - start) / calls)
    from overshoot.record import hotpath

    return {"clocksource": source, "perf_counter_ns_ns": round(best, 1), "hotpath": hotpath.describe()}


def print_table(results: list[dict], args, clock: dict | None = None) -> None:
    print(f"\n{args.preset}, {args.tokens} tokens a request, rounds alternating in a rotating order; per "
          "mode: hooked / plain time over all rounds [90% bootstrap interval]; profiler: one round over the "
          "median")
    if clock:
        print(f"host clock: {clock['clocksource'] or 'unknown source'}, perf_counter_ns() "
              f"{clock['perf_counter_ns_ns']:.0f} ns a call (in a Python loop, its best of 5); recorder hot "
              f"path {clock.get('hotpath', 'unknown')}")
    modes = [*args.modes] + (["profiler"] if args.profiler else [])
    print(f"{'configuration':22} {'batch':>5} {'rounds':>6} {'plain ms':>8} "
          + " ".join(f"{m:>22}" for m in modes) + "  per mode: kernel steps, median round ratio, own account")
    for result in results:
        for row in result.get("rows", []):
            cells = []
            for m in modes:
                cell = row["modes"].get(m) if m != "profiler" else row.get("profiler")
                if cell is None:
                    cells.append(f"{'-':>22}")
                elif m == "profiler":
                    cells.append(f"{cell['ratio']:>21.3f}x")
                else:
                    cells.append(f"{cell['ratio']:6.3f}x [{cell['low']:.3f}-{cell['high']:.3f}]")
            recorded = "; ".join(
                f"{m}: {r['run']['with_kernels']}/{r['run']['decode_steps']} steps, median round "
                f"{r['median_ratio']:.3f} [{r['median_low']:.3f}-{r['median_high']:.3f}]"
                + (f", median step {r['step_delta_us']:+.1f} µs ({r['step_delta_pct']:+.2f}%)"
                   if r.get("step_delta_us") is not None else "")
                + (f", paired by round {r['paired_delta_us']:+.1f} µs ({r['paired_delta_pct']:+.2f}% "
                   f"[{r['paired_low_pct']:+.2f}, {r['paired_high_pct']:+.2f}])"
                   if "paired_delta_pct" in r else "")
                + (f", own account {100 * r['run']['accounted']:+.2f}% "
                   f"(+{r['run']['setup_ms']:.0f} ms set-up)"
                   if m == "sampled" and r["run"]["accounted"] is not None else "")
                + (decomposed(r) if m == "sampled" else "")
                + _threads_account(r["run"])
                for m, r in row["modes"].items())
            print(f"{row['config']:22} {row['batch']:>5} {row['rounds_done']:>6} {row['plain_ms']:8.3f} "
                  + " ".join(cells) + f"  {recorded}")
            if "attach" in row:
                a = row["attach"]
                print(f"{'':22} plain rounds before any mode {a['before_ms']:.3f} ms, after all "
                      f"{a['after_ms']:.3f} ms ({a['after_ms'] / a['before_ms']:.3f}x; {a['rounds'][0]} and "
                      f"{a['rounds'][1]} rounds)")
        if "error" in result:
            print(f"{result['config']:22} error: {result['error']}")


def main() -> int:
    from benchmarks.case_study_table import CONFIGS

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-4b")
    parser.add_argument("--configs", default="step-triton", help=f"comma-separated of {', '.join(CONFIGS)}")
    parser.add_argument("--modes", default="events", help="GPU timing modes: events,sampled,kernels")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--tokens", type=int, default=128, help="generated tokens per request and round")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="rounds each way, alternating")
    parser.add_argument("--profiler", action="store_true", help="also time one torch.profiler round")
    parser.add_argument("--budget-s", type=float, default=0.0,
                        help="per configuration and batch: stop starting rounds after this many seconds")
    parser.add_argument("--attach-check-s", type=float, default=0.0,
                        help="plain rounds for this long before any mode and after all (CUPTI attached)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure this configuration here
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.modes = [m for m in args.modes.split(",") if m]
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    bad_modes = [m for m in args.modes if m not in ("events", "sampled", "kernels", "off")]
    if unknown or bad_modes or not names:
        print(f"hook_overhead: unknown configuration or mode {unknown + bad_modes or names}", file=sys.stderr)
        return 2
    if args.one:
        print("RESULT " + json.dumps(measure_config(args.one, args)))
        return 0
    results = []
    for name in names:  # one process a configuration: its own engine and CUPTI state
        argv = ["--preset", args.preset, "--modes", ",".join(args.modes), "--rounds", str(args.rounds),
                "--batches", ",".join(map(str, args.batches)), "--tokens", str(args.tokens),
                "--prompt-len", str(args.prompt_len), "--budget-s", str(args.budget_s),
                "--attach-check-s", str(args.attach_check_s),
                *(["--profiler"] if args.profiler else [])]
        done = subprocess.run([sys.executable, __file__, *argv, "--one", name], cwd=ROOT, capture_output=True,
                              text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            results.append({"config": name, "error": (done.stderr.strip().splitlines() or ["failed"])[-1]})
        else:
            results.append(json.loads(lines[-1][len("RESULT "):]))
        print(f"{name}: done", flush=True)
    clock = host_clock()
    out = {"preset": args.preset, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "tokens": args.tokens, "host_clock": clock, "results": results}
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "hook_overhead.json").write_text(json.dumps(out, indent=2))
    print_table(results, args, clock)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
