"""The `with` forms of the Recorder: `rec.busy(label)`, `rec.wait(label)`, `rec.idle()`, `rec.step(...)`.

`with rec.busy(label):` must cost about what `busy_begin(label)` + `busy_end()` cost. A `with` block calls
`type(scope).__enter__` and `type(scope).__exit__`; written as ordinary methods, each call binds a method
object and runs a frame that then calls into the recorder (a third frame), and `rec.busy` itself is a fourth:
~0.7 us per span on a 2-core VM against ~0.45 us for the begin/end pair. So each (recorder, kind, label)
gets one cached scope object of its own small class, whose __enter__ and __exit__ are staticmethods (no
binding) over closures that take the recorder's buffers as default arguments (fast locals, no attribute
lookups), and `rec.busy` is the C-level `__getitem__` of the scope cache. Nothing is allocated per span.

The closures inline Recorder.busy_begin / wait_begin and the busy and wait cases of Recorder._end; anything
unusual at exit (no open span, nesting deeper than the stack, an idle span innermost) goes to
Recorder._end itself. tests/test_recorder.py checks that both forms record the same spans. Where hot.c
compiled, its Scope type is used instead (record/hotpath.py); these closures are the Python path.
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter_ns

BUSY, WAIT, IDLE = "busy", "wait", "idle"
MAX_DEPTH = 64  # deeper nesting is ignored (counted), never an IndexError inside the engine


class ScopeCache(dict):
    """label -> that label's scope, created on first use; `rec.busy` is this dict's bound __getitem__."""

    __slots__ = ("_make",)

    def __init__(self, make: Callable[[str], object]):
        super().__init__()
        self._make = make

    def __missing__(self, label: str) -> object:
        scope = self[label] = self._make(label)
        return scope


class _FastScope:
    """Base of the per-label scope classes (for isinstance checks and a readable repr)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"<overshoot {type(self).__name__} scope>"


def fast_scope(rec, kind: str, label: str) -> _FastScope:
    """The cached `with` object for one busy or wait label of `rec` (a Recorder without NVTX)."""
    scope: _FastScope | None = None  # the closures return it from __enter__, like a context manager should

    if kind == BUSY:

        def enter(rec=rec, label=label, st_kind=rec._st_kind, st_label=rec._st_label,
                  st_start=rec._st_start, clock=perf_counter_ns):  # fmt: skip
            d = rec._depth
            rec._depth = d + 1
            if d < MAX_DEPTH:
                st_label[d] = label
                st_kind[d] = BUSY
                st_start[d] = clock()
            return scope

    else:

        def enter(rec=rec, label=label, st_kind=rec._st_kind, st_label=rec._st_label,
                  st_start=rec._st_start, clock=perf_counter_ns):  # fmt: skip
            t = clock()
            d = rec._depth
            rec._depth = d + 1
            if d < MAX_DEPTH:
                st_label[d] = label
                st_kind[d] = WAIT
                st_start[d] = t
                if not rec._wait_depth:
                    rec._wait_start = t
                    if rec._wait_work:
                        rec._work_in_wait()
                rec._wait_depth += 1
            return scope

    def exit_(exc_type, exc, tb, rec=rec, st_kind=rec._st_kind, st_label=rec._st_label,
              st_start=rec._st_start, p_step=rec._p_step, p_kind=rec._p_kind, p_label=rec._p_label,
              p_start=rec._p_start, p_dur=rec._p_dur, clock=perf_counter_ns,
              max_depth=MAX_DEPTH):  # fmt: skip
        d = rec._depth - 1
        innermost = st_kind[d] if 0 <= d < max_depth else None  # the span this exit ends
        if innermost is not BUSY and innermost is not WAIT:  # unmatched, deeper than the stack, or idle:
            rec._end()  # the general path (it reads the clock itself: one read per span end either way)
            return
        t = clock()
        step = rec._step
        if innermost is WAIT:
            rec._wait_depth -= 1
            if not rec._wait_depth and step >= 0:
                rec._step_wait += t - rec._wait_start
        rec._depth = d
        start = st_start[d]
        n = rec._n_spans
        p_step[n] = step
        p_kind[n] = innermost
        p_label[n] = st_label[d]
        p_start[n] = start
        p_dur[n] = t - start
        rec._n_spans = n + 1
        if n + 1 >= rec._spans_cap:
            rec.flush()

    cls = type(f"{kind}[{label}]", (_FastScope,), {
        "__slots__": (), "__enter__": staticmethod(enter), "__exit__": staticmethod(exit_)})  # fmt: skip
    scope = cls()
    return scope


class SpanScope:
    """Reusable `with` object for one (kind, label) of a recorder with NVTX ranges: plain calls of its
    begin/end methods (which push and pop the ranges); entering allocates nothing."""

    __slots__ = ("_begin", "_end", "_label")

    def __init__(self, begin, end, label):
        self._begin, self._end, self._label = begin, end, label

    def __enter__(self):
        self._begin(self._label)
        return self

    def __exit__(self, exc_type, exc, tb):  # explicit arguments: `*exc` would build a tuple per call
        self._end()
        return False


class IdleScope:
    __slots__ = ("_rec",)

    def __init__(self, rec):
        self._rec = rec

    def __enter__(self):
        self._rec.idle_begin()
        return self

    def __exit__(self, *exc):
        self._rec.idle_end()
        return False


class StepScope:
    __slots__ = ("_rec", "_facts")

    def __init__(self, rec, facts):
        self._rec, self._facts = rec, facts

    def __enter__(self):
        self._rec.step_begin(**self._facts)
        return self

    def __exit__(self, *exc):
        self._rec.step_end()
        return False
