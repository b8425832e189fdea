"""Every decoder layer's weights and KV cache as one argument, for ops that run all layers in one call.

`LayerStack.of(layers, kv_caches)` is built once per (model, cache) and reused every step: besides the
tensors it holds, per tensor kind, each layer's element offset from layer 0's tensor on the device, so a
single kernel can reach layer l's weights as `layer0_ptr + offset[kind, l]` wherever they live. The models
stack each kind's weights in one allocation (`stack_weights`), where the offset is l x one layer's
elements and the kernel computes it (`LayerStack.uniform`) instead of loading it first.
`run_layers` is the plain per-layer loop any op set can run.
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
    # Whether each layer's tensors sit right after the layer before's (weights stacked per kind, as the
    # models allocate them): layer l's weight of a kind is then l x one layer's elements from layer 0's,
    # and its caches l x kv_layer_stride, offsets a kernel computes instead of loading.
    uniform: bool = False
    kv_layer_stride: int = 0

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
        steps = [tensors[0].numel() for tensors in per_kind[: len(WEIGHT_KINDS)]]
        kv_step = rows[-1][1] if len(layers) > 1 else 0
        steps += [kv_step, kv_step]
        uniform = all(row == [i * step for i in range(len(layers))]
                      for row, step in zip(rows, steps, strict=True))
        return cls(layers=layers, kv_caches=kv_caches, offsets=offsets, alignment=alignment, uniform=uniform,
                   kv_layer_stride=kv_step)

    def first(self, kind: str) -> torch.Tensor:
        """Layer 0's tensor of `kind` (the base the offsets count from)."""
        if kind in ("k_cache", "v_cache"):
            return self.kv_caches[0][kind == "v_cache"]
        return getattr(self.layers[0], kind)


def stack_weights(layers: list) -> None:
    """Re-home each weight kind's per-layer tensors into one allocation, layer after layer, so a stack of
    these layers is uniform (LayerStack.uniform: a kernel computes each layer's offsets instead of loading
    them; H200, decode_layers.py: 0.4-0.5 us a qwen3-4b layer). In place, a kind at a time (the extra memory
    is one kind's while it copies); kinds already laid out so, or missing or unequal in shape, stay."""
    for kind in WEIGHT_KINDS:
        tensors = [getattr(layer, kind) for layer in layers]
        if any(t is None or t.shape != tensors[0].shape or t.dtype != tensors[0].dtype for t in tensors):
            continue
        step = tensors[0].numel() * tensors[0].element_size()
        if all(t.is_contiguous() and t.data_ptr() == tensors[0].data_ptr() + i * step
               for i, t in enumerate(tensors)):
            continue
        for layer, t in zip(layers, torch.stack(tensors), strict=True):
            setattr(layer, kind, t)


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
