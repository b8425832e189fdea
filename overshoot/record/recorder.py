"""The timer API: busy / wait / idle spans and step boundaries on one engine thread, spooled to a run dir.

Hot path design: every per-call method writes into preallocated columns indexed by a counter (int64 buffers
for the times in C, lists in Python: int_buffer) and reads `time.perf_counter_ns()` once. The calls made once
or more a step (spans, step boundaries, step facts, the CUDA event calls) are hot.c's RecorderCore, this
class's base, where it compiled (record/hotpath.py), else their Python twin (record/core.py).
`rec.busy("x")` returns a context manager cached per label, built to cost about what the begin/end pair
costs (hot.c's Scope, else record/scopes.py).
Flushing (Arrow conversion + write) happens between steps, every `flush_steps` steps or `flush_seconds`, at
idle begin (at most every 10 ms, for engines that poll), on close, atexit and SIGTERM/SIGINT
(record/lifecycle.py). A flush between steps is recorded as a busy span labelled
"overshoot:flush" at step -1, so its cost is visible and never inflates a step's busy time. In a GPU-bound
stretch (the last step waited >= 0.2 ms) a due flush runs instead at the start of the next wait, where the
thread waits anyway (its span lies inside that wait), when it took at most 80% of the last wait before;
buffers 3/4 full make a flush due there only, so that a synchronous GPU-bound engine never flushes between
steps (full buffers and the flush interval still force one).

Semantics (docs/contracts.md section 1):
- a step lasts from `step_begin` to the next `step_begin`, `step_end`, `idle_begin` or `close`;
- wait_ns of a step = union of its outermost wait spans (a wait inside a wait counts once);
- a span open at a step boundary is split there: the part before belongs to the old step;
- idle spans end the open step and belong to no step (step -1);
- GPU: one interval per step, from the first `gpu_begin` to the last `gpu_end` (CUDA events) or from
  `gpu_span(start_ns, end_ns)` calls (a device whose times are known on the host clock);
- kernels: `kernel_span` / `kernel_spans` (any thread) record GPU kernels and copies whose times are on the
  host clock, and `kernel_window` the host-time windows in which every kernel was recorded; the analyzer
  gives each kernel to the step during which it was launched. `gpu_timing="kernels"|"sampled"` runs the CUPTI
  collector (record/kernel_timing.py) that feeds them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from time import perf_counter_ns

from overshoot.record import hotpath, lifecycle
from overshoot.record.core import (
    FLUSH,
    FLUSH_IN_WAIT_MARGIN,
    RESOLVE,
    WORK_IN_WAIT_NS,
    PyRecorderCore,
)
from overshoot.record.gc_spans import GC_LABEL, GcSpans
from overshoot.record.nvtx import make_ranges
from overshoot.record.scopes import (
    BUSY,
    IDLE,
    MAX_DEPTH,
    WAIT,
    IdleScope,
    ScopeCache,
    SpanScope,
    StepScope,
    fast_scope,
)
from overshoot.record.writer import RecorderIO

# The per-call core and the state it keeps: hot.c's RecorderCore where it compiled, else record/core.py.
RecorderCore = hotpath.native.RecorderCore if hotpath.native is not None else PyRecorderCore

FLUSH_LABEL = "overshoot:flush"
# Buffers filled this far make a flush due where it fits inside a wait; only full buffers (or the flush
# interval) force one between steps. A synchronous GPU-bound engine waits every step: its flushes all fit.
SOFT_FILL = 0.75
RESOLVE_IN_WAIT_SLOTS = 8  # at most this many steps' events resolved in one wait
# events: two CUDA events a step (the GPU interval); kernels: every kernel and copy (CUPTI); sampled: kernels
# in windows of steps, spaced to keep the collector's cost within budget; off: no GPU timing.
GPU_TIMINGS = ("events", "kernels", "sampled", "off")


def _int_or_none(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def int_buffer(n: int) -> memoryview | list[int]:
    """n int64 slots, zeroed, for the C core; items read and written as Python ints, the whole as a buffer
    (the writer builds its Arrow columns from it without a Python loop). The Python core gets a list: a
    memoryview's item store costs it ~10% more a step."""
    return memoryview(bytearray(8 * n)).cast("q") if hotpath.native is not None else [0] * n


