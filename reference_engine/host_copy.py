"""The step's small copies between pinned host slots and fixed device buffers, as one-program kernels.

A copy engine charges a small transfer far more than its bytes: on an H200 a DMA copy in and one out around a
~100 us kernel add 12.1 us to each iteration of the GPU timeline, a kernel that reads or writes the pinned
memory directly (UVA maps it into the device's address space) 5.0 (docs/benchmarks.md). The copy kernels
run outside any CUDA graph with this step's slot address as their argument, so graphs still read only fixed
device buffers (graphs.py). Plain non-blocking copies on CPU, with REFERENCE_ENGINE_ZERO_COPY=0, or where the
check on first use fails.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

log = logging.getLogger(__name__)
_STATE: dict[str, Any] = {}  # "on": zero-copy checked and working; "launch": the copy kernel


class _Mapped:
    """A pinned host tensor as a kernel argument: Triton takes anything with data_ptr() and dtype, and under
    UVA the host address of pinned memory is its device address."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.dtype = tensor, tensor.dtype

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()


def _zero_copy_works(device: torch.device) -> bool:
    """Round-trips a few values through pinned memory with the kernel, once per process."""
    if os.environ.get("REFERENCE_ENGINE_ZERO_COPY", "1") == "0":
        return False
    try:
        from reference_engine.kernels.step_ops import launch_copy  # Triton: only where CUDA is

        _STATE["launch"] = launch_copy
        host = torch.arange(1, 1 + 2051, dtype=torch.int32).pin_memory()
        dev = torch.zeros_like(host, device=device)
        back = torch.zeros_like(host).pin_memory()
        launch_copy(dev, _Mapped(host), host.numel())
        launch_copy(_Mapped(back), dev, host.numel())
        torch.cuda.synchronize(device)
        return torch.equal(back, host)
    except Exception as exc:  # any failure means DMA copies, which always work
        log.warning("zero-copy host transfers unavailable (%s); using DMA copies", exc)
        return False


def zero_copy_available(device: torch.device) -> bool:
    """Whether `copy_to` runs as a kernel on the pinned memory for `device` (checked once a process)."""
    if "on" not in _STATE:
        _STATE["on"] = _zero_copy_works(device)
    return _STATE["on"]


def copy_to(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src, non_blocking=True) for contiguous tensors of one dtype and size, one of them on CUDA and
    the other pinned host memory (the engine's slots; pageable memory would fault the kernel): as a kernel on
    the current stream where zero-copy works."""
    if dst.is_cuda == src.is_cuda:  # CPU to CPU (the engine on CPU), or device to device
        dst.copy_(src, non_blocking=True)
        return
    if not zero_copy_available((dst if dst.is_cuda else src).device):
        dst.copy_(src, non_blocking=True)
        return
    assert dst.dtype == src.dtype and dst.numel() == src.numel()
    assert dst.is_contiguous() and src.is_contiguous()
    _STATE["launch"](dst if dst.is_cuda else _Mapped(dst), src if src.is_cuda else _Mapped(src), src.numel())
