"""Kernel timing windows through the real Recorder and KernelSampler, fed by a device whose kernels are known
on the host clock (a virtual collector: it records kernels only while enabled, as CUPTI does). The GPU path
itself (record/cupti) is proven on the H200 by benchmarks/gpu_truth.py and benchmarks/cupti_probe.py."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from time import perf_counter_ns

import numpy as np
import pytest
from synthetic_engine import spin

from overshoot import Recorder
from overshoot.analysis.analyze import steps_table, summarize
from overshoot.analysis.kernels import instrumented_steps
from overshoot.record.kernel_timing import KernelSampler
from overshoot.rundir.reader import load_run
from overshoot.rundir.spool import read_stream_file

KERNELS, KERNEL_NS, LAUNCH_NS = 4, 20_000, 30_000


class VirtualCollector:
    def __init__(self):
        self.on = False
        self.rows: list[tuple[int, int, int, int]] = []
        self.enables = self.closed = 0

    def describe(self) -> dict:
        return {"backend": "virtual"}

    def enable(self) -> None:
        self.on = True
        self.enables += 1

    def disable(self) -> None:
        self.on = False

    def launch(self, gpu_free: int, kernel_ns: int = KERNEL_NS) -> int:
        """A launch call of LAUNCH_NS enqueueing one kernel; returns the device's next free time."""
        t = perf_counter_ns()
        start = max(t + 2_000, gpu_free)
        spin(LAUNCH_NS)
        if self.on:
            self.recorded((t, t + LAUNCH_NS, start, start + kernel_ns))
        return start + kernel_ns

    def recorded(self, row: tuple[int, int, int, int]) -> None:
        """A kernel launched while enabled: (launch start, launch end, GPU start, GPU end)."""
        self.rows.append(row)

    def collect(self, *, final: bool = False) -> dict | None:
        rows, self.rows = self.rows, []
        if not rows:
            return None
        launch, launch_end, start, end = (np.array(c, dtype="int64") for c in zip(*rows, strict=True))
        return {"launch_start_ns": launch.astype("float64"), "launch_end_ns": launch_end.astype("float64"),
                "gpu_start_ns": start, "gpu_end_ns": end, "name": ["k"] * len(rows),
                "stream": np.full(len(rows), 7)}

    def close(self) -> None:
        self.closed += 1


def _run(tmp_path, mode: str, steps: int = 200, switch_batch_at: int | None = None, budget: float = 1.0,
         collector: VirtualCollector | None = None, facts_later: bool = False, wait_us: int = 0):
    """`facts_later`: each step begins without facts and gets them inside (as the engine hooks do: the
    step's batch is known once `schedule` returns). `wait_us`: each step then waits this long for its
    results, without the GIL, as an engine waits for the GPU (the drain thread gets the GIL there)."""
    rec = Recorder(tmp_path / mode, engine="virtual", gpu_timing=mode)
    collector = collector or VirtualCollector()
    rec._sampler = KernelSampler(rec, collector, mode=mode, window_steps=8, min_gap=32, budget=budget,
                                 drain_seconds=0.05)
    gpu_free = 0
    for i in range(steps):
        batch = 2 if switch_batch_at is not None and i >= switch_batch_at else 1
        if facts_later:
            rec.step_begin()
            rec.step_facts(batch_size=batch, num_tokens=batch, phase="decode")
        else:
            rec.step_begin(batch_size=batch, num_tokens=batch, phase="decode")
        with rec.busy("launch"):
            for _ in range(KERNELS):
                gpu_free = collector.launch(gpu_free)
        if wait_us:
            with rec.wait("gpu"):
                time.sleep(wait_us / 1e6)
    rec.close()
    return collector, load_run(tmp_path / mode)


def test_kernels_mode_records_every_step(tmp_path):
    collector, run = _run(tmp_path, "kernels", steps=60)
    assert collector.enables == 1 and collector.closed == 1
    assert len(run.kernel_windows) == 1 and len(run.kernels) == KERNELS * 60
    table = steps_table(run)
    assert (table["gpu_timing"] == "kernels").all() and (table["kernels"] == KERNELS).all()
    assert np.allclose(table["gpu_busy_ms"], KERNELS * KERNEL_NS / 1e6)
    assert np.allclose(table["launch_ms"], KERNELS * LAUNCH_NS / 1e6)
    # launch-bound: 4 kernels of 20 us in ~120 us of launching
    assert summarize(run).groups.iloc[0]["cpu_bound_pct"] > 95


class SlowSwitch(VirtualCollector):
    """Switching on costs 2 ms: at a 5% budget, windows ~300 steps of ~0.12 ms apart."""

    def enable(self) -> None:
        spin(2_000_000)
        super().enable()


def test_a_new_group_gets_a_window_and_kernel_timing_keeps_its_budget_with_facts_given_inside_steps(tmp_path):
    """Through the recorder, each step given its facts only inside it (as the hooks do): the batch-2 group,
    from step 150, gets a window of its own; the windows' measured cost stays within the budget's allowance
    (1.5 x 5%) of the run's time. (The budget's spacing and the allowance on the virtual clock: below.)"""
    collector, run = _run(tmp_path, "sampled", steps=200, switch_batch_at=150, budget=1.0,
                          collector=SlowSwitch(), facts_later=True)
    table = steps_table(run)
    inside = table["gpu_timing"] == "kernels"
    assert (inside & (table["batch_size"] == 2)).sum() >= 2, run.kernel_windows
    assert run.processes[0]["kernel_timing"]["cost_pct"] > 0


