"""Torch reference kernels: the readable definition of each op, and the CPU path.

Every Triton kernel in this package has the same signature and is tested against the function here.
All of them are CUDA-graph capturable: fixed shapes, no host syncs, no data-dependent host control flow.
Numerics follow Hugging Face Qwen3: reductions in fp32, results cast back to the input dtype.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

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


class SpecRows(NamedTuple):
    """The rows of a speculative step (reference_engine/spec_device.py), B sequences with k drafts each, R =
    B * (k + 1) rows: each sequence's last token, then its drafts."""

    ids: torch.Tensor  # int64 [R]; a missing draft's row reads token 0
    positions: torch.Tensor  # int32 [R], clamped to max_model_len - 1
    slot_mapping: torch.Tensor  # int64 [R]; rows past max_model_len write into the reserved block 0
    block_tables: torch.Tensor  # int32 [R, W], the sequence's table on each of its rows
    seq_lens: torch.Tensor  # int32 [R]: each row attends to its own prefix
    params: torch.Tensor  # int32 [R, 4]: the sequence's param_cols (temperature, top_p, top_k, seed)
    drafts: torch.Tensor  # int64 [B, k], -1 where none was found
    proposed: torch.Tensor  # int64 [B]: drafts found
    lengths: torch.Tensor  # int64 [B]: each sequence's length as read


def spec_propose(history: torch.Tensor, lengths: torch.Tensor, k: int, *, max_ngram: int,
                 min_ngram: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt-lookup drafts (reference_engine/speculative.propose) for each row of `history` [B, T] holding
    `lengths` [B] tokens: (drafts int64 [B, k], -1 where there is none; the number found [B]). A match of n
    tokens ending at e (history[e - i] == history[length - 1 - i] for i < n) must leave a token after it
    before the tail: e <= length - 2. The longest n wins, then the latest e."""
    batch, width = history.shape
    lengths = lengths.long()
    ends = torch.arange(width, device=history.device)[None, :]
    matched = torch.ones(batch, width, dtype=torch.bool, device=history.device)
    best_end = torch.full((batch,), -1, dtype=torch.long, device=history.device)
    for n in range(1, max_ngram + 1):  # n-grams grow by one older token; the longest found wins
        tail = history.gather(1, (lengths - n).clamp_min(0)[:, None])  # the tail's n-th token from the end
        older = F.pad(history[:, : width - (n - 1)], (n - 1, 0), value=-1)
        matched &= older == tail
        if n < min_ngram:
            continue
        ok = matched & (ends >= n - 1) & (ends <= (lengths - 2)[:, None]) & (lengths > n)[:, None]
        latest = torch.where(ok, ends, -1).amax(dim=1)
        best_end = torch.where(latest >= 0, latest, best_end)
    follow = best_end[:, None] + 1 + torch.arange(k, device=history.device)[None, :]
    valid = (best_end >= 0)[:, None] & (follow < lengths[:, None])
    drafts = torch.where(valid, history.gather(1, follow.clamp(0, width - 1)), -1)
    return drafts, valid.sum(dim=1)


def spec_rows(meta: torch.Tensor, history: torch.Tensor, lengths: torch.Tensor, *, k: int, block_size: int,
              max_model_len: int, max_ngram: int, slot_col: int, blocks_col: int,
              param_cols: tuple[int, int, int, int]) -> SpecRows:
    """A speculative step's rows from its int32 metadata rows [B, W_meta] (slot, block table and sampling
    params at the given columns) and the device history [slots, T] and lengths [slots]."""
    slots = meta[:, slot_col].long()
    rows = history[slots]
    length = lengths[slots].long()
    drafts, proposed = spec_propose(rows, length, k, max_ngram=max_ngram)
    last = rows.gather(1, (length - 1).clamp_min(0)[:, None])
    ids = torch.cat([last, drafts.clamp_min(0)], dim=1).reshape(-1)
    positions = ((length - 1)[:, None] + torch.arange(k + 1, device=meta.device)[None, :]).reshape(-1)
    inside = positions < max_model_len
    within = positions.clamp(max=max_model_len - 1)  # the RoPE tables end there; such rows are never kept
    row_tables = meta[:, blocks_col:].repeat_interleave(k + 1, dim=0)
    block = row_tables.gather(1, (within // block_size)[:, None]).squeeze(1).long()
    slot_mapping = torch.where(inside, block, 0) * block_size + positions % block_size
    # Column by column: a list index would be a host tensor, copied during a graph capture.
    params = torch.stack([meta[:, col] for col in param_cols], dim=1).repeat_interleave(k + 1, dim=0)
    return SpecRows(ids, within.int(), slot_mapping, row_tables, (within + 1).int(), params, drafts, proposed,
                    length)


def spec_record(history: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor,
                start: torch.Tensor, new: torch.Tensor) -> None:
    """Write tokens [B, n] into each sequence slot's history from `start` [B] on and set its length to
    start + new (the rest of the n is scratch past the length). spec_accept's bookkeeping; the prefill's too,
    for its prompts' first sampled tokens."""
    columns = start[:, None] + torch.arange(tokens.shape[1], device=slots.device)[None, :]
    history[slots[:, None].long(), columns] = tokens
    lengths[slots.long()] = (start + new).to(lengths.dtype)


def spec_accept(sampled: torch.Tensor, rows: SpecRows, slots: torch.Tensor, history: torch.Tensor,
                lengths: torch.Tensor, out: torch.Tensor, *, max_model_len: int) -> None:
    """Acceptance of a speculative step from the sampled tokens [B, k + 1] of its rows: draft i is kept while
    it equals row i's token, and the token after the last kept one comes free (never past max_model_len).
    Writes the sampled tokens after each sequence's length (the part past the new length is scratch),
    advances the lengths, and fills out [B, k + 3]: the sampled tokens, the new count, the drafts found."""
    kept = (rows.drafts == sampled[:, :-1]).long().cumprod(dim=1).sum(dim=1)
    new = torch.minimum(kept + 1, (max_model_len - rows.lengths).clamp_min(0))
    spec_record(history, lengths, slots, sampled, rows.lengths, new)
    torch.cat([sampled, new[:, None], rows.proposed[:, None]], dim=1, out=out)
