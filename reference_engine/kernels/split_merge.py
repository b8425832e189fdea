"""Split work merged by its last program, in one launch: ticket counters and the attention merge.

Each program stores its partial and draws a ticket (`last_to_arrive`); the one drawing the last ticket
combines the partials in a fixed order and resets the counter. No second launch, and the result does not
depend on which program finished last. Split attention merges per (sequence, KV head) with
`merge_partials`, above 8 active splits in two levels (`fold_partials` + `store_partial` per run of splits,
then the runs, `ticket_merge` after `store_split_partial`); the greedy argmax (step_ops.py) merges per row. A
benchmark alternative (decode_layers' "poll_merge"): the splits count their partials in with release
increments and one split merges once `wait_for_count` sees them all, its own partial from registers
(`merge_with_own`).
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
def _store_heads(out_ptr, head0, stride_oh, l_run, acc, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """A merged (l, acc) of heads head0 .. head0 + GROUP - 1, normalised, as the output."""
    offs_h = tl.arange(0, GROUP_P2)
    offs_d = tl.arange(0, BLOCK_D)
    out = acc / tl.where(l_run > 0, l_run, 1.0)[:, None]
    tl.store(out_ptr + (head0 + offs_h)[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(offs_h < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :])


@triton.jit
def merge_partials(part_acc_ptr, part_ml_ptr, out_ptr, first_row, count, split_step, head0, stride_oh,
                   NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr):
    """Fold `count` partials (splits 0, split_step, 2 * split_step, ...) of heads head0 .. head0 + GROUP - 1
    and store the normalised outputs."""
    m_run, l_run, acc = fold_partials(part_acc_ptr, part_ml_ptr, first_row, 0, count, split_step,
                                      NUM_SPLITS, GROUP, GROUP_P2, BLOCK_D, CHUNK)
    _store_heads(out_ptr, head0, stride_oh, l_run, acc, GROUP, GROUP_P2, HEAD_DIM, BLOCK_D)


@triton.jit
def wait_for_count(counter_ptr, target):
    """Spin until the counter reaches `target` (acquire: what the counted programs stored before their
    release increments is visible after)."""
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def merge_with_own(part_acc_ptr, part_ml_ptr, out_ptr, first_row, others, m_own, l_own, acc_own, head0,
                   stride_oh, NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, CHUNK: tl.constexpr):
    """merge_partials over the stored partials of splits 0 .. others - 1, then this program's own (m, l, acc)
    ([BLOCK_G] rows, the first GROUP its heads) from registers, folded last: its partial is never stored."""
    m_run, l_run, acc = fold_partials(part_acc_ptr, part_ml_ptr, first_row, 0, others, 1, NUM_SPLITS, GROUP,
                                      GROUP_P2, BLOCK_D, CHUNK)
    first = tl.arange(0, BLOCK_G // GROUP_P2) == 0  # own rows 0 .. GROUP_P2 - 1, the heads
    m_s = tl.sum(tl.where(first[:, None], tl.reshape(m_own, (BLOCK_G // GROUP_P2, GROUP_P2)), 0.0), axis=0)
    l_s = tl.sum(tl.where(first[:, None], tl.reshape(l_own, (BLOCK_G // GROUP_P2, GROUP_P2)), 0.0), axis=0)
    a_s = tl.sum(tl.where(first[:, None, None], tl.reshape(acc_own, (BLOCK_G // GROUP_P2, GROUP_P2, BLOCK_D)),
                          0.0), axis=0)
    m_new = tl.maximum(m_run, m_s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.where(m_run == float("-inf"), 0.0, tl.exp(m_run - m_safe))
    beta = tl.where(m_s == float("-inf"), 0.0, tl.exp(m_s - m_safe))
    l_run = l_run * alpha + l_s * beta
    acc = acc * alpha[:, None] + a_s * beta[:, None]
    _store_heads(out_ptr, head0, stride_oh, l_run, acc, GROUP, GROUP_P2, HEAD_DIM, BLOCK_D)


@triton.jit
def store_split_partial(part_acc_ptr, part_ml_ptr, first_row, split, m_i, l_i, acc, GROUP: tl.constexpr,
                        NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """A split's (m, l, acc) of [BLOCK_G] rows (the first GROUP its heads) as its partial."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mine = (first_row + offs_g) * NUM_SPLITS + split
    tl.store(part_acc_ptr + mine[:, None] * BLOCK_D + offs_d[None, :], acc, mask=mask_g[:, None])
    tl.store(part_ml_ptr + mine * 2, m_i, mask=mask_g)
    tl.store(part_ml_ptr + mine * 2 + 1, l_i, mask=mask_g)


