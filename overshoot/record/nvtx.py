"""Optional NVTX ranges so the recorder's steps and spans also show in Nsight Systems.

`load_nvtx(None)` follows env OVERSHOOT_NVTX=1. Returns None (the recorder then skips all NVTX calls) when
disabled or when the `nvtx` package is missing.
"""

from __future__ import annotations

import os
from types import ModuleType

DOMAIN = "overshoot"


def nvtx_requested(option: bool | None) -> bool:
    if option is not None:
        return option
    return os.environ.get("OVERSHOOT_NVTX", "") == "1"


def load_nvtx(option: bool | None) -> ModuleType | None:
    if not nvtx_requested(option):
        return None
    try:
        import nvtx
    except ImportError:
        return None
    return nvtx


class NvtxRanges:
    """NVTX ranges in the "overshoot" domain with event attributes cached per label (cheap per call).

    Spans nest, so they use push/pop; a step can end while a span is still open, so steps use start/end.
    """

    def __init__(self, nvtx: ModuleType):
        self._domain = nvtx.get_domain(DOMAIN)
        self._attributes: dict[str, object] = {}

    def _attrs(self, message: str):
        attrs = self._attributes.get(message)
        if attrs is None:
            attrs = self._attributes[message] = self._domain.get_event_attributes(message=message)
        return attrs

    def push(self, label: str) -> None:
        self._domain.push_range(self._attrs(label))

    def pop(self) -> None:
        self._domain.pop_range()

    def start_step(self, step: int):
        # Not cached: one message per step number would grow the cache forever.
        return self._domain.start_range(self._domain.get_event_attributes(message=f"step {step}"))

    def end_step(self, range_id) -> None:
        self._domain.end_range(range_id)


def make_ranges(option: bool | None) -> NvtxRanges | None:
    nvtx = load_nvtx(option)
    return NvtxRanges(nvtx) if nvtx is not None else None
