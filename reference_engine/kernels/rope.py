"""Triton fused attention prologue: q/k per-head RMSNorm + RoPE + KV-cache write in one launch.

The torch path spends ~10 launches per layer here (split, two norms, two rotations, two cache scatters);
this kernel does it in one, reading qkv once. One program per (token, head): q heads are normalised and
rotated, k heads are normalised, rotated and written to the cache, v heads are copied to the cache.
Numerics match torch_ref.qk_norm_rope_cache (norm rounded to the input dtype before the rotation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from reference_engine.kernels.pdl import launch_options, pdl_prologue


@triton.jit
def norm_rope_heads(
    head_ptrs, w_ptr, cos_row, sin_row, mask, eps, HEAD_DIM: tl.constexpr, HALF: tl.constexpr
):
    """RMSNorm (weight w) then neox RoPE of the heads at head_ptrs [BLOCK_G, 1] -> [BLOCK_G, HEAD_DIM], in the
    input dtype, rounded where the kernel below (and torch_ref) round, so both paths cache the same k."""
    offs = tl.arange(0, HALF)[None, :]
    x1 = tl.load(head_ptrs + offs, mask=mask, other=0.0)
    x2 = tl.load(head_ptrs + HALF + offs, mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    inv_rms = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / HEAD_DIM + eps)[:, None]
    w1 = tl.load(w_ptr + offs).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + offs).to(tl.float32)
    a = (w1 * (a * inv_rms).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
    b = (w2 * (b * inv_rms).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
    cos = tl.load(cos_row + offs)
    sin = tl.load(sin_row + offs)
    r1 = (a * cos - b * sin).to(x1.dtype)
    r2 = (b * cos + a * sin).to(x1.dtype)
    # [G, HALF] x 2 -> [G, HALF, 2] -> [G, 2, HALF] -> [G, HEAD_DIM] = [r1 | r2]
    return tl.reshape(tl.permute(tl.join(r1, r2), (0, 2, 1)), (r1.shape[0], HEAD_DIM))


@triton.jit
def _qk_norm_rope_cache_kernel(
    qkv_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr,
    k_cache_ptr, v_cache_ptr, q_out_ptr, k_out_ptr, v_out_ptr,
    stride_qkv, stride_cos, stride_cache_slot, stride_cache_head,
    eps,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    head_dim = 2 * HALF
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    src = qkv_ptr + token * stride_qkv + head * head_dim
    x1 = tl.load(src + offs, mask=mask, other=0.0)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0)
    slot = tl.load(slot_ptr + token).to(tl.int64)

    if head >= NUM_Q_HEADS + NUM_KV_HEADS:  # v: copy out and into the cache
        kv_head = head - NUM_Q_HEADS - NUM_KV_HEADS
        dst = v_out_ptr + (token * NUM_KV_HEADS + kv_head) * head_dim
        tl.store(dst + offs, x1, mask=mask)
        tl.store(dst + HALF + offs, x2, mask=mask)
        if slot >= 0:
            cache = v_cache_ptr + slot * stride_cache_slot + kv_head * stride_cache_head
            tl.store(cache + offs, x1, mask=mask)
            tl.store(cache + HALF + offs, x2, mask=mask)
    else:
        is_q = head < NUM_Q_HEADS
        w_ptr = tl.where(is_q, q_w_ptr, k_w_ptr)
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        inv_rms = tl.rsqrt((tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0)) / head_dim + eps)
        w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        # Round where torch_ref rounds: after the norm, and after the weight.
        a = (w1 * (a * inv_rms).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
        b = (w2 * (b * inv_rms).to(x1.dtype).to(tl.float32)).to(x1.dtype).to(tl.float32)
        pos = tl.load(pos_ptr + token).to(tl.int64)
        cos = tl.load(cos_ptr + pos * stride_cos + offs, mask=mask, other=0.0)
        sin = tl.load(sin_ptr + pos * stride_cos + offs, mask=mask, other=0.0)
        r1 = (a * cos - b * sin).to(x1.dtype)
        r2 = (b * cos + a * sin).to(x1.dtype)
        if is_q:
            dst = q_out_ptr + (token * NUM_Q_HEADS + head) * head_dim
            tl.store(dst + offs, r1, mask=mask)
            tl.store(dst + HALF + offs, r2, mask=mask)
        else:
            kv_head = head - NUM_Q_HEADS
            dst = k_out_ptr + (token * NUM_KV_HEADS + kv_head) * head_dim
            tl.store(dst + offs, r1, mask=mask)
            tl.store(dst + HALF + offs, r2, mask=mask)
            if slot >= 0:
                cache = k_cache_ptr + slot * stride_cache_slot + kv_head * stride_cache_head
                tl.store(cache + offs, r1, mask=mask)
                tl.store(cache + HALF + offs, r2, mask=mask)


def qk_norm_rope_cache(
    qkv: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as torch_ref.qk_norm_rope_cache."""
    tokens = qkv.shape[0]
    head_dim = q_norm_weight.shape[0]
    assert qkv.stride(-1) == 1 and head_dim % 2 == 0 and cos.stride() == sin.stride()
    # The kernel indexes positions and slots as dense [tokens] arrays (a strided view would be misread).
    assert positions.dim() == 1 and positions.is_contiguous() and slot_mapping.is_contiguous()
    # Cache rows are addressed as flat slots: [num_blocks, block_size] must be one dense dim.
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(0) == k_cache.shape[1] * k_cache.stride(1)
    q = torch.empty(tokens, num_q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(tokens, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    v = torch.empty(tokens, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    half = head_dim // 2
    use_pdl, pdl = launch_options(qkv)
    _qk_norm_rope_cache_kernel[(tokens, num_q_heads + 2 * num_kv_heads)](
        qkv, q_norm_weight, k_norm_weight, cos, sin, positions, slot_mapping,
        k_cache, v_cache, q, k, v,
        qkv.stride(0), cos.stride(0), k_cache.stride(1), k_cache.stride(2),
        eps,
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half), USE_PDL=use_pdl, num_warps=1, **pdl,
    )
    return q, k, v