def _phases(keys: list[tuple[int, str]]):
    """step_ns for _drive: a step of 0.2 ms, keyed by (batch size, phase) of the list by step index."""
    return lambda i: (200_000, keys[i])


@pytest.mark.parametrize("facts", ["at-begin", "at-end"])
def test_a_new_group_gets_an_early_window_only_within_the_budget_allowance(tmp_path, monkeypatch, facts):
    """A 2 ms switch at a 5% budget of 0.2 ms steps spaces windows ~200 steps apart. A batch-2 group that
    appears at step 1,880, 51 steps after a window, gets one at once from the allowance the run built up
    (its facts given as the step begins, or only as it ends); one that appears at step 60 of a fresh run does
    not, since the windows so far already cost the budget: a window a new group, whatever its cost, put a
    virtual sweep at 3% against a 0.5% budget. What every window cost stays within 1.5 x the budget."""
    for switch_at, expect_early in ((1_880, True), (60, False)):
        clock = VirtualClock()
        rec, sampler = _virtual_sampler(tmp_path / str(switch_at), monkeypatch,
                                        TimedSwitch(clock, switch_ns=2_000_000), clock)
        opened, regular = [], []
        for i in range(switch_at + 40):
            batch = 2 if i >= switch_at else 1
            before = sampler.windows
            if facts == "at-begin":
                t = sampler.at_step(clock.now, batch, "decode")
            else:  # the starting step's facts are unknown; the ended one's come with the boundary
                t = sampler.at_step(clock.now, None, None, ended=("decode", 1 if i - 1 < switch_at else 2))
            clock.now = t + 200_000
            if sampler.windows > before:
                opened.append(i)
                if i < switch_at:
                    regular.append(i)
        info = sampler.info()
        sampler.close()
        rec.close()
        if expect_early:
            assert min(np.diff(regular[2:])) >= 150, regular  # the spacing: ~200 steps apart
            assert regular[-1] + 40 < switch_at < regular[-1] + 150, regular  # due ~200 after it
            early = [i for i in opened if i >= switch_at]
            # at once: the boundary the new group's first step ends at (facts at the end) or begins at
            assert early and early[0] <= switch_at + 1, opened
            assert info["cost_pct"] <= 1.5 * 5.0, info
        else:  # (the two probes, before any cost was measured, are all it has: 17% of so short a run)
            assert [i for i in opened if i >= switch_at] == [] and opened == [0, 35], opened


def test_sampled_mode_opens_windows_and_a_new_group_gets_one(tmp_path):
    collector, run = _run(tmp_path, "sampled", steps=200, switch_batch_at=150)
    windows = run.kernel_windows.sort_values("start_ns")
    assert len(windows) >= 4 and collector.enables == len(windows)
    table = steps_table(run)
    inside = table["gpu_timing"] == "kernels"
    # two probes of 3 steps (the first has no plain step to measure its cost against), then windows of 8
    assert _window_lengths(table, windows) == [3, 3] + [8] * (len(windows) - 2)
    # every kernel recorded was launched in an instrumented step; none outside the windows
    launch = run.kernels["launch_start_ns"].to_numpy(dtype="float64")
    in_window = np.zeros(len(launch), bool)
    for lo, hi in windows[["start_ns", "end_ns"]].itertuples(index=False):
        in_window |= (launch >= lo) & (launch < hi)
    assert in_window.all() and len(launch) == KERNELS * inside.sum()
    # the batch-2 group (from step 150) got a window of its own, though the spacing alone would not give one
    groups = summarize(run).groups.set_index("batch_size")
    assert groups.loc[2, "gpu_timing"] == "sampled" and groups.loc[1, "gpu_timing"] == "sampled"
    assert (table.loc[~inside, "gpu_timing"].iloc[1:] == "estimate").all()


