"""CUDA event ring: per-step GPU intervals placed on the host clock without synchronizing the hot path.

Per step the recorder takes one slot: a begin event recorded at the step's first `gpu_begin(stream)` and an
end event re-recorded at every `gpu_end(stream)` (the last record wins, so the interval runs from the first
begin to the last end). Committed slots are resolved lazily at flush time with `Event.query()`, oldest first,
stopping at the first one the GPU has not reached yet. Nothing here calls `synchronize()` except the one-time
anchor at start and a bounded wait at close.

Host clock mapping: an anchor event is recorded on a private, otherwise idle stream and awaited once at start;
its host time is the midpoint of the `perf_counter_ns()` calls around `record()`. An event's host time is then
`anchor_host_ns + anchor.elapsed_time(event)`. The constant error is the GPU's submit latency (a few µs),
which cancels out of GPU durations and gaps. Two things grow with distance from the anchor: clock drift
between GPU and host (ppm-scale) and the float32 resolution of `elapsed_time` (~0.6 µs at 10 s, ~6 µs at
100 s). So every `reanchor_seconds` a new anchor is recorded (no wait) and adopted at a later flush once the
GPU has reached it and all events issued before it are resolved; `max_drift_us` reports the largest
correction seen.

torch is imported only when a ring is created, so CPU-only users never import it.
"""

from __future__ import annotations

import inspect
import time
from typing import Any


def native_record(event_cls):
    """`Event.record` of torch's C base class: called as record(event, stream) it skips the Python wrapper
    (its `stream is None` check and `super()` call), a few hundred ns per call on the hot path."""
    for klass in event_cls.__mro__[1:]:
        method = klass.__dict__.get("record")
        if method is not None and not inspect.isfunction(method):
            return method
    return event_cls.record


class CudaEventRing:
    def __init__(self, *, size: int = 4096, device: Any = None, reanchor_seconds: float = 10.0):
        import torch

        self._torch = torch
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
        self.size = size
        # Events are created once; CUDA allocates each event at its first record, outside steady state.
        self.record = native_record(torch.cuda.Event)  # record(event, stream); stream must not be None
        self.begin_events = [torch.cuda.Event(enable_timing=True) for _ in range(size)]
        self.end_events = [torch.cuda.Event(enable_timing=True) for _ in range(size)]
        self.slot_step = [0] * size
        self.write_head = 0  # next slot to hand out (slot = head % size); advanced on commit
        self.resolve_head = 0  # oldest committed, unresolved slot
        self.dropped = 0
        self.reanchor_ns = int(reanchor_seconds * 1e9)
        self.max_drift_us = 0.0
        self.anchors = 1
        self.gpu_name = torch.cuda.get_device_name(self.device)
        with torch.cuda.device(self.device):
            self._anchor_stream = torch.cuda.Stream()
            self._anchor, self._anchor_host_ns = self._record_anchor()
            self._anchor.synchronize()
        self._pending_anchor: tuple[Any, int, int] | None = None  # (event, host ns, write_head when recorded)
        self._last_anchor_ns = self._anchor_host_ns

    def _record_anchor(self) -> tuple[Any, int]:
        event = self._torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter_ns()
        event.record(self._anchor_stream)
        t1 = time.perf_counter_ns()
        return event, (t0 + t1) // 2

    # ---- hot path (called by the recorder) ----

    # record/hot.c does acquire and commit on these attributes itself (no Python frame a step): keep alike.

    def acquire(self) -> int:
        """The slot for the current step. When all slots are unresolved the oldest is dropped (never wait)."""
        if self.write_head - self.resolve_head >= self.size:
            self.resolve_head += 1
            self.dropped += 1
        return self.write_head % self.size

    def commit(self, slot: int, step: int) -> None:
        self.slot_step[slot] = step
        self.write_head += 1

    # ---- flush time ----

    def resolve(self, steps: list[int], starts: list[int], ends: list[int], *,
                limit: int | None = None) -> None:
        """Append (step, gpu_start_ns, gpu_end_ns) of every completed slot (at most `limit`), in order, to
        the three lists."""
        self._maybe_adopt_anchor()
        anchor, anchor_ns = self._anchor, self._anchor_host_ns
        size = self.size
        stop = self.write_head if limit is None else min(self.write_head, self.resolve_head + limit)
        while self.resolve_head < stop:
            slot = self.resolve_head % size
            end = self.end_events[slot]
            if not end.query():
                break
            begin = self.begin_events[slot]
            if not begin.query():  # other streams: the end can complete before the begin
                break
            steps.append(self.slot_step[slot])
            starts.append(anchor_ns + round(anchor.elapsed_time(begin) * 1e6))
            ends.append(anchor_ns + round(anchor.elapsed_time(end) * 1e6))
            self.resolve_head += 1
        self._maybe_record_anchor()

    def _maybe_record_anchor(self) -> None:
        if self._pending_anchor is not None:
            return
        now = time.perf_counter_ns()
        if now - self._last_anchor_ns < self.reanchor_ns:
            return
        event, host_ns = self._record_anchor()
        self._pending_anchor = (event, host_ns, self.write_head)
        self._last_anchor_ns = now

    def _maybe_adopt_anchor(self) -> None:
        pending = self._pending_anchor
        if pending is None:
            return
        event, host_ns, head_at_record = pending
        # Adopt only once the GPU reached it and every older slot is resolved, so elapsed_time stays >= 0.
        if self.resolve_head < head_at_record or not event.query():
            return
        predicted = self._anchor_host_ns + round(self._anchor.elapsed_time(event) * 1e6)
        self.max_drift_us = max(self.max_drift_us, abs(host_ns - predicted) / 1e3)
        self._anchor, self._anchor_host_ns = event, host_ns
        self._pending_anchor = None
        self.anchors += 1

    def drain(self, steps: list[int], starts: list[int], ends: list[int], *, timeout_s: float = 2.0) -> None:
        """Resolve everything committed, waiting up to `timeout_s` for the GPU (close time only)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.resolve(steps, starts, ends)
            if self.resolve_head >= self.write_head or time.monotonic() > deadline:
                return
            time.sleep(0.001)

    @property
    def unresolved(self) -> int:
        return self.write_head - self.resolve_head

    def info(self) -> dict:
        return {
            "gpu": self.gpu_name,
            "ring_size": self.size,
            "dropped": self.dropped,
            "unresolved": self.unresolved,
            "anchors": self.anchors,
            "max_drift_us": round(self.max_drift_us, 3),
        }


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()
