"""Kernel timing: windows of steps in which a collector records every GPU kernel and copy (docs/concepts.md).

Two CUDA events a step see the GPU interval, not the gaps between kernels inside it; kernel records do. The
collector (CUPTI by default, record/cupti/; anything with the `Collector` methods, e.g. a synthetic device)
is switched on and off at step boundaries by the engine thread, which costs a call into the collector and
nothing else. Its records are parsed, handed to `Recorder.kernel_spans` and written to the spool
(`Recorder.write_kernels`) on a thread of its own, so the engine thread does no work per kernel. Each window
is stored (`Recorder.kernel_window`) so the analyzer knows which steps were instrumented.

Modes: "kernels" records every step (one window for the whole run). "sampled" records windows of
`window_steps` steps and spaces them so that what a window costs (the measured slowdown of its steps and the
time of its two switches), averaged over the run, stays within `budget` (the spacing adapts: a collector that
slows eager steps 3x gets windows far apart, one that costs 3% gets them often). A window also opens early,
after at least `min_gap` steps, the first time a (phase, batch size) is seen outside any window, so that the
groups of a load sweep get kernel data of their own; such a window is shortened (to as few as one step) or
left out so that what every window cost so far stays within 1.5 times the budget of the run's time (idle and
paused stretches left out), and a regular window waits until the total is back within the budget: with a
costly collector a sweep of many groups would otherwise pay a window a group (seen on a virtual sweep: 3% at a
0.5% budget, a collector slowing steps 4x). The first window, opened as soon as the collector is ready
(usually in the engine's warm-up), is a probe of `probe_steps` that measures the cost and marks no group as
seen. In lockstep (a rank of a multi-rank engine: `Recorder.process_facts` with world_size > 1), windows open
only at multiples of `LOCKSTEP_SLOT` steps, a regular one where a number drawn from the step count alone falls
below the rate its gap sets (`_lockstep_length`). Every rank counts the same steps (one per scheduler output)
and draws the same numbers, so the ranks' windows coincide, or nest where their measured costs differ, and
the engine core's steps, which need every rank's kernels, get instrumented steps; ranks sampling on their own
open their windows apart. In both modes the collector's once-a-process
set-up (`prepare`: CUPTI's is 50-240 ms) runs on the drain thread, and the first window opens after it: the
engine thread never stalls for it, and in kernels mode the steps before that window are what the analyzer sets
the instrumented steps against to measure the collector's own cost per launch call.

A window closes at a step boundary, but the collector is switched off only once the GPU has finished the
work launched inside it (`fence`: the CUDA end event of the latest step, queried without waiting; at most
`close_steps` steps later). CUPTI times a kernel still running when its kind is disabled with whatever
comes next (seen on the H200: kernels of 2 ms recorded as 167-477 ms, ending at the next flush or enable).
Records of work launched after a window closed (in those few steps), or that ended after the collector went
off, are dropped on delivery and counted (`info()["dropped_outside_windows"]`).
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any, Protocol

from overshoot.record.errors import KernelTimingError

__all__ = ["Collector", "KernelSampler", "KernelTimingError", "cupti_collector", "unavailable_reason"]

TIMING_LABEL = "overshoot:kernel-timing"
# Early windows (a group's first) may run what all windows cost up to this many times the budget; regular
# windows then wait until it is back within the budget.
EARLY_ALLOWANCE = 1.5
# In lockstep windows open only at multiples of this step count (ranks ready within it probe together).
LOCKSTEP_SLOT = 64


class Recorder(Protocol):
    """What the sampler uses of the recorder (a protocol: this module does not import the recorder)."""

    _sampler: Any
    _io: Any

    def kernel_spans(self, columns: dict) -> None: ...
    def kernel_window(self, start_ns: int, end_ns: int) -> None: ...
    def write_kernels(self, *, wait: bool = True) -> None: ...
    def _emit_span(self, step: int, kind: str, label: str, start: int, dur: int) -> None: ...


class Collector(Protocol):
    def describe(self) -> dict: ...
    def enable(self) -> None: ...  # engine thread, at a step boundary
    def disable(self) -> None: ...  # engine thread, at a step boundary
    def collect(self, *, final: bool = False) -> dict | None: ...  # kernels-table columns, host clock
    def close(self) -> None: ...
    # Optional, `prepare(self) -> None`: the collector's once-a-process set-up, run on the drain thread
    # before the first window (the first window waits for it; the engine thread does not).


def cupti_collector() -> Collector:
    """The default collector: CUPTI activity records through a small native shim (record/cupti/)."""
    from overshoot.record.cupti import CuptiCollector

    return CuptiCollector()


def unavailable_reason(*, cuda: bool) -> str | None:
    """Why kernel timing (CUPTI) cannot run here, in one line; None when it can."""
    if not cuda:
        return "needs a CUDA GPU and none was found; use --gpu-timing events (or off)"
    from overshoot.record.cupti import unavailable_reason as cupti_reason

    return cupti_reason(cuda=True)


class KernelSampler:
    """Opens and closes collection windows at step boundaries; a drain thread feeds the recorder."""

    def __init__(self, recorder: Recorder, collector: Collector, *, mode: str = "sampled",
                 window_steps: int = 8, min_gap: int = 64, budget: float = 0.005,
                 drain_seconds: float = 0.5, fence: Callable[[], Callable[[], bool] | None] | None = None,
                 close_steps: int = 16, probe_steps: int = 3):
        if mode not in ("kernels", "sampled"):
            raise ValueError(f"kernel timing mode must be kernels or sampled, not {mode!r}")
        self.recorder = recorder
        self.collector = collector
        self.mode = mode
        self.window_steps = window_steps
        self.probe_steps = max(2, min(probe_steps, window_steps))  # two: the first carries the switch
        self.min_gap = min_gap
        self.budget = budget
        self.fence = fence  # () -> done() of the GPU work launched so far, or None (no GPU to wait for)
        self.close_steps = close_steps
        self.windows = 0
        self.dropped = 0  # records outside every window, or that ended after the collector went off
        self.cost_ratio: float | None = None  # last measured slowdown of steps inside a window
        self.lockstep = False  # windows at step counts every rank shares (module docstring)
        self._k = 0  # step boundaries seen
        self._on = False
        self._closing: Callable[[], bool] | None = None  # window closed; the collector stays on until True
        self._closing_steps = 0
        self._paused = False
        self._switch_offs = 0  # read by the drain thread: a window's records to deliver after it
        # [start, end, collector off] of every window, host ns (inf while open or still collecting):
        # appended by the engine thread, read by the drain thread
        self._spans: list[list[float]] = []
        self._window_start = 0
        self._steps_in_window = 0
        self._window_len = window_steps  # steps of the window open now (a probe or an early one: fewer)
        # The run's account (host ns): its time from the first step boundary, what the windows before the
        # last one cost, and the last one's cost in two parts (per instrumented step, and its switches and
        # the steps after it) as last measured; None until a window was measured.
        self._t0 = 0
        self._pause_t = 0  # when pause() was called (0: not paused)
        self._idle_t = 0  # when the engine went idle (0: it is stepping)
        self._spent_ns = 0.0
        self._window_cost_ns = 0.0
        self._per_step_ns: float | None = None
        self._fixed_ns = 0.0
        self._unpriced: dict[int, int] = {}  # steps of each window closed before any cost could be measured
        self._steps_since = 0  # steps since the last window closed
        self._gap = min_gap
        self._last_t = 0
        self._plain = deque(maxlen=window_steps)  # durations of the last plain steps
        # ... and of each (phase, batch size): a step inside or after a window is set against plain steps
        # of its own kind (a prefill after a window is no slowdown of decode steps)
        self._plain_of: dict[tuple, deque] = {}
        self._key: tuple = (None, None)  # (phase, batch size) of the step running now
        self._inside: list[tuple[int, tuple]] = []  # (duration, key)
        # Steps from the window's close until `window_steps` plain steps after the collector went off: on
        # the H200 they ran 2-6 ms slower each in an eager engine (the drain thread parsing the window's
        # records holds the GIL), a cost of the window as much as its switches.
        self._after: list[tuple[int, tuple]] = []
        self._after_left = 0
        self._switch_ns = 0  # time the last window's two switches took (between steps, on the engine thread)
        self.switch_ns_total = 0  # every switch, the first enable's set-up included
        self.setup_ns = 0  # the collector's set-up inside its first enable (once a process)
        # The drain thread's own time (collect, filter, hand over), mostly holding the GIL: the engine thread
        # can wait for it, so its total and longest stretch are part of what the mode costs.
        self.drains, self.drain_ns_total, self.drain_ns_max = 0, 0, 0
        # Its CPU time by the window open or last opened when a delivery began: while it holds the GIL a
        # CPU-bound engine thread waits, in slices of the switch interval (5 ms), possibly long after the
        # steps counted in `_after`. A window's cost is at least what the windows before cost it (median).
        self._drain_cpu_by_window: dict[int, int] = {}
        self._seen: set[tuple] = set()
        # The collector is set up on the drain thread; windows open once that is done.
        self._prepared = threading.Event()
        self._failed = False  # the set-up raised: no window will open
        self.prepare_ns = 0
        if not hasattr(collector, "prepare"):
            self._prepared.set()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._settled = threading.Event()  # cleared by pause until the drain thread delivered the rest
        self._settled.set()
        self._closed = False
        self._thread = threading.Thread(target=self._drain_loop, args=(drain_seconds,),
                                        name="overshoot-kernels", daemon=True)
        self._thread.start()

    # ---- engine thread ----

    def at_step(self, t: int, batch_size: int | None, phase: str | None, *,
                ended: tuple | None = None) -> int:
        """Called by step_begin at `t` with the starting step's facts, if known yet, and the (phase, batch
        size) of the step that ends at `t` as it ended (`ended`: hooked engines give a step its facts inside
        it, once scheduled); returns the time the step starts (after any switch)."""
        key, self._key = self._key, (phase, batch_size)  # the step that ends at `t`, the one that starts
        self._k += 1
        if ended is not None:
            key = ended
        if not self._t0:
            self._t0 = t
        if self._idle_t:  # the engine was idle since then: no step, and no part of the run's time
            self._t0 += t - self._idle_t
            self._idle_t = self._last_t = 0
        if self._closing is not None:  # the closed window's GPU work may still run: off once it is done
            if self._last_t:  # a step still under the collector is neither plain nor inside a window
                self._after.append((t - self._last_t, key))
            self._last_t = t
            self._closing_steps += 1
            if self._closing_steps < self.close_steps and not self._fence_done():
                return t
            return self._switch_off(t)
        last, self._last_t = self._last_t, t
        if last:
            if self._on or self._after_left > 0:
                self._count_step(t - last, key)
            else:  # a plain step, the common case: inline (each Python call costs µs inside a real step)
                self._plain.append(t - last)
                same = self._plain_of.get(key)
                if same is None:
                    same = self._plain_of[key] = deque(maxlen=self.window_steps)
                same.append(t - last)
        if self._on:
            self._steps_in_window += 1
            # The first window opens as soon as the collector is ready, usually in the engine's warm-up: the
            # groups it saw still get a window once they run for real.
            if self.windows > 1:
                self._seen.add(key)  # the step that ran inside the window
            if self.mode == "kernels" or self._steps_in_window <= self._window_len:
                return t
            return self._close_window(t)
        self._steps_since += 1
        length = self.window_steps if self.windows else self.probe_steps  # (the first opens once it can)
        if self.windows and self.lockstep and self.mode == "sampled":
            length = self._lockstep_length(t, phase, batch_size, key)
            if length < 1:
                return t
        elif self.windows:
            if self._steps_since < self._gap:
                if self._steps_since < self.min_gap:
                    return t
                if not self._unseen(phase, batch_size, key):  # due early only for a group's first window
                    return t
                length = self._affordable(t, allowance=EARLY_ALLOWANCE, share=0.5)
            else:
                length = self._affordable(t, allowance=1.0)
            if length < 1:
                return t
        elif self.lockstep and self.mode == "sampled" and self._k % LOCKSTEP_SLOT:
            return t
        if self._prepared.is_set():
            self._steps_in_window = 1
            self._window_len = length
            return self._open_window(t)
        return t

    def _unseen(self, phase: str | None, batch_size: int | None, key: tuple) -> bool:
        """The starting step's group had no window yet. Its facts may be unknown still (the hooks give them
        inside the step): then the step before's group (`key`), which a served engine changes seldom from one
        step to the next."""
        coming = (phase, batch_size) if phase is not None or batch_size is not None else key
        return coming not in self._seen

    def _lockstep_length(self, t: int, phase: str | None, batch_size: int | None, key: tuple) -> int:
        """Lockstep: a window's length if one opens at this step count, else 0. Windows open only at
        multiples of LOCKSTEP_SLOT: a group's first (early, as outside lockstep) or, with the probability
        that spaces windows by the gap (slot / (gap + length)), a regular one, drawn from the step count
        alone. Every rank draws the same number at the same count, so a rank whose windows cost more (a lower
        probability) opens a subset of the windows of one whose cost less: common random numbers."""
        if self._k % LOCKSTEP_SLOT or self._steps_since < self.window_steps:
            return 0
        if self._unseen(phase, batch_size, key) and self._steps_since >= self.min_gap:
            length = self._affordable(t, allowance=EARLY_ALLOWANCE, share=0.5)
            if length >= 1:
                return length
            # (an early window this rank cannot afford yet: the regular draw still stands)
        if _shared_draw(self._k // LOCKSTEP_SLOT) >= LOCKSTEP_SLOT / (self._gap + self.window_steps):
            return 0
        # (the draw keeps the windows' cost at the budget on average; this caps a burst of them)
        return self._affordable(t, allowance=EARLY_ALLOWANCE)

    def _affordable(self, t: int, *, allowance: float, share: float = 1.0) -> int:
        """Steps of a window (up to window_steps) that keep what every window cost, this one as the last
        measured one costs, within `allowance` x budget of the run's time so far, using at most `share` of
        what is left (an early window leaves some for the next new group); 0: none."""
        if self._per_step_ns is None:  # no window's cost measured yet: another probe
            return self.probe_steps
        # (this window's switches and the steps after it: as the last one's)
        spent = self._spent_ns + self._window_cost_ns + self._fixed_ns
        room = allowance * self.budget * (t - self._t0) - spent
        if room <= 0:
            return 0
        if self._per_step_ns <= 0:
            return self.window_steps
        return min(self.window_steps, int(share * room / self._per_step_ns))

    def _count_step(self, duration: int, key: tuple) -> None:
        """A step inside a window, or just after one; plain steps are counted in at_step."""
        if self._on:
            self._inside.append((duration, key))
        else:  # just after a window: its records are being parsed, a cost of it
            self._after.append((duration, key))
            self._after_left -= 1
            if self._after_left == 0:
                self._gap = self._next_gap()

    def idle(self, t: int) -> None:
        """The engine went idle at `t` (no work): until its next step, time that windows cost no one."""
        if self._t0 and not self._idle_t:
            self._idle_t = t

    def state(self) -> str:
        """"ready" (a window can open at the next step boundary), "setting up" (the drain thread is setting
        the collector up) or "off" (its set-up failed, or the sampler is closed)."""
        if self._failed or self._stop.is_set():
            return "off"
        return "ready" if self._prepared.is_set() else "setting up"

    def pause(self) -> None:
        """Collector off while the host runs work it does not record (no steps: the unhooked rounds of
        benchmarks/hook_overhead.py); `resume` puts it back as it was. Call with the GPU idle."""
        self._pause_t = perf_counter_ns()
        self._paused = self._on or self._closing is not None
        if self._paused:
            self._settled.clear()
            self._call(self.collector.disable)
            self._switch_offs += 1  # the drain thread delivers what is left at once, then rests until resume
            self._wake.set()

    def settle(self, timeout: float = 5.0) -> bool:
        """After `pause`: wait until the drain thread has delivered and written every record of the work
        before it (so that its work is not done during whatever runs next). False on timeout."""
        return self._settled.wait(timeout) or self._stop.is_set()

    def resume(self) -> None:
        if self._paused:
            self._paused = False
            self._call(self.collector.enable)
        self._last_t = 0  # the time in between was no step
        if self._t0 and self._pause_t:  # ... nor part of the run whose time the budget is a share of
            self._t0 += perf_counter_ns() - self._pause_t
        self._pause_t = 0

    def _open_window(self, t: int) -> int:
        setup_before = getattr(self.collector, "setup_ns", 0)
        if not self._call(self.collector.enable):
            return perf_counter_ns()
        t_after = perf_counter_ns()
        # A collector's first enable in a process also sets it up (CUPTI: 50-240 ms in the served engine on
        # the H200), paid once, not by every window: spaced by it, the next window would come tens of
        # thousands of steps later.
        setup = getattr(self.collector, "setup_ns", 0) - setup_before
        self.setup_ns += setup
        self._on = True
        self._window_start = t_after
        self._spans.append([t_after, math.inf, math.inf])
        self.windows += 1
        self._spent_ns += self._window_cost_ns  # the window before is paid for
        self._window_cost_ns = 0.0
        self._inside, self._after, self._after_left = [], [], 0
        self._switch_ns = max(0, t_after - t - setup)
        return self._after_switch(t, t_after)

    def _close_window(self, t: int) -> int:
        """The window ends at `t`; the collector goes off now if the GPU has nothing of it left to run,
        else at a later step boundary (at_step)."""
        self._on = False
        self.recorder.kernel_window(self._window_start, t)
        self._spans[-1][1] = t
        self._steps_since = 0
        self._closing = self._make_fence()
        self._closing_steps = 0
        return self._switch_off(t) if self._fence_done() else t

    def _switch_off(self, t: int) -> int:
        self._closing = None
        if not self._call(self.collector.disable):
            return perf_counter_ns()
        t_after = perf_counter_ns()
        self._spans[-1][2] = t  # records that end later are not trusted: the collector was going off
        self._switch_ns += t_after - t
        self._gap = self._next_gap()  # both switches known now; again once the steps after are
        self._after_left = self.window_steps
        self._switch_offs += 1
        self._wake.set()
        return self._after_switch(t, t_after)

    def _after_switch(self, t: int, t_after: int) -> int:
        self.switch_ns_total += t_after - t
        self.recorder._emit_span(-1, "busy", TIMING_LABEL, t, t_after - t)
        self._last_t = t_after
        return t_after

    def _call(self, switch: Callable[[], None]) -> bool:
        try:
            switch()
            return True
        except Exception as e:  # never take the engine down: stop timing kernels, say why
            self._on = False
            self._closing = None
            self.recorder._sampler = None
            self.recorder._io.note_error(f"kernel timing stopped: {type(e).__name__}: {e}")
            self._stop.set()  # the recorder no longer closes this sampler: end its drain thread now
            self._wake.set()
            return False

    def _make_fence(self) -> Callable[[], bool]:
        try:
            done = self.fence() if self.fence is not None else None
        except Exception:
            done = None
        return done or (lambda: True)

    def _fence_done(self) -> bool:
        try:
            return self._closing is None or bool(self._closing())
        except Exception:  # a fence that cannot answer: stop waiting on it
            return True

    def _next_gap(self) -> int:
        """Plain steps before the next window, so that what a window cost (its steps' slowdown, its two
        switches and the excess of the steps after it or, if larger, the drain thread's CPU time for its
        records, measured) is `budget` of the time until the next one; at least min_gap. Medians inside: one
        preempted step must not move the spacing. Each step inside or after the window is set against the
        plain steps of its phase and batch size; one of a kind with no plain step yet is not counted (the
        drain thread's measured CPU time still bounds the window's cost from below)."""
        inside = self._inside[1:]  # the first step after switching on carries the switch
        # Before any plain step (the first window opens at once) the steps inside stand for plain ones.
        baseline = list(self._plain) or [d for d, _ in inside]
        if not baseline:
            return self.min_gap
        plain = statistics.median(baseline)
        if plain <= 0:
            return self.min_gap
        medians = {key: statistics.median(d) for key, d in self._plain_of.items() if d}
        slowed = [d / medians[key] for d, key in inside if medians.get(key)]
        # (a window with no step to measure, e.g. of a kind with no plain step yet: the last ratio stands)
        ratio = max(statistics.median(slowed) - 1.0, 0.0) if slowed else (self.cost_ratio or 0.0)
        self.cost_ratio = ratio
        # (less the largest excess where it outweighs all the others: a one-off stall after a window, a
        # collection or a preemption that may hold every process of the engine, would otherwise space the
        # next window thousands of steps away; a parse that slows one step is bounded from below by the
        # drain thread's CPU time)
        excess = [d - medians[key] for d, key in self._after if medians.get(key)]
        after_ns = sum(excess)
        if excess and max(excess) > after_ns - max(excess):
            after_ns -= max(excess)
        after_ns = max(0.0, after_ns)
        # this window's records may not be parsed yet: the earlier windows' parses stand in for them, the
        # probe's excepted (the drain thread's first delivery also pays its one-time set-up: 2-16 ms seen on
        # the VM, which spaced the next window hundreds of steps away)
        parsed = [cpu for w, cpu in list(self._drain_cpu_by_window.items()) if 1 < w < self.windows]
        drain_ns = statistics.median(parsed) if parsed and self.mode == "sampled" else 0
        self._fixed_ns = self._switch_ns + max(after_ns, drain_ns)
        if slowed or self._per_step_ns is not None:
            if self._per_step_ns is None:  # the windows before had nothing to measure against: priced now
                self._spent_ns += sum(self._unpriced.values()) * ratio * plain
            self._per_step_ns = ratio * plain
        else:
            self._unpriced[self.windows] = len(self._inside)
        # every step of the window ran under the collector (the first is left out of the ratio only)
        cost_ns = self._window_cost_ns = len(self._inside) * ratio * plain + self._fixed_ns
        return max(self.min_gap, int(cost_ns / (self.budget * plain)))

    # ---- drain thread ----

    def _drain_loop(self, seconds: float) -> None:
        if not self._prepared.is_set():
            t = perf_counter_ns()
            try:
                self.collector.prepare()
            except Exception as e:  # no window ever opens: the run goes on with events
                self.recorder._io.note_error(f"kernel timing not started: {type(e).__name__}: {e}")
                self._failed = True
                return
            finally:
                self.prepare_ns = perf_counter_ns() - t
            self._prepared.set()
        seen_offs, after_off = 0, 0
        while not self._stop.is_set():
            self._wake.wait(seconds)
            self._wake.clear()
            if self._stop.is_set():
                break
            offs = self._switch_offs
            if self._paused and not self._settled.is_set():
                # paused with the GPU idle: CUPTI's buffers can be forced out now, no need to look again
                seen_offs, after_off = offs, 0
                self._deliver(final=True)
                self._settled.set()
                continue
            if offs > seen_offs:  # a window's collector went off: CUPTI hands over a buffer only once all
                seen_offs, after_off = offs, 3  # its records are complete, so look a few more times
            # Between windows (or paused) the collector is off and has nothing left to hand over: no flush,
            # no work on this thread that could take the GIL from the engine thread.
            if (self._on and not self._paused) or self._closing is not None or after_off > 0:
                after_off = max(after_off - 1, 0)
                self._deliver(final=False)

    def _deliver(self, *, final: bool) -> None:
        t, cpu, window = perf_counter_ns(), time.thread_time_ns(), self.windows
        try:
            columns = self.collector.collect(final=final)
        except Exception as e:
            self.recorder._io.note_error(f"kernel records lost: {type(e).__name__}: {e}")
            return
        if columns is not None:
            columns = self._inside_windows(columns)
        if columns is not None:
            self.recorder.kernel_spans(columns)
        self.recorder.write_kernels()  # here, not in the engine thread's flush
        took = perf_counter_ns() - t
        cpu = time.thread_time_ns() - cpu  # its wall time also counts its waits for the GIL
        self._drain_cpu_by_window[window] = self._drain_cpu_by_window.get(window, 0) + cpu
        self.drains += 1
        self.drain_ns_total += took
        self.drain_ns_max = max(self.drain_ns_max, took)

    def _inside_windows(self, columns: dict) -> dict | None:
        """The records launched inside a window (by GPU start where the launch is unknown) that ended
        before the collector went off; None when no record is left."""
        import numpy as np

        launch = np.asarray(columns["launch_start_ns"], dtype="float64")
        key = np.where(np.isnan(launch), np.asarray(columns["gpu_start_ns"], dtype="float64"), launch)
        end = np.asarray(columns["gpu_end_ns"], dtype="float64")
        # windows in time order, never overlapping: each record's is the last one opened before it
        spans = np.array(self._spans or [[np.inf] * 3], dtype="float64")
        at = np.searchsorted(spans[:, 0], key, side="right") - 1
        window = spans[np.maximum(at, 0)]
        keep = (at >= 0) & (key <= window[:, 1]) & (end <= window[:, 2])
        if keep.all():
            return columns
        self.dropped += int((~keep).sum())
        if not keep.any():
            return None
        rows = np.flatnonzero(keep)
        return {name: _take(values, rows) for name, values in columns.items()}

    def close(self, *, wait_seconds: float = 2.0) -> None:
        """Close the open window and deliver every outstanding record (forced, with the collector still on,
        after up to `wait_seconds` for the window's GPU work), then switch off and stop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5.0)
        if self._on or self._closing is not None:
            if self._on:
                self._on = False
                t = perf_counter_ns()
                self.recorder.kernel_window(self._window_start, t)
                self._spans[-1][1] = t
                self._closing = self._make_fence()
            deadline = time.monotonic() + wait_seconds
            while not self._fence_done() and time.monotonic() < deadline:
                time.sleep(0.001)
            self._closing = None
            self._deliver(final=True)
            try:
                self.collector.disable()
            except Exception:
                pass
            self._spans[-1][2] = perf_counter_ns()
        self._deliver(final=True)
        try:
            self.collector.close()
        except Exception:
            pass

    def info(self) -> dict:
        spent = self._spent_ns + self._window_cost_ns
        run_ns = (self._last_t - self._t0) if self._t0 and self._last_t else 0
        return {"mode": self.mode, "windows": self.windows, "window_steps": self.window_steps,
                "budget_pct": 100.0 * self.budget,
                "cost_pct": 100.0 * spent / run_ns if run_ns > 0 and self.mode == "sampled" else None,
                "last_cost_ratio": self.cost_ratio, "dropped_outside_windows": self.dropped,
                "lockstep": self.lockstep,
                "switch_ms": self.switch_ns_total / 1e6, "setup_ms": self.setup_ns / 1e6,
                "prepare_ms": self.prepare_ns / 1e6,
                "drains": self.drains, "drain_ms": self.drain_ns_total / 1e6,
                "drain_ms_max": self.drain_ns_max / 1e6,
                "drain_cpu_ms": sum(self._drain_cpu_by_window.values()) / 1e6,
                "collector": self.collector.describe()}


def _shared_draw(n: int) -> float:
    """A number in [0, 1) that depends on `n` alone (splitmix64's finaliser): the same in every process."""
    z = (n * 0x9E3779B97F4A7C15 + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


def _take(values, rows):
    """Rows `rows` of one kernels column: a list, a numpy array or an Arrow array (the collector's names)."""
    import numpy as np
    import pyarrow as pa

    from overshoot.record.writer import int_column

    if isinstance(values, list):
        return [values[i] for i in rows]
    if isinstance(values, pa.Array):
        return values.take(int_column(rows, pa.int64()))
    return np.asarray(values)[rows]
