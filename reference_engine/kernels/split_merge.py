"""Split work merged by its last program, in one launch: ticket counters and the attention merge.

Each program stores its partial and draws a ticket (`last_to_arrive`); the one drawing the last ticket
combines the partials in a fixed order and resets the counter. No second launch, and the result does not
depend on which program finished last. Split attention merges per (sequence, KV head) with
`merge_partials`, above 8 active splits in two levels (`fold_partials` + `store_partial` per run of splits,
then the runs); the greedy argmax (step_ops.py) merges per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_COUNTERS: dict[tuple[torch.device, str], torch.Tensor] = {}


def counters_for(device: torch.device, name: str, needed: int) -> torch.Tensor:
    """Zeroed int32 counters kept for the process under `name`: every launch using them leaves them at
    zero again. Grown only outside a CUDA-graph capture (the first, eager step of a shape allocates)."""
    counters = _COUNTERS.get((device, name))
    if counters is None or counters.numel() < needed:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{name}: counters must be allocated before graph capture")
        counters = torch.zeros(max(needed, 64), dtype=torch.int32, device=device)
        _COUNTERS[(device, name)] = counters
    return counters


def tickets_for(device: torch.device, needed: int) -> torch.Tensor:
    """Split attention's ticket counters, one per (sequence, KV head)."""
    return counters_for(device, "paged attention tickets", max(needed, 4096))


@triton.jit
def last_to_arrive(ticket_ptr, arrivals):
    """Whether this program draws the last of `arrivals` tickets, called after its partial stores. The
    barrier puts every thread's stores before the ticket, which releases them to the GPU (acq_rel); the last
    program acquires all of them. That program must reset the ticket to 0 once it has merged."""
    tl.debug_barrier()
    return tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu") == arrivals - 1


@triton.jit
def fold_partials(part_acc_ptr, part_ml_ptr, first_row, first_split, count, split_step,
                  NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
                  BLOCK_D: tl.constexpr, CHUNK: tl.constexpr):
    """Fold `count` split partials of heads 0 .. GROUP - 1 (rows (first_row + head) * NUM_SPLITS + split for
    split = first_split + i * split_step) into one (m, l, acc), in split order.

    CHUNK splits at a time, each chunk's m, l and acc loaded together: one round trip to L2 per chunk instead
    of one per split (36 chained attentions at 3 active splits: 7.32 -> 6.80 us each on an H200). Chunks are
    folded in split order with the usual running-max rescaling, so the sum does not depend on timing. Loads
    bypass L1 (.cg): other SMs wrote these rows, and this SM may hold stale lines from an earlier launch.
    """
    offs_h = tl.arange(0, GROUP_P2)
    mask_h = offs_h < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, CHUNK)
    m_run = tl.full([GROUP_P2], float("-inf"), tl.float32)
    l_run = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, BLOCK_D], tl.float32)
    for c0 in range(0, count, CHUNK):
        index = c0 + offs_c
        valid = (index < count)[:, None] & mask_h[None, :]  # [CHUNK, GROUP_P2]
        rows = (first_row + offs_h[None, :]) * NUM_SPLITS + (first_split + index * split_step)[:, None]
        m = tl.load(part_ml_ptr + rows * 2, mask=valid, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(part_ml_ptr + rows * 2 + 1, mask=valid, other=0.0, cache_modifier=".cg")
        a = tl.load(part_acc_ptr + rows[:, :, None] * BLOCK_D + offs_d[None, None, :], mask=valid[:, :, None],
                    other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_run, tl.max(m, axis=0))
        # Empty splits (m = -inf) weigh 0; a row with no tokens at all (graph padding) stays 0, never NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.where(m_run == float("-inf"), 0.0, tl.exp(m_run - m_safe))
        weight = tl.where(m > float("-inf"), tl.exp(m - m_safe[None, :]), 0.0)
        l_run = l_run * alpha + tl.sum(weight * l_s, axis=0)
        acc = acc * alpha[:, None] + tl.sum(a * weight[:, :, None], axis=0)
        m_run = m_new
    return m_run, l_run, acc


@triton.jit
def store_partial(part_acc_ptr, part_ml_ptr, first_row, split, m, l_s, acc,
                  NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """Write a folded (m, l, acc) of heads 0 .. GROUP - 1 as the partial of `split` (a two-level merge)."""
    offs_h = tl.arange(0, GROUP_P2)
    mask_h = offs_h < GROUP
    rows = (first_row + offs_h) * NUM_SPLITS + split
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(part_acc_ptr + rows[:, None] * BLOCK_D + offs_d[None, :], acc, mask=mask_h[:, None])
    tl.store(part_ml_ptr + rows * 2, m, mask=mask_h)
    tl.store(part_ml_ptr + rows * 2 + 1, l_s, mask=mask_h)


@triton.jit
def merge_partials(part_acc_ptr, part_ml_ptr, out_ptr, first_row, count, split_step, head0, stride_oh,
                   NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr):
    """Fold `count` partials (splits 0, split_step, 2 * split_step, ...) of heads head0 .. head0 + GROUP - 1
    and store the normalised outputs."""
    m_run, l_run, acc = fold_partials(part_acc_ptr, part_ml_ptr, first_row, 0, count, split_step,
                                      NUM_SPLITS, GROUP, GROUP_P2, BLOCK_D, CHUNK)
    offs_h = tl.arange(0, GROUP_P2)
    offs_d = tl.arange(0, BLOCK_D)
    out = acc / tl.where(l_run > 0, l_run, 1.0)[:, None]
    tl.store(out_ptr + (head0 + offs_h)[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(offs_h < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :])
