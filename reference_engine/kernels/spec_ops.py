"""A speculative step's small ops (reference_engine/spec_device.py), one launch each: torch needs ~70 tiny
kernels for the drafts, the verify rows and the acceptance, each a few microseconds inside the step graph.

- `spec_rows(meta, history, lengths, ...)`: per sequence (one program), the prompt-lookup drafts from its
  device history (the ends of the 1..max_ngram-token matches of its tail, scanned in BLOCK_T-token tiles),
  then its k + 1 verify rows: ids, positions, slot mapping, a copy of its block table a row, seq lens and its
  sampling params a row.
- `spec_accept(sampled, rows, slots, history, lengths, out, ...)`: per sequence, the leading drafts equal to
  the sampled tokens, the history write, the length update and the host's row of results.

Same contracts and results as torch_ref.spec_rows / spec_accept (integer work only: bit-identical).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from reference_engine.kernels.torch_ref import SpecRows

_BLOCK_T = 256  # history tokens a loop trip
_BLOCK_W = 64  # block-table entries a loop trip


@triton.jit
def _spec_rows_kernel(
    meta_ptr, history_ptr, lengths_ptr, ids_ptr, pos_ptr, slots_ptr, tables_ptr, lens_ptr, params_ptr,
    drafts_ptr, proposed_ptr, read_ptr, stride_m, stride_h, width, k, max_model_len,
    SLOT_COL: tl.constexpr, BLOCKS_COL: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
    P3: tl.constexpr, BLOCK_SIZE: tl.constexpr, MAX_NGRAM: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    b = tl.program_id(0)
    row = meta_ptr + b * stride_m
    slot = tl.load(row + SLOT_COL)
    length = tl.load(lengths_ptr + slot)
    text = history_ptr + slot.to(tl.int64) * stride_h
    # The latest end of a match, longest first: a match of n ends at n - 1 <= e <= length - 2 (so length > n).
    # (Conditions are vector compares: the interpreter cannot AND a vector mask with a scalar one.)
    best = length * 0 - 1
    for n in tl.static_range(1, MAX_NGRAM + 1):
        latest = length * 0 - 1
        for start in range(0, length - 1, BLOCK_T):
            e = start + tl.arange(0, BLOCK_T)
            matched = (e <= length - 2) & (e >= n - 1)
            for i in tl.static_range(n):
                tail = tl.load(text + tl.maximum(length - 1 - i, 0))
                older = tl.load(text + e - i, mask=matched, other=-1)
                matched = matched & (older == tail)
            latest = tl.maximum(latest, tl.max(tl.where(matched, e, -1), axis=0))
        best = tl.where(latest >= 0, latest, best)
    r = tl.arange(0, BLOCK_R)  # row r: the last token (r = 0) or draft r - 1
    follow = best + r
    has_draft = (r >= 1) & (r <= k) & (follow >= r) & (follow < length)  # follow >= r: a match was found
    draft = tl.load(text + follow, mask=has_draft, other=-1)
    tl.store(drafts_ptr + b * k + r - 1, draft, mask=(r >= 1) & (r <= k))
    tl.store(proposed_ptr + b, tl.sum(has_draft.to(tl.int64), axis=0))
    tl.store(read_ptr + b, length)
    last = tl.load(text + tl.maximum(length - 1, 0))
    in_rows = r <= k
    out = b * (k + 1) + r
    position = length - 1 + r
    within = tl.minimum(position, max_model_len - 1)
    block = tl.load(row + BLOCKS_COL + within // BLOCK_SIZE, mask=in_rows, other=0).to(tl.int64)
    block = tl.where(position < max_model_len, block, 0)
    tl.store(ids_ptr + out, tl.where(r == 0, last, tl.maximum(draft, 0)), mask=in_rows)
    tl.store(pos_ptr + out, within.to(tl.int32), mask=in_rows)
    tl.store(slots_ptr + out, block * BLOCK_SIZE + position % BLOCK_SIZE, mask=in_rows)
    tl.store(lens_ptr + out, (within + 1).to(tl.int32), mask=in_rows)
    tl.store(params_ptr + out * 4, tl.load(row + P0) + r * 0, mask=in_rows)
    tl.store(params_ptr + out * 4 + 1, tl.load(row + P1) + r * 0, mask=in_rows)
    tl.store(params_ptr + out * 4 + 2, tl.load(row + P2) + r * 0, mask=in_rows)
    tl.store(params_ptr + out * 4 + 3, tl.load(row + P3) + r * 0, mask=in_rows)
    for w0 in range(0, width, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        entries = tl.load(row + BLOCKS_COL + w, mask=w < width, other=0)
        tl.store(tables_ptr + out[:, None] * width + w[None, :], entries[None, :] + 0 * r[:, None],
                 mask=in_rows[:, None] & (w < width)[None, :])


def spec_rows(meta: torch.Tensor, history: torch.Tensor, lengths: torch.Tensor, *, k: int, block_size: int,
              max_model_len: int, max_ngram: int, slot_col: int, blocks_col: int,
              param_cols: tuple[int, int, int, int]) -> SpecRows:
    """Same contract as torch_ref.spec_rows, one launch."""
    batch, device = meta.shape[0], meta.device
    width = meta.shape[1] - blocks_col
    rows = batch * (k + 1)
    assert meta.stride(1) == 1 and history.stride(1) == 1
    out = SpecRows(
        ids=torch.empty(rows, dtype=torch.int64, device=device),
        positions=torch.empty(rows, dtype=torch.int32, device=device),
        slot_mapping=torch.empty(rows, dtype=torch.int64, device=device),
        block_tables=torch.empty(rows, width, dtype=torch.int32, device=device),
        seq_lens=torch.empty(rows, dtype=torch.int32, device=device),
        params=torch.empty(rows, 4, dtype=torch.int32, device=device),
        drafts=torch.empty(batch, k, dtype=torch.int64, device=device),
        proposed=torch.empty(batch, dtype=torch.int64, device=device),
        lengths=torch.empty(batch, dtype=torch.int64, device=device),
    )
    _spec_rows_kernel[(batch,)](
        meta, history, lengths, out.ids, out.positions, out.slot_mapping, out.block_tables, out.seq_lens,
        out.params, out.drafts, out.proposed, out.lengths, meta.stride(0), history.stride(0), width, k,
        max_model_len, SLOT_COL=slot_col, BLOCKS_COL=blocks_col, P0=param_cols[0], P1=param_cols[1],
        P2=param_cols[2], P3=param_cols[3], BLOCK_SIZE=block_size, MAX_NGRAM=max_ngram, BLOCK_T=_BLOCK_T,
        BLOCK_R=triton.next_power_of_2(k + 1), BLOCK_W=_BLOCK_W,
    )
    return out


@triton.jit
def _spec_accept_kernel(
    sampled_ptr, drafts_ptr, read_ptr, proposed_ptr, slots_ptr, history_ptr, lengths_ptr, out_ptr, k,
    stride_s, stride_h, stride_o, max_model_len, BLOCK_R: tl.constexpr,
):
    b = tl.program_id(0)
    r = tl.arange(0, BLOCK_R)
    in_rows = r <= k
    sampled = tl.load(sampled_ptr + b * (k + 1) + r, mask=in_rows, other=0)
    draft = tl.load(drafts_ptr + b * k + r, mask=r < k, other=-1)
    # Kept drafts: those before the first row whose token differs from the draft after it.
    kept = tl.min(tl.where((r < k) & (draft != sampled), r, k), axis=0)
    start = tl.load(read_ptr + b)
    new = tl.minimum(kept + 1, tl.maximum(max_model_len - start, 0))
    slot = tl.load(slots_ptr + b * stride_s).to(tl.int64)
    tl.store(history_ptr + slot * stride_h + start + r, sampled, mask=in_rows)
    tl.store(lengths_ptr + slot, start + new)
    out = out_ptr + b * stride_o
    tl.store(out + r, sampled, mask=in_rows)
    tl.store(out + k + 1, new)
    tl.store(out + k + 2, tl.load(proposed_ptr + b))


def spec_accept(sampled: torch.Tensor, rows: SpecRows, slots: torch.Tensor, history: torch.Tensor,
                lengths: torch.Tensor, out: torch.Tensor, *, max_model_len: int) -> None:
    """Same contract as torch_ref.spec_accept, one launch."""
    batch, width = sampled.shape
    assert sampled.is_contiguous() and out.stride(1) == 1 and history.stride(1) == 1
    _spec_accept_kernel[(batch,)](
        sampled, rows.drafts, rows.lengths, rows.proposed, slots, history, lengths, out, width - 1,
        slots.stride(0), history.stride(0), out.stride(0), max_model_len,
        BLOCK_R=triton.next_power_of_2(width),
    )
