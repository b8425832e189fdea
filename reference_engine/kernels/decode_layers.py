"""A one-row Qwen3 decode step through every layer in one launch: qkv, attention, o_proj, MLP, 36 times.

fused_mlp.py made a layer two launches (attention, then the rest). Here the whole stack is one grid: no
launch boundary drains the GPU between layers (with the dependencies skipped, the weights stream at 46 us a
qwen3-4b layer against 51.6 at a launch a layer), the step graph holds 5 kernels instead of 77, and an
eager step launches 36 x 2 fewer. Each program draws its role from a dispatch counter (in the order programs
start), so it only waits for programs already running: no deadlock, whatever fits on the GPU. Per layer:

- qkv tiles: rmsnorm(x_l) @ w_qkv.T (Q_N rows each), walking x_l chunk by chunk as the previous layer's down
  tiles fill it; each counts on the flag of the KV head its rows belong to (q rows of its group, k or v),
  and they are dispatched group by group;
- attention splits (attention.py's `attend_split`: q/k norm, RoPE, cache write, flash-decoding with the merge
  in the last split, up to 16 splits in one level and one round trip): each waits for its KV head's qkv rows;
  the program that stores the head group's output counts on the flag of its o_proj chunk, then zeroes the
  merge ticket (each layer has its own);
- o_proj tiles load their whole weight tile (O_N x attention width) before waiting for attention, so the HBM
  streams o_proj while attention's chain of round trips runs; then one pass over the attention output;
- gate_up + SiLU and down tiles as in fused_mlp.py, chained through per-chunk flags; down writes x_{l+1}
  and counts on the next layer's input flags.

Every output is one program's K loop in order, as in the separate kernels: the result does not depend on
timing. Its qkv, gate_up and down sums are the per-layer launches'; o_proj's one pass over the whole
attention width adds in another order than their 1024-wide chunks, and attention's reductions run in 4 warps
here (8 there): on the GPU the result differs from the per-layer launches by rounding (with the same 64-token
attention tile and one o_proj chunk, the interpreter gives the same bits). Each layer has its own flags and
activation buffers, so no SM's L1 can hold a line of an earlier layer's buffer at the same address. The last
down tile of a layer resets that layer's flags (every reader of them has finished by then), the last of the
last layer the dispatch counter: graph replays reuse them. The same limit as fused_mlp.py: two of these
launches must not run at once on one device (their programs would take each other's roles). With
OPTIONS["trace"] set the launch also stamps, per layer, when its latest (or earliest) program passes each of
TRACE_EVENTS (the GPU's global timer; a logical clock in the interpreter): see
benchmarks/engine/decode_layers.py --trace.

On the H200 (docs/benchmarks.md) a qwen3-4b layer takes 58.7 us at 170 tokens (61.5 at 1024) against
64.2-64.6 (69.7-70.1) at two launches a layer (floor 47.2-47.5), and an eager step drops from 10.7 to 2.7-3.3
ms (it was CPU-bound on its launches). Attention is a chain of dependent memory round trips, and the one
dependency that costs much (o_proj not waiting for it: 53.0 us); before o_proj held its weights across it
(63.9 us) the HBM idled through it. Each other phase edge costs 0.4-1.1 us on its own (no waits at all: 49).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from reference_engine.kernels import attention, fused_mlp
from reference_engine.kernels.attention import attend_split, read_step_metadata, split_bounds
from reference_engine.kernels.fused_mlp import (
    MlpTiles,
    _chunks_ready,
    _count_done,
    _norm_rows,
    _residual_cols,
)
from reference_engine.kernels.layer_stack import KINDS, LayerStack, run_layers
from reference_engine.kernels.pdl import INTERPRETED, launch_options, pdl_prologue
from reference_engine.kernels.split_merge import counters_for, last_to_arrive, tickets_for

# Attention tokens per loop trip: at 64 (the per-layer kernel's) the launch needs 185 registers a thread (2
# programs an SM), at 32 168 (3, as the GEMM phases alone; sm_90, triton 3.6); 16 is slower again (H200:
# 66.8 against 64.6 us a layer at 170 tokens).
_ATTENTION_TILE = 32
# Per layer: input, qkv (per KV head), attention (per o_proj chunk), h and act flags, the layer-done ticket.
_FLAG_SETS = tl.constexpr(6)
# gate_up with 5 stages (69.6 KB of shared memory a program, still 3 programs an SM): H200, 59.96 against
# 60.37-60.40 us a layer at 170 tokens, 62.86-62.89 against 63.05 at 1024 (down with 3 or 8 stages, qkv with 2
# or 5: slower; docs/benchmarks.md).
_TILES = MlpTiles(gu_stages=5)
# Bytes of o_proj weights a thread may hold across attention (64 registers): the launch stays at 168 registers
# (3 programs an SM; sm_90, triton 3.6), as without.
_O_WHOLE_BYTES = 256
# Up to this many attention tiles (32 tokens each) one split takes a KV head's whole context, with no merge:
# the merge's round trips (partials, fence, ticket, their loads) cost ~3 us a layer, a loop trip ~1 (H200, us
# a layer at 32 / 64 / 96 tokens: 55.5 / 56.6 / 57.5 against 58.8 / 58.9 at 64 / 96 with a split a tile).
_SOLO_TILES = 3
# Benchmark switches (benchmarks/engine/decode_layers.py): "skip" 2 makes o_proj not wait for attention, 4
# gate_up for h, 8 down for act, 16 qkv for the layer's input (wrong results: what each dependency costs);
# "o_proj_whole" False walks o_proj's K chunks as attention fills them;
# "maxnreg" caps the registers a thread (128: 4 programs an SM, some spilled, slower; docs/benchmarks.md).
# "trace": an int64 tensor from new_trace() to stamp TRACE_EVENTS into (None: no trace code compiled in).
# "o_proj_tiles" 2: each o_proj program holds one weight tile across attention and streams a second after it,
# so all of o_proj's roles are drawn while attention runs: o_proj ends ~8 us earlier, but gate_up does not,
# and the layer takes 61.3-61.8 against 60.0-60.3 us at 170 tokens (H200; docs/benchmarks.md).
# "o_ahead" False: o_proj's first half does not ask L2 for the second half's weights.
# "solo_tiles": _SOLO_TILES overridden (1: a split a tile from two tiles up, as before).
OPTIONS = {"skip": 0, "o_proj_whole": True, "maxnreg": 0, "trace": None, "o_proj_tiles": 1, "o_ahead": True,
           "uniform": True, "solo_tiles": _SOLO_TILES}
# Attention's split merge here: up to 16 splits in one level, their partials loaded in one round trip (8 when
# they fit). H200, us a layer at 170 / 1024 tokens: 61.22 / 63.99 against 61.39 / 66.77 with the attention
# kernel's (runs of 8, two splits a trip); 8 a trip in runs of 8: 61.32 / 68.19.
_MERGE_CHUNK = 16
_MERGE_GROUP = 16


# Trace points (benchmarks/engine/decode_layers.py --trace): per layer, the latest (or earliest) program past
# each.
TRACE_EVENTS = (
    ("qkv tile done", "latest"),
    ("attention split past its wait", "latest"),
    ("attention output counted for o_proj", "latest"),
    ("o_proj tile drew its role", "latest"),
    ("o_proj tile's weights in registers", "latest"),
    ("o_proj tile past its wait", "earliest"),
    ("o_proj tile past its wait", "latest"),
    ("o_proj tile done", "latest"),
    ("gate_up tile drew its role", "earliest"),
    ("gate_up tile drew its role", "latest"),
    ("gate_up tile done", "earliest"),
    ("gate_up tile done", "latest"),
    ("down tile done", "latest"),
)
_EVENTS = tl.constexpr(len(TRACE_EVENTS))
# Their slots, in TRACE_EVENTS' order.
(_QKV_DONE, _ATTENTION_WAITED, _ATTENTION_COUNTED, _O_ROLE, _O_WEIGHTS, _O_WAITED_FIRST, _O_WAITED, _O_DONE,
 _GU_ROLE_FIRST, _GU_ROLE, _GATE_UP_DONE_FIRST, _GATE_UP_DONE,
 _DOWN_DONE) = (tl.constexpr(i) for i in range(len(TRACE_EVENTS)))


@triton.jit
def _stamp(trace_ptr, layer, EVENT: tl.constexpr, LATEST: tl.constexpr, TRACE: tl.constexpr,
           GLOBAL_TIMER: tl.constexpr, layers, after=0):
    """With TRACE, fold this program's time into the layer's EVENT slot (max or min): the GPU's global
    timer (ns), read once `after` (an int32 the asm takes as an operand, so loads it depends on have
    arrived) is known; under the interpreter, which runs no PTX, a logical clock (a counter after the
    slots)."""
    if TRACE:
        if GLOBAL_TIMER:
            now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [layer + after],
                                            dtype=tl.int64, is_pure=False, pack=1)
        else:
            now = tl.atomic_add(trace_ptr + layers * _EVENTS, 1).to(tl.int64) + 1
        slot = trace_ptr + layer * _EVENTS + EVENT
        if LATEST:
            tl.atomic_max(slot, now)
        else:
            tl.atomic_min(slot, now)


@triton.jit
def _bulk_prefetch_l2(ptr, BYTES: tl.constexpr):
    """Ask L2 for BYTES bytes from ptr (16-byte aligned, a multiple of 16): one Hopper bulk prefetch,
    issued by the program's thread 0 (no registers held, nothing waits for it). GPU only."""
    tl.inline_asm_elementwise(
        "{ .reg .u32 t; .reg .pred p; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr.to(tl.int64), tl.full((), BYTES, tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _at(base_ptr, table_ptr, KIND: tl.constexpr, layers, uniform_offset, UNIFORM: tl.constexpr):
    """This layer's tensor of KIND: layer 0's pointer plus the stack's offset (table_ptr points at the layer's
    column; offsets are multiples of 16 elements, `supports` checks: the hint keeps the loads vectorised).
    With UNIFORM (LayerStack.uniform) the offset is `uniform_offset`, computed: no load before the weight
    loads can issue."""
    if UNIFORM:
        return base_ptr + tl.multiple_of(uniform_offset, 16)
    return base_ptr + tl.multiple_of(tl.load(table_ptr + KIND * layers), 16)


@triton.jit
def _wait_for(flags_ptr, count, FLAGS: tl.constexpr, NO_WAIT: tl.constexpr, chunks=1):
    """Spin until each of the `chunks` flags reaches `count` (every warp sees the same reads: see
    _chunks_ready)."""
    ready = 0
    while ready < chunks:
        ready = _chunks_ready(flags_ptr, chunks, count, FLAGS, True, NO_WAIT)


@triton.jit
def _store_h(h_l, col, h, H, h_flags, tile, O_N: tl.constexpr, GU_K: tl.constexpr):
    """Store o_proj tile `tile`'s columns of h and count it on the flag of gate_up's chunk holding them."""
    tl.store(h_l + col, h.to(h_l.dtype.element_ty), mask=col < H)
    _count_done(h_flags + tile * O_N // GU_K)


@triton.jit
def _layer_done(sync_ptr, flags_ptr, programs, last_layer, FLAGS: tl.constexpr):
    """Called by each down tile of a layer after its output is counted: the last of them zeroes the layer's
    flags (its readers all finished: each down tile read every act chunk, each gate_up tile every h chunk, and
    so on back to the qkv tiles) and, in the last layer, the dispatch counter."""
    ticket = flags_ptr + (_FLAG_SETS - 1) * FLAGS
    if last_to_arrive(ticket, programs):
        offs = tl.arange(0, FLAGS)
        zeros = tl.zeros((FLAGS,), tl.int32)
        for s in tl.static_range(_FLAG_SETS - 1):
            tl.store(flags_ptr + s * FLAGS + offs, zeros)
        tl.atomic_xchg(ticket, 0)
        if last_layer:
            tl.atomic_xchg(sync_ptr, 0)


@triton.jit
def _decode_layers_kernel(
    x0_ptr, xs_ptr, qkv_ptr, attn_ptr, h_ptr, act_ptr, sync_ptr, offsets_ptr,
    in_norm0_ptr, wqkv0_ptr, q_norm0_ptr, k_norm0_ptr, wo0_ptr, post_norm0_ptr, wgu0_ptr, wd0_ptr,
    k_cache0_ptr, v_cache0_ptr,
    cos_ptr, sin_ptr, slot_ptr, block_tables_ptr, seq_lens_ptr, part_acc_ptr, part_ml_ptr, tickets_ptr,
    group_tickets_ptr, scale, eps, stride_cos,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    LAYERS, H, INTER, QKV, A,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, GROUP_P2: tl.constexpr, MERGE_GROUP: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    O_N: tl.constexpr, O_K: tl.constexpr, O_STAGES: tl.constexpr,
    GU_N: tl.constexpr, GU_K: tl.constexpr, GU_STAGES: tl.constexpr,
    D_N: tl.constexpr, D_K: tl.constexpr, D_STAGES: tl.constexpr,
    Q_N: tl.constexpr, Q_K: tl.constexpr, Q_STAGES: tl.constexpr,
    FLAGS: tl.constexpr, USE_PDL: tl.constexpr, NO_WAIT: tl.constexpr, SKIP: tl.constexpr,
    ATT_CHUNKS: tl.constexpr, O_WHOLE: tl.constexpr, O_TILES: tl.constexpr, A_P2: tl.constexpr,
    MERGE_CHUNK: tl.constexpr, O_AHEAD: tl.constexpr,
    trace_ptr, TRACE: tl.constexpr, GLOBAL_TIMER: tl.constexpr,
    stride_kv_layer, UNIFORM: tl.constexpr, SOLO_TILES: tl.constexpr,
):
    pdl_prologue(USE_PDL)  # x0 (the embedding) is an earlier kernel's; the last launch reset the counters
    vid = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    n_q = tl.cdiv(QKV, Q_N)
    n_att = NUM_KV_HEADS * NUM_SPLITS
    n_o = tl.cdiv(H, O_N * O_TILES)
    n_gu = tl.cdiv(INTER, GU_N)
    n_d = tl.cdiv(H, D_N)
    per_layer = n_q + n_att + n_o + n_gu + n_d
    layer = vid // per_layer
    r = vid % per_layer
    flags = sync_ptr + 2 + layer * (_FLAG_SETS * FLAGS)
    in_flags = flags
    qkv_flags = flags + FLAGS
    attn_flags = flags + 2 * FLAGS
    h_flags = flags + 3 * FLAGS
    act_flags = flags + 4 * FLAGS
    x_ptr = x0_ptr  # this layer's input: the embedding, or the previous layer's output
    if layer > 0:
        x_ptr = xs_ptr + (layer - 1) * H
    qkv_l = qkv_ptr + layer * QKV
    attn_l = attn_ptr + layer * A
    h_l = h_ptr + layer * H
    act_l = act_ptr + layer * INTER
    table = offsets_ptr + layer
    l64 = layer.to(tl.int64)
    if r < n_q:  # qkv = rmsnorm(x_l) @ w_qkv.T for Q_N rows
        # Tiles in KV head group order (the group's q rows, its k rows, its v rows), so the first groups'
        # attention can start while the last groups' tiles stream (H200: 61.5 against 61.8 us a layer in row
        # order, where every group waited for the k and v rows at the end; docs/benchmarks.md).
        per_group = (GROUP + 2) * HEAD_DIM // Q_N
        q_tiles = GROUP * HEAD_DIM // Q_N
        kv_tiles = HEAD_DIM // Q_N
        head = r // per_group
        t = r % per_group
        q_rows = NUM_Q_HEADS * HEAD_DIM
        kv_rows = NUM_KV_HEADS * HEAD_DIM
        row = tl.where(t < q_tiles, head * GROUP * HEAD_DIM + t * Q_N,
                       tl.where(t < q_tiles + kv_tiles, q_rows + head * HEAD_DIM + (t - q_tiles) * Q_N,
                                q_rows + kv_rows + head * HEAD_DIM + (t - q_tiles - kv_tiles) * Q_N))
        rn = row + tl.arange(0, Q_N)
        w_qkv = _at(wqkv0_ptr, table, 1, LAYERS, l64 * QKV * H, UNIFORM)
        rows = w_qkv + tl.minimum(rn, QKV - 1).to(tl.int64)[:, None] * H
        rows += tl.arange(0, Q_K)[None, :]
        per_chunk = Q_K // D_N
        if layer == 0:
            per_chunk = 0  # the embedding is complete
        in_norm = _at(in_norm0_ptr, table, 0, LAYERS, l64 * H, UNIFORM)
        y = _norm_rows(x_ptr, in_norm, rows, 0, in_flags, H, eps, Q_N, Q_K, Q_STAGES, False, (SKIP & 16) == 0,
                       per_chunk, FLAGS, NO_WAIT)
        tl.store(qkv_l + rn, y.to(qkv_ptr.dtype.element_ty), mask=rn < QKV)
        _count_done(qkv_flags + head)
        _stamp(trace_ptr, layer, _QKV_DONE, True, TRACE, GLOBAL_TIMER, LAYERS)
    elif r < n_q + n_att:  # one split of one KV head's attention
        kv_head = (r - n_q) // NUM_SPLITS
        split = (r - n_q) % NUM_SPLITS
        seq_len, start, end, active = split_bounds(seq_lens_ptr, 0, split, BLOCK_N, NUM_SPLITS, SOLO_TILES)
        if split < active:
            layer_tickets = tickets_ptr + layer * NUM_KV_HEADS  # merge tickets: a set per layer
            k_l = _at(k_cache0_ptr, table, 8, LAYERS, l64 * stride_kv_layer, UNIFORM)
            v_l = _at(v_cache0_ptr, table, 9, LAYERS, l64 * stride_kv_layer, UNIFORM)
            # The step's metadata (the first tile's block numbers, the slot) read before the wait, off the
            # chain (H200: 59.69 against 59.96 us a layer at 170 tokens, 62.33 against 62.88 at 1024). The
            # tile's keys and values too cost more than they save (their registers, or the current token
            # patched in: docs/benchmarks.md).
            blocks, slot = read_step_metadata(block_tables_ptr, slot_ptr, 0, 0, start, end, BLOCK_SIZE,
                                              BLOCK_N)
            _wait_for(qkv_flags + kv_head, (GROUP + 2) * HEAD_DIM // Q_N, FLAGS, NO_WAIT)
            _stamp(trace_ptr, layer, _ATTENTION_WAITED, True, TRACE, GLOBAL_TIMER, LAYERS)
            final = attend_split(
                qkv_l, k_l, v_l, block_tables_ptr, attn_l, part_acc_ptr, part_ml_ptr, layer_tickets,
                group_tickets_ptr, scale, _at(q_norm0_ptr, table, 2, LAYERS, l64 * HEAD_DIM, UNIFORM),
                _at(k_norm0_ptr, table, 3, LAYERS, l64 * HEAD_DIM, UNIFORM), cos_ptr, sin_ptr, slot_ptr,
                stride_cos, eps, QKV, HEAD_DIM, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                stride_vh, 0, A, HEAD_DIM, 0,
                kv_head, split, NUM_KV_HEADS, seq_len, start, end, active, GROUP, HEAD_DIM, BLOCK_SIZE,
                NUM_SPLITS, BLOCK_G, BLOCK_D, BLOCK_N, DOT_FP32, PRECISION, True, NUM_Q_HEADS, GROUP_P2,
                MERGE_GROUP, NUM_GROUPS, MERGE_CHUNK, False, True, blocks, slot,
            )
            if final != 0:  # the group's output fills ATT_CHUNKS o_proj chunks (or part of one)
                for i in tl.static_range(ATT_CHUNKS):
                    _count_done(attn_flags + kv_head * GROUP * HEAD_DIM // O_K + i)
                _stamp(trace_ptr, layer, _ATTENTION_COUNTED, True, TRACE, GLOBAL_TIMER, LAYERS)
                # The merge ticket is zeroed only now, off the chain to o_proj: 60.7 / 63.5 against 61.2 /
                # 64.0 us a layer at 170 / 1024 tokens (H200). Each layer has its own tickets, so nothing
                # reads this one again in this launch (a shared one would need the zeroing ordered before
                # the next layer's splits draw it); the launch boundary orders it before the next launch.
                tl.atomic_xchg(layer_tickets + kv_head, 0)
    elif r < n_q + n_att + n_o:  # h = x_l + attn @ w_o.T for O_N columns (O_TILES tiles of them)
        if r == n_q + n_att + n_o - 1:  # roles are drawn in order: the last o_proj program draws last
            _stamp(trace_ptr, layer, _O_ROLE, True, TRACE, GLOBAL_TIMER, LAYERS)
        col = (r - n_q - n_att) * O_N * O_TILES + tl.arange(0, O_N)
        wo_l = _at(wo0_ptr, table, 4, LAYERS, l64 * H * A, UNIFORM)
        w_rows = wo_l + tl.minimum(col, H - 1).to(tl.int64)[:, None] * A
        attn_chunk = tl.maximum(O_K // (GROUP * HEAD_DIM), 1)  # KV head groups finishing a chunk
        if SKIP & 2:
            attn_chunk = 0  # diagnostics: o_proj does not wait for attention (wrong results)
        if O_WHOLE:  # the tile's weights load while attention runs; then one pass once it is all done
            kk = tl.arange(0, A_P2)
            w = tl.load(w_rows + kk[None, :], mask=kk[None, :] < A, other=0.0)
            if TRACE:
                # An operand the compiler cannot fold away, so the timer is read after the loads land.
                _stamp(trace_ptr, layer, _O_WEIGHTS, True, TRACE, GLOBAL_TIMER, LAYERS,
                       (tl.sum(w.to(tl.float32)) == 1234.5).to(tl.int32))
            _wait_for(attn_flags, attn_chunk, FLAGS, NO_WAIT, A // O_K)
            _stamp(trace_ptr, layer, _O_WAITED_FIRST, False, TRACE, GLOBAL_TIMER, LAYERS)
            _stamp(trace_ptr, layer, _O_WAITED, True, TRACE, GLOBAL_TIMER, LAYERS)
            # The programs of the first half then ask L2 for the second half's tiles: the programs that did
            # not fit beside attention's draw their roles only as these finish, and their loads otherwise
            # queue behind gate_up's streams (H200: 58.85 against 59.10 us a layer at 170 tokens; before the
            # wait the prefetch slows attention's chain: 59.62; docs/benchmarks.md).
            ahead = (r - n_q - n_att) * O_TILES + (n_o * O_TILES) // 2
            if O_AHEAD and (ahead < n_o * O_TILES):
                _bulk_prefetch_l2(wo_l + ahead.to(tl.int64) * O_N * A, O_N * A * 2)
            a = tl.load(attn_l + kk, mask=kk < A, other=0.0).to(tl.float32)
            res = tl.load(x_ptr + col, mask=col < H, other=0.0).to(tl.float32)  # in the same round trip as a
            for t in tl.static_range(O_TILES):
                if t > 0:  # a later tile of this program streams after attention, with no role to draw
                    col += O_N
                    w = tl.load(w_rows + t * O_N * A + kk[None, :], mask=kk[None, :] < A, other=0.0)
                    res = tl.load(x_ptr + col, mask=col < H, other=0.0).to(tl.float32)
                h = tl.sum(w.to(tl.float32) * a[None, :], axis=1) + res
                _store_h(h_l, col, h, H, h_flags, (r - n_q - n_att) * O_TILES + t, O_N, GU_K)
        else:
            h = _residual_cols(attn_l, w_rows + tl.arange(0, O_K)[None, :], x_ptr, col, attn_flags, A, H, O_N,
                               O_K, O_STAGES, True, attn_chunk, FLAGS, NO_WAIT)
            _store_h(h_l, col, h, H, h_flags, r - n_q - n_att, O_N, GU_K)
        _stamp(trace_ptr, layer, _O_DONE, True, TRACE, GLOBAL_TIMER, LAYERS)
    elif r < n_q + n_att + n_o + n_gu:  # silu(rmsnorm(h) @ gate.T) * (rmsnorm(h) @ up.T) for GU_N rows
        if r == n_q + n_att + n_o:  # the first gate_up program draws first (no contended atomics)
            _stamp(trace_ptr, layer, _GU_ROLE_FIRST, False, TRACE, GLOBAL_TIMER, LAYERS)
        if r == n_q + n_att + n_o + n_gu - 1:
            _stamp(trace_ptr, layer, _GU_ROLE, True, TRACE, GLOBAL_TIMER, LAYERS)
        rn = (r - n_q - n_att - n_o) * GU_N + tl.arange(0, GU_N)
        w_gu = _at(wgu0_ptr, table, 6, LAYERS, l64 * 2 * INTER * H, UNIFORM)
        rows = w_gu + tl.minimum(rn, INTER - 1).to(tl.int64)[:, None] * H
        rows += tl.arange(0, GU_K)[None, :]
        post_norm = _at(post_norm0_ptr, table, 5, LAYERS, l64 * H, UNIFORM)
        act = _norm_rows(h_l, post_norm, rows, INTER * H, h_flags, H, eps, GU_N, GU_K, GU_STAGES, True,
                         (SKIP & 4) == 0, GU_K // O_N, FLAGS, NO_WAIT)
        tl.store(act_l + rn, act.to(act_ptr.dtype.element_ty), mask=rn < INTER)
        _count_done(act_flags + (r - n_q - n_att - n_o) * GU_N // D_K)
        _stamp(trace_ptr, layer, _GATE_UP_DONE_FIRST, False, TRACE, GLOBAL_TIMER, LAYERS)
        _stamp(trace_ptr, layer, _GATE_UP_DONE, True, TRACE, GLOBAL_TIMER, LAYERS)
    else:  # x_{l+1} = h + act @ w_down.T for D_N columns
        tile = r - n_q - n_att - n_o - n_gu
        col = tile * D_N + tl.arange(0, D_N)
        w_d = _at(wd0_ptr, table, 7, LAYERS, l64 * H * INTER, UNIFORM)
        w_cols = w_d + tl.minimum(col, H - 1).to(tl.int64)[:, None] * INTER
        w_cols += tl.arange(0, D_K)[None, :]
        out = _residual_cols(act_l, w_cols, h_l, col, act_flags, INTER, H, D_N, D_K, D_STAGES,
                             (SKIP & 8) == 0, D_K // GU_N, FLAGS, NO_WAIT)
        tl.store(xs_ptr + layer * H + col, out.to(xs_ptr.dtype.element_ty), mask=col < H)
        if layer + 1 < LAYERS:
            _count_done(flags + _FLAG_SETS * FLAGS + tile * D_N // Q_K)  # the next layer's input flags
        _stamp(trace_ptr, layer, _DOWN_DONE, True, TRACE, GLOBAL_TIMER, LAYERS)
        _layer_done(sync_ptr, flags, n_d, layer == LAYERS - 1, FLAGS)


def supports(x: torch.Tensor, stack: LayerStack, block_tables: torch.Tensor, *,
             num_q_heads: int, num_kv_heads: int, tiles: MlpTiles = _TILES) -> bool:
    """One sequence, one contiguous row, Qwen3 layers (q/k norm) whose tensors the stack can offset, and
    tiles that divide the shapes: fused_mlp's, qkv tiles inside one head, o_proj chunks of whole KV head
    groups or parts of one."""
    layer = stack.layers[0]
    hidden, inter, attn_dim = x.shape[-1], layer.down.shape[1], layer.o_proj.shape[1]
    head_dim = attn_dim // num_q_heads
    group_width = num_q_heads // num_kv_heads * head_dim
    t = tiles.fit(hidden, inter, attn_dim)
    contiguous = all(getattr(layer, kind).is_contiguous() for kind in ("qkv", "o_proj", "gate_up", "down"))
    return (stack.offsets is not None and stack.alignment >= 16 and block_tables.shape[0] == 1 and contiguous
            and head_dim == triton.next_power_of_2(head_dim) and head_dim % t.q_n == 0
            and (t.o_k % group_width == 0 or group_width % t.o_k == 0)
            and fused_mlp.supports(x, layer.gate_up, layer.down, layer.o_proj, layer.qkv, tiles=tiles))


@functools.cache
def _triton_ops():
    from reference_engine.kernels import get_kernels  # at call time: this module is one of its homes

    return get_kernels("triton")


def decode_layers(
    x: torch.Tensor, stack: LayerStack, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float, *, num_q_heads: int,
    num_kv_heads: int, eps: float, tiles: MlpTiles = _TILES,
) -> torch.Tensor:
    """Same contract as torch_ref.decode_layers. One launch for one sequence; otherwise the layers one by
    one with the other Triton ops."""
    heads = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads)
    if not supports(x, stack, block_tables, **heads, tiles=tiles):
        return run_layers(_triton_ops(), x, stack, slot_mapping, block_tables, seq_lens, cos, sin, scale,
                          **heads, eps=eps)
    return _launch(x, stack, slot_mapping, block_tables, seq_lens, cos, sin, scale, eps=eps, tiles=tiles,
                   **heads)


def new_trace(layers: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(trace, initial): a trace buffer for OPTIONS["trace"] and the values to copy into it before each launch
    (the min slots start high, the max slots and the clock at 0)."""
    initial = torch.zeros(layers * _EVENTS.value + 1, dtype=torch.int64, device=device)
    latest = torch.tensor([kind == "latest" for _, kind in TRACE_EVENTS], device=device)
    initial[:-1].view(layers, -1)[:, ~latest] = torch.iinfo(torch.int64).max
    return initial.clone(), initial


def read_trace(trace: torch.Tensor, layers: int) -> torch.Tensor:
    """The stamped times [layers, len(TRACE_EVENTS)] (ns on the GPU, logical ticks under the interpreter)."""
    return trace[:-1].view(layers, -1).cpu()


def _launch(x, stack: LayerStack, slot_mapping, block_tables, seq_lens, cos, sin, scale, *, num_q_heads,
            num_kv_heads, eps, tiles: MlpTiles) -> torch.Tensor:
    layer = stack.layers[0]
    layers = len(stack.layers)
    hidden, inter, attn_dim = x.shape[-1], layer.down.shape[1], layer.o_proj.shape[1]
    qkv_size = layer.qkv.shape[0]
    head_dim = attn_dim // num_q_heads
    group = num_q_heads // num_kv_heads
    t = tiles.fit(hidden, inter, attn_dim)
    k_cache, v_cache = stack.kv_caches[0]
    assert k_cache.stride() == v_cache.stride() and cos.stride() == sin.stride()
    assert slot_mapping.is_contiguous()
    block_size = k_cache.shape[1]
    block_d = triton.next_power_of_2(head_dim)
    block_n = _ATTENTION_TILE
    num_splits = attention.choose_num_splits(1, num_kv_heads, block_tables.shape[1] * block_size, x.device,
                                             tile=block_n)
    flags = max(triton.next_power_of_2(max(hidden // t.gu_k, inter // t.d_k, hidden // t.q_k,
                                           attn_dim // t.o_k, num_kv_heads)), 32 * t.num_warps)
    sync = counters_for(x.device, "decode layers", 2 + layers * _FLAG_SETS.value * flags)
    part_acc, part_ml, _, group_tickets, num_groups = attention.split_workspace(
        x.device, 1, num_q_heads, num_kv_heads, num_splits, block_d, x, _MERGE_GROUP)
    tickets = tickets_for(x.device, layers * num_kv_heads)  # a merge ticket per layer and KV head
    xs = torch.empty(layers, hidden, dtype=x.dtype, device=x.device)
    qkv = torch.empty(layers, qkv_size, dtype=x.dtype, device=x.device)
    attn = torch.empty(layers, attn_dim, dtype=x.dtype, device=x.device)
    h = torch.empty(layers, hidden, dtype=x.dtype, device=x.device)
    act = torch.empty(layers, inter, dtype=x.dtype, device=x.device)
    use_pdl, pdl = launch_options(x)
    # o_proj's whole [O_N, attn_dim] weight tile in registers: up to 64 a thread (qwen3-4b: 4 x 4096 bf16).
    o_whole = OPTIONS["o_proj_whole"] and (
        t.o_n * triton.next_power_of_2(attn_dim) * x.element_size() <= _O_WHOLE_BYTES * 32 * t.num_warps)
    dot_fp32 = attention.DOT_FP32_DEFAULT or INTERPRETED or x.dtype == torch.float32
    trace = OPTIONS["trace"]
    assert trace is None or trace.shape == (layers * _EVENTS.value + 1,)
    # o_proj tiles a program (held whole: the first across attention, the rest streamed after it).
    o_tiles = OPTIONS["o_proj_tiles"] if o_whole and hidden % (t.o_n * OPTIONS["o_proj_tiles"]) == 0 else 1
    per_layer = (triton.cdiv(qkv_size, t.q_n) + num_kv_heads * num_splits
                 + triton.cdiv(hidden, t.o_n * o_tiles)
                 + triton.cdiv(inter, t.gu_n) + triton.cdiv(hidden, t.d_n))
    _decode_layers_kernel[(layers * per_layer,)](
        x, xs, qkv, attn, h, act, sync, stack.offsets,
        *(stack.first(kind) for kind in KINDS),
        cos, sin, slot_mapping, block_tables, seq_lens, part_acc, part_ml, tickets, group_tickets, scale, eps,
        cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        layers, hidden, inter, qkv_size, attn_dim,
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, NUM_SPLITS=num_splits, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d, BLOCK_N=block_n, DOT_FP32=dot_fp32,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", GROUP_P2=triton.next_power_of_2(group),
        MERGE_GROUP=_MERGE_GROUP, NUM_GROUPS=num_groups,
        O_N=t.o_n, O_K=t.o_k, O_STAGES=t.o_stages, GU_N=t.gu_n, GU_K=t.gu_k, GU_STAGES=t.gu_stages,
        D_N=t.d_n, D_K=t.d_k, D_STAGES=t.d_stages, Q_N=t.q_n, Q_K=t.q_k, Q_STAGES=t.q_stages,
        FLAGS=flags, USE_PDL=use_pdl, NO_WAIT=t.no_wait, SKIP=OPTIONS["skip"],
        ATT_CHUNKS=max(group * head_dim // t.o_k, 1), O_WHOLE=o_whole, O_TILES=o_tiles,
        A_P2=triton.next_power_of_2(attn_dim),
        MERGE_CHUNK=_MERGE_CHUNK, O_AHEAD=OPTIONS["o_ahead"] and not INTERPRETED,
        trace_ptr=sync if trace is None else trace, TRACE=trace is not None,
        GLOBAL_TIMER=not INTERPRETED, stride_kv_layer=stack.kv_layer_stride,
        UNIFORM=stack.uniform and OPTIONS["uniform"], SOLO_TILES=OPTIONS["solo_tiles"],
        num_warps=t.num_warps, **pdl, **({"maxnreg": OPTIONS["maxnreg"]} if OPTIONS["maxnreg"] else {}),
    )
    return xs[layers - 1 :]
