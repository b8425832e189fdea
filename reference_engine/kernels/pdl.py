"""Programmatic dependent launch (Hopper+): a kernel may start while the one before it drains.

Every decode kernel of the Triton set (projections, RoPE, attention) launches with PDL and begins with
`pdl_prologue`: it lets the next kernel launch at once, then waits for its own inputs. The next kernel's
launch and program start-up thus overlap this one's tail (2.80 -> 2.75 ms per qwen3-4b step on an H200;
loading weights before the wait was tried and was slower, see docs/benchmarks.md). Safety is transitive:
each kernel waits for the previous one to complete, and that one completed only after waiting for its own
predecessor, so every earlier write is visible.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton's CPU interpreter (CI, tests): no PDL, no PTX hints, fp32 dots (its bf16 tl.dot is wrong).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
_STATE: dict[str, bool] = {}


def pdl_enabled() -> bool:
    """Hopper+ CUDA only, never under the interpreter; REFERENCE_ENGINE_PDL=0 turns it off. Decided once
    per process: a launch must not pay a device query."""
    if "on" not in _STATE:
        wanted = os.environ.get("REFERENCE_ENGINE_PDL", "1") == "1" and not INTERPRETED
        _STATE["on"] = wanted and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
    return _STATE["on"]


def set_pdl(on: bool) -> None:
    """Force PDL on or off (benchmarks compare both in one process)."""
    _STATE["on"] = on and not INTERPRETED


def launch_options(tensor: torch.Tensor) -> tuple[bool, dict[str, bool]]:
    """(USE_PDL constexpr, extra launch kwargs) for a kernel reading `tensor`."""
    if tensor.is_cuda and pdl_enabled():
        return True, {"launch_pdl": True}
    return False, {}


@triton.jit
def pdl_prologue(USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
