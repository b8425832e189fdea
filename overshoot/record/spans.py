"""The span stack of a Recorder: busy / wait begin and the end of any span, in Python.

record/hot.c's SpanStack is this class line for line and is used instead wherever it compiles
(record/hotpath.py); both keep their state in the same attributes, which the rest of the Recorder (step
boundaries, idle, splits, flushes) reads and writes either way.

The stack holds MAX_DEPTH entries; `_depth` keeps counting beyond that so that the matching ends of spans too
deep to record are recognised and ignored. (try/except costs nothing when nothing raises.)
"""

from __future__ import annotations

from time import perf_counter_ns

from overshoot.record.scopes import BUSY, IDLE, MAX_DEPTH, WAIT

# The state both implementations keep (hot.c's SpanStack members).
SPAN_FIELDS = ("_depth", "_wait_depth", "_wait_start", "_step", "_step_wait", "_n_spans", "_spans_cap",
               "_wait_work", "_st_kind", "_st_label", "_st_start", "_p_step", "_p_kind", "_p_label",
               "_p_start", "_p_dur")


class PySpanStack:
    __slots__ = SPAN_FIELDS

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
