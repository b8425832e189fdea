"""One `Config` for the whole engine: model shape (preset or Hugging Face directory) and engine options.

Every field has a plain type and a default, so a CLI can map `--max-num-seqs 4` straight to
`Config(max_num_seqs=4)`. Shape fields left as None are filled from the preset or from `model`'s config.json.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from reference_engine.hf_config import read_hf_config

SHAPE_FIELDS = (
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "tie_embeddings",
    "max_model_len",
)

# Model shapes, one row each in SHAPE_FIELDS order. tiny fits the byte tokenizer (256 bytes + 3 specials) and
# runs on a CPU in milliseconds.
_PRESET_ROWS: dict[str, tuple] = {
    #             hidden layers heads kv_heads head_dim intermediate vocab  tied   max_len
    "tiny":       (128,   2,     4,    2,       32,      256,         512,    False, 256),
    "qwen3-0.6b": (1024,  28,    16,   8,       128,     3072,        151936, True,  4096),
    "qwen3-4b":   (2560,  36,    32,   8,       128,     9728,        151936, True,  4096),
}
PRESETS: dict[str, dict] = {
    name: dict(zip(SHAPE_FIELDS, row, strict=True)) for name, row in _PRESET_ROWS.items()
}

GRAPH_MODES = ("eager", "model", "step")
MAX_SPEC_TOKENS = 32
DRAFTERS = ("host", "device")
KERNEL_CHOICES = ("auto", "torch", "triton")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class Config:
    # --- which model
    preset: str | None = None  # a key of PRESETS; None with model=None means "tiny"
    model: str | None = None  # local Hugging Face directory (config.json + *.safetensors [+ tokenizer.json])
    # --- model shape (None: from preset / config.json)
    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    vocab_size: int | None = None
    tie_embeddings: bool | None = None
    max_model_len: int | None = None
    qk_norm: bool = True  # Qwen3 normalises q and k per head; Llama-style models do not
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    bos_token_id: int | None = None  # None: the tokenizer's
    eos_token_id: int | None = None
    # --- engine
    device: str = "auto"  # auto | cpu | cuda
    graph: str = "eager"  # eager | model | step
    kernels: str = "auto"  # auto (triton on CUDA, torch on CPU) | torch | triton
    async_scheduling: bool = False
    # One sequence's decode step through every layer in one launch (Triton kernels, q/k-norm models;
    # kernels/decode_layers.py). False: a launch per layer, as most engines (an eager step's thread then
    # launches ~190 kernels and is CPU-bound, the case study's regime).
    one_launch_layers: bool = True
    max_num_seqs: int = 8
    block_size: int = 16
    num_blocks: int | None = None  # None: every running sequence can reach max_model_len
    max_num_batched_tokens: int | None = None  # prefill token budget per step; None: max(max_model_len, 2048)
    seed: int = 0
    queue_limit: int | None = None  # for the server: pending requests beyond this are refused
    # Speculative decoding: up to this many prompt-lookup draft tokens per sequence and decode step. 0: off.
    spec_tokens: int = 0
    # Where drafts are proposed and accepted: "host" (speculative.py: on the engine thread, greedy sequences,
    # one eager verify step, sync scheduling) or "device" (spec_device.py: inside the step, every sequence,
    # graph eager or step, sync or async).
    drafter: str = "host"

    def __post_init__(self) -> None:
        if self.preset is not None and self.model is not None:
            raise ValueError("give either preset or model, not both")
        if self.model is not None:
            shape = read_hf_config(self.model)
        else:
            self.preset = self.preset or "tiny"
            if self.preset not in PRESETS:
                raise ValueError(f"unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
            shape = PRESETS[self.preset]
        for key, value in shape.items():
            if getattr(self, key) is None or (
                key in ("qk_norm", "rms_norm_eps", "rope_theta") and self.model
            ):
                setattr(self, key, value)
        self._resolve_device()
        self._validate()

    def _resolve_device(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {self.kernels!r}")
        if self.device == "auto" or self.device == "cuda":
            import torch

            has_cuda = torch.cuda.is_available()
            if self.device == "cuda" and not has_cuda:
                raise ValueError("device 'cuda' asked for but torch sees no CUDA device")
            self.device = "cuda" if has_cuda else "cpu"
        if self.kernels == "auto":
            self.kernels = "triton" if self.device == "cuda" else "torch"
        if self.kernels == "triton" and self.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("kernels 'triton' on the CPU needs TRITON_INTERPRET=1 (Triton's interpreter)")

    def _validate(self) -> None:
        positive = (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_model_len",
            "max_num_seqs",
            "block_size",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.graph not in GRAPH_MODES:
            raise ValueError(f"graph must be one of {', '.join(GRAPH_MODES)}, got {self.graph!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps and rope_theta must be positive")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is reserved), got {self.num_blocks}")
        if self.queue_limit is not None and self.queue_limit <= 0:
            raise ValueError(f"queue_limit must be positive, got {self.queue_limit}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("max_num_batched_tokens must be at least max_model_len (prefill is not chunked)")
        if not isinstance(self.spec_tokens, int) or not 0 <= self.spec_tokens <= MAX_SPEC_TOKENS:
            raise ValueError(f"spec_tokens must be 0..{MAX_SPEC_TOKENS}, got {self.spec_tokens!r}")
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {', '.join(DRAFTERS)}, got {self.drafter!r}")
        if self.spec_tokens and self.drafter == "host" and (self.graph != "eager" or self.async_scheduling):
            raise ValueError("spec_tokens with the host drafter needs graph 'eager' and sync scheduling (its "
                             "drafts are verified in an eager step); drafter 'device' runs inside the step")
        if self.spec_tokens and self.drafter == "device" and self.graph == "model":
            raise ValueError("drafter 'device' runs with graph 'eager' or 'step' (the speculative step is "
                             "one graph, not a forward graph)")
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{name} {value} is outside the vocabulary (size {self.vocab_size})")

    # --- derived sizes
    @property
    def max_blocks_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)

    @property
    def total_blocks(self) -> int:
        """Blocks in the KV cache, including block 0, which is reserved and never handed out."""
        return self.num_blocks or self.max_num_seqs * self.max_blocks_per_seq + 1

    @property
    def batched_token_budget(self) -> int:
        return self.max_num_batched_tokens or max(self.max_model_len, 2048)

    @property
    def qkv_size(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def replace(self, **changes) -> Config:
        """A copy with some options changed (shape fields already resolved stay)."""
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Parameters of the model (the tied LM head counted once)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = (
            h * self.qkv_size
            + self.num_heads * self.head_dim * h
            + (2 * self.head_dim if self.qk_norm else 0)
        )
        layer = attn + 3 * h * i + 2 * h
        return self.num_layers * layer + v * h * (1 if self.tie_embeddings else 2) + h
