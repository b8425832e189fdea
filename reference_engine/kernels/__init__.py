"""The engine's hot ops, as a torch reference and as Triton kernels with the same signatures.

    from reference_engine.kernels import get_kernels
    ops = get_kernels("triton")          # or "torch"
    out = ops.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)

Ops (all CUDA-graph capturable: fixed shapes, no host syncs):
- paged_decode_attention(q[B,Hq,D], k_cache, v_cache [num_blocks, block_size, Hkv, D],
  block_tables int32 [B, max_blocks], seq_lens int32 [B], scale) -> [B, Hq, D]
- fused_add_rmsnorm(x, residual, weight, eps) -> (normed, new_residual); rmsnorm(x, weight, eps)
- silu_and_mul(gate_up[..., 2I]) -> [..., I]
- norm_linear(x, norm_w, w, eps, *, out_dtype=None) -> rmsnorm(x) @ w.T (qkv; LM head with fp32 out)
- norm_gate_up_silu(x, norm_w, w_gate_up, eps) -> silu_and_mul(rmsnorm(x) @ w_gate_up.T)
- linear_residual(x, w, residual) -> residual + x @ w.T (o_proj, down)
- o_proj_mlp(attn, w_o, x, norm_w, w_gate_up, w_down, eps, *, next_qkv=None) -> (out, qkv): a layer after
  its attention, out = h + down(norm_gate_up_silu(h)) with h = linear_residual(attn, w_o, x), and with
  next_qkv = (input norm, qkv weight) the next layer's norm_linear(out, ...) (else None); at one row the
  Triton version is one launch (fused_mlp.py)
  The Triton versions of these three are single decode kernels (skinny_gemm.py) for up to 16 rows, and
  compose cuBLAS with the Triton row kernels above that (prefill).
- qk_norm_rope_cache(qkv, q_norm_weight, k_norm_weight, cos, sin, positions, k_cache, v_cache, slot_mapping,
  *, num_q_heads, num_kv_heads, eps) -> (q, k, v): Qwen3's attention prologue; cos/sin from rope_cos_sin().
- decode_attention_from_qkv(qkv, q_norm_weight, k_norm_weight, cos, sin, k_cache, v_cache, slot_mapping,
  block_tables, seq_lens, scale, *, num_q_heads, num_kv_heads, eps) -> [B, Hq, D]: the two above in one
  decode step (position = seq_len - 1); the Triton version is one launch.
- decode_layers(x, stack, slot_mapping, block_tables, seq_lens, cos, sin, scale, *, num_q_heads, num_kv_heads,
  eps) -> [B, H]: a Qwen3 decode step through every layer of a LayerStack (layer_stack.py): per layer
  norm_linear (qkv), decode_attention_from_qkv, o_proj_mlp. The Triton version is one launch for one sequence
  (decode_layers.py).

- decode_inputs(meta, tokens, *, block_size, slot_col, position_col, blocks_col) -> (ids, positions,
  slot_mapping, seq_lens): a decode step's inputs from its metadata rows; embedding(weight, ids);
  argmax(logits) -> int64 [B] (first index of the maximum); greedy_store(logits, slots, tokens, sampled): the
  argmax into sampled[row] and tokens[slots[row]]. One launch each in Triton (step_ops.py).
- spec_rows(meta, history, lengths, *, k, block_size, max_model_len, max_ngram, slot_col, blocks_col,
  param_cols) -> SpecRows: a speculative step's drafts and verify rows from the device history;
  spec_accept(sampled, rows, slots, history, lengths, out, *, max_model_len): its acceptance and bookkeeping
  (reference_engine/spec_device.py). One launch each in Triton (spec_ops.py).

Triton is imported only when asked for, so the torch path works where Triton is missing.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, fields

from reference_engine.kernels import torch_ref
from reference_engine.kernels.torch_ref import rope_cos_sin

KERNEL_CHOICES = ("torch", "triton")


@dataclass(frozen=True)
class Kernels:
    name: str
    paged_decode_attention: Callable
    fused_add_rmsnorm: Callable
    rmsnorm: Callable
    silu_and_mul: Callable
    qk_norm_rope_cache: Callable
    norm_linear: Callable
    norm_gate_up_silu: Callable
    linear_residual: Callable
    o_proj_mlp: Callable
    decode_attention_from_qkv: Callable
    decode_layers: Callable
    decode_inputs: Callable
    embedding: Callable
    argmax: Callable
    greedy_store: Callable
    spec_rows: Callable
    spec_accept: Callable


# Where each op of the Triton set lives (imported only when asked for).
_TRITON_HOMES = {
    "paged_decode_attention": "attention",
    "fused_add_rmsnorm": "elementwise",
    "rmsnorm": "elementwise",
    "silu_and_mul": "elementwise",
    "qk_norm_rope_cache": "rope",
    "norm_linear": "decode_linear",
    "norm_gate_up_silu": "decode_linear",
    "linear_residual": "decode_linear",
    "o_proj_mlp": "decode_linear",
    "decode_attention_from_qkv": "attention",
    "decode_layers": "decode_layers",
    "decode_inputs": "step_ops",
    "embedding": "step_ops",
    "argmax": "step_ops",
    "greedy_store": "step_ops",
    "spec_rows": "spec_ops",
    "spec_accept": "spec_ops",
}


def get_kernels(name: str) -> Kernels:
    """The op namespace for `name` in KERNEL_CHOICES. Raises ValueError for an unknown name."""
    if name not in KERNEL_CHOICES:
        raise ValueError(f"unknown kernels {name!r}: choose one of {', '.join(KERNEL_CHOICES)}")
    ops = {}
    for field in fields(Kernels)[1:]:
        module = f"{__name__}.{_TRITON_HOMES[field.name]}"
        home = torch_ref if name == "torch" else importlib.import_module(module)
        ops[field.name] = getattr(home, field.name)
    return Kernels(name=name, **ops)


__all__ = ["KERNEL_CHOICES", "Kernels", "get_kernels", "rope_cos_sin"]
