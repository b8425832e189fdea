"""Dense Qwen3 decoder as plain tensors and functions (no nn.Module): easy to load and to capture.

Fast-path layout: q/k/v projections fused into one `qkv` weight and gate/up into one `gate_up` weight, so a
layer is 4 GEMMs (qkv, o, gate_up, down), each carrying the norm, SiLU or residual add next to it, plus the
attention kernels of `reference_engine.kernels`. The forward computes the first layer's qkv before the loop
and each later one with the layer before it (`o_proj_mlp(next_qkv=...)`), so the one-row Triton decode
layer is two launches; a decode step of one sequence takes `decode_layers` instead, all layers in one launch
(unless Config.one_launch_layers is off).

Two attention paths share every other op:
- prefill: each sequence's whole prompt at once; k/v are written to the paged cache and attention runs with
  SDPA (causal) on the fresh k/v of that sequence (no prefix reuse: a preempted sequence simply recomputes);
- decode: one token per sequence; k/v written to the cache, then `paged_decode_attention` over block tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from reference_engine.config import Config
from reference_engine.kernels import Kernels, get_kernels, rope_cos_sin
from reference_engine.kernels.layer_stack import LayerStack, stack_weights


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(Hq + 2 Hkv) * D, H]
    q_norm: torch.Tensor | None  # [D]; None for Llama-style models
    k_norm: torch.Tensor | None
    o_proj: torch.Tensor  # [H, Hq * D]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 I, H]
    down: torch.Tensor  # [H, I]


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache, and (decode) what they attend to.

    slot_mapping int [T]: flat cache slot (block * block_size + offset) of each token.
    prefill: cu_seqlens host list [num_seqs + 1] of token offsets. decode: block_tables int32 [B, max_blocks],
    seq_lens int32 [B] (including the current token).
    """

    slot_mapping: torch.Tensor
    cu_seqlens: list[int] | None = None
    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    # Verify steps: several decode rows belong to one sequence (its last token and drafts), so every row's k/v
    # must be in the cache before any row attends; the fused prologue + attention launch cannot promise that.
    shared_rows: bool = False

    @property
    def is_prefill(self) -> bool:
        return self.cu_seqlens is not None


