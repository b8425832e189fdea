"""Paged KV cache: per layer k and v tensors [num_blocks, block_size, Hkv, D], handed out block by block.

Block 0 is reserved: graph padding rows write their (discarded) k/v there and point their block tables at it,
so a padding row can never touch a live sequence's cache.
"""

from __future__ import annotations

import torch

from reference_engine.config import Config

RESERVED_BLOCK = 0


def allocate_kv_cache(config: Config, *, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k_cache, v_cache) pair per layer, views of a single allocation."""
    shape = (
        config.num_layers,
        2,
        config.total_blocks,
        config.block_size,
        config.num_kv_heads,
        config.head_dim,
    )
    storage = torch.zeros(shape, dtype=dtype, device=config.device)
    return [(storage[i, 0], storage[i, 1]) for i in range(config.num_layers)]


class BlockManager:
    """Free list of KV blocks. Sequences own a list of block ids (their block table)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        # Pop from the end: low block ids are handed out first, which keeps test expectations readable.
        self._free = list(range(num_blocks - 1, RESERVED_BLOCK, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, block_table: list[int], num_tokens: int) -> None:
        """Grow `block_table` in place until it holds `num_tokens` tokens. Raises if blocks run out."""
        need = self.blocks_for(num_tokens) - len(block_table)
        if need > len(self._free):
            raise RuntimeError(f"KV cache out of blocks: need {need}, {len(self._free)} free")
        for _ in range(need):
            block_table.append(self._free.pop())

    def free(self, block_table: list[int]) -> None:
        self._free.extend(reversed(block_table))
        block_table.clear()
