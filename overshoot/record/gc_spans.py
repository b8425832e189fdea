"""Python's garbage collections on the recorder's thread, as busy spans labelled `python:gc`.

A collection runs inside whatever call allocated last, so without this its pause is charged to that call's
label (or to `unlabelled`): a generation-2 collection over a large heap stops the engine thread for
milliseconds, and the GPU starves meanwhile. `gc.callbacks` brackets every collection in the process; only
those on the recorder's thread are kept. The callback never touches the recorder's buffers (a collection
can start inside the recorder's own code): it appends (step, start, duration) to a list that the next flush
writes with the spans. Its cost is ~0.5 µs a collection, on collections only.
"""

from __future__ import annotations

import gc
import os
import threading
from time import perf_counter_ns

GC_LABEL = "python:gc"


class GcSpans:
    __slots__ = ("_recorder", "_owner", "_pid", "_start", "rows")

    def __init__(self, recorder, owner: int):
        self._recorder = recorder  # reads its open step; removed from gc.callbacks when it finishes
        self._owner = owner
        self._pid = os.getpid()  # a forked child's thread may carry the owner's ident: its recorder is closed
        self._start = 0
        self.rows: list[tuple[int, int, int]] = []  # (step, start ns, duration ns)
        gc.callbacks.append(self.callback)

    def callback(self, phase: str, info: dict) -> None:
        if threading.get_ident() != self._owner or os.getpid() != self._pid:
            return
        if phase == "start":
            self._start = perf_counter_ns()
        elif self._start:
            t = perf_counter_ns()
            self.rows.append((self._recorder._step, self._start, t - self._start))
            self._start = 0

    def take(self) -> list[tuple[int, int, int]]:
        rows, self.rows = self.rows, []
        return rows

    def stop(self) -> None:
        try:
            gc.callbacks.remove(self.callback)
        except ValueError:
            pass
