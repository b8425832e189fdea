"""The small ops around a decode step's forward: its inputs, the embedding gather, the greedy argmax.

Each is one Triton launch where torch needs several: a step graph used to spend ~45 us of an H200's
2.75 ms step in 16 tiny torch kernels (index, gather, arithmetic, a memset and a single-block argmax
over 152k logits) outside the 36 layers.

- `decode_inputs(meta, tokens, ...)`: from each row's metadata (slot, position, block table) the input
  ids (the slot's latest sampled token, still on the device), positions, cache slot mapping and seq lens;
  with `embed=` also the ids' embedding rows, in the same launch.
- `embedding(weight, ids)`: weight[ids].
- `argmax(logits)`: the first index of each row's maximum, split over SPLITS programs per row whose
  partials the last of them merges (a ticket per row, reset after), in split order: torch.argmax's answer.
- `greedy_store(logits, slots, tokens, sampled)`: the same argmax, its merging program also storing the
  step's bookkeeping (three fewer launches after a greedy step's LM head).
- `launch_copy(dst, src, n)`: dst[:n] = src[:n], either side pinned host memory (host_copy.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from reference_engine.kernels.split_merge import counters_for, last_to_arrive

_ARGMAX_BLOCK = 2048  # logits per load
_ARGMAX_PROGRAMS = 128  # programs over the whole batch (an H200 has 132 SMs)
_COPY_BLOCK = 1024


@triton.jit
def _decode_inputs_kernel(
    meta_ptr, tokens_ptr, ids_ptr, pos_ptr, slots_ptr, lens_ptr, rows, stride_m, embed_ptr, x_ptr, hidden,
    stride_e, SLOT_COL: tl.constexpr, POS_COL: tl.constexpr, BLOCKS_COL: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr,
):
    b = tl.arange(0, BLOCK_B)
    mask = b < rows
    row = meta_ptr + b * stride_m
    slot = tl.load(row + SLOT_COL, mask=mask, other=0)
    ids = tl.load(tokens_ptr + slot, mask=mask, other=0)
    if tl.program_id(0) > 0:  # a slice of the ids' embedding rows (the step's first layer input)
        h = (tl.program_id(0) - 1) * BLOCK_H + tl.arange(0, BLOCK_H)
        m2 = mask[:, None] & (h < hidden)[None, :]
        values = tl.load(embed_ptr + ids.to(tl.int64)[:, None] * stride_e + h[None, :], mask=m2)
        tl.store(x_ptr + b.to(tl.int64)[:, None] * hidden + h[None, :], values, mask=m2)
        return
    pos = tl.load(row + POS_COL, mask=mask, other=0)
    block = tl.load(row + BLOCKS_COL + pos // BLOCK_SIZE, mask=mask, other=0)
    tl.store(ids_ptr + b, ids, mask=mask)
    tl.store(pos_ptr + b, pos, mask=mask)
    tl.store(slots_ptr + b, block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE, mask=mask)
    tl.store(lens_ptr + b, pos + 1, mask=mask)


def decode_inputs(
    meta: torch.Tensor, tokens: torch.Tensor, *, block_size: int, slot_col: int, position_col: int,
    blocks_col: int, embed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Same contract as torch_ref.decode_inputs. Launched without PDL, and it never lets its dependents start
    early: everything it writes is complete before any later kernel of the step begins, which is what lets
    attention read seq_lens, slot_mapping and the block table before its own PDL wait (attention.py). With
    `embed`, programs beside the metadata's gather the embedding rows: no embedding launch before the
    layers (H200: the step's layers start ~2 us sooner)."""
    rows = meta.shape[0]
    assert meta.stride(1) == 1 and tokens.is_contiguous()
    device = meta.device
    ids = torch.empty(rows, dtype=tokens.dtype, device=device)
    positions = torch.empty(rows, dtype=meta.dtype, device=device)
    slot_mapping = torch.empty(rows, dtype=torch.int64, device=device)
    seq_lens = torch.empty(rows, dtype=meta.dtype, device=device)
    hidden, block_h, x = 0, 16, ids
    if embed is not None:
        assert embed.stride(1) == 1
        hidden = embed.shape[1]
        block_h = min(1024, triton.next_power_of_2(hidden))
        x = torch.empty(rows, hidden, dtype=embed.dtype, device=device)
    _decode_inputs_kernel[(1 + triton.cdiv(hidden, block_h),)](
        meta, tokens, ids, positions, slot_mapping, seq_lens, rows, meta.stride(0),
        embed if embed is not None else ids, x, hidden, embed.stride(0) if embed is not None else 0,
        SLOT_COL=slot_col, POS_COL=position_col, BLOCKS_COL=blocks_col, BLOCK_SIZE=block_size,
        BLOCK_B=max(16, triton.next_power_of_2(rows)), BLOCK_H=block_h, num_warps=1 if embed is None else 4,
    )
    if embed is not None:
        return ids, positions, slot_mapping, seq_lens, x
    return ids, positions, slot_mapping, seq_lens