def test_kernel_timing_without_cuda_is_refused_in_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "overshoot", "run", "--gpu-timing", "kernels", "--out", str(tmp_path / "r")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "overshoot run: error: --gpu-timing kernels: needs a CUDA GPU and none was found; use --gpu-timing "
        "events (or off)"
    ]
    assert not (tmp_path / "r").exists()
    bad = subprocess.run([sys.executable, "-m", "overshoot", "run", "--gpu-timing", "fast"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown mode 'fast'" in bad.stderr


def _window_lengths(table, windows) -> list[int]:
    """Steps inside each kernel window, in time order."""
    start = table["start_ns"].to_numpy()
    return [int(((start >= lo) & (start < hi)).sum())
            for lo, hi in windows.sort_values("start_ns")[["start_ns", "end_ns"]].itertuples(index=False)]


def _window_gaps(run) -> tuple[list[int], float]:
    """Steps between each kernel window and the next, and the median step (ns)."""
    windows = run.kernel_windows.sort_values("start_ns")
    steps = run.steps.sort_values("start_ns")
    gaps = [int(((steps["start_ns"] > a) & (steps["start_ns"] < b)).sum())
            for a, b in zip(windows["end_ns"][:-1], windows["start_ns"][1:], strict=True)]
    return gaps, float((steps["end_ns"] - steps["start_ns"]).median())


class VirtualClock:
    """The sampler's clock in tests of its spacing: steps last what the test says and switches what the
    collector says, whatever the machine does meanwhile (a preempted step would move the spacing)."""

    def __init__(self):
        self.now = 10**12

    def __call__(self) -> int:
        return self.now


class TimedSwitch(VirtualCollector):
    """A collector whose switches take set times on the virtual clock: `switch_ns` each enable, plus
    `setup_ns_first` on the first one (its once-a-process set-up, as CUPTI's first enable in a served
    engine: 50-240 ms)."""

    def __init__(self, clock: VirtualClock, *, switch_ns: int = 0, setup_ns_first: int = 0):
        super().__init__()
        self.clock, self.switch_ns, self.setup_ns_first = clock, switch_ns, setup_ns_first
        self.setup_ns = 0

    def enable(self) -> None:
        if self.enables == 0 and self.setup_ns_first:
            self.clock.now += self.setup_ns_first
            self.setup_ns += self.setup_ns_first
        self.clock.now += self.switch_ns
        super().enable()


def _drive(sampler: KernelSampler, clock: VirtualClock, steps: int, step_ns=lambda i: (200_000, "decode")):
    """Steps through the sampler on the virtual clock; `step_ns(i)` gives each step's length and phase.
    The indices of the steps at which a window opened."""
    opened = []
    for i in range(steps):
        before = sampler.windows
        length, phase = step_ns(i)
        clock.now = sampler.at_step(clock.now, 1, phase) + length
        if sampler.windows > before:
            opened.append(i)
    return opened


def _virtual_sampler(tmp_path, monkeypatch, collector: VirtualCollector, clock: VirtualClock):
    from overshoot.record import kernel_timing

    monkeypatch.setattr(kernel_timing, "perf_counter_ns", clock)
    rec = Recorder(tmp_path / "r", engine="virtual", gpu_timing="sampled")
    sampler = KernelSampler(rec, collector, mode="sampled", window_steps=8, min_gap=32, budget=0.05,
                            drain_seconds=60)
    return rec, sampler


def test_sampled_windows_are_spaced_to_keep_their_cost_within_the_budget(tmp_path, monkeypatch):
    clock = VirtualClock()
    rec, sampler = _virtual_sampler(tmp_path, monkeypatch, TimedSwitch(clock, switch_ns=2_000_000), clock)
    opened = _drive(sampler, clock, 1200)
    sampler.close()
    rec.close()
    # The first window (at once, in what is usually the engine's warm-up) is a probe of 3 steps and marks no
    # group as seen: the group gets its own after the minimum gap (32 steps after the probe). From then on a
    # 2 ms switch over 5% of the time between windows spaces them at least 2e6 / (0.05 x 0.2 ms) = 200 steps
    # apart.
    assert opened[:2] == [0, 35], opened
    gaps = np.diff(opened[1:])
    assert len(gaps) >= 1 and gaps.min() >= 200, opened


def test_the_collector_set_up_does_not_space_windows_as_if_every_switch_cost_it(tmp_path, monkeypatch):
    clock = VirtualClock()
    collector = TimedSwitch(clock, setup_ns_first=100_000_000)
    rec, sampler = _virtual_sampler(tmp_path, monkeypatch, collector, clock)
    _drive(sampler, clock, 300)
    info = sampler.info()
    sampler.close()
    rec.close()
    # 100 ms over 5% of 0.2 ms steps would space the next window 10,000 steps away; a free switch keeps
    # windows at the minimum gap
    assert sampler.windows >= 6, sampler.windows
    assert info["setup_ms"] == 100 and info["switch_ms"] == 100


class PreparedOffThread(VirtualCollector):
    """A collector whose once-a-process set-up takes 150 ms (CUPTI's first enable: 50-240 ms)."""

    def __init__(self):
        super().__init__()
        self.prepared_at = 0
        self.thread = None

    def prepare(self) -> None:
        import threading

        self.thread = threading.current_thread().name
        time.sleep(0.15)
        self.prepared_at = perf_counter_ns()


def test_sampled_mode_sets_the_collector_up_on_the_drain_thread_and_opens_windows_after(tmp_path):
    collector = PreparedOffThread()
    rec = Recorder(tmp_path / "r", engine="virtual", gpu_timing="sampled")
    sampler = rec._sampler = KernelSampler(rec, collector, mode="sampled", window_steps=8, min_gap=32,
                                           budget=0.05, drain_seconds=0.05)
    gpu_free, longest, start = 0, 0, perf_counter_ns()
    while perf_counter_ns() - start < 400_000_000:
        t = perf_counter_ns()
        rec.step_begin(batch_size=1, num_tokens=1, phase="decode")
        with rec.busy("launch"):
            for _ in range(KERNELS):
                gpu_free = collector.launch(gpu_free)
        longest = max(longest, perf_counter_ns() - t)
    info = sampler.info()
    rec.close()
    run = load_run(tmp_path / "r")
    assert collector.thread == "overshoot-kernels"
    assert longest < 50_000_000  # no step waited for the set-up
    assert info["prepare_ms"] >= 150 and info["setup_ms"] == 0 and sampler.windows >= 1
    assert run.kernel_windows["start_ns"].min() >= collector.prepared_at


class CostlyPreparedOffThread(PreparedOffThread):
    """... whose launch calls take COST_NS longer while it records, as CUPTI's callbacks make them."""

    COST_NS = 10_000

    def launch(self, gpu_free: int, kernel_ns: int = KERNEL_NS) -> int:
        if self.on:
            spin(self.COST_NS)
        return super().launch(gpu_free, kernel_ns)


def test_kernels_mode_sets_up_off_thread_and_measures_its_cost_from_the_steps_before(tmp_path):
    """Kernels mode too sets its collector up on the drain thread: the engine never stalls for it, every
    step once it is ready is recorded, and the steps before are the plain reference from which the analyzer
    recovers what the collector added to each launch call."""
    collector = CostlyPreparedOffThread()
    rec = Recorder(tmp_path / "r", engine="virtual", gpu_timing="kernels")
    assert rec.kernel_timing_state() == "off"
    sampler = rec._sampler = KernelSampler(rec, collector, mode="kernels", drain_seconds=0.05)
    assert rec.kernel_timing_state() == "setting up"
    gpu_free, longest, start, ready_at = 0, 0, perf_counter_ns(), None
    while perf_counter_ns() - start < 400_000_000:
        t = perf_counter_ns()
        if ready_at is None and rec.kernel_timing_state() == "ready":
            ready_at = t
        rec.step_begin(batch_size=1, num_tokens=1, phase="decode")
        with rec.busy("launch"):
            for _ in range(KERNELS):
                gpu_free = collector.launch(gpu_free)
        longest = max(longest, perf_counter_ns() - t)
    rec.close()
    assert rec.kernel_timing_state() == "off"
    run = load_run(tmp_path / "r")
    assert collector.thread == "overshoot-kernels" and longest < 50_000_000
    assert ready_at is not None and sampler.windows == 1
    steps = summarize(run, warmup_steps=5).steps
    window_start = int(run.kernel_windows["start_ns"].min())
    assert window_start >= collector.prepared_at
    inside = steps["start_ns"] >= window_start
    assert 5 <= (~inside).sum() and (steps.loc[inside, "kernels"] == KERNELS).all()
    cost = float(np.nanmedian(steps["_collector_ns"]))
    assert abs(cost - CostlyPreparedOffThread.COST_NS) < 4_000, cost


class FailingPrepare(VirtualCollector):
    def prepare(self) -> None:
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")


def test_a_collector_that_cannot_be_set_up_leaves_the_run_on_events(tmp_path):
    collector = FailingPrepare()
    rec = Recorder(tmp_path / "r", engine="virtual", gpu_timing="kernels")
    sampler = rec._sampler = KernelSampler(rec, collector, mode="kernels", drain_seconds=0.05)
    gpu_free, deadline = 0, time.monotonic() + 5
    while rec.kernel_timing_state() == "setting up" and time.monotonic() < deadline:
        rec.step_begin(batch_size=1, num_tokens=1, phase="decode")
        with rec.busy("launch"):
            gpu_free = collector.launch(gpu_free)
    assert rec.kernel_timing_state() == "off"
    rec.step_end()
    rec.close()
    run = load_run(tmp_path / "r")
    assert sampler.windows == 0 and collector.enables == 0 and len(run.kernels) == 0 and len(run.steps) > 0
    assert any("kernel timing not started: RuntimeError" in e for e in run.processes[0]["errors"])


def test_a_long_step_of_another_kind_after_a_window_is_no_cost_of_it(tmp_path, monkeypatch):
    """Steps inside and after a window are set against plain steps of their own phase and batch size: a
    prefill (25 decode steps long) that follows a window is not the window's cost, so a collector that costs
    nothing keeps its windows at the minimum gap. Decode steps of 0.2 ms, a prefill of 5 ms every 12th."""
    clock = VirtualClock()
    rec, sampler = _virtual_sampler(tmp_path, monkeypatch, TimedSwitch(clock), clock)
    _drive(sampler, clock, 800, lambda i: (5_000_000, "prefill") if i % 12 == 0 else (200_000, "decode"))
    sampler.close()
    rec.close()
    # counted against the decode median, each prefill after a window would space the next ~480 steps away
    assert sampler.windows >= 15, sampler.windows


class SlowAfterWindow(VirtualCollector):
    """Slows the host for a few steps after each window, as parsing a window's records did on the H200."""

    def __init__(self):
        super().__init__()
        self.slow_launches = 0

    def disable(self) -> None:
        super().disable()
        self.slow_launches = 4 * KERNELS  # four steps of 4 x 0.5 ms: 8 ms a window

    def launch(self, gpu_free: int, kernel_ns: int = KERNEL_NS) -> int:
        if self.slow_launches > 0:
            self.slow_launches -= 1
            spin(500_000)
        return super().launch(gpu_free, kernel_ns)


def test_the_steps_slowed_after_a_window_count_in_its_cost(tmp_path):
    collector, run = _run(tmp_path, "sampled", steps=700, budget=0.5, collector=SlowAfterWindow())
    gap_steps, plain_ns = _window_gaps(run)
    # 8 ms after each window over 50% of the time between windows: at least 8e6 / (0.5 x step) steps apart
    # (the first gap is the minimum: before it no plain step was measured)
    assert len(gap_steps) >= 2 and min(gap_steps[1:]) >= 0.8 * 8e6 / (0.5 * plain_ns), (gap_steps, plain_ns)


class InFlightAtSwitchOff(VirtualCollector):
    """CUPTI as seen on the H200: a kernel still running when its kind is switched off is handed over at a
    later collect with that collect's time as its end; kernels still running stay pending (forced at the
    last collect)."""

    def __init__(self):
        super().__init__()
        self.off_ns = float("inf")
        self.pending: list[tuple[int, int, int, int]] = []

    def enable(self) -> None:
        super().enable()
        self.off_ns = float("inf")

    def disable(self) -> None:
        super().disable()
        self.off_ns = perf_counter_ns()

    def recorded(self, row: tuple[int, int, int, int]) -> None:
        self.pending.append(row)  # handed over once done (collect)

    def collect(self, *, final: bool = False) -> dict | None:
        now = perf_counter_ns()
        done = [r for r in self.pending if r[3] <= now or final]
        self.pending = [r for r in self.pending if not (r[3] <= now or final)]
        self.rows += [r if r[3] <= self.off_ns else (*r[:3], now) for r in done]
        return super().collect(final=final)


def _gpu_bound_run(tmp_path, *, fence: bool, steps: int = 120):
    """Async steps of 4 launches of 150 µs kernels (GPU-bound): each step waits for the previous step's
    work, so at every step boundary one step's kernels are still running."""
    kernel_ns = 150_000
    rec = Recorder(tmp_path / str(fence), engine="virtual", gpu_timing="sampled")
    collector = InFlightAtSwitchOff()
    device = {"free": 0}

    def gpu_done():
        target = device["free"]
        return lambda: perf_counter_ns() >= target

    rec._sampler = KernelSampler(rec, collector, window_steps=8, min_gap=32, budget=1.0, drain_seconds=0.01,
                                 fence=gpu_done if fence else None)
    previous_end = 0
    for _ in range(steps):
        rec.step_begin(batch_size=1, num_tokens=1, phase="decode")
        with rec.busy("launch"):
            for _ in range(KERNELS):
                device["free"] = collector.launch(device["free"], kernel_ns)
        with rec.wait("device"):
            while perf_counter_ns() < previous_end:
                pass
        previous_end = device["free"]
    rec.close()
    return rec, collector, load_run(tmp_path / str(fence)), kernel_ns


def test_the_collector_goes_off_only_after_the_window_gpu_work(tmp_path):
    # Without a fence the collector goes off with the window's last kernels still running: their records
    # cannot be trusted and are dropped, so the window's last step misses kernels.
    _rec, _collector, run, kernel_ns = _gpu_bound_run(tmp_path, fence=False)
    dropped = run.processes[0]["kernel_timing"]["dropped_outside_windows"]
    table = steps_table(run)
    inside = table[table["gpu_timing"] == "kernels"]
    assert dropped > 0 and (inside["kernels"] < KERNELS).any()

    _rec, collector, run, kernel_ns = _gpu_bound_run(tmp_path, fence=True)
    windows = run.kernel_windows
    assert len(windows) >= 3 and collector.enables == len(windows)
    durations = (run.kernels["gpu_end_ns"] - run.kernels["gpu_start_ns"]).to_numpy()
    assert np.allclose(durations, kernel_ns)  # every record whole, the last window's included
    table = steps_table(run)
    inside = table[table["gpu_timing"] == "kernels"]
    lengths = _window_lengths(table, windows)  # two probes, then 8 steps (the last: cut by the run's end)
    assert lengths[:2] == [3, 3] and set(lengths[2:-1]) <= {8} and 0 < lengths[-1] <= 8, lengths
    assert (inside["kernels"] == KERNELS).all()
    assert np.allclose(inside["gpu_busy_ms"], KERNELS * kernel_ns / 1e6)
    # the kernels of the steps after each window, launched while its work drained, were dropped
    assert run.processes[0]["kernel_timing"]["dropped_outside_windows"] >= KERNELS * (len(windows) - 1)


def test_paused_kernel_timing_records_nothing_between_recorded_stretches(tmp_path):
    collector = VirtualCollector()
    rec = Recorder(tmp_path / "r", engine="virtual", gpu_timing="kernels")
    rec._sampler = KernelSampler(rec, collector, mode="kernels", drain_seconds=0.05)
    gpu_free = 0
    for stretch in range(3):
        if stretch:
            rec.resume()
        for _ in range(10):
            rec.step_begin(batch_size=1, num_tokens=1, phase="decode")
            gpu_free = collector.launch(gpu_free)
        rec.step_end()
        rec.pause()
        assert not collector.on
        for _ in range(5):  # unrecorded work between stretches (a plain round): its kernels are not taken
            gpu_free = collector.launch(gpu_free)
        time.sleep(0.3)  # the drain thread hands over what is left, then rests
        drains = rec._sampler.drains
        time.sleep(0.3)
        assert rec._sampler.drains == drains  # no flush while paused: nothing to take the GIL for
    rec.close()
    run = load_run(tmp_path / "r")
    assert collector.enables == 3 and len(run.kernels) == 30


class CostlyParse(VirtualCollector):
    """Burns 10 ms of its thread's CPU on each collect that has records (a parse holding the GIL)."""

    def collect(self, *, final: bool = False) -> dict | None:
        columns = super().collect(final=final)
        if columns is not None:
            t = time.thread_time_ns()
            while time.thread_time_ns() - t < 10_000_000:
                pass
        return columns


def test_the_drain_threads_cpu_time_for_a_window_counts_in_its_cost(tmp_path):
    # The steps wait 100 µs each without the GIL: a loop that never lets it go gives the drain thread its
    # turn only every switch interval (5 ms), and its parse of a window may then come after the run ended.
    collector, run = _run(tmp_path, "sampled", steps=1500, budget=0.5, collector=CostlyParse(), wait_us=100)
    gap_steps, plain_ns = _window_gaps(run)
    info = run.processes[0]["kernel_timing"]
    assert info["drain_cpu_ms"] >= 10 and info["drains"] >= 1
    # >= 10 ms of parse a window over 50% of the time between windows: >= 10e6 / (0.5 x step) steps apart,
    # once a window's parse is known (the first gaps are the minimum, 32). Half of that is asked: on a
    # loaded machine a parse can start after the next window opened and count for that one.
    later = sorted(gap_steps[2:])
    assert len(later) >= 1 and later[len(later) // 2] >= 0.5 * 10e6 / (0.5 * plain_ns), (gap_steps, plain_ns)


def _launch_steps(rec: Recorder, collector: VirtualCollector, steps: int, *, rest_s: float = 0.0) -> None:
    """Decode steps that launch KERNELS kernels each, then sleep `rest_s`."""
    gpu_free = 0
    for _ in range(steps):
        rec.step_begin(batch_size=1, phase="decode")
        with rec.busy("launch"):
            for _ in range(KERNELS):
                gpu_free = collector.launch(gpu_free)
        if rest_s:
            time.sleep(rest_s)


def test_the_drain_thread_writes_the_kernel_records_not_the_engine_threads_flushes(tmp_path, monkeypatch):
    """Kernel records reach the spool from the thread that delivers them: the engine thread's flushes (every
    16 steps here) convert and write none while the run goes on; the close writes the last ones. Every
    record and the window are read back."""
    from overshoot.record.writer import RecorderIO

    writers: list[tuple[str, int]] = []
    original = RecorderIO.write_kernels

    def spy(self, kernels, windows):
        writers.append((threading.current_thread().name, sum(len(k["gpu_start_ns"]) for k in kernels)))
        original(self, kernels, windows)

    monkeypatch.setattr(RecorderIO, "write_kernels", spy)
    rec = Recorder(tmp_path, engine="virtual", gpu_timing="kernels", flush_steps=16)
    collector = VirtualCollector()
    rec._sampler = KernelSampler(rec, collector, mode="kernels", drain_seconds=0.01)
    _launch_steps(rec, collector, 120, rest_s=0.001)  # the drain thread's turn after each step
    engine = threading.current_thread().name
    during = [(name, rows) for name, rows in writers]
    rec.close()
    assert any(name == "overshoot-kernels" and rows for name, rows in during), during
    assert not any(name == engine and rows for name, rows in during), during
    run = load_run(tmp_path)
    assert len(run.kernels) == KERNELS * 120 and len(run.kernel_windows) == 1


def test_settle_waits_for_the_drain_thread_to_write_what_came_before_the_pause(tmp_path):
    """pause() switches the collector off; settle() returns once the drain thread has delivered and written
    every record of the work before it (read back from the spool while the recorder is still open), so that
    none of that work falls on what runs next; it is immediate when nothing was collecting."""
    rec = Recorder(tmp_path, engine="virtual", gpu_timing="kernels")
    collector = VirtualCollector()
    rec._sampler = KernelSampler(rec, collector, mode="kernels", drain_seconds=30.0)  # never on its own
    _launch_steps(rec, collector, 20)
    rec.pause()
    assert rec.settle(timeout=5.0)
    assert not collector.on and not collector.rows
    written = [b for path in (tmp_path / "spool").glob("*.kernels.*.arrow")
               for b in read_stream_file(path, label=path.name)[0]]
    assert sum(b.num_rows for b in written) == KERNELS * 20  # before any flush of the engine thread
    rec.resume()
    assert collector.on
    rec.close()
    idle = Recorder(tmp_path / "idle", engine="virtual", gpu_timing="kernels")
    idle.pause()
    assert idle.settle(timeout=0.01)
    idle.close()


def test_on_the_hooked_reference_engine_each_group_gets_a_window(tmp_path):
    """The real reference engine (tiny, CPU) measured through its hooks, which give each step its facts inside
    it: a batch-1 stretch, then a batch-4 one, with a budget that affords windows at the minimum gap; the
    batch-4 steps are instrumented with their batch. (A 2 ms switch at the default 0.5% budget affords no
    window in so short a run: the budget's allowance is tested on the virtual clock, above.)"""
    from engine_hooks import patcher
    from engine_hooks.reference import SPEC
    from reference_engine.config import Config
    from reference_engine.engine import Engine, SamplingParams

    opened: list[Recorder] = []

    def factory(engine: str, process_info: dict) -> Recorder:
        rec = Recorder(tmp_path / "run", engine=engine, process_info=process_info, gpu_timing="sampled")
        rec.start_kernel_timing(SlowSwitch(), budget=1.0)
        opened.append(rec)
        return rec

    statuses = patcher.install(SPEC, recorder_factory=factory)
    try:
        assert all(s.status == "installed" for s in statuses), statuses
        engine = Engine(Config(preset="tiny", device="cpu"))
        params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
        engine.generate([[5, 6, 7, 8]], params)
        engine.generate([[5, 6, 7, 8]] * 4, params)
    finally:
        patcher.reset()
    for rec in opened:
        rec.close()
    run = load_run(tmp_path / "run")
    steps = run.steps.sort_values("start_ns")
    inside, _ = instrumented_steps(steps["start_ns"].to_numpy("float64"), steps["end_ns"].to_numpy("float64"),
                                   run.kernel_windows)
    decode = (steps["phase"] == "decode").to_numpy()
    batches = steps["batch_size"].to_numpy("float64", na_value=np.nan)
    assert (decode & (batches == 4)).sum() >= 100
    assert (inside & decode & (batches == 4)).sum() >= 4, run.kernel_windows


def test_on_a_served_sweep_sampled_timing_keeps_to_its_budget_and_covers_the_decode_steps():
    """benchmarks/sampler_coverage.py's virtual sweep (levels 1-8, 8,001 steps), whose cost is known exactly:
    an eager engine whose steps CUPTI slows 4x costs at most 1% (a window a new group cost 3.8%), a graph
    engine's ~0.5% budget; nine decode steps in ten or more have kernel data of their group or its shape."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "sampler_coverage.py"
    spec = importlib.util.spec_from_file_location("sampler_coverage", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    steps = bench.sweep([1, 2, 4, 8], 32)
    for ratio, most in ((3.0, 0.01), (0.03, 0.0055)):
        inside, cost, _ = bench.play(steps, ratio=ratio, switch_ns=100_000, budget=0.005)
        own, with_borrowed = bench.coverage(steps, inside)
        assert cost <= most and own >= 0.9 and with_borrowed >= 0.95, (ratio, cost, own, with_borrowed)


@pytest.mark.parametrize("how", ["paused", "idle"])
def test_paused_or_idle_time_is_no_part_of_the_run_the_budget_is_a_share_of(tmp_path, monkeypatch, how):
    """hook_overhead.py pauses a sampled recorder while other modes' rounds run, and a served engine idles
    between loads: that time must not build up the allowance early windows are held to, or windows would
    cost the steps more than the budget. A new group after a long pause or idle stretch gets no window the
    steps alone would not afford."""
    for pause_s in (0.0, 100.0):
        clock = VirtualClock()
        rec, sampler = _virtual_sampler(tmp_path / f"{how}{pause_s}", monkeypatch,
                                        TimedSwitch(clock, switch_ns=2_000_000), clock)
        opened = []
        for i in range(120):
            if i == 80 and how == "paused":
                sampler.pause()
                clock.now += int(pause_s * 1e9)
                sampler.resume()
            elif i == 80:
                sampler.idle(clock.now)
                clock.now += int(pause_s * 1e9)
            before = sampler.windows
            clock.now = sampler.at_step(clock.now, 2 if i >= 80 else 1, "decode") + 200_000
            if sampler.windows > before:
                opened.append(i)
        sampler.close()
        rec.close()
        assert opened == [0, 35], (pause_s, opened)  # the two probes only, as without the pause


def test_the_recorder_tells_the_sampler_when_the_engine_goes_idle(tmp_path):
    rec = Recorder(tmp_path / "r", engine="virtual", gpu_timing="sampled")
    rec._sampler = sampler = KernelSampler(rec, VirtualCollector(), mode="sampled", drain_seconds=60)
    for _ in range(3):
        rec.step_begin(batch_size=1, phase="decode")
    rec.idle_begin()
    assert sampler._idle_t > 0
    t0 = sampler._t0
    time.sleep(0.05)
    rec.idle_end()
    rec.step_begin(batch_size=1, phase="decode")
    assert sampler._idle_t == 0 and sampler._t0 - t0 >= 50_000_000  # the idle time left the run's
    rec.close()


def test_the_kernel_budget_reaches_the_sampler_and_bad_values_are_refused(tmp_path, monkeypatch):
    """`overshoot run --kernel-budget 2%` sets OVERSHOOT_KERNEL_BUDGET for the server, whose recorders'
    samplers take it (and say so in their process record); a value that is no percentage is refused in one
    line before any server starts; a malformed environment value leaves the default and a note."""
    monkeypatch.setenv("OVERSHOOT_KERNEL_BUDGET", "0.02")
    rec = Recorder(tmp_path / "a", engine="virtual", gpu_timing="sampled")
    rec.start_kernel_timing(VirtualCollector())
    assert rec._sampler.budget == 0.02
    rec.close()
    record = json.loads(rec._io.json_path.read_text())
    assert record["kernel_timing"]["budget_pct"] == pytest.approx(2.0)
    monkeypatch.setenv("OVERSHOOT_KERNEL_BUDGET", "lots")
    rec = Recorder(tmp_path / "b", engine="virtual", gpu_timing="sampled")
    rec.start_kernel_timing(VirtualCollector())
    assert rec._sampler.budget == 0.005
    rec.close()
    errors = json.loads(rec._io.json_path.read_text())["errors"]
    assert any("OVERSHOOT_KERNEL_BUDGET='lots'" in e for e in errors), errors
    for bad, needle in (("ten", "bad --kernel-budget 'ten'"), ("0%", "must be more than 0%"),
                        ("150%", "at most 100%")):
        done = subprocess.run([sys.executable, "-m", "overshoot", "run", "--kernel-budget", bad,
                               "--out", str(tmp_path / bad.replace("%", ""))], capture_output=True, text=True)
        assert done.returncode == 2 and needle in done.stderr and len(done.stderr.strip().splitlines()) == 1


class TimedSwitches(VirtualCollector):
    """Each switch moves a virtual clock (a list holding its now) by `switch_ns`."""

    def __init__(self, clock: list[int], switch_ns: int):
        super().__init__()
        self.clock, self.switch_ns = clock, switch_ns

    def enable(self) -> None:
        super().enable()
        self.clock[0] += self.switch_ns

    def disable(self) -> None:
        super().disable()
        self.clock[0] += self.switch_ns


def _play_ranks(tmp_path, monkeypatch, *, lockstep: bool, steps: int = 6_000) -> tuple[list, list[float]]:
    """Two ranks' samplers over the same decode steps, each on a virtual clock of its own (1 ms steps ±2%),
    their collectors slowing steps 3% and 6% with switches of 0.1 and 0.15 ms (so their measured costs space
    their windows differently). Per rank: which steps ran inside a window; the windows' cost over the run."""
    from overshoot.record import kernel_timing

    clocks = [[10**12], [10**12]]
    now = [clocks[0]]
    monkeypatch.setattr(kernel_timing, "perf_counter_ns", lambda: now[0][0])
    ratios, switches = (0.03, 0.06), (100_000, 150_000)
    samplers = []
    for r in (0, 1):
        rec = Recorder(tmp_path / f"{lockstep}-{r}", engine="virtual")
        sampler = KernelSampler(rec, TimedSwitches(clocks[r], switches[r]), budget=0.005, drain_seconds=60)
        sampler.lockstep = lockstep
        samplers.append((rec, sampler))
    rng = np.random.default_rng(0)
    inside, plain = [[], []], [0, 0]
    for _ in range(steps):
        for r, (_rec, sampler) in enumerate(samplers):
            now[0] = clocks[r]
            t = sampler.at_step(clocks[r][0], 8, "decode")
            step = int(1_000_000 * (1 + rng.uniform(-0.02, 0.02)))
            clocks[r][0] = t + int(step * (1 + ratios[r] if sampler._on else 1))
            inside[r].append(sampler._on)
            plain[r] += step
    for rec, sampler in samplers:
        sampler.close(wait_seconds=0.1)
        rec.close()
    return inside, [(clocks[r][0] - 10**12) / plain[r] - 1 for r in (0, 1)]


def test_ranks_in_lockstep_open_their_windows_together(tmp_path, monkeypatch):
    """The engine core's steps need every rank's kernels. Sampling on their own, two ranks whose collectors
    cost differently open their windows apart and few steps are instrumented on both; in lockstep (windows at
    multiples of LOCKSTEP_SLOT, drawn from the step count alone) the ranks' windows nest: the steps the
    costlier rank instrumented the other did too, or nearly, each within its budget."""
    # (eight runs each: 9-25% of the fewer instrumented steps on both ranks apart, 84-99% in lockstep; the
    # rest in lockstep are windows one rank's budget shortened or left out, and each group's first window)
    apart, _ = _play_ranks(tmp_path, monkeypatch, lockstep=False)
    both = np.logical_and(*apart)
    assert both.sum() < 0.35 * min(sum(apart[0]), sum(apart[1])), (both.sum(), sum(apart[0]), sum(apart[1]))
    together, costs = _play_ranks(tmp_path, monkeypatch, lockstep=True)
    both = np.logical_and(*together)
    fewer = min(sum(together[0]), sum(together[1]))
    assert fewer >= 100 and both.sum() >= 0.75 * fewer, (both.sum(), sum(together[0]), sum(together[1]))
    assert all(0 < cost <= 0.006 for cost in costs), costs
    # windows open at step counts every rank shares: the probe at a multiple of LOCKSTEP_PROBE
    assert together[0].index(True) == together[1].index(True) == 63


def test_a_rank_of_several_samples_in_lockstep_and_says_so(tmp_path):
    """The hooks give a worker's parallel layout as process facts: world size 2 puts its sampler in lockstep
    (a single-rank worker's stays free), and the process record says which."""
    for world, expected in ((2, True), (1, False)):
        rec = Recorder(tmp_path / f"w{world}", engine="virtual")
        rec._sampler = KernelSampler(rec, VirtualCollector(), drain_seconds=0.05)
        rec.process_facts(rank=0, world_size=world)
        assert rec._sampler.lockstep is expected
        rec.step_begin(batch_size=1, num_tokens=1, phase="decode")
        rec.close()
        (process,) = load_run(tmp_path / f"w{world}").processes
        assert process["kernel_timing"]["lockstep"] is expected and process["world_size"] == world


def _windows_with_a_stall(tmp_path, monkeypatch, *, stall_ns: int, steps: int = 4_000) -> int:
    """Windows a sampler opens over `steps` decode steps of 1 ms on a virtual clock (its collector slowing
    steps 3%), the host stalling `stall_ns` once, on the third step after its second window closed."""
    from overshoot.record import kernel_timing

    clock = [10**12]
    monkeypatch.setattr(kernel_timing, "perf_counter_ns", lambda: clock[0])
    rec = Recorder(tmp_path / f"stall-{stall_ns}", engine="virtual")
    sampler = KernelSampler(rec, TimedSwitches(clock, 100_000), budget=0.005, drain_seconds=60)
    closed_at = None
    for i in range(steps):
        was_on = sampler._on
        t = sampler.at_step(clock[0], 8, "decode")
        if was_on and not sampler._on and sampler.windows == 2:
            closed_at = i
        stall = stall_ns if closed_at is not None and i == closed_at + 3 else 0
        clock[0] = t + int(1_000_000 * (1.03 if sampler._on else 1.0)) + stall
    windows = sampler.windows
    sampler.close(wait_seconds=0.1)
    rec.close()
    return windows


def test_a_one_off_stall_after_a_window_does_not_stop_the_sampling(tmp_path, monkeypatch):
    """A stall of 50 ms on one step after a window (a collection, a preemption: it may hold every process of
    the engine) is no cost of that window: counted whole, it spaced the next window 10,000 steps away and the
    run kept no window after it. The largest excess after a window is left out where it outweighs the rest."""
    plain = _windows_with_a_stall(tmp_path, monkeypatch, stall_ns=0)
    stalled = _windows_with_a_stall(tmp_path, monkeypatch, stall_ns=50_000_000)
    assert plain >= 10 and stalled >= 0.8 * plain, (plain, stalled)
