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

Steps 1-2 are the kernel set's `spec_rows` and step 4 its `spec_accept` (kernels/torch_ref.py defines them;
in Triton each is one launch, kernels/spec_ops.py). This module holds the host's side.
"""

from __future__ import annotations


def history_width(max_model_len: int, k: int) -> int:
    """Columns of the history buffer: a step writes its k + 1 sampled tokens from the length on, and the
    length never passes max_model_len."""
    return max_model_len + k + 1


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
