"""Speculative decoding on the host: prompt-lookup drafts, the rows of a verify step, greedy acceptance.

Drafts: the tokens that followed the latest earlier occurrence of the text's tail. On output that copies its
context (code edits, quoting, summaries, the loops of a random-weight model) they are often right, and finding
them needs no model. This is the host-side baseline (like vLLM's n-gram proposer): the engine thread pays for
the search, the row building and the acceptance every step, which is the CPU work the case study measures. A
drafter and acceptance inside the one-graph step are the roadmap's next slice (graphs.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from reference_engine.config import Config
    from reference_engine.scheduler import ScheduledBatch


def verify_rows(batch: ScheduledBatch, config: Config) -> dict:
    """Host arrays of a verify step (graphs.VERIFY_ARRAYS, plus "verify": rows per sequence): per sequence its
    last token, then its drafts, at consecutive positions (sync scheduling: the last token is on the host).
    Each row attends to its own prefix through the sequence's block table."""
    block_size, width = config.block_size, config.max_blocks_per_seq
    ids: list[int] = []
    positions, tables, params, rows = [], [], [], []
    for seq in batch.seqs:
        known = seq.known_ids
        chunk = [known[-1], *seq.draft]
        start = len(known) - 1  # the last token's position: its k/v are not cached yet
        ids.extend(chunk)
        positions.append(np.arange(start, start + len(chunk)))
        table = np.zeros(width, dtype=np.int32)
        table[: len(seq.block_table)] = seq.block_table
        tables.append(np.repeat(table[None, :], len(chunk), axis=0))
        p = seq.params
        params.extend([(p.temperature, p.top_p, p.top_k, seq.seed)] * len(chunk))
        rows.append(len(chunk))
    pos = np.concatenate(positions)
    table_rows = np.ascontiguousarray(np.concatenate(tables))  # row-major: kernels step along a row
    blocks = table_rows[np.arange(len(pos)), pos // block_size].astype(np.int64)
    temperature, top_p, top_k, seeds = zip(*params, strict=True)
    return {
        "verify": rows,
        "ids": torch.tensor(ids, dtype=torch.int64),
        "positions": torch.from_numpy(pos.astype(np.int32)),
        "slot_mapping": torch.from_numpy(blocks * block_size + pos % block_size),
        "block_tables": torch.from_numpy(table_rows),
        "seq_lens": torch.from_numpy((pos + 1).astype(np.int32)),
        "temperature": torch.tensor(temperature, dtype=torch.float32),
        "top_p": torch.tensor(top_p, dtype=torch.float32),
        "top_k": torch.tensor(top_k, dtype=torch.int32),
        "seeds": torch.tensor(seeds, dtype=torch.int32),
    }


def accept(batch: ScheduledBatch, rows: list[int], tokens: list[int]) -> tuple[list[list[int]], int, int]:
    """Greedy verification of a verify step's sampled tokens (`rows` per sequence, in batch order): row i of a
    sequence is the target's token after its last token and drafts 0 .. i-1. Drafts are kept while they equal
    the target's tokens, and the target's token after the last kept one comes free, so each sequence gains
    1 .. len(draft) + 1 tokens. Returns (new tokens per sequence, drafts checked, drafts accepted)."""
    out, start, drafted, accepted_total = [], 0, 0, 0
    for seq, count in zip(batch.seqs, rows, strict=True):
        target = tokens[start:start + count]
        start += count
        accepted = 0
        while accepted < len(seq.draft) and seq.draft[accepted] == target[accepted]:
            accepted += 1
        out.append(target[: accepted + 1])
        drafted += len(seq.draft)
        accepted_total += accepted
    return out, drafted, accepted_total
