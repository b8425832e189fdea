"""Torch reference kernels: the readable definition of each op, and the CPU path.

Every Triton kernel in this package has the same signature and is tested against the function here.
All of them are CUDA-graph capturable: fixed shapes, no host syncs, no data-dependent host control flow.
Numerics follow Hugging Face Qwen3: reductions in fp32, results cast back to the input dtype.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from reference_engine.kernels.layer_stack import LayerStack, run_layers


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: x / rms(x) * weight, computed in fp32."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = x + residual (in x's dtype); returns (rmsnorm(new_residual), new_residual)."""
    new_residual = x + residual
    return rmsnorm(new_residual, weight, eps), new_residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation: silu(gate) * up, where gate_up = [gate | up] along the last dim."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def norm_linear(
    x: torch.Tensor, norm_w: torch.Tensor, w: torch.Tensor, eps: float, *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """rmsnorm(x, norm_w) @ w.T in out_dtype (default x's): the qkv projection and the LM head."""
    out = F.linear(rmsnorm(x, norm_w, eps), w)
    return out if out_dtype is None else out.to(out_dtype)


def norm_gate_up_silu(
    x: torch.Tensor, norm_w: torch.Tensor, w_gate_up: torch.Tensor, eps: float
) -> torch.Tensor:
    """The MLP's first half: silu_and_mul(rmsnorm(x, norm_w) @ w_gate_up.T)."""
    return silu_and_mul(F.linear(rmsnorm(x, norm_w, eps), w_gate_up))


