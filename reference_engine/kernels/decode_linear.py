"""The Triton kernel set's linear layers: one fused kernel per layer at decode sizes, cuBLAS above them.

At up to skinny_gemm.MAX_ROWS rows (decode steps) each call is a single skinny_gemm launch with its norm,
SiLU or residual folded in. Larger calls (prefill) are compute-heavy GEMMs where cuBLAS wins, so they run
F.linear with the Triton row kernels around it. Both paths compute the same function (see torch_ref).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from reference_engine.kernels import elementwise, fused_mlp, skinny_gemm

# How a one-row layer tail runs when layers launch one by one (fused_mlp.py): "o+mlp+qkv" one launch with
# the next layer's qkv, "o+mlp" one launch and the next qkv separately, "mlp" o_proj then the MLP in one
# launch, "off" all separate. Benchmarks switch it to compare the seams in whole steps; whether a step runs
# its layers one by one at all is Config.one_launch_layers.
FUSED_MLP = {"mode": "o+mlp+qkv"}


def norm_linear(
    x: torch.Tensor, norm_w: torch.Tensor, w: torch.Tensor, eps: float, *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    if skinny_gemm.supports(x, w):
        return skinny_gemm.norm_linear(x, norm_w, w, eps, out_dtype=out_dtype)
    out = F.linear(elementwise.rmsnorm(x, norm_w, eps), w)
    return out if out_dtype is None else out.to(out_dtype)


def norm_gate_up_silu(
    x: torch.Tensor, norm_w: torch.Tensor, w_gate_up: torch.Tensor, eps: float
) -> torch.Tensor:
    if skinny_gemm.supports(x, w_gate_up):
        return skinny_gemm.norm_gate_up_silu(x, norm_w, w_gate_up, eps)
    return elementwise.silu_and_mul(F.linear(elementwise.rmsnorm(x, norm_w, eps), w_gate_up))


def linear_residual(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    if skinny_gemm.supports(x, w):
        return skinny_gemm.linear_residual(x, w, residual)
    return F.linear(x, w) + residual


def o_proj_mlp(
    attn: torch.Tensor, w_o: torch.Tensor, x: torch.Tensor, norm_w: torch.Tensor, w_gate_up: torch.Tensor,
    w_down: torch.Tensor, eps: float, *, next_qkv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    mode = FUSED_MLP["mode"]
    one_launch = mode.startswith("o+mlp") and attn.is_contiguous()
    with_qkv = next_qkv if mode == "o+mlp+qkv" else None
    if one_launch and fused_mlp.supports(x, w_gate_up, w_down, w_o, with_qkv[1] if with_qkv else None):
        out, qkv = fused_mlp.o_proj_mlp(attn, w_o, x, norm_w, w_gate_up, w_down, eps, next_qkv=with_qkv)
    else:
        h = linear_residual(attn, w_o, x)
        if mode != "off" and fused_mlp.supports(h, w_gate_up, w_down):
            out, qkv = fused_mlp.mlp_residual(h, norm_w, w_gate_up, w_down, eps), None
        else:
            out, qkv = linear_residual(norm_gate_up_silu(h, norm_w, w_gate_up, eps), w_down, h), None
    if qkv is None and next_qkv is not None:
        qkv = norm_linear(out, *next_qkv, eps)
    return out, qkv
