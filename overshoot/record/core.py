"""The recorder's per-call core in Python: spans, step boundaries, step facts and the CUDA event calls.

record/hot.c's RecorderCore is this class line for line and is used instead wherever it compiles
(record/hotpath.py); both keep their state in the same attributes (CORE_FIELDS), which the rest of the
Recorder (idle, splits, flushes, GPU set-up, close) reads and writes either way. Everything that runs once or
more a step is here; what runs seldom (a flush, splitting spans open at a boundary, creating the CUDA ring,
a kernel-timing window) stays in Recorder and is called from here.

Both read the clock at the same points, so that on one fake clock both record identical rows
(tests/test_recorder.py). The span stack holds MAX_DEPTH entries; `_depth` keeps counting beyond that so
that the matching ends of spans too deep to record are recognised and ignored. (try/except costs nothing
when nothing raises.)
"""

from __future__ import annotations

from time import perf_counter_ns

from overshoot.record.scopes import BUSY, IDLE, MAX_DEPTH, WAIT

# A step that waited this long on the GPU marks a GPU-bound stretch: the next wait does the recorder's own
# work (a due flush when it fits in the last wait with FLUSH_IN_WAIT_MARGIN to spare, else resolving
# finished steps' CUDA events) while the thread waits anyway, instead of between steps, where it delays the
# next launch. A flush that outlasts the wait delays the step by the difference only; one between steps, by
# all of it.
WORK_IN_WAIT_NS = 200_000
FLUSH_IN_WAIT_MARGIN = 1.25
RESOLVE, FLUSH = 1, 2  # values of `_wait_work`: what the next wait does (0: nothing)

# The state both implementations keep (hot.c's RecorderCore members).
CORE_FIELDS = (
    # the span stack and the span buffer
    "_depth", "_wait_depth", "_wait_start", "_step", "_step_wait", "_n_spans", "_spans_cap", "_wait_work",
    "_st_kind", "_st_label", "_st_start", "_p_step", "_p_kind", "_p_label", "_p_start", "_p_dur",
    # the open step and the step buffer
    "_next_step", "_step_start", "_n_steps", "_steps_cap", "_soft_steps", "_soft_spans", "steps_recorded",
    "_batch", "_tokens", "_phase", "_facts", "_s_step", "_s_start", "_s_end", "_s_wait", "_s_batch",
    "_s_tokens", "_s_phase", "_s_facts",
    # flush timing
    "_flush_ns", "_last_flush_ns", "_flush_interval_ns",
    # GPU: host-clock intervals, the CUDA ring's slot of the open step, kernel timing's sampler, NVTX
    "_n_gpu", "_g_step", "_g_start", "_g_end", "_gpu_t0", "_gpu_t1", "_gpu_slot", "_gpu_ended",
    "_gpu_detached", "_ring", "_sampler", "_nvtx", "_nvtx_step",
)