def linear_residual(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The residual stream update: residual + x @ w.T (the product rounded to x's dtype first)."""
    return F.linear(x, w) + residual


def o_proj_mlp(
    attn: torch.Tensor, w_o: torch.Tensor, x: torch.Tensor, norm_w: torch.Tensor, w_gate_up: torch.Tensor,
    w_down: torch.Tensor, eps: float, *, next_qkv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A layer after its attention: (out, qkv) with h = x + attn @ w_o.T, out = h + mlp(h) where mlp is
    down(norm_gate_up_silu(h)), and given next_qkv = (input norm, qkv weight) of the next layer,
    qkv = norm_linear(out, ...) (else None)."""
    h = linear_residual(attn, w_o, x)
    out = linear_residual(norm_gate_up_silu(h, norm_w, w_gate_up, eps), w_down, h)
    return out, (norm_linear(out, *next_qkv, eps) if next_qkv is not None else None)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence against its paged KV history (GQA).

    q [B, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables int32 [B, max_blocks];
    seq_lens int32 [B] (including the current token, already written to the cache). Returns [B, Hq, D].
    Gathers every sequence up to max_blocks * block_size and masks by seq_len, so shapes never depend on
    the data (capturable); rows with seq_len 0 (graph padding) give zeros.
    """
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    max_tokens = block_tables.shape[1] * block_size
    blocks = block_tables.long().clamp(min=0)
    # [B, max_blocks, block_size, Hkv, D] -> [B, Hkv, T, D]
    keys = k_cache[blocks].reshape(batch, max_tokens, num_kv_heads, head_dim).transpose(1, 2).float()
    values = v_cache[blocks].reshape(batch, max_tokens, num_kv_heads, head_dim).transpose(1, 2).float()
    queries = q.float().reshape(batch, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,bhtd->bhgt", queries, keys) * scale
    valid = torch.arange(max_tokens, device=q.device)[None, :] < seq_lens[:, None].long()  # [B, T]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    # A row with no valid token would be all -inf -> NaN; zero its probabilities instead.
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhgt,bhtd->bhgd", probs, values)
    return out.reshape(batch, num_q_heads, head_dim).to(q.dtype)


def rope_cos_sin(
    max_positions: int, head_dim: int, theta: float, *, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos and sin tables [max_positions, head_dim // 2] for neox-style (rotate-half) RoPE."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    angles = torch.arange(max_positions, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, H, D] fp32; cos/sin [T, D/2]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


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
    """Qwen3 attention prologue: split qkv, per-head RMSNorm of q and k, RoPE, write k/v to the cache.

    qkv [T, (Hq + 2 Hkv) * D]; cos/sin [max_positions, D/2] (see rope_cos_sin); positions int [T];
    slot_mapping int [T]: flat cache slot (block * block_size + offset) per token; < 0: not written (padding).
    Returns q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] (k, v as written to the cache) in qkv's dtype.
    """
    tokens = qkv.shape[0]
    head_dim = q_norm_weight.shape[0]
    q, k, v = qkv.view(tokens, num_q_heads + 2 * num_kv_heads, head_dim).split(
        [num_q_heads, num_kv_heads, num_kv_heads], dim=1
    )
    pos = positions.long()
    c, s = cos[pos], sin[pos]
    q = _apply_rope(rmsnorm(q, q_norm_weight, eps).float(), c, s).to(qkv.dtype)
    k = _apply_rope(rmsnorm(k, k_norm_weight, eps).float(), c, s).to(qkv.dtype)
    v = v.contiguous()
    _write_cache(k_cache, v_cache, k, v, slot_mapping)
    return q, k, v


def _write_cache(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter k/v rows [T, Hkv, D] to their flat slots, skipping slots < 0 without host syncs.

    A padding row is redirected to the first real row, so duplicate indices always carry identical values
    (index_copy_ with duplicates is order-undefined); with no real row at all, slot 0 is rewritten unchanged.
    """
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    slots = slot_mapping.long()
    keep = slots >= 0
    rows = torch.arange(slots.shape[0], device=slots.device)
    src = torch.where(keep, rows, keep.to(torch.int32).argmax())
    src_keep = keep[src]
    target = torch.where(src_keep, slots[src], torch.zeros_like(slots))
    flat_k.index_copy_(0, target, torch.where(src_keep[:, None, None], k[src], flat_k[target]))
    flat_v.index_copy_(0, target, torch.where(src_keep[:, None, None], v[src], flat_v[target]))


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
) -> torch.Tensor:
    """A Qwen3 decode step's attention from the qkv projection: qk_norm_rope_cache at each row's position
    seq_len - 1 (the current token), then paged_decode_attention. Returns [B, Hq, D]."""
    positions = (seq_lens.long() - 1).clamp(min=0)
    q, _, _ = qk_norm_rope_cache(qkv, q_norm_weight, k_norm_weight, cos, sin, positions, k_cache, v_cache,
                                 slot_mapping, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, eps=eps)
    return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)


def decode_inputs(
    meta: torch.Tensor, tokens: torch.Tensor, *, block_size: int, slot_col: int, position_col: int,
    blocks_col: int, embed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """A decode step's inputs from its int32 metadata rows [B, W] (slot, position and block table at the
    given columns) and the device token buffer [slots] (each slot's latest sampled token): (input ids
    [B] in tokens' dtype, positions int32 [B], cache slot mapping int64 [B], seq lens int32 [B]), and with
    an embedding table `embed` a fifth: the ids' embedding rows embedding(embed, ids)."""
    positions = meta[:, position_col].contiguous()
    ids = tokens[meta[:, slot_col].long()]
    block = meta[:, blocks_col:].gather(1, (positions // block_size).long()[:, None]).squeeze(1)
    slot_mapping = block.long() * block_size + (positions % block_size).long()
    if embed is not None:
        return ids, positions, slot_mapping, positions + 1, embedding(embed, ids)
    return ids, positions, slot_mapping, positions + 1


def embedding(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """weight[ids] for 1-D ids."""
    return weight[ids]


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """int64 [B]: the first index of each row's maximum (greedy sampling)."""
    return logits.argmax(dim=-1)


def greedy_store(
    logits: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor, sampled: torch.Tensor
) -> None:
    """A greedy step's sampling and bookkeeping: each row's argmax into sampled[row] and into
    tokens[slots[row]] (the slot's next input token; slots int [B], any stride)."""
    ids = argmax(logits)
    tokens.index_copy_(0, slots.long(), ids)
    sampled[: ids.shape[0]].copy_(ids)


def decode_layers(
    x: torch.Tensor, stack: LayerStack, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float, *, num_q_heads: int,
    num_kv_heads: int, eps: float,
) -> torch.Tensor:
    """A Qwen3 decode step through every layer of `stack`: per layer norm_linear (qkv),
    decode_attention_from_qkv and o_proj_mlp. Returns the residual stream [B, H] after the last layer."""
    return run_layers(sys.modules[__name__], x, stack, slot_mapping, block_tables, seq_lens, cos, sin, scale,
                      num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, eps=eps)
