"""Decode GEMMs (a few rows times a weight matrix) with the layer's small ops folded in.

A decode step at batch <= 16 is a chain of matrix-vector products: each reads its weight once from HBM and
does almost no arithmetic, so it should run at copy bandwidth. cuBLAS picks split-K GEMV kernels for these
shapes that reach ~3.0 TB/s on an H200 (4.28 TB/s copy), and every RMSNorm, residual add and SwiGLU around
them is another launch. Here one kernel does the product and its neighbours:

- `norm_linear(x, norm_w, w)`: rmsnorm(x) @ w.T. The per-row 1/rms is a scalar, so the kernel multiplies
  x by the norm weight while it streams K, sums x^2 on the way, and scales the product at the end: the
  norm costs no extra pass. Used for qkv (input norm) and the LM head (final norm, fp32 logits).
- `norm_gate_up_silu(x, norm_w, w_gate_up)`: silu(rmsnorm(x) @ gate.T) * (rmsnorm(x) @ up.T); each program
  reads the gate rows and the matching up rows, so the [2I] intermediate is never written.
- `linear_residual(x, w, residual)`: residual + x @ w.T, the residual stream update (o_proj, down).

Each program owns BLOCK_N output columns for all rows and walks the whole of K (or, for linear_residual
with split_k > 1, one slice of K, summed in a fixed order by a small reduce launch): results never depend
on timing, so eager and graphed steps give the same bits. The row block is
padded to 16 for tl.dot (the MMA tile); rows past M are masked, which costs registers, not bandwidth.
Configs per shape come from `choose_config`, tuned on an H200 with benchmarks/skinny_gemm_sweep.py.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from reference_engine.kernels.pdl import INTERPRETED, launch_options, pdl_prologue

MAX_ROWS = 16  # beyond this a step is prefill-like and cuBLAS is the better GEMM


@dataclass(frozen=True)
class GemmConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # linear_residual only: K in this many slices, summed by a second (reduce) launch
    fma: bool = False  # one row only: FMA on a [block_n, block_k] register tile instead of tl.dot
    pdl: bool = False  # programmatic dependent launch: start while the previous kernel drains


@functools.cache  # called at every launch: eager steps must not rebuild configs
def choose_config(n: int, k: int, rows: int, *, silu: bool = False) -> GemmConfig:
    """Tiles per shape, from the H200 sweep (benchmarks/skinny_gemm_sweep.py, qwen3-4b, docs/benchmarks.md).

    One row: FMA tiles with a pipelined K loop stream best, gate_up + SiLU included (us without / with PDL:
    qkv 10.3 / 11.4, o_proj 7.6 / 8.6, gate_up 27.6 / 26.9, down 14.4 / 14.5; cuBLAS GEMMs alone 11.6 / 9.5 /
    30.5 / 17.6; whole steps with these tiles and PDL: 2.73 -> 2.62 ms). More rows: the
    swap-AB MMA tile; narrow-N products (o_proj, down) split K in two so 80 column blocks still fill 132
    SMs. PDL helped the narrow MMA products by ~0.5-1 us and slowed the wide SiLU one (28.5 -> 32.3 us, its
    big shared-memory tiles block the early-launched next kernel), so there it is on only where it helped.
    """
    if n >= 65536 and rows == 1:  # LM head at one row: 176 us (4.41 TB/s) against 183+ for the MMA tile
        cfg = GemmConfig(16, 256, 4, 3, fma=True, pdl=True)
    elif n >= 65536:  # LM head: many waves of programs, nothing to overlap
        cfg = GemmConfig(128, 128, 8, 3)
    elif rows == 1:  # FMA tiles, the K loop pipelined (2026-12-01 sweep)
        cfg = (GemmConfig(8, 256, 4, 4, fma=True, pdl=True) if silu
               else GemmConfig(4, 512, 4, 3, fma=True, pdl=True) if k >= 8192
               else GemmConfig(4, 1024, 4, 3, fma=True, pdl=True) if k >= 4096
               else GemmConfig(16, 512, 4, 3, fma=True, pdl=True))
    elif silu:
        cfg = GemmConfig(128, 128, 8, 3)
    elif n <= 4096:
        cfg = GemmConfig(64, 128, 4, 5, split_k=2, pdl=True)
    else:
        cfg = GemmConfig(64, 256, 4, 4, pdl=True)
    return _fit(cfg, k)


def _fit(cfg: GemmConfig, k: int) -> GemmConfig:
    """Shrink block_k (then drop split-K) until the tiles divide K: small models (tests) have K of 64."""
    split, block_k = cfg.split_k, cfg.block_k
    while split > 1 and k % (block_k * split):
        split //= 2
    while block_k > 16 and k % (block_k * split):
        block_k //= 2
    return dataclasses.replace(cfg, block_k=block_k, split_k=split)


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, out_ptr, res_ptr, norm_ptr,
    M, N, K, up_offset, eps,
    stride_xm, stride_wn, stride_om, stride_rm,
    NORM: tl.constexpr, SILU_MUL: tl.constexpr, RESIDUAL: tl.constexpr, SPLIT_K: tl.constexpr,
    FMA: tl.constexpr, USE_PDL: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    # Output tile is [BLOCK_N, BLOCK_M] (columns x rows): the weight tile is the MMA's A operand in its
    # natural K-contiguous layout and the few activation rows are the narrow B operand ("swap AB").
    pid = tl.program_id(0)
    k_len = K // SPLIT_K  # SPLIT_K > 1: out_ptr is a [SPLIT_K, BLOCK_M, N] fp32 partial buffer
    k_start = tl.program_id(1) * k_len
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    w_rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * stride_wn + k_start
    pdl_prologue(USE_PDL)  # the activations and residual are earlier kernels' outputs
    w_ptrs = w_rows[:, None] + rk[None, :]
    xt_ptrs = x_ptr + rm[None, :] * stride_xm + k_start + rk[:, None]  # [BLOCK_K, BLOCK_M]
    if FMA:
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc2_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    # The loop's own num_stages: the launch option pipelines only loads that feed tl.dot, so without it the
    # FMA tile's loads were not pipelined at all (no cp.async in the sm_90 PTX).
    for k in tl.range(0, k_len, BLOCK_K, num_stages=NUM_STAGES):  # callers guarantee k_len % BLOCK_K == 0
        xt = tl.load(xt_ptrs, mask=m_mask[None, :], other=0.0)
        if NORM:
            xf = xt.to(tl.float32)
            sum_sq += tl.sum(xf * xf, axis=0)
            xt = (xf * tl.load(norm_ptr + k + rk).to(tl.float32)[:, None]).to(x_ptr.dtype.element_ty)
        w = tl.load(w_ptrs)
        if FMA:  # BLOCK_M == 1: xt is [BLOCK_K, 1]
            xrow = tl.reshape(xt, (1, BLOCK_K)).to(tl.float32)
            acc2 += w.to(tl.float32) * xrow
            if SILU_MUL:
                acc2_up += tl.load(w_ptrs + up_offset * stride_wn).to(tl.float32) * xrow
        else:
            if DOT_FP32:
                acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision=PRECISION)
            else:
                acc = tl.dot(w, xt, acc)
            if SILU_MUL:
                w_up = tl.load(w_ptrs + up_offset * stride_wn)
                if DOT_FP32:
                    acc_up = tl.dot(w_up.to(tl.float32), xt.to(tl.float32), acc_up, input_precision=PRECISION)
                else:
                    acc_up = tl.dot(w_up, xt, acc_up)
        xt_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if FMA:
        acc = tl.reshape(tl.sum(acc2, axis=1), (BLOCK_N, 1))
        acc_up = tl.reshape(tl.sum(acc2_up, axis=1), (BLOCK_N, 1))
    if NORM:
        inv_rms = tl.rsqrt(sum_sq / K + eps)
        acc = acc * inv_rms[None, :]
        acc_up = acc_up * inv_rms[None, :]
    if SILU_MUL:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    out_mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT_K > 1:
        part = out_ptr + (tl.program_id(1) * BLOCK_M + rm[None, :]) * N + rn[:, None]
        tl.store(part, acc, mask=out_mask)
        return
    if RESIDUAL:
        res = tl.load(res_ptr + rm[None, :] * stride_rm + rn[:, None], mask=out_mask, other=0.0)
        acc += res.to(tl.float32)
    tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _split_reduce_kernel(
    part_ptr, res_ptr, out_ptr, N, stride_rm, stride_om,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = rn < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in range(SPLIT_K):  # fixed order: the sum does not depend on which split finished first
        acc += tl.load(part_ptr + (s * BLOCK_M + row) * N + rn, mask=mask, other=0.0)
    acc += tl.load(res_ptr + row * stride_rm + rn, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + rn, acc.to(out_ptr.dtype.element_ty), mask=mask)


def supports(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the fused kernel takes this call (else callers compose torch ops)."""
    rows = x.numel() // x.shape[-1]
    return 0 < rows <= MAX_ROWS and x.shape[-1] % 32 == 0 and w.stride(-1) == 1


