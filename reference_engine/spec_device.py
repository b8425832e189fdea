"""Speculative decoding inside the step (Config.drafter = "device"): drafts, verify rows and acceptance as
fixed-shape tensor ops on device buffers, so the whole speculative step is one CUDA graph (graph "step") and
works with async scheduling.

The host drafter (speculative.py) reads each sequence's text on the engine thread, so its verify step cannot
be built before the previous step's tokens reach the host. Here the device keeps, per sequence slot, the
sequence's tokens (`history`, the prompt and every accepted token; entries past the length are scratch) and
its length (`lengths`). One step over B sequences, k drafts each:

1. drafts: the tokens that followed the latest earlier occurrence of the longest matching tail (3 down to 1
   tokens) of the sequence, as speculative.propose; missing ones are -1, which no sampled token equals;
2. verify rows: each sequence's last token, then its k drafts, at positions length - 1 .. length - 1 + k
   (B * (k + 1) rows, each attending to its own prefix through the sequence's block table);
3. the target forward and the sampler over every row, each row's noise keyed by its own position, so a row
   draws exactly what a plain decode step at that position would: sampled sequences verify drafts too, and
   their tokens equal plain decoding's with the same seed;
4. acceptance: the leading drafts that equal the token sampled one row before, plus the token after them
   (1 .. k + 1 new tokens); they are written into the history and the length advances.

The host gets one row per sequence (`out` [B, k + 3]): the k + 1 sampled tokens, how many of them are new,
how many drafts were proposed. Positions past max_model_len (a sequence the host is about to stop) write
their k/v into the reserved block 0 and are never accepted.
"""

from __future__ import annotations

import torch

from reference_engine.speculative import MAX_NGRAM, MIN_NGRAM


def history_width(max_model_len: int, k: int) -> int:
    """Columns of the history buffer: a step writes its k + 1 sampled tokens from the length on, and the
    length never passes max_model_len."""
    return max_model_len + k + 1


def propose(history: torch.Tensor, lengths: torch.Tensor, k: int, *, max_ngram: int = MAX_NGRAM,
            min_ngram: int = MIN_NGRAM) -> tuple[torch.Tensor, torch.Tensor]:
    """speculative.propose for each row of `history` [B, T] holding `lengths` [B] tokens: (drafts int64
    [B, k], -1 where there is none, and the number proposed [B]). A match of n tokens ending at e
    (history[e - i] == history[length - 1 - i] for i < n) must leave a token after it before the tail:
    e <= length - 2."""
    batch, width = history.shape
    lengths = lengths.long()
    ends = torch.arange(width, device=history.device)[None, :]
    matched = torch.ones(batch, width, dtype=torch.bool, device=history.device)
    best_end = torch.full((batch,), -1, dtype=torch.long, device=history.device)
    for n in range(1, max_ngram + 1):  # n-grams grow by one older token; the longest found wins
        tail = history.gather(1, (lengths - n).clamp_min(0)[:, None])  # the tail's n-th token from the end
        older = torch.nn.functional.pad(history[:, : width - (n - 1)], (n - 1, 0), value=-1)
        matched &= older == tail
        if n < min_ngram:
            continue
        ok = matched & (ends >= n - 1) & (ends <= (lengths - 2)[:, None]) & (lengths > n)[:, None]
        latest = torch.where(ok, ends, -1).amax(dim=1)
        best_end = torch.where(latest >= 0, latest, best_end)
    follow = best_end[:, None] + 1 + torch.arange(k, device=history.device)[None, :]
    valid = (best_end >= 0)[:, None] & (follow < lengths[:, None])
    drafts = torch.where(valid, history.gather(1, follow.clamp(0, width - 1)), -1)
    return drafts, valid.sum(dim=1)


def verify_inputs(tables: torch.Tensor, slots: torch.Tensor, history: torch.Tensor, lengths: torch.Tensor, *,
                  k: int, block_size: int, max_model_len: int) -> dict[str, torch.Tensor]:
    """A speculative step's rows from each sequence's block table [B, W], slot [B] and the device history and
    lengths: ids, positions (int32), slot_mapping (int64), block_tables (a copy per row), seq_lens (int32) of
    the B * (k + 1) rows, plus the drafts [B, k], their count [B] and the lengths [B] read (int64)."""
    rows = history[slots]
    length = lengths[slots].long()
    drafts, proposed = propose(rows, length, k)
    last = rows.gather(1, (length - 1).clamp_min(0)[:, None])
    ids = torch.cat([last, drafts.clamp_min(0)], dim=1).reshape(-1)
    positions = ((length - 1)[:, None] + torch.arange(k + 1, device=slots.device)[None, :]).reshape(-1)
    inside = positions < max_model_len
    within = positions.clamp(max=max_model_len - 1)
    row_tables = tables.repeat_interleave(k + 1, dim=0)
    block = row_tables.gather(1, (within // block_size)[:, None]).squeeze(1).long()
    slot_mapping = torch.where(inside, block, 0) * block_size + positions % block_size
    # Rows past max_model_len run at its last position (the RoPE tables end there); they are never accepted.
    return {"ids": ids, "positions": within.int(), "slot_mapping": slot_mapping,
            "block_tables": row_tables, "seq_lens": (within + 1).int(), "drafts": drafts,
            "proposed": proposed, "lengths": length}


def accept(sampled: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor, *,
           max_model_len: int) -> torch.Tensor:
    """New tokens per sequence [B] (int64) from the sampled tokens [B, k + 1] of its rows: draft i is kept
    while it equals row i's token, and the token after the last kept one comes free; never past
    max_model_len."""
    kept = (drafts == sampled[:, :-1]).long().cumprod(dim=1).sum(dim=1)
    return torch.minimum(kept + 1, (max_model_len - lengths).clamp_min(0))


def record(history: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, sampled: torch.Tensor,
           new: torch.Tensor, start: torch.Tensor) -> None:
    """Write the step's sampled tokens after each sequence's length (only the first `new` count: the rest is
    scratch past the length) and advance the lengths."""
    columns = start[:, None] + torch.arange(sampled.shape[1], device=slots.device)[None, :]
    history[slots[:, None].long(), columns] = sampled
    lengths[slots.long()] = (start + new).to(lengths.dtype)


def read_results(rows: list[list[int]], live: list[bool]) -> tuple[list[list[int]], int, int]:
    """The host side of `out`: (new tokens per sequence, drafts proposed, drafts accepted), the counts over
    the `live` sequences only (async scheduling runs a finished sequence one step more; its row is
    dropped)."""
    per_seq, proposed, accepted = [], 0, 0
    for row, counted in zip(rows, live, strict=True):
        new = row[-2]
        per_seq.append(row[:new])
        if counted:
            proposed += row[-1]
            accepted += max(new - 1, 0)
    return per_seq, proposed, accepted
