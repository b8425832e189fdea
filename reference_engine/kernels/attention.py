"""Triton paged decode attention, split over the KV sequence (flash-decoding).

At batch 1 with 8 KV heads, one program per (sequence, KV head) would occupy 8 of the GPU's ~132 SMs. So each
(sequence, KV head) is cut into `num_splits` programs, each reducing its share of the sequence to a partial
(max, sum, acc) in fp32. The last of them to finish merges the partials (a per-(sequence, KV head) ticket
counter says which one is last), so there is no second launch; it merges in split order, so the result
does not depend on which program finished last. The split count depends only on shapes (batch, heads,
max_blocks, SM count), and each program computes its token range from seq_len on the device, so the launch
is CUDA-graph capturable: no host syncs, the same grid for every step of a graph. Splits that hold no
tokens this step (short sequences in a graph sized for max_model_len) exit at once and are not merged.

Each program handles all query heads of one KV head at once (GQA), so K/V are read once per group.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from reference_engine.kernels.pdl import INTERPRETED, launch_options, pdl_prologue
from reference_engine.kernels.rope import norm_rope_heads
from reference_engine.kernels.split_merge import (
    counters_for,
    fold_partials,
    last_to_arrive,
    merge_partials,
    store_partial,
    tickets_for,
)

# Fewer tiles per split than this and the merge costs more than the parallelism gains; more splits than
# _MAX_SPLITS and the merge (two levels, two splits per L2 round trip) costs more than it saves.
_MIN_TILES_PER_SPLIT = 2
_MAX_SPLITS = 32
# Above this many active splits the merge runs in two levels (runs of this many splits, then the runs).
_MERGE_GROUP = 8
DOT_FP32_DEFAULT = False


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(batch: int, num_kv_heads: int, max_tokens: int, device: torch.device, *,
                      tile: int = 64) -> int:
    """Splits per (sequence, KV head): ~4 programs per SM, at least two `tile`-token tiles each, at most 32.

    Tuned on an H200 (132 SMs, qwen3-4b shapes, two-level merge, `benchmarks/engine/kernels.py` sweep,
    2026-12-01),
    graph-replayed us with the tiles of `choose_tile`: B=1 ctx 1024 -> 8 splits (9.9; 9.5 at 4), ctx 4096 ->
    32 (13.8), ctx 16384 -> 32 (23.4); B=8 ctx 1024 -> 4 (15.1), ctx 4096 -> 8 (42.6), ctx 16384 -> 8 (133;
    120 at 32, but 8 already fill the SMs at that batch).
    """
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 8
    want = 4 * sms // (batch * num_kv_heads)
    most = max(1, max_tokens // (_MIN_TILES_PER_SPLIT * tile))
    return max(1, min(want, most, _MAX_SPLITS))


def choose_tile(batch: int, block_d: int) -> int:
    """Tokens per loop trip. From 4 sequences up, 128: fewer trips per split (B=8 ctx 4096: 42.6 against 46.9
    us; ctx 16384: 123 against 137). Below, 64: the 128-token tile's 128 KB of shared memory keeps the program
    off SMs where the qkv projection still runs, so it loses its early (PDL) start; in qwen3-4b steps at
    batch 1 attention plus o_proj took 17.2 us a layer with 128 against 14.2 with 64 (H200, 2026-12-01)."""
    if block_d > 128:
        return 32
    return 128 if batch >= 4 else 64


@triton.jit
def split_bounds(seq_lens_ptr, seq, split, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                 SOLO_TILES: tl.constexpr = 1):
    """(seq_len, start, end, active): this split's token range, in whole BLOCK_N tiles, decided on the device
    from seq_len, and how many splits hold tokens. Splits past the last token (split >= active, "empty") must
    exit at once: they draw no ticket and leave no partial. A row with no tokens still has one active split
    (it writes zeros). Up to SOLO_TILES tiles, one split takes them all: no merge."""
    seq_len = tl.load(seq_lens_ptr + seq)
    tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.maximum(tl.cdiv(tiles, NUM_SPLITS), 1)
    if SOLO_TILES > 1:
        tiles_per_split = tl.where(tiles <= SOLO_TILES, tl.maximum(tiles, 1), tiles_per_split)
    active = tl.maximum(tl.cdiv(tiles, tiles_per_split), 1)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
    return seq_len, start, end, active


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    tickets_ptr, group_tickets_ptr, scale,
    q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, slot_ptr, stride_cos, eps,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    stride_ob, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr, USE_PDL: tl.constexpr, FROM_QKV: tl.constexpr, NUM_Q_HEADS: tl.constexpr,
    GROUP_P2: tl.constexpr, MERGE_GROUP: tl.constexpr, NUM_GROUPS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # seq_len and the block table come from the step's input metadata, written before the first kernel of
    # this step's PDL chain started, so they are read before waiting on the previous kernel (the qkv
    # projection).
    seq_len, start, end, active = split_bounds(seq_lens_ptr, seq, split, BLOCK_N, NUM_SPLITS)
    if split >= active:
        return
    blocks, slot = read_step_metadata(block_tables_ptr, slot_ptr, seq, stride_bt, start, end, BLOCK_SIZE,
                                      BLOCK_N)
    pdl_prologue(USE_PDL)
    attend_split(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
        tickets_ptr, group_tickets_ptr, scale, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, slot_ptr, stride_cos,
        eps, stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        stride_bt, stride_ob, stride_oh, seq, kv_head, split, tl.num_programs(1), seq_len, start, end, active,
        GROUP, HEAD_DIM, BLOCK_SIZE, NUM_SPLITS, BLOCK_G, BLOCK_D, BLOCK_N, DOT_FP32, PRECISION, FROM_QKV,
        NUM_Q_HEADS, GROUP_P2, MERGE_GROUP, NUM_GROUPS, PREREAD=True, first_blocks=blocks,
        slot_read=slot,
    )


@triton.jit
def tile_blocks(block_tables_ptr, seq, stride_bt, tile_start, end, BLOCK_SIZE: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """The block numbers of tokens [tile_start, tile_start + BLOCK_N) of sequence `seq` (0 from `end` on)."""
    tokens = tile_start + tl.arange(0, BLOCK_N)
    return tl.load(block_tables_ptr + seq * stride_bt + tokens // BLOCK_SIZE, mask=tokens < end, other=0)


@triton.jit
def read_step_metadata(block_tables_ptr, slot_ptr, seq, stride_bt, start, end, BLOCK_SIZE: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """(block numbers of the split's first tile, the sequence's slot_mapping entry as int64) for
    `attend_split(PREREAD=True)`: step metadata, which does not depend on this step's kernels, so a split
    reads it before waiting for its input."""
    blocks = tile_blocks(block_tables_ptr, seq, stride_bt, start, end, BLOCK_SIZE, BLOCK_N)
    return blocks, tl.load(slot_ptr + seq).to(tl.int64)


@triton.jit
def attend_split(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    tickets_ptr, group_tickets_ptr, scale, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, slot_ptr, stride_cos,
    eps, stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    stride_ob, stride_oh, seq, kv_head, split, num_kv_heads, seq_len, start, end, active,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr, FROM_QKV: tl.constexpr, NUM_Q_HEADS: tl.constexpr, GROUP_P2: tl.constexpr,
    MERGE_GROUP: tl.constexpr, NUM_GROUPS: tl.constexpr, MERGE_CHUNK: tl.constexpr = 2,
    RESET_TICKET: tl.constexpr = True, PREREAD: tl.constexpr = False, first_blocks=0, slot_read=0,
):
    """One active split of (seq, kv_head) over tokens [start, end) (from `split_bounds`). Returns 1 in the
    program that stored the group's final output (the only split, or the last to arrive, which merged),
    else 0: decode_layers.py counts that output done for its consumers. Without RESET_TICKET the caller
    zeroes the (seq, kv_head) ticket after that (off the chain to the consumers). With PREREAD the caller
    read the step's metadata before waiting for its input (`read_step_metadata`): the first tile's block
    numbers and the sequence's slot_mapping entry (`slot_read`, int64)."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    if FROM_QKV:
        # q_ptr is the qkv projection: q/k RMSNorm + RoPE happen here (no separate launch). The program whose
        # range holds the current token (position seq_len - 1) also writes its k and v to the cache, then
        # reads them back with the history below: the same program, so a barrier makes them visible.
        pos = tl.maximum(seq_len - 1, 0)
        row = q_ptr + seq * stride_qb
        q = norm_rope_heads(row + heads[:, None] * HEAD_DIM, q_norm_ptr, cos_ptr + pos * stride_cos,
                       sin_ptr + pos * stride_cos, mask_g[:, None], eps, HEAD_DIM, BLOCK_D // 2)
        if (start <= pos) & (pos < end):
            if PREREAD:
                slot = slot_read
            else:
                slot = tl.load(slot_ptr + seq).to(tl.int64)
            if slot >= 0:
                one = offs_g < 1  # row 0 of a [BLOCK_G, D] tile: the one k/v head of this program
                src = row + (NUM_Q_HEADS + kv_head + 0 * offs_g)[:, None] * HEAD_DIM
                k_new = norm_rope_heads(src, k_norm_ptr, cos_ptr + pos * stride_cos,
                                        sin_ptr + pos * stride_cos, one[:, None], eps, HEAD_DIM, BLOCK_D // 2)
                v_new = tl.load(src + num_kv_heads * HEAD_DIM + offs_d[None, :], mask=one[:, None], other=0.0)
                k_dst = k_cache_ptr + (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_kt \
                    + kv_head * stride_kh + offs_d[None, :] + 0 * offs_g[:, None]
                v_dst = v_cache_ptr + (slot // BLOCK_SIZE) * stride_vb + (slot % BLOCK_SIZE) * stride_vt \
                    + kv_head * stride_vh + offs_d[None, :] + 0 * offs_g[:, None]
                tl.store(k_dst, k_new, mask=one[:, None])
                tl.store(v_dst, v_new, mask=one[:, None])
            tl.debug_barrier()
    else:
        q = tl.load(
            q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=mask_g[:, None] & mask_d[None, :], other=0.0,
        )
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + offs_n
        mask_n = tokens < end
        if PREREAD and tile_start == start:
            blocks = first_blocks
        else:
            blocks = tile_blocks(block_tables_ptr, seq, stride_bt, tile_start, end, BLOCK_SIZE, BLOCK_N)
        within = tokens % BLOCK_SIZE
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(
            k_cache_ptr + blocks[:, None].to(tl.int64) * stride_kb + within[:, None] * stride_kt
            + kv_head * stride_kh + offs_d[None, :],
            mask=kv_mask, other=0.0,
        )
        if DOT_FP32:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(mask_n[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        v = tl.load(
            v_cache_ptr + blocks[:, None].to(tl.int64) * stride_vb + within[:, None] * stride_vt
            + kv_head * stride_vh + offs_d[None, :],
            mask=kv_mask, other=0.0,
        )
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    final = 0
    if (NUM_SPLITS == 1) or (active == 1):
        final = 1
        # One split holds every token (or the only one has tokens): normalise and write, no merge.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :],
        )
    else:
        # Partials laid out [B, Hq, NUM_SPLITS, ...].
        first_row = seq * num_kv_heads * GROUP + kv_head * GROUP
        mine = (first_row + offs_g) * NUM_SPLITS + split
        tl.store(part_acc_ptr + mine[:, None] * BLOCK_D + offs_d[None, :], acc, mask=mask_g[:, None])
        tl.store(part_ml_ptr + mine * 2, m_i, mask=mask_g)
        tl.store(part_ml_ptr + mine * 2 + 1, l_i, mask=mask_g)
        # MERGE_CHUNK splits a round trip: in the attention kernel 2 was the fastest of 2, 4 and 8 at batch 1
        # (H200); decode_layers.py passes its own.
        ticket_ptr = tickets_ptr + seq * num_kv_heads + kv_head
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


def split_workspace(device: torch.device, batch: int, num_q_heads: int, num_kv_heads: int, num_splits: int,
                    block_d: int, placeholder: torch.Tensor, merge_group: int = _MERGE_GROUP):
    """(part_acc, part_ml, tickets, group_tickets, num_groups): what `attend_split` needs to merge
    `num_splits` splits of each (sequence, KV head): fp32 partials [B * Hq * splits, BLOCK_D] and (m, l),
    the ticket counters, the run tickets of a two-level merge (runs of `merge_group` splits) and the number
    of runs. With one split the partials are `placeholder` (never read)."""
    if num_splits > 1:
        rows = batch * num_q_heads * num_splits
        part_acc = torch.empty(rows, block_d, dtype=torch.float32, device=device)
        part_ml = torch.empty(rows, 2, dtype=torch.float32, device=device)
    else:
        part_acc = part_ml = placeholder
    num_groups = triton.cdiv(num_splits, merge_group)
    group_tickets = counters_for(device, "attention run tickets", batch * num_kv_heads * num_groups)
    return part_acc, part_ml, tickets_for(device, batch * num_kv_heads), group_tickets, num_groups


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    dot_fp32: bool | None = None,
    tiles: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Same contract as torch_ref.paged_decode_attention.

    `tiles` = (tokens per tile, pipeline stages) overrides the defaults (benchmarks/engine/kernels.py sweeps
    them).

    `num_splits` overrides the automatic choice. `dot_fp32` runs the two matmuls on fp32 operands (bf16
    values are exact in tf32, and p keeps 10 mantissa bits instead of 7); it is forced under the Triton
    interpreter, whose bf16 tl.dot returns garbage (triton 3.9), and otherwise defaults to DOT_FP32_DEFAULT.
    """
    batch, num_q_heads, head_dim = q.shape
    assert q.stride(-1) == 1
    out = torch.empty_like(q)
    _launch(q, q.stride(0), q.stride(1), out, k_cache, v_cache, block_tables, seq_lens, scale, None,
            num_q_heads=num_q_heads, num_splits=num_splits, dot_fp32=dot_fp32, tiles=tiles)
    return out


def decode_attention_from_qkv(
    qkv: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    eps: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Same contract as torch_ref.decode_attention_from_qkv: Qwen3's q/k norm + RoPE + cache write and paged
    decode attention in one launch (the current token's position is seq_len - 1)."""
    batch = qkv.shape[0]
    head_dim = q_norm_weight.shape[0]
    assert qkv.stride(-1) == 1 and slot_mapping.is_contiguous() and cos.stride() == sin.stride()
    assert head_dim == triton.next_power_of_2(head_dim), "fused RoPE needs a power-of-two head_dim"
    out = torch.empty(batch, num_q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    rope = (q_norm_weight, k_norm_weight, cos, sin, slot_mapping, cos.stride(0), eps)
    _launch(qkv, qkv.stride(0), head_dim, out, k_cache, v_cache, block_tables, seq_lens, scale, rope,
            num_q_heads=num_q_heads, num_splits=num_splits, dot_fp32=None)
    return out


def _launch(
    q: torch.Tensor, stride_qb: int, stride_qh: int, out: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    rope: tuple | None, *, num_q_heads: int, num_splits: int | None, dot_fp32: bool | None,
    tiles: tuple[int, int] | None = None,
) -> None:
    batch, head_dim = out.shape[0], out.shape[2]
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert block_tables.stride(-1) == 1, "block tables must be row-major (the kernel steps along a row)"
    max_tokens = block_tables.shape[1] * block_size
    block_d = triton.next_power_of_2(head_dim)
    block_n, num_stages = tiles or (choose_tile(batch, block_d), 2)
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_tokens, q.device, tile=block_n)
    if dot_fp32 is None or INTERPRETED:
        dot_fp32 = DOT_FP32_DEFAULT or INTERPRETED
    use_pdl, pdl = launch_options(q)
    block_g = max(16, triton.next_power_of_2(group))  # tl.dot needs M >= 16
    part_acc, part_ml, tickets, group_tickets, num_groups = split_workspace(
        q.device, batch, num_q_heads, num_kv_heads, num_splits, block_d, out)
    # Without rope the fused-RoPE arguments are placeholders the kernel never reads.
    q_norm, k_norm, cos, sin, slots, stride_cos, eps = rope or (q, q, q, q, seq_lens, 0, 0.0)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_ml,
        tickets, group_tickets, scale,
        q_norm, k_norm, cos, sin, slots, stride_cos, eps,
        stride_qb, stride_qh,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n, DOT_FP32=dot_fp32 or q.dtype == torch.float32,
        # fp32 caches (tests) get exact fp32 products; bf16 values are exact in tf32 anyway.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FROM_QKV=rope is not None, NUM_Q_HEADS=num_q_heads, GROUP_P2=triton.next_power_of_2(group),
        MERGE_GROUP=_MERGE_GROUP, NUM_GROUPS=num_groups,
        # 8 warps: with 4, ptxas (sm_90) spills ~300 bytes a thread for the fp32 tiles.
        USE_PDL=use_pdl, num_warps=8, num_stages=num_stages, **pdl,
    )
