"""Sampling on the device, with no host syncs and no generator state (so it can sit inside a CUDA graph).

Per-request parameters arrive as device tensors. Randomness is a counter-based hash of (request seed,
position, token id): a request's samples do not depend on which other requests share its batch, replay
identically, and need no RNG state to register with a graph. Sampling uses the exponential race:
argmax(p / E) with E ~ Exp(1) picks token i with probability p_i.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


# splitmix64 constants as signed int64 (torch has no uint64 arithmetic); products wrap modulo 2^64.
_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)
_POSITION_STRIDE = _signed(0x632BE59BD9B4E019)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    ignore_eos: bool = False
    seed: int | None = None  # None: derived from the engine seed and the request number

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic on signed ints)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform floats in (0, 1), [B, V], a pure function of (seed, position, token id)."""
    token_ids = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    z = seeds.long()[:, None] * _GOLDEN + positions.long()[:, None] * _POSITION_STRIDE + token_ids[None, :]
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    z = z ^ _shift_right(z, 31)
    return (_shift_right(z, 40).float() + 0.5) * (1.0 / (1 << 24))


def sample(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor | None,
    greedy_only: bool,
    argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Next token ids int64 [B] from fp32 logits [B, V].

    temperature, top_p float32 [B]; top_k int [B] (0 = off); seeds, positions int [B]. Rows with temperature 0
    are greedy. `greedy_only` (host-known from the batch) skips the sampling ops entirely. `argmax` is the
    kernel set's (first index of the maximum, as torch's).
    """
    greedy = argmax(logits) if argmax is not None else logits.argmax(dim=-1)
    if greedy_only:
        return greedy
    assert positions is not None, "sampling needs the noise positions"
    batch, vocab = logits.shape
    probs = torch.softmax(logits / temperature.clamp_min(1e-5)[:, None], dim=-1)
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab).long()[:, None]
    # Keep a token while the mass before it is below top_p: the top token is always kept.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = (rank < k) & (mass_before < top_p[:, None])
    noise = uniform_noise(seeds, positions, vocab).gather(1, sorted_ids)
    race = torch.where(keep, sorted_probs / -torch.log(noise), -1.0)
    sampled = sorted_ids.gather(1, race.argmax(dim=-1, keepdim=True)).squeeze(1)
    return torch.where(temperature > 0, sampled, greedy)
