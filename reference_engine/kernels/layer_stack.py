"""Every decoder layer's weights and KV cache as one argument, for ops that run all layers in one call.

`LayerStack.of(layers, kv_caches)` is built once per (model, cache) and reused every step: besides the
tensors it holds, per tensor kind, each layer's element offset from layer 0's tensor on the device, so a
single kernel can reach layer l's weights as `layer0_ptr + offset[kind, l]` without stacking (copying) the
weights into one allocation. `run_layers` is the plain per-layer loop any op set can run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# The tensors of a layer a decode step reads, in the order of LayerStack.offsets' rows.
WEIGHT_KINDS = ("input_norm", "qkv", "q_norm", "k_norm", "o_proj", "post_norm", "gate_up", "down")
KINDS = (*WEIGHT_KINDS, "k_cache", "v_cache")


@dataclass(frozen=True)
class LayerStack:
    layers: tuple  # per layer: an object with the WEIGHT_KINDS attributes (model.LayerWeights)
    kv_caches: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    # int64 [len(KINDS), num_layers] on the weights' device; None when a kind is missing (Llama-style: no
    # q/k norm) or some layer's tensor is not a whole number of elements away from layer 0's.
    offsets: torch.Tensor | None
    # The largest power of two (up to 256) dividing every offset: kernels may promise aligned loads with it.
    alignment: int = 0

    @classmethod
    def of(cls, layers, kv_caches) -> LayerStack:
        layers, kv_caches = tuple(layers), tuple(tuple(pair) for pair in kv_caches)
        per_kind = [[getattr(layer, kind) for layer in layers] for kind in WEIGHT_KINDS]
        per_kind += [[pair[0] for pair in kv_caches], [pair[1] for pair in kv_caches]]
        rows = _offsets(per_kind)
        if rows is None:
            return cls(layers=layers, kv_caches=kv_caches, offsets=None)
        alignment = 256
        while any(d % alignment for row in rows for d in row):
            alignment //= 2
        offsets = torch.tensor(rows, dtype=torch.int64, device=per_kind[0][0].device)
        return cls(layers=layers, kv_caches=kv_caches, offsets=offsets, alignment=alignment)

    def first(self, kind: str) -> torch.Tensor:
        """Layer 0's tensor of `kind` (the base the offsets count from)."""
        if kind in ("k_cache", "v_cache"):
            return self.kv_caches[0][kind == "v_cache"]
        return getattr(self.layers[0], kind)


def _offsets(per_kind: list[list[torch.Tensor | None]]) -> list[list[int]] | None:
    rows = []
    for tensors in per_kind:
        if any(t is None or t.dtype != tensors[0].dtype for t in tensors):
            return None
        size, base = tensors[0].element_size(), tensors[0].data_ptr()
        deltas = [t.data_ptr() - base for t in tensors]
        if any(d % size for d in deltas):
            return None
        rows.append([d // size for d in deltas])
    return rows


def run_layers(
    ops: Any, x: torch.Tensor, stack: LayerStack, slot_mapping: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float, *,
    num_q_heads: int, num_kv_heads: int, eps: float,
) -> torch.Tensor:
    """Qwen3 decode layers one by one with `ops` (norm_linear, decode_attention_from_qkv, o_proj_mlp): the
    residual stream [B, H] after the last layer. Each layer's tail computes the next layer's qkv."""
    layers = stack.layers
    qkv = ops.norm_linear(x, layers[0].input_norm, layers[0].qkv, eps)
    for index, layer in enumerate(layers):
        k_cache, v_cache = stack.kv_caches[index]
        attn = ops.decode_attention_from_qkv(
            qkv, layer.q_norm, layer.k_norm, cos, sin, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
            scale, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, eps=eps,
        ).reshape(x.shape[0], -1)
        after = layers[index + 1] if index + 1 < len(layers) else None
        x, qkv = ops.o_proj_mlp(attn, layer.o_proj, x, layer.post_norm, layer.gate_up, layer.down, eps,
                                next_qkv=(after.input_norm, after.qkv) if after is not None else None)
    return x
