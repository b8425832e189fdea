"""The what-if replay's step recurrence as a max-plus linear system, solved by a parallel prefix scan.

The replay's state after a step is (t, G1, G2): the thread's time and the ends of the latest two GPU works.
Each step maps it through max and + only (whatif.py), so it is a 3x3 matrix A in the max-plus semiring:
x'_r = max_c(A[r][c] + x_c). The states of all steps are the prefix products A_i ⊗ ... ⊗ A_1 applied to
(0, -inf, -inf), which a work-efficient scan computes with numpy: about two matrix products per step, no
Python per step (a million steps in a fraction of a second instead of seconds in a loop). This holds when
each wait awaits one of the latest two GPU works before it, the step's own, or none: async engines await
the previous batch (or, after a wait that did not block, the one before), sync engines their own. Other
patterns use the loop in whatif.py.
"""

from __future__ import annotations

import numpy as np

NEG = -np.inf
SIZE = 3  # t, G1, G2

Matrix = list[list[np.ndarray]]  # m[row][column], one array over the steps each


def compose(a: Matrix, b: Matrix) -> Matrix:
    """a ⊗ b: apply b, then a."""
    out = []
    for r in range(SIZE):
        row = []
        for c in range(SIZE):
            entry = a[r][0] + b[0][c]
            for m in range(1, SIZE):
                np.maximum(entry, a[r][m] + b[m][c], out=entry)
            row.append(entry)
        out.append(row)
    return out


def _take(m: Matrix, index) -> Matrix:
    return [[x[index] for x in row] for row in m]


def prefix_products(m: Matrix) -> Matrix:
    """P_i = A_i ⊗ ... ⊗ A_0 for every i (pairs combined, scanned recursively, the rest filled in)."""
    n = len(m[0][0])
    if n <= 1:
        return [[x.copy() for x in row] for row in m]
    half = n // 2
    paired = prefix_products(compose(_take(m, slice(1, 2 * half, 2)), _take(m, slice(0, 2 * half, 2))))
    out = [[np.empty(n) for _ in range(SIZE)] for _ in range(SIZE)]
    rest = _take(m, slice(2, None, 2))  # A_2, A_4, ...: each after the pair prefix before it
    filled = compose(rest, _take(paired, slice(0, len(rest[0][0])))) if len(rest[0][0]) else None
    for r in range(SIZE):
        for c in range(SIZE):
            out[r][c][1:2 * half:2] = paired[r][c]
            out[r][c][0] = m[r][c][0]
            if filled is not None:
                out[r][c][2::2] = filled[r][c]
    return out


def thread_times(m: Matrix) -> np.ndarray:
    """t after each step, from t = 0 and no earlier GPU work."""
    return prefix_products(m)[0][0]


def final_time(m: Matrix) -> float:
    """t after the last step, from t = 0 and no earlier GPU work: the product of all steps' matrices by
    pairwise reduction (half a scan's work: only the end is wanted)."""
    while len(m[0][0]) > 1:
        n = len(m[0][0])
        pairs = compose(_take(m, slice(1, n - n % 2, 2)), _take(m, slice(0, n - n % 2, 2)))
        if n % 2:
            pairs = [[np.append(pairs[r][c], m[r][c][-1]) for c in range(SIZE)] for r in range(SIZE)]
        m = pairs
    return float(m[0][0][0]) if len(m[0][0]) else 0.0


def segment_products(m: Matrix, segment: np.ndarray) -> Matrix:
    """Per run of equal `segment` values (consecutive steps): the product of its steps' matrices, in order.
    Pairs are combined within runs level by level: about one product per step."""
    seg = np.asarray(segment)
    while True:
        n = len(seg)
        boundary = np.ones(n + 1, bool)  # boundary[i]: a run starts at i (and at n)
        boundary[1:n] = seg[1:] != seg[:-1]
        starts = np.flatnonzero(boundary[:n])
        if len(starts) == n:
            return m
        pos = np.arange(n) - np.repeat(starts, np.diff(np.append(starts, n)))
        left = (pos % 2 == 0) & ~boundary[1:]  # pairs (i, i + 1) inside a run
        keep = np.ones(n, bool)
        keep[1:] = ~left[:-1]  # a pair's right item goes; its left one becomes the pair's product
        li = np.flatnonzero(left)
        pairs = compose(_take(m, li + 1), _take(m, li))
        at = np.flatnonzero(left[keep])  # where the pairs' products sit among the kept items
        m = _take(m, keep)
        for r in range(SIZE):
            for c in range(SIZE):
                m[r][c][at] = pairs[r][c]
        seg = seg[keep]