@triton.jit
def ticket_merge(part_acc_ptr, part_ml_ptr, out_ptr, group_tickets_ptr, ticket_ptr, first_row, seq, kv_head,
                 split, num_kv_heads, active, stride_ob, stride_oh, GROUP: tl.constexpr,
                 HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
                 GROUP_P2: tl.constexpr, MERGE_GROUP: tl.constexpr, NUM_GROUPS: tl.constexpr,
                 MERGE_CHUNK: tl.constexpr, RESET_TICKET: tl.constexpr):
    """After this split's partial is stored: the last to draw the ticket merges (one level up to MERGE_GROUP
    splits, else two). Returns 1 where the output was stored."""
    final = 0
    # MERGE_CHUNK splits a round trip: in the attention kernel 2 was the fastest of 2, 4 and 8 at batch 1
    # (H200); decode_layers.py passes its own.
    if active <= MERGE_GROUP:
        if last_to_arrive(ticket_ptr, active):
            small = (MERGE_CHUNK > 2) & (active <= MERGE_CHUNK // 2)  # half the tile holds them all
            if small:
                merge_partials(part_acc_ptr, part_ml_ptr, out_ptr + seq * stride_ob, first_row, active, 1,
                               kv_head * GROUP, stride_oh, NUM_SPLITS, GROUP, GROUP_P2, HEAD_DIM, BLOCK_D,
                               MERGE_CHUNK // 2)
            else:
                merge_partials(part_acc_ptr, part_ml_ptr, out_ptr + seq * stride_ob, first_row, active, 1,
                               kv_head * GROUP, stride_oh, NUM_SPLITS, GROUP, GROUP_P2, HEAD_DIM, BLOCK_D,
                               MERGE_CHUNK)
            if RESET_TICKET:  # ready for the next launch (graph replays reuse the counters)
                tl.atomic_xchg(ticket_ptr, 0)
            final = 1
    else:
        # Two levels: the last split of each run of MERGE_GROUP folds the run into the partial of the
        # run's first split, and the last run to finish merges those (16 -> 6 round trips at 32 splits).
        lo = split // MERGE_GROUP * MERGE_GROUP
        run = (seq * num_kv_heads + kv_head) * NUM_GROUPS + split // MERGE_GROUP
        run_ticket = group_tickets_ptr + run
        run_size = tl.minimum(active - lo, MERGE_GROUP)
        if last_to_arrive(run_ticket, run_size):
            m_run, l_run, acc_run = fold_partials(part_acc_ptr, part_ml_ptr, first_row, lo, run_size, 1,
                                                  NUM_SPLITS, GROUP, GROUP_P2, BLOCK_D, MERGE_CHUNK)
            store_partial(part_acc_ptr, part_ml_ptr, first_row, lo, m_run, l_run, acc_run,
                          NUM_SPLITS, GROUP, GROUP_P2, BLOCK_D)
            tl.atomic_xchg(run_ticket, 0)
            if last_to_arrive(ticket_ptr, tl.cdiv(active, MERGE_GROUP)):
                merge_partials(part_acc_ptr, part_ml_ptr, out_ptr + seq * stride_ob, first_row,
                               tl.cdiv(active, MERGE_GROUP), MERGE_GROUP, kv_head * GROUP, stride_oh,
                               NUM_SPLITS, GROUP, GROUP_P2, HEAD_DIM, BLOCK_D, MERGE_CHUNK)
                if RESET_TICKET:
                    tl.atomic_xchg(ticket_ptr, 0)
                final = 1
    return final
