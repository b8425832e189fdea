"""Write a tiny random-weight Hugging Face model directory (Qwen3 or Llama) with a locally trained tokenizer.

    python scripts/make_tiny_hf_model.py OUT_DIR [--arch qwen3|llama] [--layers 2] [--seed 0]

The directory holds config.json, generation_config.json, model.safetensors, tokenizer.json,
tokenizer_config.json and special_tokens_map.json: enough for vLLM or transformers to load and serve it, with
no download. The weights are random (the text it writes is noise) but the shapes, and so the code paths, are
those of the real architecture. Needs numpy, safetensors and tokenizers only (no torch, no transformers).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Words for the tokenizer's training text; "the" and digits are what `overshoot run` prompts are made of.
WORDS = (
    "the a an of to in and is it that was for on are as with his they at be this have from or one had "
    "by word but not what all were we when your can said there use each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part step token batch decode prefill engine queue model server request stream kernel "
    "graph"
).split()


def train_tokenizer(vocab_size: int, seed: int) -> Tokenizer:
    rng = random.Random(seed)
    lines = [
        " ".join(rng.choice(WORDS) for _ in range(24)) + f" {rng.randrange(10_000)}" for _ in range(2000)
    ]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        # Printable ASCII only: a random model then samples only tokens that decode to whole characters. With
        # all 256 bytes it emits broken UTF-8 that the server's detokenizer holds back, and streamed text (so
        # time to first token) arrives late. Prompts for this model must be ASCII.
        initial_alphabet=[chr(c) for c in range(0x21, 0x7F)] + ["\u0120"],  # "\u0120": ByteLevel's space
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer=trainer)
    return tokenizer


def model_config(arch: str, *, vocab_size: int, layers: int, eos_id: int) -> dict:
    common = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,  # the smallest head size vLLM's CPU attention supports
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "bfloat16",
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if arch == "qwen3":
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **common}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "mlp_bias": False, **common}


def random_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_dim = config["num_attention_heads"] * config["head_dim"]
    kv_dim = config["num_key_value_heads"] * config["head_dim"]

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * config["initializer_range"]).astype(np.float32)

    weights = {
        "model.embed_tokens.weight": normal(config["vocab_size"], hidden),
        "model.norm.weight": np.ones(hidden, np.float32),
        "lm_head.weight": normal(config["vocab_size"], hidden),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": np.ones(hidden, np.float32),
            p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
            p + "self_attn.q_proj.weight": normal(q_dim, hidden),
            p + "self_attn.k_proj.weight": normal(kv_dim, hidden),
            p + "self_attn.v_proj.weight": normal(kv_dim, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, q_dim),
            p + "mlp.gate_proj.weight": normal(inter, hidden),
            p + "mlp.up_proj.weight": normal(inter, hidden),
            p + "mlp.down_proj.weight": normal(hidden, inter),
        }
        if config["model_type"] == "qwen3":  # Qwen3 normalises q and k per head
            weights[p + "self_attn.q_norm.weight"] = np.ones(config["head_dim"], np.float32)
            weights[p + "self_attn.k_norm.weight"] = np.ones(config["head_dim"], np.float32)
    return weights


def write_tiny_model(out_dir: str | Path, *, arch: str = "qwen3", layers: int = 2, seed: int = 0) -> Path:
    """Write the model directory and return its path (created if missing, files overwritten)."""
    if arch not in ("qwen3", "llama"):
        raise ValueError(f"unknown arch {arch!r}: qwen3 or llama")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab_size=512, seed=seed)
    eos_id = tokenizer.token_to_id("<|endoftext|>")
    vocab_size = -(-tokenizer.get_vocab_size() // 64) * 64  # padded like real checkpoints
    config = model_config(arch, vocab_size=vocab_size, layers=layers, eos_id=eos_id)

    tokenizer.save(str(out / "tokenizer.json"))
    special = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": config["max_position_embeddings"],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        **special,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": eos_id, "eos_token_id": eos_id, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    save_file(random_weights(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory to write (created if missing)")
    parser.add_argument("--arch", choices=("qwen3", "llama"), default="qwen3")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.layers < 1:
        parser.error("--layers must be at least 1")
    try:
        out = write_tiny_model(args.out_dir, arch=args.arch, layers=args.layers, seed=args.seed)
    except OSError as exc:
        print(f"make_tiny_hf_model: cannot write {args.out_dir}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
