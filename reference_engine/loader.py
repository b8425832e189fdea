"""Model weights: seeded random (presets) or a local Hugging Face directory (config.json + *.safetensors).

Hugging Face names map onto the fused fast-path layout: q/k/v_proj -> one `qkv` weight, gate/up_proj -> one
`gate_up` weight. `save_hf_dir` writes the inverse (used by tests to round-trip). Nothing is ever downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from reference_engine.config import Config
from reference_engine.model import LayerWeights, Qwen3Model


def load_model(config: Config) -> Qwen3Model:
    if config.model is None:
        return Qwen3Model.random(config)
    return load_hf_model(config)


def load_hf_model(config: Config) -> Qwen3Model:
    from safetensors.torch import load_file

    files = sorted(Path(config.model).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {config.model} has no *.safetensors files")
    device = torch.device(config.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file), device="cpu"))

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"weight {name} missing from {config.model}")
        return tensors[name].to(device=device, dtype=dtype)

    def cat(*names: str) -> torch.Tensor:
        return torch.cat([take(n) for n in names])

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=cat(attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
                q_norm=take(attn + "q_norm.weight") if config.qk_norm else None,
                k_norm=take(attn + "k_norm.weight") if config.qk_norm else None,
                o_proj=take(attn + "o_proj.weight"),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=cat(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=take(p + "mlp.down_proj.weight"),
            )
        )
    embed = take("model.embed_tokens.weight")
    if config.tie_embeddings or "lm_head.weight" not in tensors:
        lm_head = embed
    else:
        lm_head = take("lm_head.weight")
    return Qwen3Model(
        config, embed=embed, layers=layers, final_norm=take("model.norm.weight"), lm_head=lm_head
    )


def hf_state_dict(model: Qwen3Model) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names (fused weights split back), on the CPU."""
    cfg = model.config
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": model.embed, "model.norm.weight": model.final_norm}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = model.lm_head
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = layer.qkv.split([q_size, kv_size, kv_size])
        gate, up = layer.gate_up.chunk(2)
        out.update(
            {
                p + "input_layernorm.weight": layer.input_norm,
                p + "post_attention_layernorm.weight": layer.post_norm,
                p + "self_attn.q_proj.weight": q,
                p + "self_attn.k_proj.weight": k,
                p + "self_attn.v_proj.weight": v,
                p + "self_attn.o_proj.weight": layer.o_proj,
                p + "mlp.gate_proj.weight": gate,
                p + "mlp.up_proj.weight": up,
                p + "mlp.down_proj.weight": layer.down,
            }
        )
        if layer.q_norm is not None:
            out[p + "self_attn.q_norm.weight"] = layer.q_norm
            out[p + "self_attn.k_norm.weight"] = layer.k_norm
    return {name: t.detach().to("cpu").contiguous().clone() for name, t in out.items()}


def save_hf_dir(
    model: Qwen3Model,
    directory: str | Path,
    *,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> Path:
    """Write config.json + model.safetensors in Hugging Face's Qwen3 layout."""
    from safetensors.torch import save_file

    cfg = model.config
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf_config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3" if cfg.qk_norm else "llama",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_model_len,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "torch_dtype": "float32",
        "hidden_act": "silu",
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2))
    save_file(hf_state_dict(model), str(directory / "model.safetensors"))
    return directory
