"""Triton row kernels: RMSNorm, fused residual-add + RMSNorm, SiLU-and-mul.

Decode rows are short (hidden 2560, intermediate 9728), so each program takes whole rows in one tile:
one launch per op, one read and one write of each tensor. Numerics match torch_ref (fp32 math, the
residual rounded to the input dtype before it is normalised, like Hugging Face Qwen3).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    return flat, flat.shape[0]


def _num_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_res, stride_out, stride_res_out,
    n_cols, eps,
    ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded like `x + residual` in torch
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    normed = (xf * inv_rms).to(x.dtype)
    tl.store(out_ptr + row * stride_out + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype),
             mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    flat, n_rows = _rows(x)
    out = torch.empty_like(flat)
    block = triton.next_power_of_2(flat.shape[-1])
    _rmsnorm_kernel[(n_rows,)](
        flat, flat, weight, out, out,
        flat.stride(0), flat.stride(0), out.stride(0), out.stride(0),
        flat.shape[-1], eps,
        ADD_RESIDUAL=False, BLOCK=block, num_warps=_num_warps(block),
    )
    return out.view(x.shape)


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    flat, n_rows = _rows(x)
    flat_res, _ = _rows(residual)
    out = torch.empty_like(flat)
    new_residual = torch.empty_like(flat)
    block = triton.next_power_of_2(flat.shape[-1])
    _rmsnorm_kernel[(n_rows,)](
        flat, flat_res, weight, out, new_residual,
        flat.stride(0), flat_res.stride(0), out.stride(0), new_residual.stride(0),
        flat.shape[-1], eps,
        ADD_RESIDUAL=True, BLOCK=block, num_warps=_num_warps(block),
    )
    return out.view(x.shape), new_residual.view(x.shape)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, act.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    flat, n_rows = _rows(gate_up)
    n_cols = flat.shape[-1] // 2
    out = torch.empty(n_rows, n_cols, dtype=flat.dtype, device=flat.device)
    # Column tiles so that a batch-1 decode row (9728 wide) still spreads over several SMs.
    block = min(1024, triton.next_power_of_2(n_cols))
    _silu_and_mul_kernel[(n_rows, triton.cdiv(n_cols, block))](
        flat, out, flat.stride(0), out.stride(0), n_cols, BLOCK=block, num_warps=4,
    )
    return out.view(*gate_up.shape[:-1], n_cols)
