"""The rest of a decode layer after attention, at one row, in one launch: o_proj + residual, then the MLP.

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
- then down + residual tiles (D_N columns): out = h + act @ w_down.T, walking the activation chunks.

Consumers are dispatched while their producers' last tiles run and stream the weights of the chunks already
done, so one phase's tail overlaps the next one's ramp. With `o_proj=False` the launch starts at gate_up
(x is the MLP's input). Every output is one program's K loop in order, as in the separate kernels: the
result does not depend on timing and matches them bit for bit. The last down program resets the counters
for the next launch (graph replays reuse them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from reference_engine.kernels.pdl import launch_options, pdl_prologue
from reference_engine.kernels.split_merge import counters_for


@dataclass(frozen=True)
class MlpTiles:
    """Per phase: columns per program, K step, pipeline stages. o_proj keeps skinny_gemm's one-row tile; in
    one launch wider gate_up and down tiles stream better (`benchmarks/layer_tail.py --sweep`, H200, us a
    layer tail: 46.4 with these; 47.9 with gate_up 8 rows / 4 stages; 48.4 with down 4 columns / 3 stages
    as well, the separate kernels' tiles)."""

    o_n: int = 4
    o_k: int = 1024
    o_stages: int = 3
    gu_n: int = 16
    gu_k: int = 256
    gu_stages: int = 3
    d_n: int = 8
    d_k: int = 512
    d_stages: int = 4
    num_warps: int = 4

    def fit(self, hidden: int, inter: int, attn_dim: int) -> MlpTiles:
        """K steps halved until they divide small shapes (the tiny test model)."""
        def shrink(step: int, k: int, least: int) -> int:
            while step > least and k % step:
                step //= 2
            return step
        return dataclasses.replace(self, o_k=shrink(self.o_k, attn_dim, 16),
                                   gu_k=shrink(self.gu_k, hidden, 16), d_k=shrink(self.d_k, inter, self.gu_n))


@triton.jit
def _chunks_ready(flags_ptr, chunks, per_chunk, FLAGS: tl.constexpr):
    """How many leading chunks have all `per_chunk` producer tiles counted. One flag a thread (FLAGS >= the
    CTA's threads): the min then crosses warps through shared memory and every warp gets the same answer.
    With fewer flags each warp would read its own copy, could see another count, and the warps' K loops
    (barriers inside) would fall out of step. Read through L2 (volatile): never a stale L1 line."""
    offs = tl.arange(0, FLAGS)
    seen = tl.load(flags_ptr + offs, mask=offs < chunks, other=per_chunk, volatile=True)
    return tl.min(tl.where(seen < per_chunk, offs, chunks), axis=0)


@triton.jit
def _count_done(flag_ptr):
    """Release this program's stores (every thread's, hence the barrier) and count its tile."""
    tl.debug_barrier()
    tl.atomic_add(flag_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _layer_tail_kernel(
    attn_ptr, wo_ptr, x_ptr, norm_ptr, wgu_ptr, wd_ptr, h_ptr, act_ptr, out_ptr, sync_ptr,
    A, H, INTER, eps, stride_o, stride_gu, stride_d,
    O_PROJ: tl.constexpr, O_N: tl.constexpr, O_K: tl.constexpr, O_STAGES: tl.constexpr,
    GU_N: tl.constexpr, GU_K: tl.constexpr, GU_STAGES: tl.constexpr,
    D_N: tl.constexpr, D_K: tl.constexpr, D_STAGES: tl.constexpr,
    FLAGS: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)  # inputs are earlier kernels' outputs; the counters were reset by the last launch
    vid = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    act_flags = sync_ptr + 2
    h_flags = sync_ptr + 2 + FLAGS
    o_programs = 0
    if O_PROJ:
        o_programs = tl.cdiv(H, O_N)
    gu_programs = tl.cdiv(INTER, GU_N)
    h_chunks = H // GU_K
    act_chunks = INTER // D_K
    if vid < o_programs:  # h = x + attn @ w_o.T for O_N columns
        col = vid * O_N + tl.arange(0, O_N)
        ok = tl.arange(0, O_K)
        w_rows = wo_ptr + tl.minimum(col, H - 1).to(tl.int64)[:, None] * stride_o + ok[None, :]
        acc = tl.zeros((O_N, O_K), dtype=tl.float32)
        for k in tl.range(0, A, O_K, num_stages=O_STAGES):
            a = tl.load(attn_ptr + k + ok).to(tl.float32)
            acc += tl.load(w_rows + k).to(tl.float32) * a[None, :]
        h = tl.sum(acc, axis=1) + tl.load(x_ptr + col, mask=col < H, other=0.0).to(tl.float32)
        tl.store(h_ptr + col, h.to(h_ptr.dtype.element_ty), mask=col < H)
        _count_done(h_flags + vid * O_N // GU_K)
    elif vid < o_programs + gu_programs:  # silu(rmsnorm(h) @ gate.T) * (rmsnorm(h) @ up.T), GU_N rows
        rn = (vid - o_programs) * GU_N + tl.arange(0, GU_N)
        gk = tl.arange(0, GU_K)
        rows = wgu_ptr + tl.minimum(rn, INTER - 1).to(tl.int64)[:, None] * stride_gu + gk[None, :]
        src = x_ptr
        if O_PROJ:
            src = h_ptr
        acc_gate = tl.zeros((GU_N, GU_K), dtype=tl.float32)
        acc_up = tl.zeros((GU_N, GU_K), dtype=tl.float32)
        sum_sq = 0.0
        done = 0
        while done < h_chunks:
            ready = h_chunks
            if O_PROJ:
                ready = _chunks_ready(h_flags, h_chunks, GU_K // O_N, FLAGS)
            # The loads below come after the flag reads that allowed them (loop bounds).
            for k in tl.range(done * GU_K, ready * GU_K, GU_K, num_stages=GU_STAGES):
                xk = tl.load(src + k + gk).to(tl.float32)
                sum_sq += tl.sum(xk * xk, axis=0)
                xn = (xk * tl.load(norm_ptr + k + gk).to(tl.float32)).to(x_ptr.dtype.element_ty)
                xn = xn.to(tl.float32)
                acc_gate += tl.load(rows + k).to(tl.float32) * xn[None, :]
                acc_up += tl.load(rows + k + INTER * stride_gu).to(tl.float32) * xn[None, :]
            done = ready
        inv_rms = tl.rsqrt(sum_sq / H + eps)
        gate = tl.sum(acc_gate, axis=1) * inv_rms
        up = tl.sum(acc_up, axis=1) * inv_rms
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(act_ptr + rn, act.to(act_ptr.dtype.element_ty), mask=rn < INTER)
        _count_done(act_flags + (vid - o_programs) * GU_N // D_K)
    else:  # out = h + act @ w_down.T for D_N columns
        col = (vid - o_programs - gu_programs) * D_N + tl.arange(0, D_N)
        dk = tl.arange(0, D_K)
        w_cols = wd_ptr + tl.minimum(col, H - 1).to(tl.int64)[:, None] * stride_d + dk[None, :]
        acc = tl.zeros((D_N, D_K), dtype=tl.float32)
        done = 0
        while done < act_chunks:
            ready = _chunks_ready(act_flags, act_chunks, D_K // GU_N, FLAGS)
            for k in tl.range(done * D_K, ready * D_K, D_K, num_stages=D_STAGES):
                a = tl.load(act_ptr + k + dk).to(tl.float32)
                acc += tl.load(w_cols + k).to(tl.float32) * a[None, :]
            done = ready
        # h is complete: every gate_up tile read all of it before counting.
        res_ptr = x_ptr
        if O_PROJ:
            res_ptr = h_ptr
        res = tl.load(res_ptr + col, mask=col < H, other=0.0).to(tl.float32)
        tl.store(out_ptr + col, (tl.sum(acc, axis=1) + res).to(out_ptr.dtype.element_ty), mask=col < H)
        tl.debug_barrier()
        if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu") == tl.cdiv(H, D_N) - 1:
            # Every program has taken its vid and every flag is full: reset for the next launch.
            offs = tl.arange(0, FLAGS)
            tl.store(act_flags + offs, tl.zeros((FLAGS,), tl.int32), mask=offs < act_chunks)
            tl.store(h_flags + offs, tl.zeros((FLAGS,), tl.int32), mask=offs < h_chunks)
            tl.atomic_xchg(sync_ptr + 1, 0)
            tl.atomic_xchg(sync_ptr, 0)


def supports(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
             w_o: torch.Tensor | None = None, *, tiles: MlpTiles = MlpTiles()) -> bool:
    """One contiguous row and tiles that divide the shapes (qwen3 presets and the tiny test model)."""
    hidden, inter = x.shape[-1], w_down.shape[1]
    attn_dim = w_o.shape[1] if w_o is not None else 16
    t = tiles.fit(hidden, inter, attn_dim)
    weights = (w_gate_up, w_down) if w_o is None else (w_gate_up, w_down, w_o)
    return (x.numel() == hidden and x.is_contiguous() and all(w.stride(-1) == 1 for w in weights)
            and hidden % t.gu_k == 0 and hidden % t.o_n == 0 and hidden % t.d_n == 0 and t.gu_k % t.o_n == 0
            and inter % t.d_k == 0 and t.d_k % t.gu_n == 0 and attn_dim % t.o_k == 0
            and max(hidden // t.gu_k, inter // t.d_k) <= 1024)


def _launch(attn, w_o, x, norm_w, w_gate_up, w_down, eps, tiles: MlpTiles) -> torch.Tensor:
    hidden, inter = x.shape[-1], w_down.shape[1]
    o_proj = w_o is not None
    attn_dim = w_o.shape[1] if o_proj else 16
    assert supports(x, w_gate_up, w_down, w_o, tiles=tiles)
    t = tiles.fit(hidden, inter, attn_dim)
    flags = max(triton.next_power_of_2(max(hidden // t.gu_k, inter // t.d_k)), 32 * t.num_warps)
    sync = counters_for(x.device, "layer tail", 2 + 2 * flags)
    h = torch.empty_like(x) if o_proj else x
    act = torch.empty(inter, dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    use_pdl, pdl = launch_options(x)
    programs = (triton.cdiv(hidden, t.o_n) if o_proj else 0) + triton.cdiv(inter, t.gu_n)
    grid = (programs + triton.cdiv(hidden, t.d_n),)
    _layer_tail_kernel[grid](
        attn if o_proj else x, w_o if o_proj else w_down, x, norm_w, w_gate_up, w_down, h, act, out, sync,
        attn_dim, hidden, inter, eps, w_o.stride(0) if o_proj else 0, w_gate_up.stride(0), w_down.stride(0),
        O_PROJ=o_proj, O_N=t.o_n, O_K=t.o_k, O_STAGES=t.o_stages,
        GU_N=t.gu_n, GU_K=t.gu_k, GU_STAGES=t.gu_stages, D_N=t.d_n, D_K=t.d_k, D_STAGES=t.d_stages,
        FLAGS=flags, USE_PDL=use_pdl, num_warps=t.num_warps, **pdl,
    )
    return out


def mlp_residual(
    x: torch.Tensor, norm_w: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, eps: float, *,
    tiles: MlpTiles = MlpTiles(),
) -> torch.Tensor:
    """x + down(silu(rmsnorm(x) @ gate.T) * (rmsnorm(x) @ up.T)) for one row, in one launch."""
    return _launch(None, None, x, norm_w, w_gate_up, w_down, eps, tiles)


def o_proj_mlp(
    attn: torch.Tensor, w_o: torch.Tensor, x: torch.Tensor, norm_w: torch.Tensor, w_gate_up: torch.Tensor,
    w_down: torch.Tensor, eps: float, *, tiles: MlpTiles = MlpTiles(),
) -> torch.Tensor:
    """h + mlp(h) with h = x + attn @ w_o.T, for one row, in one launch."""
    assert attn.is_contiguous() and attn.numel() == w_o.shape[1]
    return _launch(attn, w_o, x, norm_w, w_gate_up, w_down, eps, tiles)
