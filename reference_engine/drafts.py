"""Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of the text's tail.

Shared by the scheduler (host drafter), speculative.py (verify and accept) and the device drafter's kernels,
which must propose exactly these tokens.
"""

from __future__ import annotations

import numpy as np

MAX_NGRAM = 3  # longest tail matched; longer tails are rarer and rarely better guesses
MIN_NGRAM = 1


def propose(tokens: list[int], k: int, *, max_ngram: int = MAX_NGRAM,
            min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching tail (max_ngram down
    to min_ngram tokens) of `tokens`; [] when no tail occurs earlier or k is 0."""
    if k <= 0 or len(tokens) < min_ngram + 1:
        return []
    history = np.asarray(tokens, dtype=np.int64)
    size = len(history)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        tail = history[size - n:]
        # Candidate starts whose first token matches, excluding the tail itself; latest first.
        starts = np.flatnonzero(history[: size - n] == tail[0])
        for start in starts[::-1]:
            if np.array_equal(history[start:start + n], tail):
                follow = history[start + n:start + n + k]
                if len(follow):
                    return follow.tolist()
    return []
