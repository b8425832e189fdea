"""The rest of a decode layer after attention, at one row, in one launch: o_proj, the MLP, the next qkv.

Separate launches (skinny_gemm.py) leave a seam at each dependency: down waits for the whole gate_up grid,
so gate_up's tail (its last programs finishing unevenly) and down's ramp (its first weight loads) both run
at a fraction of the HBM bandwidth. Here the three products are programs of one grid, chained through
per-chunk flags. Each program takes its role from a dispatch counter (`vid`, in the order programs actually
start), so a program only waits for programs that already started: no deadlock however many fit on the GPU.

- vids [0, n_o): o_proj tiles, h = x + attn @ w_o.T (O_N columns each); each finished tile counts on the
  flag of its chunk of h (GU_K columns, the gate_up K step).
- then gate_up + SiLU tiles (GU_N intermediates): their K loop walks h chunk by chunk as its flags fill
  (the RMSNorm's 1/rms is applied at the end, so it needs no pass of its own); each finished tile counts on
  the flag of its chunk of the activation (D_K intermediates, the down K step).
- then down + residual tiles (D_N columns): out = h + act @ w_down.T, walking the activation chunks; with
  the next layer's weights given, each counts on the flag of its chunk of out (Q_K columns),
- and then the next layer's qkv tiles (Q_N rows): rmsnorm(out) @ w_qkv.T, walking out chunk by chunk. So a
  decode layer is two launches: attention, and this one.

Consumers are dispatched while their producers' last tiles run and stream the weights of the chunks already
done, so one phase's tail overlaps the next one's ramp. With `o_proj=False` the launch starts at gate_up
(x is the MLP's input). Every output is one program's K loop in order, as in the separate kernels: the
result does not depend on timing and matches them bit for bit. The last program of the last phase resets
the counters for the next launch (graph replays reuse them).

Limit: the counters are per device, so two of these launches must not run at the same time (two engines
stepping concurrently on one GPU on different streams): their programs would take each other's roles and
wait forever. Launches on one stream are safe, PDL included: a program takes its role only after waiting
for the previous kernel. Attention's split tickets share the same rule (there the failure is wrong output).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from reference_engine.kernels.pdl import launch_options, pdl_prologue
from reference_engine.kernels.split_merge import counters_for, last_to_arrive


@dataclass(frozen=True)
class MlpTiles:
    """Per phase: columns per program, K step, pipeline stages. o_proj and qkv keep skinny_gemm's one-row
    tiles; in one launch wider gate_up and down tiles stream better (`benchmarks/layer_tail.py --sweep`,
    H200, us for o_proj + MLP: 46.4 with these, 47.9 with gate_up's 8 rows / 4 stages, 48.4 with down's 4
    columns / 3 stages as well; with the next qkv: 55.8 against 59.4, and qkv at 8 rows 59.1)."""

    o_n: int = 4
    o_k: int = 1024
    o_stages: int = 3
    gu_n: int = 16
    gu_k: int = 256
    gu_stages: int = 3
    d_n: int = 8
    d_k: int = 512
    d_stages: int = 4
    q_n: int = 16
    q_k: int = 512
    q_stages: int = 3
    num_warps: int = 4
    no_wait: bool = False  # benchmarks only: skip the flag waits to time the launch without dependencies

    @functools.cache  # noqa: B019 (frozen, few instances): every eager launch asks, twice
    def fit(self, hidden: int, inter: int, attn_dim: int) -> MlpTiles:
        """K steps halved until they divide small shapes (the tiny test model)."""
        def shrink(step: int, k: int, least: int) -> int:
            while step > least and k % step:
                step //= 2
            return step
        return dataclasses.replace(self, o_k=shrink(self.o_k, attn_dim, 16),
                                   gu_k=shrink(self.gu_k, hidden, 16), d_k=shrink(self.d_k, inter, self.gu_n),
                                   q_k=shrink(self.q_k, hidden, self.d_n))


@triton.jit
def _chunks_ready(flags_ptr, chunks, per_chunk, FLAGS: tl.constexpr, WAIT: tl.constexpr,
                  NO_WAIT: tl.constexpr):
    """How many leading chunks have all `per_chunk` producer tiles counted. One flag a thread (FLAGS >= the
    CTA's threads): the min then crosses warps through shared memory and every warp gets the same answer.
    With fewer flags each warp would read its own copy, could see another count, and the warps' K loops
    (barriers inside) would fall out of step. Read through L2 (volatile): never a stale L1 line."""
    if not WAIT or NO_WAIT:  # an input from an earlier launch; or (benchmarks only) skipping the dependencies
        return chunks
    offs = tl.arange(0, FLAGS)
    seen = tl.load(flags_ptr + offs, mask=offs < chunks, other=per_chunk, volatile=True)
    return tl.min(tl.where(seen < per_chunk, offs, chunks), axis=0)


@triton.jit
def _count_done(flag_ptr):
    """Release this program's stores (every thread's, hence the barrier) and count its tile."""
    tl.debug_barrier()
    tl.atomic_add(flag_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _walk_chunks(src_ptr, norm_ptr, w_rows, up_offset, flags_ptr, K, N: tl.constexpr, K_STEP: tl.constexpr,
                 STAGES: tl.constexpr, NORM: tl.constexpr, UP: tl.constexpr, WAIT: tl.constexpr, per_chunk,
                 FLAGS: tl.constexpr, NO_WAIT: tl.constexpr, res_ptrs=0, res_mask=0,
                 RES: tl.constexpr = False):
    """The one-row FMA K loop both tile kinds share: (w @ a, with UP the same for the rows up_offset further,
    and with NORM the sum of squares of src, and with RES the residual at res_ptrs), where a = src, or with
    NORM (src * norm) rounded to src's dtype (the 1/rms is the caller's, at the end). w_rows: [N, K_STEP]
    pointers at K offset 0. With WAIT the loop walks src chunk by chunk (K_STEP wide) as `flags_ptr` fills
    (per_chunk producer tiles a chunk; 0: src is complete). skinny_gemm's FMA tile, the same sums in the same
    order. The residual is complete once one chunk of src is (its producers read all of it first), so it
    loads then, while the chunks stream, not after the last one."""
    kk = tl.arange(0, K_STEP)
    acc = tl.zeros((N, K_STEP), dtype=tl.float32)
    acc_up = tl.zeros((N, K_STEP), dtype=tl.float32)
    sum_sq = 0.0
    chunks = K // K_STEP
    done = 0
    ready = _chunks_ready(flags_ptr, chunks, per_chunk, FLAGS, WAIT, NO_WAIT)
    if RES:
        while ready < 1:
            ready = _chunks_ready(flags_ptr, chunks, per_chunk, FLAGS, WAIT, NO_WAIT)
        res = tl.load(res_ptrs, mask=res_mask, other=0.0).to(tl.float32)
    else:
        res = tl.zeros((N,), dtype=tl.float32)
    while done < chunks:
        # The loads below come after the flag reads that allowed them (loop bounds), and no program reads a
        # chunk before its flags are full, so no SM's L1 can hold a stale line of it (the pipeliner's
        # look-ahead loads past `ready` are masked off).
        for k in tl.range(done * K_STEP, ready * K_STEP, K_STEP, num_stages=STAGES):
            a = tl.load(src_ptr + k + kk).to(tl.float32)
            if NORM:
                sum_sq += tl.sum(a * a, axis=0)
                a = (a * tl.load(norm_ptr + k + kk).to(tl.float32)).to(src_ptr.dtype.element_ty)
                a = a.to(tl.float32)
            acc += tl.load(w_rows + k).to(tl.float32) * a[None, :]
            if UP:
                acc_up += tl.load(w_rows + k + up_offset).to(tl.float32) * a[None, :]
        done = ready
        if done < chunks:
            ready = _chunks_ready(flags_ptr, chunks, per_chunk, FLAGS, WAIT, NO_WAIT)
    return tl.sum(acc, axis=1), tl.sum(acc_up, axis=1), sum_sq, res


@triton.jit
def _norm_rows(src_ptr, norm_ptr, w_rows, up_offset, flags_ptr, K, eps,
               N: tl.constexpr, K_STEP: tl.constexpr, STAGES: tl.constexpr, SILU: tl.constexpr,
               WAIT: tl.constexpr, per_chunk, FLAGS: tl.constexpr, NO_WAIT: tl.constexpr):
    """rmsnorm(src) @ w.T for the N weight rows `w_rows`, or with SILU silu(that) * (the same with the rows
    up_offset further), walking src as `_walk_chunks` does; the norm's 1/rms is applied at the end, so it
    needs no pass."""
    dot, dot_up, sum_sq, _ = _walk_chunks(src_ptr, norm_ptr, w_rows, up_offset, flags_ptr, K, N, K_STEP,
                                          STAGES, True, SILU, WAIT, per_chunk, FLAGS, NO_WAIT)
    inv_rms = tl.rsqrt(sum_sq / K + eps)
    y = dot * inv_rms
    if SILU:
        y = y / (1.0 + tl.exp(-y)) * (dot_up * inv_rms)
    return y


@triton.jit
def _residual_cols(src_ptr, w_cols, res_ptr, col, flags_ptr, K, H, N: tl.constexpr,
                   K_STEP: tl.constexpr, STAGES: tl.constexpr, WAIT: tl.constexpr, per_chunk,
                   FLAGS: tl.constexpr, NO_WAIT: tl.constexpr):
    """res[col] + src @ w.T for the N weight rows `w_cols` (one per output column col), walking src as
    `_walk_chunks` does: skinny_gemm's one-row FMA tile with its residual epilogue."""
    dot, _, _, res = _walk_chunks(src_ptr, src_ptr, w_cols, 0, flags_ptr, K, N, K_STEP, STAGES, False, False,
                                  WAIT, per_chunk, FLAGS, NO_WAIT, res_ptr + col, col < H, True)
    return dot + res


