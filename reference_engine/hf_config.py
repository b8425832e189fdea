"""Shape fields of Config from a Hugging Face model directory's config.json (Qwen3 or Llama-style keys).

Its own module so that config.py can read a directory without importing the loader (and torch).
"""

from __future__ import annotations

import json
from pathlib import Path

_SUPPORTED_TYPES = ("qwen3", "llama", "mistral")


def read_hf_config(directory: str | Path) -> dict:
    """Shape fields of Config from a Hugging Face config.json (Qwen3 or Llama-style keys)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ValueError(f"model directory {directory} has no config.json")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    model_type = hf.get("model_type", "qwen3")
    if model_type not in _SUPPORTED_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported (only {', '.join(_SUPPORTED_TYPES)})")
    try:
        heads = hf["num_attention_heads"]
        shape = dict(
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads", heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            intermediate_size=hf["intermediate_size"],
            vocab_size=hf["vocab_size"],
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_model_len=min(hf.get("max_position_embeddings", 4096), 4096),
            qk_norm=model_type == "qwen3",
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=hf.get("rope_theta", 1_000_000.0 if model_type == "qwen3" else 10_000.0),
        )
    except KeyError as exc:
        raise ValueError(f"{path} lacks {exc.args[0]!r}") from None
    for name in ("bos_token_id", "eos_token_id"):
        value = hf.get(name)
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int):
            shape[name] = value
    return shape