def _joined(column: memoryview | list, rows: list) -> memoryview | list:
    """A buffer's rows followed by the CUDA ring's rows resolved in waits (usually none)."""
    return [*column, *rows] if rows else column


class Recorder(RecorderCore):
    """Per-thread step timer, writing to RUN/spool/. See the module docstring and docs/contracts.md §1.

    Options (keyword-only): `engine` (name in meta.json), `flush_steps` / `flush_seconds` (chunk size, checked
    at step boundaries), `nvtx` (None: env OVERSHOOT_NVTX=1), `thread_tag` (file/`thread` name, default the
    thread's name), `process_info` (merged into RUN/spool/{pid}-{tag}.json, e.g. {"hooks": [...]}),
    `cuda=True` to set up the CUDA event ring (and its one clock-anchor sync) now rather than at the first
    `gpu_begin`, `span_capacity` (span buffer rows; default 16 x flush_steps, flushed early when full).

    Signals: handlers for SIGTERM/SIGINT are installed when a Recorder is created on the main thread; a
    process whose recorders live on other threads should call `install_signal_handlers()` from its main
    thread (the hook bootstrap does). Without them, atexit still flushes at a normal exit.
    """

    # Slots, not an instance dict: with this many attributes CPython 3.11 stops sharing dict keys and every
    # attribute access on the hot path gets ~20% slower.
    __slots__ = (
        "run_dir", "engine", "flush_steps", "tag", "__weakref__", "_idle_flush_ns", "_owner", "_io",
        "_w_steps", "_w_spans", "_w_gpu", "_ring_rows", "_flush_lock", "_flushing_ident", "_paused_at",
        "_closed", "_k_lock", "_kw_lock", "_k_batches", "_k_rows", "_k_windows", "gpu_timing", "busy",
        "_wait_scopes", "_idle_scope", "_gc",
    )

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        engine: str = "unknown",
        flush_steps: int = 256,
        flush_seconds: float = 1.0,
        nvtx: bool | None = None,
        thread_tag: str | None = None,
        process_info: dict | None = None,
        cuda: bool = False,
        span_capacity: int | None = None,
        gpu_timing: str | None = None,
    ):
        if flush_steps < 1:
            raise ValueError("flush_steps must be >= 1")
        # None: env OVERSHOOT_GPU_TIMING (set by `overshoot run --gpu-timing`), else "events".
        gpu_timing = gpu_timing or os.environ.get("OVERSHOOT_GPU_TIMING") or "events"
        if gpu_timing not in GPU_TIMINGS:
            raise ValueError(f"gpu_timing must be one of {', '.join(GPU_TIMINGS)}, not {gpu_timing!r}")
        self.gpu_timing = gpu_timing
        self.run_dir = Path(run_dir)
        self.engine = engine
        self.flush_steps = flush_steps
        self._flush_interval_ns = int(flush_seconds * 1e9)
        # Engines that poll for work enter idle every loop: flush there at most once per interval (>= 10 ms).
        self._idle_flush_ns = max(10_000_000, self._flush_interval_ns)
        self._owner = threading.get_ident()
        self._nvtx = make_ranges(nvtx)
        self._nvtx_step = None
        options = {"flush_steps": flush_steps, "flush_seconds": flush_seconds, "nvtx": self._nvtx is not None,
                   "gpu_timing": gpu_timing, "hotpath": hotpath.describe()}
        thread_name = threading.current_thread().name
        self._io = RecorderIO(
            self.run_dir, engine=engine, thread_name=thread_name, thread_tag=thread_tag or thread_name,
            options=options, process_info=process_info or {},
        )
        self.tag = self._io.tag

        # Columnar buffers: steps (one row per finished step), spans, host-clock GPU intervals.
        n = flush_steps
        self._steps_cap = n
        # The int columns are raw int64 buffers (int_buffer): a store writes 8 bytes, where a list slot
        # allocates an int and frees the one written a buffer's length ago, memory long gone from the cache
        # in a real engine's step (on a CPU-only tiny engine the hooked calls cost several times more inside
        # its steps than around a stub, and these stores were a third of it).
        self._s_step, self._s_start, self._s_end, self._s_wait = (int_buffer(n) for _ in range(4))
        self._s_batch, self._s_tokens, self._s_phase = [None] * n, [None] * n, [None] * n
        self._s_facts: list[dict | None] = [None] * n
        self._n_steps = 0
        self._spans_cap = span_capacity or max(1024, 16 * n)
        m = self._spans_cap
        self._p_step, self._p_start, self._p_dur = (int_buffer(m) for _ in range(3))
        self._p_kind, self._p_label = [None] * m, [None] * m
        self._n_spans = 0
        self._soft_steps, self._soft_spans = max(1, int(SOFT_FILL * n)), int(SOFT_FILL * m)
        self._g_step, self._g_start, self._g_end = (int_buffer(n) for _ in range(3))
        self._n_gpu = 0
        # Rows [0, watermark) were already written by a flush from another thread (signal handler, atexit).
        self._w_steps = self._w_spans = self._w_gpu = 0

        # Open-span stack.
        self._st_kind: list[str | None] = [None] * MAX_DEPTH
        self._st_label: list[str | None] = [None] * MAX_DEPTH
        self._st_start = [0] * MAX_DEPTH
        self._depth = 0
        self._wait_depth = 0
        self._wait_start = 0

        # The open step (-1: none).
        self._step = -1
        self._next_step = 0
        self._step_start = 0
        self._step_wait = 0
        self._wait_work = 0  # RESOLVE / FLUSH: work for the next outermost wait (a GPU-bound stretch)
        self._flush_ns = 0  # how long the last flush took
        self._batch = self._tokens = self._phase = None
        self._facts: dict | None = None
        self._gpu_t0 = self._gpu_t1 = -1  # host-clock GPU interval of the open step (gpu_span)
        self._gpu_slot = -1  # CUDA ring slot of the open step
        self._gpu_ended = False
        self._gpu_detached = False  # the open CUDA slot began outside any step (a worker thread)
        self._ring = False if gpu_timing == "off" else None  # None: not tried yet; False: no CUDA
        self._ring_rows: tuple[list, list, list] = ([], [], [])  # resolved in waits, for the next flush
        self.steps_recorded = 0
        # Kernel records arrive from any thread (the CUPTI collector's, tests): a lock, off the hot path.
        self._k_lock = threading.Lock()
        self._kw_lock = threading.Lock()  # one writer of the kernel tables at a time (write_kernels)
        self._k_batches: list[dict] = []
        self._k_rows: list[tuple] = []
        self._k_windows: list[tuple[int, int]] = []
        self._sampler = None  # record/kernel_timing.KernelSampler, started with the CUDA ring

        self._gc = GcSpans(self, self._owner)  # the thread's garbage collections, as python:gc spans
        self._flush_lock = threading.Lock()
        self._flushing_ident: int | None = None
        self._last_flush_ns = perf_counter_ns()
        self._paused_at = 0  # pause(): when the recorder stopped seeing the process's work
        self._closed = False
        # `rec.busy(label)` is the scope cache's own __getitem__: a C call, no Python frame (scopes.py).
        self.busy = ScopeCache(lambda label: self._scope(BUSY, label)).__getitem__
        self._wait_scopes = ScopeCache(lambda label: self._scope(WAIT, label))
        self._idle_scope = IdleScope(self)
        if self._nvtx is not None:
            self.__class__ = _NvtxRecorder  # span methods that also push/pop NVTX ranges
        lifecycle.register(self)
        if cuda:
            self._init_gpu()

    # ---- steps ----

    def process_facts(self, **facts) -> None:
        """Facts of the whole process (a worker's rank and parallel layout), stored in its process record
        (`spool/{pid}-{tag}.json`). Not for the hot path: it writes that file. A rank of several
        (`world_size` > 1) samples kernels in lockstep with the other ranks (record/kernel_timing.py)."""
        self._io.update_info(**facts)
        sampler = self._sampler
        if sampler is not None and _int_or_none(facts.get("world_size")) not in (None, 0, 1):
            sampler.lockstep = True

    def step_end(self) -> None:
        if self._step >= 0:
            self._boundary(perf_counter_ns())

    def step(self, **facts) -> StepScope:
        """`with rec.step(batch_size=1, phase="decode"): ...` = step_begin(...) + step_end()."""
        return StepScope(self, facts)

    def _split_open_spans(self, old: int, t: int) -> None:
        """Spans still open at a boundary: the part before `t` is recorded for step `old` (-1: none)."""
        for d in range(min(self._depth, MAX_DEPTH)):
            kind = self._st_kind[d]
            if kind is not IDLE and t > self._st_start[d]:
                self._emit_span(old, kind, self._st_label[d], self._st_start[d], t - self._st_start[d])
                self._st_start[d] = t

    def _timed_flush(self, t: int) -> int:
        """Flush from `t`; visible in the trace as an `overshoot:flush` span at step -1 (the engine thread
        spent this time in overshoot). Returns when it ended."""
        self.flush()
        t_after = perf_counter_ns()
        self._flush_ns = t_after - t
        self._emit_span(-1, BUSY, FLUSH_LABEL, t, t_after - t)
        return t_after

    def _flush_between_steps(self, t: int) -> int:
        t_after = self._timed_flush(t)
        for d in range(min(self._depth, MAX_DEPTH)):  # the spans open at `t` start after the flush
            if self._st_start[d] == t:
                self._st_start[d] = t_after
        if self._wait_depth and self._wait_start == t:
            self._wait_start = t_after
        return t_after

    # ---- spans ----

    # busy(label): `with rec.busy("schedule"): ...`, a cached scope per label; an attribute set in __init__.
    busy: Callable[[str], AbstractContextManager]

    def wait(self, label: str = "gpu") -> AbstractContextManager:
        """`with rec.wait("gpu"): ...`: the thread blocked on GPU results (a cached scope per label)."""
        return self._wait_scopes[label]

    def idle(self) -> IdleScope:
        return self._idle_scope

    def _scope(self, kind: str, label: str) -> AbstractContextManager:
        if self._nvtx is None:
            if hotpath.native is not None:
                return hotpath.native.Scope(self, label, kind is WAIT)
            return fast_scope(self, kind, label)
        begin = self.busy_begin if kind == BUSY else self.wait_begin  # NVTX: these push the range
        return SpanScope(begin, self._end, label)

    def _work_in_wait(self) -> None:
        """The recorder's own work inside the first wait after a GPU-bound step: its time counts in the wait
        (the thread had nothing else to do; if it outlasts the GPU's work, the wait ends later than the GPU,
        as a wake-up would). A flush is also recorded as an `overshoot:flush` span at step -1."""
        work, self._wait_work = self._wait_work, 0
        if work == FLUSH:
            self._timed_flush(perf_counter_ns())
            return
        ring = self._ring
        if not ring or ring.write_head == ring.resolve_head or not self._flush_lock.acquire(blocking=False):
            return
        self._flushing_ident = self._owner  # a signal handler's flush on this thread skips, as in a flush
        try:
            ring.resolve(*self._ring_rows, limit=RESOLVE_IN_WAIT_SLOTS)
        finally:
            self._flushing_ident = None
            self._flush_lock.release()

    def idle_begin(self) -> None:
        t = perf_counter_ns()
        if self._step >= 0:
            t = self._boundary(t)
        if self._sampler is not None:
            self._sampler.idle(t)
        if self._n_steps > self._w_steps and t - self._last_flush_ns >= self._idle_flush_ns:
            # The thread has nothing to do: a good moment to flush (rate-limited for engines that poll).
            t = self._flush_between_steps(t)
        d = self._depth
        self._depth = d + 1
        if d < MAX_DEPTH:
            self._st_kind[d] = IDLE
            self._st_label[d] = IDLE
            self._st_start[d] = t

    def _emit_span(self, step: int, kind: str, label: str, start: int, dur: int) -> None:
        n = self._n_spans
        self._p_step[n], self._p_kind[n], self._p_label[n], self._p_start[n], self._p_dur[n] = (
            step, kind, label, start, dur)
        self._n_spans = n + 1
        if n + 1 >= self._spans_cap:
            self.flush()

    # ---- GPU ----

    def pause(self) -> None:
        """This process runs work that is not recorded (between hooked stretches; benchmarks/hook_overhead.py
        runs plain and other modes' rounds there), until `resume`: kernel timing's collector goes off, and
        the time in between does not count toward the flush interval, so a recorder that sees a quarter of
        the rounds flushes as often per step as it would in a served engine. The open step ends here: the
        unrecorded work is no part of it."""
        self.step_end()
        if self._sampler is not None:
            self._sampler.pause()
        self._paused_at = perf_counter_ns()

    def settle(self, timeout: float = 5.0) -> bool:
        """After `pause`: wait until kernel timing's drain thread has written the records of the work before
        the pause (True at once without kernel timing), so that its work does not fall on what runs next."""
        return self._sampler.settle(timeout) if self._sampler is not None else True

    def resume(self) -> None:
        if self._paused_at:
            self._last_flush_ns += perf_counter_ns() - self._paused_at
            self._paused_at = 0
        if self._sampler is not None:
            self._sampler.resume()

    def gpu_span(self, start_ns: int, end_ns: int) -> None:
        """GPU work whose times are known on the host clock (first start .. last end of the open step; in a
        thread that runs no steps, one detached interval per call, as for gpu_begin)."""
        start_ns, end_ns = int(start_ns), int(end_ns)  # (numbers of any kind: the buffers hold int64)
        if self._step < 0:
            g = self._n_gpu
            self._g_step[g], self._g_start[g], self._g_end[g] = -1, start_ns, end_ns
            self._n_gpu = g + 1
            if g + 1 >= self._steps_cap:
                self._flush_detached()
            return
        if self._gpu_t0 < 0:
            self._gpu_t0 = start_ns
        self._gpu_t1 = end_ns

    def kernel_span(self, start_ns: int, end_ns: int, *, launch_ns: int | None = None, stream: int = 0,
                    name: str = "", kind: str = "kernel", launch_end_ns: int | None = None,
                    correlation: int = -1) -> None:
        """One GPU kernel (or copy: kind="memcpy"/"memset") whose device times are on the host
        perf_counter_ns clock; `launch_ns` .. `launch_end_ns` the host call that enqueued it. Any thread."""
        with self._k_lock:
            self._k_rows.append((kind, name, stream, correlation, launch_ns, launch_end_ns, start_ns, end_ns))

    def kernel_spans(self, columns: dict) -> None:
        """Many kernel_span rows at once: equal-length columns named as the kernels table (docs/schema.md);
        gpu_start_ns and gpu_end_ns are required. The CUPTI collector's path: no Python per row."""
        if len(columns["gpu_start_ns"]):
            with self._k_lock:
                self._k_batches.append(columns)

    def kernel_window(self, start_ns: int, end_ns: int) -> None:
        """Every kernel launched between these host times was recorded (kernel timing was on)."""
        with self._k_lock:
            self._k_windows.append((start_ns, end_ns))

    def _take_kernels(self) -> tuple[list[dict], list[tuple[int, int]]]:
        with self._k_lock:
            batches, rows, windows = self._k_batches, self._k_rows, self._k_windows
            self._k_batches, self._k_rows, self._k_windows = [], [], []
        if rows:
            names = ("kind", "name", "stream", "correlation", "launch_start_ns", "launch_end_ns",
                     "gpu_start_ns", "gpu_end_ns")
            columns = dict(zip(names, (list(c) for c in zip(*rows, strict=True)), strict=True))
            for key in ("launch_start_ns", "launch_end_ns"):
                columns[key] = [float("nan") if v is None else v for v in columns[key]]
            batches.append(columns)
        return batches, windows

    def write_kernels(self, *, wait: bool = True) -> None:
        """Write the kernel records and windows handed over so far (any thread; the CUPTI drain thread calls
        it after each delivery, so their Arrow conversion and write stay off the engine thread).
        wait=False: return at once if another thread is writing them."""
        if not self._kw_lock.acquire(blocking=wait):
            return
        try:
            kernels, windows = self._take_kernels()
            if (kernels or windows) and not self._closed and os.getpid() == self._io.pid:
                self._io.write_kernels(kernels, windows)
        finally:
            self._kw_lock.release()

    def _flush_detached(self) -> None:
        """A thread without steps has no boundaries to flush at: it flushes after a hooked call when its
        buffers fill up (~every 256 intervals), not on a timer, since each flush delays the step that waits
        on this thread; close, atexit and the signal handlers flush the rest."""
        self._flush_between_steps(perf_counter_ns())

    def _init_gpu(self) -> bool:
        """Create the CUDA event ring (imports torch; one synchronize for the clock anchor)."""
        from overshoot.record.cuda_events import CudaEventRing, cuda_available

        if not cuda_available():
            self._ring = False
            return False
        try:
            self._ring = CudaEventRing(size=max(256, 4 * self.flush_steps))
            self._io.set_gpu(self._ring.gpu_name)
        except Exception as e:  # a measurement tool must not take the engine down: record without GPU times
            self._ring = False
            self._io.note_error(f"CUDA events disabled: {type(e).__name__}: {e}")
            return False
        if self.gpu_timing in ("kernels", "sampled"):
            self.start_kernel_timing()
        return True

    def start_kernel_timing(self, collector=None, **sampling) -> None:
        """Start kernel timing (`gpu_timing` "kernels" or "sampled") with `collector` (default: CUPTI);
        `sampling`: KernelSampler's window_steps, min_gap, budget. A collector that cannot start is noted in
        the process info; events still work."""
        from overshoot.record.kernel_timing import KernelSampler, KernelTimingError, cupti_collector

        try:
            collector = collector or cupti_collector()
            budget = os.environ.get("OVERSHOOT_KERNEL_BUDGET")  # set by `overshoot run --kernel-budget`
            if budget and "budget" not in sampling:
                try:
                    sampling["budget"] = float(budget)
                except ValueError:  # never take the engine down over a setting: the default, said why
                    self._io.note_error(f"OVERSHOOT_KERNEL_BUDGET={budget!r} is not a number; budget 0.5%")
            self._sampler = KernelSampler(self, collector, mode=self.gpu_timing, fence=self._gpu_fence,
                                          **sampling)
            self._io.info["kernel_timing"] = {"mode": self.gpu_timing, "collector": collector.describe()}
        except KernelTimingError as e:
            self._io.note_error(f"kernel timing off: {e}")

    def kernel_timing_state(self) -> str:
        """"off" (no kernel timing: not asked for, no CUDA yet, it could not start, or it is closed),
        "setting up" (its collector is being set up on the drain thread, 50-240 ms for CUPTI; no window
        opens until then) or "ready" (windows open at step boundaries)."""
        return "off" if self._sampler is None else self._sampler.state()

    def _gpu_fence(self):
        """`query` of the end event of the latest step with GPU work (True once the GPU has passed it), for
        the kernel sampler: it switches its collector off only after a window's work. None without events."""
        ring = self._ring
        if not ring or ring.write_head == 0:
            return None
        return ring.end_events[(ring.write_head - 1) % ring.size].query

    # ---- flush / close ----

    def flush(self) -> None:
        """Write buffered rows to the spool. Safe from any thread; a re-entrant call (signal handler
        interrupting a flush on the same thread) is skipped."""
        me = threading.get_ident()
        if self._flushing_ident == me:
            return
        if self._closed or os.getpid() != self._io.pid:
            # Closed (or inherited by a forked child): nothing more is written; the owner still rewinds so
            # the buffers never overflow. No lock: a fork may have copied it held.
            self._closed = True
            if me == self._owner:
                self._rewind(self._n_steps)
            return
        with self._flush_lock:
            self._flushing_ident = me
            try:
                self._flush_locked(owner=me == self._owner)
            finally:
                self._flushing_ident = None

    def _flush_locked(self, *, owner: bool, drain: bool = False) -> None:
        n_steps, n_spans, n_gpu = self._n_steps, self._n_spans, self._n_gpu
        w_steps, w_spans, w_gpu = self._w_steps, self._w_spans, self._w_gpu
        gpu_rows, self._ring_rows = self._ring_rows, ([], [], [])
        if self._ring and not self._closed:
            (self._ring.drain if drain else self._ring.resolve)(*gpu_rows)
        if drain and self._sampler is not None:
            self._sampler.close()  # its last window and records land in this flush
        # Kernel records are normally written by the drain thread that delivers them (write_kernels): the
        # engine thread's flush writes only what it finds pending, and never waits for that thread's write.
        self.write_kernels(wait=drain or not owner)
        gc_rows = self._gc.take()
        gc_spans = (([r[0] for r in gc_rows], [BUSY] * len(gc_rows), [GC_LABEL] * len(gc_rows),
                     [r[1] for r in gc_rows], [r[2] for r in gc_rows]) if gc_rows else ([],) * 5)
        if not self._closed:
            self._io.write_chunk(
                steps=(self._s_step[w_steps:n_steps], self._s_start[w_steps:n_steps],
                       self._s_end[w_steps:n_steps], self._s_wait[w_steps:n_steps],
                       self._s_batch[w_steps:n_steps], self._s_tokens[w_steps:n_steps],
                       self._s_phase[w_steps:n_steps], self._s_facts[w_steps:n_steps]),
                spans=tuple(_joined(column[w_spans:n_spans], rows) for column, rows in zip(
                    (self._p_step, self._p_kind, self._p_label, self._p_start, self._p_dur), gc_spans,
                    strict=True)),
                gpu=tuple(_joined(column[w_gpu:n_gpu], rows) for column, rows in
                          zip((self._g_step, self._g_start, self._g_end), gpu_rows, strict=True)),
            )
        if owner:
            self._rewind(n_steps)
        else:
            self._w_steps, self._w_spans, self._w_gpu = n_steps, n_spans, n_gpu
        self._last_flush_ns = perf_counter_ns()

    def _rewind(self, n_steps: int) -> None:
        # Only the owning thread may rewind the buffers: it is their only writer.
        self._s_facts[:n_steps] = [None] * n_steps
        self._n_steps = self._n_spans = self._n_gpu = 0
        self._w_steps = self._w_spans = self._w_gpu = 0

    def close(self, *, reason: str = "close") -> None:
        """End the open spans and step, flush, resolve outstanding GPU events (bounded wait), finalize
        (meta: closed, end_reason). From another thread than the owner's, only what is complete is written."""
        self._close(reason)

    def _close(self, reason: str) -> None:
        if self._closed:
            return
        owner = threading.get_ident() == self._owner
        if owner:
            while self._depth:  # spans still open end now, inside the open step
                self._end()
            if self._step >= 0:
                self._boundary(perf_counter_ns())
        self._finish(reason=reason, drain=owner)

    def _finish(self, *, reason: str, drain: bool) -> None:
        with self._flush_lock:
            if self._closed:
                return
            self._flushing_ident = threading.get_ident()
            try:
                self._gc.stop()
                self._flush_locked(owner=threading.get_ident() == self._owner, drain=drain)
                self._closed = True
                if self._sampler is not None:
                    self._io.info["kernel_timing"] = self._sampler.info()
                self._io.close(
                    reason=reason, steps=self.steps_recorded, gpu=self._ring.info() if self._ring else None
                )
            finally:
                self._flushing_ident = None
        lifecycle.unregister(self)

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def gpu_dropped(self) -> int:
        return self._ring.dropped if self._ring else 0


