"""The what-if replay's step recurrence as a max-plus linear system, solved by a parallel prefix scan.

The replay's state after a step is (t, G1, G2): the thread's time and the ends of the latest two GPU works.
Each step maps it through max and + only (whatif.py), so it is a 3x3 matrix A in the max-plus semiring:
x'_r = max_c(A[r][c] + x_c). The states of all steps are the prefix products A_i ⊗ ... ⊗ A_1 applied to
(0, -inf, -inf), which a work-efficient scan computes with numpy: a pairwise reduction up (about one matrix
product per step, its levels kept) and a matrix-vector product per step on the way down, no Python per step
(a million steps in a fraction of a second instead of seconds in a loop). The levels also give the end of
the timeline, and of any mix of two sets of matrices, without a second pass (mixed_final_time). This holds
when each wait awaits one of the latest two GPU works before it, the step's own, or none: async engines
await the previous batch (or, after a wait that did not block, the one before), sync engines their own.
Other patterns use the loop in whatif.py.
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


def reduction_levels(m: Matrix) -> list[Matrix]:
    """Every level of the pairwise reduction of the steps' matrices: [m, products of pairs (1 ⊗ 0, 3 ⊗ 2,
    ...), products of those, ...] down to one item (an odd last item is carried up as it is). About one
    product per step. The scan (thread_times) and the end of the timeline (final_time, mixed_final_time)
    are all read from these levels, so one pass serves them all."""
    levels = [m]
    while len(m[0][0]) > 1:
        n = len(m[0][0])
        pairs = compose(_take(m, slice(1, n - n % 2, 2)), _take(m, slice(0, n - n % 2, 2)))
        if n % 2:
            pairs = [[np.append(pairs[r][c], m[r][c][-1]) for c in range(SIZE)] for r in range(SIZE)]
        m = pairs
        levels.append(m)
    return levels


def thread_times(m: Matrix, levels: list[Matrix] | None = None) -> np.ndarray:
    """t after each step, from t = 0 and no earlier GPU work (`levels`: reduction_levels(m) when known)."""
    levels = levels or reduction_levels(m)
    return _prefix_states(levels, 0, len(m[0][0]), rows=1)[0]


def _prefix_states(levels: list[Matrix], k: int, length: int, rows: int = SIZE) -> list[np.ndarray]:
    """The state (t, G1, G2) after each of the first `length` items of level k, from (0, -inf, -inf): the
    first column of the prefix products P_i = A_i ⊗ ... ⊗ A_0, which is all that this start reads. Level
    k + 1 holds the products of pairs, whose prefixes give every other item; the items between take one
    more product each (a work-efficient scan: a vector, not a matrix, per item on the way down). `rows`:
    the first so many entries of the state (the caller of the whole scan wants t only)."""
    level = levels[k]
    if length <= 1:
        return [level[r][0][:length].copy() for r in range(rows)]
    half = length // 2
    paired = _prefix_states(levels, k + 1, half)  # after items 1, 3, 5, ...
    rest = _take(level, slice(2, length, 2))  # items 2, 4, ...: each after the pair prefix before it
    n_rest = len(rest[0][0])
    out = []
    for r in range(rows):
        state = np.empty(length)
        state[0] = level[r][0][0]
        state[1 : 2 * half : 2] = paired[r]
        if n_rest:
            entry = rest[r][0] + paired[0][:n_rest]
            for m in range(1, SIZE):
                np.maximum(entry, rest[r][m] + paired[m][:n_rest], out=entry)
            state[2::2] = entry
        out.append(state)
    return out


def final_time(m: Matrix) -> float:
    """t after the last step, from t = 0 and no earlier GPU work: the product of all steps' matrices by
    pairwise reduction (half a scan's work: only the end is wanted)."""
    return final_time_of(reduction_levels(m))


def final_time_of(levels: list[Matrix]) -> float:
    """final_time from the reduction levels."""
    top = levels[-1]
    return float(top[0][0][0]) if len(top[0][0]) else 0.0


class Reduction:
    """The levels of a pairwise reduction (reduction_levels) as mixed_final_time reads them: all of them, or
    (kept_for) only the nodes that given mixes read, the rest freed."""

    def __init__(self, levels: list[Matrix]) -> None:
        self.levels = levels
        self.sizes = [len(level[0][0]) for level in levels]
        self.index: list[np.ndarray] | None = None  # per level, the kept nodes (sorted); None: all

    @property
    def whole(self) -> bool:
        return self.index is None

    def end(self) -> float:
        return final_time_of(self.levels)

    def take(self, k: int, nodes: np.ndarray) -> Matrix:
        """Values of some nodes of level k (kept ones only, when not whole)."""
        at = nodes if self.index is None else np.searchsorted(self.index[k], nodes)
        return _take(self.levels[k], at)

    def kept_for(self, picks: list[np.ndarray], side_a: bool) -> Reduction:
        """This reduction with only the nodes that mixed_final_time reads from it as side a (`side_a`) or b
        for these picks; itself when one of them mixes the plain way (it reads every step)."""
        needed: list[list[np.ndarray]] = [[] for _ in self.sizes]
        for pick in picks:
            pick = np.asarray(pick, bool)
            changes = _changes(pick)
            if _plain_mix(changes, len(self.sizes), len(pick)):
                return self
            for k, (idx, below) in enumerate(_over_both(changes, len(self.sizes)), start=1):
                children = np.concatenate([2 * idx, 2 * idx + 1])
                children = children[children < self.sizes[k - 1]]
                pure = ~_member(children, below)
                on_side = pick[children << (k - 1)] == side_a
                needed[k - 1].append(children[pure & on_side])
        out = Reduction([])
        out.sizes = self.sizes
        out.index = [np.unique(np.concatenate(n)) if n else np.empty(0, "int64") for n in needed[:-1]]
        out.levels = [_take(level, i) for level, i in zip(self.levels, out.index, strict=False)]
        out.index.append(np.zeros(1, "int64") if self.sizes[-1] else np.empty(0, "int64"))
        out.levels.append(self.levels[-1])  # the top: the end of the timeline
        return out


def _changes(pick: np.ndarray) -> np.ndarray:
    """First step of each run of equal picks but the first."""
    return np.flatnonzero(pick[1:] != pick[:-1]) + 1


def _plain_mix(changes: np.ndarray, depth: int, n: int) -> bool:
    """Sides changing every few steps: composing the mixed steps outright is cheaper."""
    return len(changes) * depth > n // 4


def _over_both(changes: np.ndarray, depth: int):
    """Per level k = 1 .. depth - 1: the nodes over both sides (sorted), and those of level k - 1."""
    below = np.empty(0, "int64")  # leaves are of one side each
    for k in range(1, depth):
        width = 1 << k
        idx = np.unique(changes[(changes - 1) // width == changes // width] // width)
        yield idx, below
        below = idx


def _member(nodes: np.ndarray, sorted_nodes: np.ndarray) -> np.ndarray:
    if len(sorted_nodes) == 0:
        return np.zeros(len(nodes), bool)
    pos = np.minimum(np.searchsorted(sorted_nodes, nodes), len(sorted_nodes) - 1)
    return sorted_nodes[pos] == nodes


def mixed_final_time(side_a: Reduction, side_b: Reduction, pick_a: np.ndarray) -> float:
    """final_time of the steps' matrices taken from side a where `pick_a`, else from side b, given both
    sides' reductions. A node of the reduction over steps of one side only is that side's node, so only
    the nodes over both sides (one a level at each change of side) are composed again, with the very
    products final_time would compute: the same result to the bit, for a fraction of the work when the
    sides come in runs (a group's steps, in whatif.py). Sides changing every few steps: the plain way."""
    pick_a = np.asarray(pick_a, bool)
    n = len(pick_a)
    changes = _changes(pick_a)
    depth = len(side_a.sizes)
    if _plain_mix(changes, depth, n):
        mixed = [[np.where(pick_a, a, b) for a, b in zip(ra, rb, strict=True)]
                 for ra, rb in zip(side_a.levels[0], side_b.levels[0], strict=True)]
        return final_time(mixed)
    if len(changes) == 0:
        return (side_a if n and pick_a[0] else side_b).end()
    both: Matrix | None = None  # values of the nodes over both sides at the level below
    for k, (idx, below) in enumerate(_over_both(changes, depth), start=1):
        sides = (side_a, side_b, k - 1, below, both, pick_a)
        paired = 2 * idx + 1 < side_a.sizes[k - 1]  # an odd last node is carried up as it is
        value = compose(_node_values(*sides, 2 * idx[paired] + 1), _node_values(*sides, 2 * idx[paired]))
        if not paired.all():  # the carried node is the last one
            carried = _node_values(*sides, 2 * idx[~paired])
            value = [[np.append(value[r][c], carried[r][c]) for c in range(SIZE)] for r in range(SIZE)]
        both = value
    return final_time_of([both])


def _node_values(side_a: Reduction, side_b: Reduction, k: int, both_idx: np.ndarray, both: Matrix | None,
                 pick_a: np.ndarray, nodes: np.ndarray) -> Matrix:
    """Values of some nodes of reduction level k: side a's or side b's node, or the recomposed value of a
    node over both sides (`both_idx`, sorted, with `both`)."""
    is_both = _member(nodes, both_idx)
    from_a = pick_a[nodes << k] & ~is_both
    from_b = ~pick_a[nodes << k] & ~is_both
    parts = [(from_a, side_a.take(k, nodes[from_a])), (from_b, side_b.take(k, nodes[from_b]))]
    if both is not None and is_both.any():
        parts.append((is_both, _take(both, np.searchsorted(both_idx, nodes[is_both]))))
    out = [[np.empty(len(nodes)) for _ in range(SIZE)] for _ in range(SIZE)]
    for where, values in parts:
        for r in range(SIZE):
            for c in range(SIZE):
                out[r][c][where] = values[r][c]
    return out


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