@triton.jit
def _embedding_kernel(weight_ptr, ids_ptr, out_ptr, hidden, stride_w, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    row = tl.load(ids_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    for h in range(0, hidden, BLOCK_H):
        mask = h + offs < hidden
        values = tl.load(weight_ptr + row * stride_w + h + offs, mask=mask)
        tl.store(out_ptr + t.to(tl.int64) * hidden + h + offs, values, mask=mask)


def embedding(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """weight[ids] for 1-D ids."""
    assert ids.dim() == 1 and weight.stride(1) == 1
    hidden = weight.shape[1]
    out = torch.empty(ids.shape[0], hidden, dtype=weight.dtype, device=weight.device)
    if ids.shape[0]:
        block_h = min(4096, triton.next_power_of_2(hidden))
        _embedding_kernel[(ids.shape[0],)](weight, ids.contiguous(), out, hidden, weight.stride(0),
                                           BLOCK_H=block_h, num_warps=4)
    return out


@triton.jit
def _argmax_kernel(logits_ptr, out_ptr, part_val_ptr, part_idx_ptr, tickets_ptr, vocab, stride_l, chunk,
                   slots_ptr, tokens_ptr, stride_slot, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                   STORE: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    start = split * chunk
    for base in range(start, tl.minimum(start + chunk, vocab), BLOCK):
        idx = base + offs
        x = tl.load(logits_ptr + row * stride_l + idx, mask=(idx < vocab) & (idx < start + chunk),
                    other=float("-inf"))
        block_best = tl.max(x, axis=0)
        block_idx = tl.min(tl.where(x == block_best, idx, vocab), axis=0)  # first index of the maximum
        better = block_best > best  # strict: an equal maximum later in the row does not replace it
        best_idx = tl.where(better, block_idx, best_idx)
        best = tl.where(better, block_best, best)
    tl.store(part_val_ptr + row * SPLITS + split, best)
    tl.store(part_idx_ptr + row * SPLITS + split, best_idx)
    if last_to_arrive(tickets_ptr + row, SPLITS):
        s = tl.arange(0, SPLITS)
        vals = tl.load(part_val_ptr + row * SPLITS + s, cache_modifier=".cg")
        idxs = tl.load(part_idx_ptr + row * SPLITS + s, cache_modifier=".cg")
        top = tl.max(vals, axis=0)
        # Splits cover increasing index ranges, so the smallest index among equal maxima is the first.
        token = tl.min(tl.where(vals == top, idxs, vocab), axis=0).to(tl.int64)
        tl.store(out_ptr + row, token)
        if STORE:  # the step's bookkeeping: the row's sequence slot gets its next input token
            tl.store(tokens_ptr + tl.load(slots_ptr + row * stride_slot), token)
        tl.atomic_xchg(tickets_ptr + row, 0)  # ready for the next launch (graph replays reuse it)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Same contract as torch_ref.argmax: int64 [B], the first index of each row's maximum (fp32 logits
    [B, V]; NaN-free, as the LM head gives them)."""
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    _launch_argmax(logits, out, None, None)
    return out


def greedy_store(
    logits: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor, sampled: torch.Tensor
) -> None:
    """Same contract as torch_ref.greedy_store, in the argmax's one launch (its merging program stores)."""
    assert sampled.is_contiguous() and tokens.is_contiguous()
    _launch_argmax(logits, sampled, slots, tokens)


def _launch_argmax(logits, out, slots, tokens) -> None:
    rows, vocab = logits.shape
    assert logits.stride(1) == 1
    # A power of two (the merge loads all partials as one tile), ~_ARGMAX_PROGRAMS programs in all.
    splits = min(64, triton.next_power_of_2(max(1, _ARGMAX_PROGRAMS // max(rows, 1))),
                 triton.next_power_of_2(triton.cdiv(vocab, _ARGMAX_BLOCK)))
    chunk = triton.cdiv(triton.cdiv(vocab, splits), _ARGMAX_BLOCK) * _ARGMAX_BLOCK
    part_val = torch.empty(rows, splits, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(rows, splits, dtype=torch.int32, device=logits.device)
    tickets = counters_for(logits.device, "argmax tickets", rows)
    store = slots is not None
    _argmax_kernel[(rows, splits)](
        logits, out, part_val, part_idx, tickets, vocab, logits.stride(0), chunk,
        slots if store else tickets, tokens if store else out, slots.stride(0) if store else 0,
        SPLITS=splits, BLOCK=_ARGMAX_BLOCK, STORE=store, num_warps=8,
    )


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def launch_copy(dst, src, n: int) -> None:
    """dst[:n] = src[:n] in one launch: tensors, or pinned host tensors wrapped as host_copy._Mapped."""
    _copy_kernel[(triton.cdiv(n, _COPY_BLOCK),)](src, dst, n, BLOCK=_COPY_BLOCK, num_warps=4)