@triton.jit
def _layer_tail_kernel(
    attn_ptr, wo_ptr, x_ptr, norm_ptr, wgu_ptr, wd_ptr, h_ptr, act_ptr, out_ptr, sync_ptr,
    next_norm_ptr, wq_ptr, qkv_ptr,
    A, H, INTER, QKV, eps, stride_o, stride_gu, stride_d, stride_q,
    O_PROJ: tl.constexpr, O_N: tl.constexpr, O_K: tl.constexpr, O_STAGES: tl.constexpr,
    GU_N: tl.constexpr, GU_K: tl.constexpr, GU_STAGES: tl.constexpr,
    D_N: tl.constexpr, D_K: tl.constexpr, D_STAGES: tl.constexpr,
    NEXT_QKV: tl.constexpr, Q_N: tl.constexpr, Q_K: tl.constexpr, Q_STAGES: tl.constexpr,
    FLAGS: tl.constexpr, USE_PDL: tl.constexpr, NO_WAIT: tl.constexpr,
):
    pdl_prologue(USE_PDL)  # inputs are earlier kernels' outputs; the counters were reset by the last launch
    vid = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    act_flags = sync_ptr + 2
    h_flags = sync_ptr + 2 + FLAGS
    out_flags = sync_ptr + 2 + 2 * FLAGS
    o_programs = 0
    if O_PROJ:
        o_programs = tl.cdiv(H, O_N)
    gu_programs = tl.cdiv(INTER, GU_N)
    d_programs = tl.cdiv(H, D_N)
    h_chunks = H // GU_K
    act_chunks = INTER // D_K
    if vid < o_programs:  # h = x + attn @ w_o.T for O_N columns
        col = vid * O_N + tl.arange(0, O_N)
        w_rows = wo_ptr + tl.minimum(col, H - 1).to(tl.int64)[:, None] * stride_o + tl.arange(0, O_K)[None, :]
        h = _residual_cols(attn_ptr, w_rows, x_ptr, col, h_flags, A, H, O_N, O_K, O_STAGES, False, 1, FLAGS,
                           NO_WAIT)
        tl.store(h_ptr + col, h.to(h_ptr.dtype.element_ty), mask=col < H)
        _count_done(h_flags + vid * O_N // GU_K)
    elif vid < o_programs + gu_programs:  # silu(rmsnorm(h) @ gate.T) * (rmsnorm(h) @ up.T), GU_N rows
        rn = (vid - o_programs) * GU_N + tl.arange(0, GU_N)
        rows = wgu_ptr + tl.minimum(rn, INTER - 1).to(tl.int64)[:, None] * stride_gu
        rows = rows + tl.arange(0, GU_K)[None, :]
        src = x_ptr
        if O_PROJ:
            src = h_ptr
        act = _norm_rows(src, norm_ptr, rows, INTER * stride_gu, h_flags, H, eps, GU_N, GU_K, GU_STAGES,
                         True, O_PROJ, GU_K // O_N, FLAGS, NO_WAIT)
        tl.store(act_ptr + rn, act.to(act_ptr.dtype.element_ty), mask=rn < INTER)
        _count_done(act_flags + (vid - o_programs) * GU_N // D_K)
    elif vid < o_programs + gu_programs + d_programs:  # out = h + act @ w_down.T for D_N columns
        col = (vid - o_programs - gu_programs) * D_N + tl.arange(0, D_N)
        w_cols = wd_ptr + tl.minimum(col, H - 1).to(tl.int64)[:, None] * stride_d + tl.arange(0, D_K)[None, :]
        # The residual h is complete: every gate_up tile read all of it before counting.
        res_ptr = x_ptr
        if O_PROJ:
            res_ptr = h_ptr
        out = _residual_cols(act_ptr, w_cols, res_ptr, col, act_flags, INTER, H, D_N, D_K, D_STAGES, True,
                             D_K // GU_N, FLAGS, NO_WAIT)
        tl.store(out_ptr + col, out.to(out_ptr.dtype.element_ty), mask=col < H)
        if NEXT_QKV:
            _count_done(out_flags + (vid - o_programs - gu_programs) * D_N // Q_K)
        else:
            _last_resets(sync_ptr, d_programs, FLAGS, act_chunks, h_chunks, 0)
    else:  # the next layer's qkv = rmsnorm(out) @ w_qkv.T for Q_N rows
        rn = (vid - o_programs - gu_programs - d_programs) * Q_N + tl.arange(0, Q_N)
        rows = wq_ptr + tl.minimum(rn, QKV - 1).to(tl.int64)[:, None] * stride_q
        rows = rows + tl.arange(0, Q_K)[None, :]
        y = _norm_rows(out_ptr, next_norm_ptr, rows, 0, out_flags, H, eps, Q_N, Q_K, Q_STAGES, False, True,
                       Q_K // D_N, FLAGS, NO_WAIT)
        tl.store(qkv_ptr + rn, y.to(qkv_ptr.dtype.element_ty), mask=rn < QKV)
        _last_resets(sync_ptr, tl.cdiv(QKV, Q_N), FLAGS, act_chunks, h_chunks, H // Q_K)


@triton.jit
def _last_resets(sync_ptr, programs, FLAGS: tl.constexpr, act_chunks, h_chunks, out_chunks):
    """Called by each program of the last phase: the last of them resets the flags and counters for the next
    launch (graph replays reuse them). By then every program has taken its vid and counted its tile, and
    none reads a flag after counting."""
    if last_to_arrive(sync_ptr + 1, programs):
        offs = tl.arange(0, FLAGS)
        zeros = tl.zeros((FLAGS,), tl.int32)
        tl.store(sync_ptr + 2 + offs, zeros, mask=offs < act_chunks)
        tl.store(sync_ptr + 2 + FLAGS + offs, zeros, mask=offs < h_chunks)
        tl.store(sync_ptr + 2 + 2 * FLAGS + offs, zeros, mask=offs < out_chunks)
        tl.atomic_xchg(sync_ptr + 1, 0)
        tl.atomic_xchg(sync_ptr, 0)


def supports(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
             w_o: torch.Tensor | None = None, w_qkv: torch.Tensor | None = None, *,
             tiles: MlpTiles = MlpTiles()) -> bool:
    """One contiguous row and tiles that divide the shapes (qwen3 presets and the tiny test model)."""
    hidden, inter = x.shape[-1], w_down.shape[1]
    attn_dim = w_o.shape[1] if w_o is not None else 16
    t = tiles.fit(hidden, inter, attn_dim)
    weights = [w for w in (w_gate_up, w_down, w_o, w_qkv) if w is not None]
    return (x.numel() == hidden and x.is_contiguous() and all(w.stride(-1) == 1 for w in weights)
            and hidden % t.gu_k == 0 and hidden % t.o_n == 0 and hidden % t.d_n == 0 and t.gu_k % t.o_n == 0
            and inter % t.d_k == 0 and t.d_k % t.gu_n == 0 and attn_dim % t.o_k == 0
            and hidden % t.q_k == 0 and t.q_k % t.d_n == 0
            and max(hidden // t.gu_k, inter // t.d_k, hidden // t.q_k) <= 1024)


def _launch(attn, w_o, x, norm_w, w_gate_up, w_down, eps, next_qkv, tiles: MlpTiles):
    hidden, inter = x.shape[-1], w_down.shape[1]
    o_proj = w_o is not None
    next_norm, w_qkv = next_qkv or (norm_w, w_down)  # placeholders the kernel never reads without NEXT_QKV
    attn_dim = w_o.shape[1] if o_proj else 16
    assert supports(x, w_gate_up, w_down, w_o, w_qkv if next_qkv else None, tiles=tiles)
    t = tiles.fit(hidden, inter, attn_dim)
    flags = max(triton.next_power_of_2(max(hidden // t.gu_k, inter // t.d_k, hidden // t.q_k)),
                32 * t.num_warps)
    sync = counters_for(x.device, "layer tail", 2 + 3 * flags)
    h = torch.empty_like(x) if o_proj else x
    act = torch.empty(inter, dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    qkv = torch.empty(1, w_qkv.shape[0], dtype=x.dtype, device=x.device) if next_qkv else out
    use_pdl, pdl = launch_options(x)
    programs = (triton.cdiv(hidden, t.o_n) if o_proj else 0) + triton.cdiv(inter, t.gu_n)
    programs += triton.cdiv(hidden, t.d_n) + (triton.cdiv(w_qkv.shape[0], t.q_n) if next_qkv else 0)
    _layer_tail_kernel[(programs,)](
        attn if o_proj else x, w_o if o_proj else w_down, x, norm_w, w_gate_up, w_down, h, act, out, sync,
        next_norm, w_qkv, qkv,
        attn_dim, hidden, inter, w_qkv.shape[0], eps, w_o.stride(0) if o_proj else 0, w_gate_up.stride(0),
        w_down.stride(0), w_qkv.stride(0),
        O_PROJ=o_proj, O_N=t.o_n, O_K=t.o_k, O_STAGES=t.o_stages,
        GU_N=t.gu_n, GU_K=t.gu_k, GU_STAGES=t.gu_stages, D_N=t.d_n, D_K=t.d_k, D_STAGES=t.d_stages,
        NEXT_QKV=next_qkv is not None, Q_N=t.q_n, Q_K=t.q_k, Q_STAGES=t.q_stages,
        FLAGS=flags, USE_PDL=use_pdl, NO_WAIT=t.no_wait, num_warps=t.num_warps, **pdl,
    )
    return out, (qkv if next_qkv else None)


def mlp_residual(
    x: torch.Tensor, norm_w: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, eps: float, *,
    tiles: MlpTiles = MlpTiles(),
) -> torch.Tensor:
    """x + down(silu(rmsnorm(x) @ gate.T) * (rmsnorm(x) @ up.T)) for one row, in one launch."""
    return _launch(None, None, x, norm_w, w_gate_up, w_down, eps, None, tiles)[0]


def o_proj_mlp(
    attn: torch.Tensor, w_o: torch.Tensor, x: torch.Tensor, norm_w: torch.Tensor, w_gate_up: torch.Tensor,
    w_down: torch.Tensor, eps: float, *, next_qkv: tuple[torch.Tensor, torch.Tensor] | None = None,
    tiles: MlpTiles = MlpTiles(),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, qkv): out = h + mlp(h) with h = x + attn @ w_o.T for one row, in one launch; with next_qkv =
    (input norm, qkv weight) of the next layer, also its qkv = rmsnorm(out) @ w_qkv.T (else None)."""
    assert attn.is_contiguous() and attn.numel() == w_o.shape[1]
    return _launch(attn, w_o, x, norm_w, w_gate_up, w_down, eps, next_qkv, tiles)