class Qwen3Model:
    def __init__(
        self,
        config: Config,
        *,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
    ) -> None:
        self.config = config
        stack_weights(layers)  # each kind in one allocation: the one-launch decode computes layer offsets
        self.embed, self.layers, self.final_norm, self.lm_head = embed, layers, final_norm, lm_head
        self.device, self.dtype = embed.device, embed.dtype
        self.ops: Kernels = get_kernels(config.kernels)
        self.cos, self.sin = rope_cos_sin(
            config.max_model_len, config.head_dim, config.rope_theta, device=self.device
        )
        self.scale = config.head_dim**-0.5
        self._stack: tuple[list, LayerStack] | None = None  # (the kv_caches list it was built for, the stack)

    # --- construction
    @classmethod
    def random(cls, config: Config) -> Qwen3Model:
        """Seeded random weights made directly on the target device (bf16 on CUDA, fp32 on CPU).

        Scales keep activations sane without training: linear weights ~ N(0, 1/fan_in) so each GEMM keeps the
        variance of its normalised input, embeddings ~ N(0, 0.02^2) as in Hugging Face's init, so layer
        outputs (which depend on context) dominate the residual and greedy decoding does not echo its input.
        """
        device = torch.device(config.device)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        gen = torch.Generator(device=device).manual_seed(config.seed)

        def normal(*shape: int, std: float) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, device=device, dtype=dtype).mul_(std)

        def ones(n: int) -> torch.Tensor:
            return torch.ones(n, device=device, dtype=dtype)

        h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
        embed = normal(config.vocab_size, h, std=0.02)
        layers = [
            LayerWeights(
                input_norm=ones(h),
                qkv=normal(config.qkv_size, h, std=h**-0.5),
                q_norm=ones(d) if config.qk_norm else None,
                k_norm=ones(d) if config.qk_norm else None,
                o_proj=normal(h, config.num_heads * d, std=(config.num_heads * d) ** -0.5),
                post_norm=ones(h),
                gate_up=normal(2 * i, h, std=h**-0.5),
                down=normal(h, i, std=i**-0.5),
            )
            for _ in range(config.num_layers)
        ]
        lm_head = embed if config.tie_embeddings else normal(config.vocab_size, h, std=h**-0.5)
        return cls(config, embed=embed, layers=layers, final_norm=ones(h), lm_head=lm_head)

    def with_config(self, config: Config) -> Qwen3Model:
        """The same weights under another config (kernels, max_model_len): ops and RoPE tables rebound."""
        return Qwen3Model(
            config, embed=self.embed, layers=self.layers, final_norm=self.final_norm, lm_head=self.lm_head
        )

    def weight_bytes_per_step(self) -> int:
        """Bytes of weights a decode step streams from memory (the embedding row gather is negligible)."""
        tensors = [self.final_norm, self.lm_head]
        for layer in self.layers:
            tensors += [t for t in vars(layer).values() if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    # --- forward
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, ...]],
        meta: AttentionMetadata,
        *,
        embedded: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The residual stream [T, H] after the last layer, before the final norm (prefill: all prompts'
        tokens concatenated). `compute_logits` applies the final norm, so callers can pick rows first.

        Each norm is folded into the projection that reads it and each residual add into the projection that
        writes it (kernels' norm_linear / o_proj_mlp): a decode layer is the four weight reads plus the
        attention kernel. With Triton at one row that is two launches: attention, then o_proj, the MLP and
        the next layer's qkv in one (fused_mlp.py); a decode step with `one_launch_layers` takes the
        kernels' decode_layers instead (every layer in one launch at one sequence, decode_layers.py).
        `embedded`: the ids' embedding rows when the caller has them (ops.decode_inputs with embed=).
        """
        cfg, ops = self.config, self.ops
        eps = cfg.rms_norm_eps
        x = embedded if embedded is not None else ops.embedding(self.embed, input_ids)
        if cfg.one_launch_layers and cfg.qk_norm and not meta.is_prefill and not meta.shared_rows:
            return ops.decode_layers(
                x, self._layer_stack(kv_caches), meta.slot_mapping, meta.block_tables, meta.seq_lens,
                self.cos, self.sin, self.scale, num_q_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                eps=eps,
            )
        qkv = ops.norm_linear(x, self.layers[0].input_norm, self.layers[0].qkv, eps)
        for index, layer in enumerate(self.layers):
            k_cache, v_cache = kv_caches[index]
            attn = self._attention(layer, qkv, positions, k_cache, v_cache, meta)
            # The next layer's qkv comes with this layer's tail (one launch at decode, fused_mlp.py).
            after = self.layers[index + 1] if index + 1 < len(self.layers) else None
            x, qkv = ops.o_proj_mlp(attn, layer.o_proj, x, layer.post_norm, layer.gate_up, layer.down, eps,
                                    next_qkv=(after.input_norm, after.qkv) if after is not None else None)
        return x

    def _layer_stack(self, kv_caches: list[tuple[torch.Tensor, ...]]) -> LayerStack:
        """The layers and this cache as one op argument, built once per cache (the engine keeps its list)."""
        if self._stack is None or self._stack[0] is not kv_caches:
            self._stack = (kv_caches, LayerStack.of(self.layers, kv_caches))
        return self._stack[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, V] of `forward`'s rows (the sampler's softmax and argmax run in fp32)."""
        return self.ops.norm_linear(
            hidden, self.final_norm, self.lm_head, self.config.rms_norm_eps, out_dtype=torch.float32
        )

    def _attention(
        self,
        layer: LayerWeights,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Attention from the layer's qkv projection (of the normed residual stream)."""
        cfg = self.config
        tokens = qkv.shape[0]
        heads = dict(num_q_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads)
        if layer.q_norm is not None and not meta.is_prefill and not meta.shared_rows:
            # Qwen3 decode: prologue and attention, one op
            out = self.ops.decode_attention_from_qkv(
                qkv, layer.q_norm, layer.k_norm, self.cos, self.sin, k_cache, v_cache, meta.slot_mapping,
                meta.block_tables, meta.seq_lens, self.scale, eps=cfg.rms_norm_eps, **heads,
            )
            return out.reshape(tokens, -1)
        if layer.q_norm is not None:
            q, k, v = self.ops.qk_norm_rope_cache(
                qkv, layer.q_norm, layer.k_norm, self.cos, self.sin, positions, k_cache, v_cache,
                meta.slot_mapping, eps=cfg.rms_norm_eps, **heads,
            )
        else:
            q, k, v = _rope_and_cache(
                qkv, self.cos, self.sin, positions, k_cache, v_cache, meta.slot_mapping, **heads
            )
        if not meta.is_prefill:
            out = self.ops.paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale
            )
            return out.reshape(tokens, -1)
        outs = []
        bounds = meta.cu_seqlens
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            # [L, H, D] -> [1, H, L, D]; enable_gqa lets SDPA share each k/v head across its query group.
            qs, ks, vs = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=True)
            outs.append(o.squeeze(0).transpose(0, 1).reshape(end - start, -1))
        return torch.cat(outs) if len(outs) > 1 else outs[0]


def _rope_and_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_q_heads: int,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Llama-style prologue (no q/k norm): RoPE on q and k, then write k/v to their cache slots."""
    tokens, head_dim = qkv.shape[0], k_cache.shape[-1]
    q, k, v = qkv.view(tokens, num_q_heads + 2 * num_kv_heads, head_dim).split(
        [num_q_heads, num_kv_heads, num_kv_heads], dim=1
    )
    c, s = cos[positions.long()][:, None, :], sin[positions.long()][:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    q, k, v = rotate(q), rotate(k), v.contiguous()
    slots = slot_mapping.long()
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)
    return q, k, v