class PyRecorderCore:
    __slots__ = CORE_FIELDS

    # ---- spans ----

    def busy_begin(self, label: str) -> None:
        d = self._depth
        self._depth = d + 1
        try:
            self._st_label[d] = label
        except IndexError:
            return
        self._st_kind[d] = BUSY
        self._st_start[d] = perf_counter_ns()

    def wait_begin(self, label: str = "gpu") -> None:
        t = perf_counter_ns()
        d = self._depth
        self._depth = d + 1
        try:
            self._st_label[d] = label
        except IndexError:
            return
        self._st_kind[d] = WAIT
        self._st_start[d] = t
        if not self._wait_depth:
            self._wait_start = t
            if self._wait_work:
                self._work_in_wait()
        self._wait_depth += 1

    def _end(self) -> None:
        """End the innermost open span (any kind). busy_end / wait_end / idle_end are this method."""
        t = perf_counter_ns()
        d = self._depth - 1
        if d < 0:
            return  # unmatched end: ignore rather than raise inside the engine
        self._depth = d
        if d >= MAX_DEPTH:
            return
        kind = self._st_kind[d]
        start = self._st_start[d]
        step = self._step
        if kind is WAIT:
            self._wait_depth -= 1
            if not self._wait_depth and step >= 0:
                self._step_wait += t - self._wait_start
        elif kind is IDLE:
            step = -1
        n = self._n_spans
        self._p_step[n] = step
        self._p_kind[n] = kind
        self._p_label[n] = self._st_label[d]
        self._p_start[n] = start
        self._p_dur[n] = t - start
        self._n_spans = n + 1
        if n + 1 >= self._spans_cap:
            self.flush()

    busy_end = _end
    wait_end = _end
    idle_end = _end

    # ---- steps ----

    def step_begin(self, batch_size: int | None = None, num_tokens: int | None = None,
                   phase: str | None = None, **facts) -> None:
        t = perf_counter_ns()
        if self._step >= 0 or self._depth:
            t = self._boundary(t)
        step = self._step = self._next_step
        self._next_step = step + 1
        if self._sampler is not None:  # kernel timing windows open and close at step boundaries
            t = self._sampler.at_step(t, batch_size, phase, ended=(self._phase, self._batch))
        self._step_start = t
        self._step_wait = 0
        self._batch, self._tokens, self._phase = batch_size, num_tokens, phase
        self._facts = facts or None
        if self._nvtx is not None:
            self._nvtx_step = self._nvtx.start_step(step)

    def step_facts(self, batch_size: int | None = None, num_tokens: int | None = None,
                   phase: str | None = None, **facts) -> None:
        """Set or override facts of the open step (no-op outside a step)."""
        if self._step < 0:
            return
        if batch_size is not None:
            self._batch = batch_size
        if num_tokens is not None:
            self._tokens = num_tokens
        if phase is not None:
            self._phase = phase
        if facts:
            self._facts = {**self._facts, **facts} if self._facts else facts

    def _boundary(self, t: int) -> int:
        """End the open step at `t` (splitting open spans there); maybe flush. Returns the time the next
        step may start: after the flush, so that flush cost is never counted as a step's busy time."""
        old = self._step
        if self._wait_depth:
            if old >= 0:
                self._step_wait += t - self._wait_start
            self._wait_start = t
        if self._depth:
            self._split_open_spans(old, t)
        if old < 0:
            return t
        n = self._n_steps
        self._s_step[n], self._s_start[n], self._s_end[n] = old, self._step_start, t
        self._s_wait[n] = waited = self._step_wait
        self._s_batch[n], self._s_tokens[n], self._s_phase[n] = self._batch, self._tokens, self._phase
        self._s_facts[n] = self._facts
        if self._gpu_t0 >= 0:
            g = self._n_gpu
            self._g_step[g], self._g_start[g], self._g_end[g] = old, self._gpu_t0, self._gpu_t1
            self._n_gpu = g + 1
            self._gpu_t0 = self._gpu_t1 = -1
        if self._gpu_slot >= 0:
            if self._gpu_ended:
                self._ring.commit(self._gpu_slot, old)
            self._gpu_slot = -1
            self._gpu_ended = self._gpu_detached = False
        self._n_steps = n + 1
        self._step = -1
        self.steps_recorded += 1
        if self._nvtx is not None:
            self._nvtx.end_step(self._nvtx_step)
        long_wait = waited >= WORK_IN_WAIT_NS
        full = n + 1 >= self._steps_cap  # (a full span buffer flushes itself, in _end)
        timed_out = t - self._last_flush_ns >= self._flush_interval_ns
        if full or timed_out or n + 1 >= self._soft_steps or self._n_spans >= self._soft_spans:
            if not full and long_wait and waited >= FLUSH_IN_WAIT_MARGIN * self._flush_ns:
                self._wait_work = FLUSH
                return t
            if full or timed_out:
                self._wait_work = 0
                return self._flush_between_steps(t)
            # Filled past SOFT_FILL only: keep going until a wait fits the flush or the buffers fill up.
        self._wait_work = RESOLVE if long_wait and self._ring else 0
        return t

    # ---- GPU ----

    def gpu_begin(self, stream) -> None:
        """Record the step's GPU-start CUDA event on `stream` (first call per step only).

        In a thread that runs no steps (a model worker process of a multiprocess executor), each
        gpu_begin .. gpu_end pair is its own interval, recorded at step -1 ("detached"); the analyzer gives
        it to the step of the run's stepping thread during which its GPU work started. There each pair also
        counts as a step for kernel timing's windows (the worker launches the kernels)."""
        if self._gpu_slot >= 0:
            return
        ring = self._ring
        if not ring:
            if ring is False or not self._init_gpu():
                return
            ring = self._ring
        if self._step < 0 and self._sampler is not None:
            self._sampler.at_step(perf_counter_ns(), None, None)
        slot = ring.acquire()
        if stream is None:
            ring.begin_events[slot].record()  # the current stream (a ~4 µs lookup): pass the stream
        else:
            ring.record(ring.begin_events[slot], stream)
        self._gpu_slot = slot
        self._gpu_detached = self._step < 0

    def gpu_end(self, stream) -> None:
        """(Re-)record the step's GPU-end CUDA event on `stream`: the last call of the step wins."""
        slot = self._gpu_slot
        if slot >= 0:
            ring = self._ring
            if stream is None:
                ring.end_events[slot].record()
            else:
                ring.record(ring.end_events[slot], stream)
            self._gpu_ended = True
            if self._gpu_detached:  # no step will end it: commit now
                self._gpu_slot = -1
                self._gpu_ended = self._gpu_detached = False
                ring.commit(slot, -1)
                if ring.write_head - ring.resolve_head >= ring.size // 2:
                    self._flush_detached()