def _launch(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    *,
    n: int,
    norm_w: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    up_offset: int = 0,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows, k = flat.shape
    assert rows <= MAX_ROWS and w.shape[1] == k and w.stride(-1) == 1
    cfg = config or choose_config(n, k, rows, silu=up_offset > 0)
    use_pdl, pdl = launch_options(x) if cfg.pdl else (False, {})
    split = cfg.split_k if residual is not None else 1
    assert k % (cfg.block_k * split) == 0, f"K={k} is not a multiple of block_k={cfg.block_k} x {split}"
    fma = cfg.fma and rows == 1
    block_m = 1 if fma else MAX_ROWS
    res = residual.reshape(rows, n) if residual is not None else out
    fp32 = x.dtype == torch.float32
    target = out
    if split > 1:
        target = torch.empty(split, block_m, n, dtype=torch.float32, device=x.device)
    _skinny_gemm_kernel[(triton.cdiv(n, cfg.block_n), split)](
        flat, w, target, res, norm_w if norm_w is not None else w,
        rows, n, k, up_offset, eps,
        flat.stride(0), w.stride(0), out.stride(0), res.stride(0),
        NORM=norm_w is not None, SILU_MUL=up_offset > 0, RESIDUAL=residual is not None, SPLIT_K=split,
        FMA=fma, USE_PDL=use_pdl,
        # The interpreter's bf16 tl.dot is wrong (triton 3.9): upcast there; fp32 inputs get exact products.
        DOT_FP32=fp32 or INTERPRETED, PRECISION="ieee" if fp32 or INTERPRETED else "tf32",
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl,
    )
    if split > 1:
        _split_reduce_kernel[(rows, triton.cdiv(n, 1024))](
            target, res, out, n, res.stride(0), out.stride(0),
            SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=1024, USE_PDL=use_pdl, num_warps=4, **pdl,
        )
    return out.view(*x.shape[:-1], n)


def norm_linear(
    x: torch.Tensor, norm_w: torch.Tensor, w: torch.Tensor, eps: float, *,
    out_dtype: torch.dtype | None = None, config: GemmConfig | None = None,
) -> torch.Tensor:
    """rmsnorm(x, norm_w) @ w.T, in out_dtype (default x's)."""
    n = w.shape[0]
    out = torch.empty(x.numel() // x.shape[-1], n, dtype=out_dtype or x.dtype, device=x.device)
    return _launch(x, w, out, n=n, norm_w=norm_w, eps=eps, config=config)


def norm_gate_up_silu(
    x: torch.Tensor, norm_w: torch.Tensor, w_gate_up: torch.Tensor, eps: float, *,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """silu(h @ gate.T) * (h @ up.T) with h = rmsnorm(x, norm_w) and w_gate_up = [gate; up] ([2I, K])."""
    n = w_gate_up.shape[0] // 2
    out = torch.empty(x.numel() // x.shape[-1], n, dtype=x.dtype, device=x.device)
    return _launch(x, w_gate_up, out, n=n, norm_w=norm_w, eps=eps, up_offset=n, config=config)


def linear_residual(
    x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, *,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """residual + x @ w.T (a new tensor; the residual is read, not written)."""
    n = w.shape[0]
    out = torch.empty(x.numel() // x.shape[-1], n, dtype=x.dtype, device=x.device)
    return _launch(x, w, out, n=n, residual=residual, config=config)