class _NvtxRecorder(Recorder):
    """A Recorder whose spans are also NVTX ranges; a separate class so the plain hot path has no check."""

    __slots__ = ()

    def busy_begin(self, label: str) -> None:
        self._nvtx.push(label)
        Recorder.busy_begin(self, label)

    def wait_begin(self, label: str = "gpu") -> None:
        self._nvtx.push(label)
        Recorder.wait_begin(self, label)

    def idle_begin(self) -> None:
        Recorder.idle_begin(self)
        self._nvtx.push(IDLE)

    def _end(self) -> None:
        if self._depth > 0:
            Recorder._end(self)
            self._nvtx.pop()

    busy_end = _end
    wait_end = _end
    idle_end = _end


if hotpath.native is not None:  # C calls the core of exactly this class directly, with these constants
    hotpath.native.configure(busy=BUSY, wait=WAIT, idle=IDLE, max_depth=MAX_DEPTH, recorder=Recorder,
                             work_in_wait_ns=WORK_IN_WAIT_NS, flush_margin=FLUSH_IN_WAIT_MARGIN,
                             resolve=RESOLVE, flush=FLUSH)

# Kept importable from here (hook bootstraps and tests call it as recorder.install_signal_handlers).
install_signal_handlers = lifecycle.install_signal_handlers
