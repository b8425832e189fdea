"""The end of split (flash-decoding) attention: the last split program of each (sequence, KV head) merges.

Each split program stores its partial (max, sum, acc) and draws a ticket from a per-(sequence, KV head)
counter; the one drawing the last ticket combines all partials in split order and resets the counter. No
second launch, and the result does not depend on which program finished last.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TICKETS: dict[torch.device, torch.Tensor] = {}


def tickets_for(device: torch.device, needed: int) -> torch.Tensor:
    """Zeroed int32 counters, one per (sequence, KV head), kept for the process: each launch leaves them at
    zero again. Grown only outside a CUDA-graph capture (the first, eager step of a shape allocates)."""
    tickets = _TICKETS.get(device)
    if tickets is None or tickets.numel() < needed:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("paged attention: ticket counters must be allocated before graph capture")
        tickets = torch.zeros(max(needed, 4096), dtype=torch.int32, device=device)
        _TICKETS[device] = tickets
    return tickets


@triton.jit
def merge_partials(part_acc_ptr, part_ml_ptr, out_ptr, rows, heads, mask_g, offs_d, mask_d, stride_oh,
                    NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """Combine NUM_SPLITS partials of each head in `heads` (split order). Loads bypass L1 (.cg): other
    SMs wrote these rows, and this SM may hold stale lines from an earlier launch."""
    m_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for s in range(NUM_SPLITS):  # a loop, not unrolled: unrolling hoists every load and spills
        m_max = tl.maximum(m_max, tl.load(part_ml_ptr + (rows + s) * 2, mask=mask_g, other=float("-inf"),
                                          cache_modifier=".cg"))
    # All splits empty (seq_len 0, graph padding): weights 0 and the output 0, never NaN.
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    total = tl.zeros([BLOCK_G], tl.float32)
    out = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for s in range(NUM_SPLITS):  # a loop, not unrolled: unrolling hoists every load and spills
        m_s = tl.load(part_ml_ptr + (rows + s) * 2, mask=mask_g, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(part_ml_ptr + (rows + s) * 2 + 1, mask=mask_g, other=0.0, cache_modifier=".cg")
        weight = tl.where(m_s > float("-inf"), tl.exp(m_s - m_safe), 0.0)
        acc_s = tl.load(part_acc_ptr + (rows + s)[:, None] * BLOCK_D + offs_d[None, :], mask=mask_g[:, None],
                        other=0.0, cache_modifier=".cg")
        out += acc_s * weight[:, None]
        total += weight * l_s
    out = out / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + heads[:, None] * stride_oh + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask_g[:, None] & mask_d[None, :])
