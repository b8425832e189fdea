"""Triton kernels against the torch reference, on fresh random inputs with awkward sizes.

Without a GPU the Triton kernels run under TRITON_INTERPRET=1 (set by conftest.py). Tolerances:
- fp32: rtol 1e-5, atol 1e-5 (only summation order differs).
- bf16: rtol 2e-2, atol 2e-2 on values of order 1 (= a few bf16 ulps). The interpreter also rounds
  fp32 -> bf16 toward zero where the GPU rounds to nearest, so each rounding may differ by one ulp.
Keep sizes small: each interpreted launch costs ~0.1-0.5 s on a CPU.
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from reference_engine.kernels import get_kernels, rope_cos_sin

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REF = get_kernels("torch")
TRITON = get_kernels("triton")
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, *,
                 atol: float | None = None) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    tol = dict(TOLERANCE[dtype])
    if atol is not None:
        tol["atol"] = atol
    torch.testing.assert_close(actual.float(), expected.float(), **tol)


def randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=DEVICE, dtype=dtype)


@pytest.fixture
def gen(request) -> torch.Generator:
    # Fresh inputs per test, but reproducible when a failure needs a rerun.
    return torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_and_fused_add(dtype, gen):
    x = randn(2, 3, 100, dtype=dtype, gen=gen)  # 3-D input, hidden not a power of two
    residual = randn(2, 3, 100, dtype=dtype, gen=gen)
    weight = randn(100, dtype=dtype, gen=gen)
    assert_close(TRITON.rmsnorm(x, weight, 1e-6), REF.rmsnorm(x, weight, 1e-6), dtype)

    normed, new_residual = TRITON.fused_add_rmsnorm(x, residual, weight, 1e-6)
    ref_normed, ref_residual = REF.fused_add_rmsnorm(x, residual, weight, 1e-6)
    assert_close(new_residual, ref_residual, dtype)
    assert_close(normed, ref_normed, dtype)
    # Inputs are left alone (the op is out of place).
    assert not torch.equal(new_residual, residual)


def test_rmsnorm_strided_rows(gen):
    base = randn(5, 160, dtype=torch.float32, gen=gen)
    x = base[:, :80]  # rows with stride 160
    weight = randn(80, dtype=torch.float32, gen=gen)
    assert_close(TRITON.rmsnorm(x, weight, 1e-5), REF.rmsnorm(x, weight, 1e-5), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype, gen):
    gate_up = randn(2, 3, 2 * 1100, dtype=dtype, gen=gen)  # 1100 columns: two column tiles, the last partial
    out = TRITON.silu_and_mul(gate_up)
    assert out.shape == (2, 3, 1100)
    assert_close(out, REF.silu_and_mul(gate_up), dtype)


def make_paged_kv(*, batch, num_q_heads, num_kv_heads, head_dim, block_size, seq_lens, dtype, gen):
    """Random q and a paged cache whose block tables are a shuffled, non-contiguous pick of blocks."""
    max_blocks = max(-(-n // block_size) for n in seq_lens) + 1  # one spare column, left unused (-1)
    num_blocks = batch * max_blocks + 3
    k_cache = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    v_cache = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    order = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((batch, max_blocks), -1, dtype=torch.int32)
    used = 0
    for row, n in enumerate(seq_lens):
        needed = -(-n // block_size)
        block_tables[row, :needed] = order[used:used + needed].to(torch.int32)
        used += needed
    q = randn(batch, num_q_heads, head_dim, dtype=dtype, gen=gen)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, block_tables.to(DEVICE), seq_lens_t


@pytest.mark.parametrize(
    "dtype,num_q_heads,num_kv_heads,block_size,seq_lens,num_splits,tiles",
    [
        (torch.float32, 8, 2, 16, [1, 37, 130], 1, None),  # GQA group 4, one split (direct write)
        (torch.float32, 8, 2, 16, [1, 37, 130], 3, (16, 2)),  # split-K, some splits empty for the short rows
        (torch.bfloat16, 4, 4, 8, [70, 9], None, None),  # MHA, small blocks, automatic split count
        (torch.bfloat16, 6, 2, 5, [23, 64], 4, (16, 3)),  # group 3 (padded), block size not a power of two
        # 16-token tiles: 10 of 12 splits hold 4 tiles of the long row each (two merge levels: a run of 8
        # and a run of 2); 3 hold the short row's 3 tiles (its 9 empty splits exit without a ticket)
        (torch.float32, 4, 2, 4, [600, 45], 12, (16, 2)),
        # 19 of 32 splits active for the long row: a two-level merge (runs of 8, 8 and 3, then the runs)
        (torch.bfloat16, 4, 2, 4, [600, 45], 32, (16, 2)),
    ],
)
def test_paged_decode_attention(dtype, num_q_heads, num_kv_heads, block_size, seq_lens, num_splits, tiles,
                                gen):
    q, k_cache, v_cache, block_tables, seq_lens_t = make_paged_kv(
        batch=len(seq_lens), num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=32,
        block_size=block_size, seq_lens=seq_lens, dtype=dtype, gen=gen)
    scale = 32**-0.5
    expected = REF.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens_t, scale)
    kwargs = {} if num_splits is None else {"num_splits": num_splits}
    if tiles:  # tokens per tile, stages: small tiles put several tiles in a split and many splits in a row
        kwargs["tiles"] = tiles
    out = TRITON.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens_t, scale, **kwargs)
    assert_close(out, expected, dtype)
    # The last split of each (sequence, KV head) merged and reset its ticket: a second call (a graph
    # replay reuses the counters) gives the same bits.
    from reference_engine.kernels import split_merge

    assert not split_merge.tickets_for(q.device, 1).any()
    assert not split_merge.counters_for(q.device, "attention run tickets", 1).any()
    again = TRITON.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens_t, scale, **kwargs)
    assert torch.equal(again, out)


def test_paged_decode_attention_matches_dense_and_ignores_padding(gen):
    """Against plain dense softmax attention (not the paged reference), plus a seq_len-0 padding row."""
    q, k_cache, v_cache, block_tables, seq_lens = make_paged_kv(
        batch=2, num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=16, seq_lens=[21, 1],
        dtype=torch.float32, gen=gen)
    seq_lens[1] = 0  # a graph-padding row: no history at all
    out = TRITON.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.25, num_splits=2)
    keys = k_cache[block_tables[0, :2].long()].reshape(32, 2, 16)[:21]  # [21, Hkv, D]
    values = v_cache[block_tables[0, :2].long()].reshape(32, 2, 16)[:21]
    for head in range(4):
        kv_head = head // 2
        probs = torch.softmax(keys[:, kv_head] @ q[0, head] * 0.25, dim=0)
        torch.testing.assert_close(out[0, head], probs @ values[:, kv_head], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_cache(dtype, gen):
    num_q_heads, num_kv_heads, head_dim, block_size = 4, 2, 32, 8
    tokens = 5
    qkv = randn(tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, gen=gen)
    q_weight, k_weight = randn(head_dim, dtype=dtype, gen=gen), randn(head_dim, dtype=dtype, gen=gen)
    cos, sin = rope_cos_sin(64, head_dim, 1e6, device=DEVICE)
    positions = torch.tensor([0, 7, 63, 12, 3], device=DEVICE)
    slots = torch.tensor([3, -1, 17, 40, 8], device=DEVICE)  # -1: padding, must not be written
    k_cache = randn(6, block_size, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    v_cache = randn(6, block_size, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    outs = [
        ops.qk_norm_rope_cache(qkv, q_weight, k_weight, cos, sin, positions, kc, vc, slots,
                               num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, eps=1e-6)
        for ops, (kc, vc) in zip((TRITON, REF), caches, strict=True)
    ]
    # Rotated outputs chain three roundings in bf16: allow a little more absolute slack there.
    atol = 6e-2 if dtype == torch.bfloat16 else None
    for actual, expected in zip(outs[0], outs[1], strict=True):
        assert_close(actual, expected, dtype, atol=atol)
    for actual, expected in zip(caches[0], caches[1], strict=True):
        assert_close(actual, expected, dtype, atol=atol)
    # Exactly the four real slots changed, and they hold the returned k and v.
    flat_k = caches[0][0].view(-1, num_kv_heads, head_dim)
    flat_v = caches[0][1].view(-1, num_kv_heads, head_dim)
    changed = (flat_k != k_cache.view(-1, num_kv_heads, head_dim)).flatten(1).any(1).nonzero().flatten()
    assert changed.tolist() == [3, 8, 17, 40]
    keep = slots >= 0
    assert torch.equal(flat_k[slots[keep]], outs[0][1][keep])
    assert torch.equal(flat_v[slots[keep]], outs[0][2][keep])
    assert torch.equal(outs[0][2], qkv.view(tokens, -1, head_dim)[:, num_q_heads + num_kv_heads:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_from_qkv(dtype, num_splits, gen):
    """The one-launch decode attention (norm + RoPE + cache write inside) against the two reference ops:
    same output, same cache (the current token written at its slot, nothing else touched); rows at seq_len
    1, 37 and 130 put the current token in the first, middle and last split."""
    num_q_heads, num_kv_heads, head_dim, block_size = 8, 2, 32, 16
    seq_lens = [1, 37, 130]
    _, k_cache, v_cache, block_tables, seq_lens_t = make_paged_kv(
        batch=3, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, seq_lens=seq_lens, dtype=dtype, gen=gen)
    qkv = randn(3, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, gen=gen)
    q_weight, k_weight = randn(head_dim, dtype=dtype, gen=gen), randn(head_dim, dtype=dtype, gen=gen)
    cos, sin = rope_cos_sin(256, head_dim, 1e6, device=DEVICE)
    tables = block_tables.long().cpu()
    slots = torch.tensor([int(tables[r, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                          for r, n in enumerate(seq_lens)], device=DEVICE)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    kwargs = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, eps=1e-6)
    from reference_engine.kernels import attention

    args = (qkv, q_weight, k_weight, cos, sin)
    got = attention.decode_attention_from_qkv(*args, *caches[0], slots, block_tables, seq_lens_t, 0.2,
                                              num_splits=num_splits, **kwargs)
    want = REF.decode_attention_from_qkv(*args, *caches[1], slots, block_tables, seq_lens_t, 0.2, **kwargs)
    atol = 6e-2 if dtype == torch.bfloat16 else None
    assert_close(got, want, dtype, atol=atol)
    for actual, expected, before in zip(caches[0], caches[1], (k_cache, v_cache), strict=True):
        assert_close(actual, expected, dtype, atol=atol)
        changed = (actual != before).flatten(2).any(2).any(1).nonzero().flatten()
        assert sorted(changed.tolist()) == sorted({int(s) // block_size for s in slots.tolist()})


def test_torch_reference_rope_is_a_rotation(gen):
    """The reference itself: RoPE at position 0 is the identity and keeps norms at every position."""
    head_dim = 16
    cos, sin = rope_cos_sin(32, head_dim, 10_000.0)
    qkv = randn(2, 3 * head_dim, dtype=torch.float32, gen=gen).cpu()
    ones = torch.ones(head_dim)
    k_cache = torch.zeros(2, 4, 1, head_dim)
    v_cache = torch.zeros(2, 4, 1, head_dim)
    q, k, _ = REF.qk_norm_rope_cache(qkv, ones, ones, cos, sin, torch.tensor([0, 9]), k_cache, v_cache,
                                     torch.tensor([0, 5]), num_q_heads=1, num_kv_heads=1, eps=1e-6)
    normed_q = REF.rmsnorm(qkv[:, :head_dim], ones, 1e-6)
    torch.testing.assert_close(q[0, 0], normed_q[0])
    torch.testing.assert_close(q[1, 0].norm(), normed_q[1].norm())
    assert not torch.allclose(q[1, 0], normed_q[1])
    assert torch.equal(k_cache.view(-1, 1, head_dim)[5], k[1])


def test_unknown_kernels_name():
    with pytest.raises(ValueError, match="unknown kernels 'cuda'"):
        get_kernels("cuda")
    assert get_kernels("torch").name == "torch"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 16, 20])  # 20 > MAX_ROWS: the prefill path (cuBLAS + row kernels)
def test_decode_linear_ops_match_torch(dtype, rows, gen):
    """Fused norm/SiLU/residual GEMMs against torch composition; N not a multiple of the tile."""
    k, n = 96, 40
    x = randn(rows, k, dtype=dtype, gen=gen)
    norm_w = randn(k, dtype=dtype, gen=gen)
    w = randn(2 * n, k, dtype=dtype, gen=gen) * k**-0.5
    residual = randn(rows, n, dtype=dtype, gen=gen)
    # bf16: the fused kernel scales by 1/rms after the product instead of rounding the normed input first.
    atol = 6e-2 if dtype == torch.bfloat16 else None
    assert_close(TRITON.norm_linear(x, norm_w, w, 1e-6), REF.norm_linear(x, norm_w, w, 1e-6), dtype,
                 atol=atol)
    logits = TRITON.norm_linear(x, norm_w, w, 1e-6, out_dtype=torch.float32)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, REF.norm_linear(x, norm_w, w, 1e-6, out_dtype=torch.float32),
                               **(dict(rtol=2e-2, atol=6e-2) if dtype == torch.bfloat16 else {}))
    assert_close(TRITON.norm_gate_up_silu(x, norm_w, w, 1e-6), REF.norm_gate_up_silu(x, norm_w, w, 1e-6),
                 dtype, atol=atol)
    got = TRITON.linear_residual(x, w[:n], residual)
    assert_close(got, REF.linear_residual(x, w[:n], residual), dtype)
    assert got.data_ptr() != residual.data_ptr()  # out of place


@pytest.mark.parametrize("dtype", DTYPES)
def test_single_row_fma_path(dtype, gen):
    """The one-row FMA variant (no tl.dot) computes the same three ops."""
    from reference_engine.kernels import skinny_gemm

    k, n = 128, 40
    config = skinny_gemm.GemmConfig(block_n=16, block_k=64, num_warps=4, num_stages=2, fma=True)
    x = randn(1, k, dtype=dtype, gen=gen)
    norm_w = randn(k, dtype=dtype, gen=gen)
    w = randn(2 * n, k, dtype=dtype, gen=gen) * k**-0.5
    residual = randn(1, n, dtype=dtype, gen=gen)
    atol = 6e-2 if dtype == torch.bfloat16 else 1e-4
    assert_close(skinny_gemm.norm_linear(x, norm_w, w, 1e-6, config=config),
                 REF.norm_linear(x, norm_w, w, 1e-6), dtype, atol=atol)
    assert_close(skinny_gemm.norm_gate_up_silu(x, norm_w, w, 1e-6, config=config),
                 REF.norm_gate_up_silu(x, norm_w, w, 1e-6), dtype, atol=atol)
    assert_close(skinny_gemm.linear_residual(x, w[:n], residual, config=config),
                 REF.linear_residual(x, w[:n], residual), dtype, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden, inter", [(128, 256), (64, 96)])  # 96: chunks of 32 intermediates
def test_layer_tail_in_one_launch(dtype, hidden, inter, gen):
    """fused_mlp: o_proj + residual, gate_up + SiLU, down + residual and the next layer's qkv in one launch
    (and the shorter chains) give the separate launches' bits (same sums in the same order), match torch,
    and leave the chunk flags and dispatch counter at zero for the next launch (graph replays reuse them)."""
    from reference_engine.kernels import decode_linear, fused_mlp, skinny_gemm, split_merge

    attn_dim, qkv_dim = 96, 80
    attn = randn(1, attn_dim, dtype=dtype, gen=gen)
    w_o = randn(hidden, attn_dim, dtype=dtype, gen=gen) * attn_dim**-0.5
    x = randn(1, hidden, dtype=dtype, gen=gen)
    norm_w, next_norm = randn(hidden, dtype=dtype, gen=gen), randn(hidden, dtype=dtype, gen=gen)
    w_gate_up = randn(2 * inter, hidden, dtype=dtype, gen=gen) * hidden**-0.5
    w_down = randn(hidden, inter, dtype=dtype, gen=gen) * inter**-0.5
    w_qkv = randn(qkv_dim, hidden, dtype=dtype, gen=gen) * hidden**-0.5
    args = (norm_w, w_gate_up, w_down, 1e-6)
    assert fused_mlp.supports(x, w_gate_up, w_down, w_o, w_qkv)
    h = skinny_gemm.linear_residual(attn, w_o, x)
    act = skinny_gemm.norm_gate_up_silu(h, norm_w, w_gate_up, 1e-6)
    separate = skinny_gemm.linear_residual(act, w_down, h)
    separate_qkv = skinny_gemm.norm_linear(separate, next_norm, w_qkv, 1e-6)
    for _ in range(2):  # the second launch finds the counters the first one reset
        out, qkv = fused_mlp.o_proj_mlp(attn, w_o, x, *args, next_qkv=(next_norm, w_qkv))
        assert torch.equal(out, separate) and torch.equal(qkv, separate_qkv)
        out, qkv = fused_mlp.o_proj_mlp(attn, w_o, x, *args)
        assert torch.equal(out, separate) and qkv is None
        assert torch.equal(fused_mlp.mlp_residual(h, *args), separate)
        assert not split_merge.counters_for(x.device, "layer tail", 0).any()
    tol = 6e-2 if dtype == torch.bfloat16 else 1e-4
    ref_out, ref_qkv = REF.o_proj_mlp(attn, w_o, x, *args, next_qkv=(next_norm, w_qkv))
    assert_close(separate, ref_out, dtype, atol=tol)
    assert_close(separate_qkv, ref_qkv, dtype, atol=2 * tol)
    # More rows than one take the separate launches; the op is the same function either way.
    attn3, x3 = randn(3, attn_dim, dtype=dtype, gen=gen), randn(3, hidden, dtype=dtype, gen=gen)
    assert not fused_mlp.supports(x3, w_gate_up, w_down, w_o)
    got = decode_linear.o_proj_mlp(attn3, w_o, x3, *args, next_qkv=(next_norm, w_qkv))
    want = REF.o_proj_mlp(attn3, w_o, x3, *args, next_qkv=(next_norm, w_qkv))
    assert_close(got[0], want[0], dtype, atol=tol)
    assert_close(got[1], want[1], dtype, atol=2 * tol)


@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k_linear_residual_sums_every_slice(split_k, gen):
    """Split-K partials are all summed (a missing slice would be off by ~1/split of the product)."""
    from reference_engine.kernels import skinny_gemm

    k, n = 192, 24
    x = randn(3, k, dtype=torch.float32, gen=gen)
    w = randn(n, k, dtype=torch.float32, gen=gen)
    residual = randn(3, n, dtype=torch.float32, gen=gen)
    config = skinny_gemm.GemmConfig(block_n=16, block_k=32, num_warps=4, num_stages=2, split_k=split_k)
    got = skinny_gemm.linear_residual(x, w, residual, config=config)
    assert_close(got, REF.linear_residual(x, w, residual), torch.float32, atol=1e-4)
    with pytest.raises(AssertionError, match="not a multiple"):
        skinny_gemm.linear_residual(x[:, :160].contiguous(), w[:, :160].contiguous(), residual, config=config)


@pytest.mark.parametrize("rows", [1, 3])
def test_step_ops_match_torch(rows, gen):
    """decode_inputs, embedding and argmax (ties: the first index, as torch; rows split over several
    programs whose last merges and resets its ticket) against the torch reference."""
    from reference_engine.kernels import split_merge

    block_size, width = 4, 6 + 5
    meta = torch.zeros(rows, width, dtype=torch.int32)
    meta[:, 0] = torch.tensor([2, 0, 5][:rows])  # slot
    meta[:, 1] = torch.tensor([6, 0, 17][:rows])  # position
    meta[:, 6:] = torch.randperm(40, generator=gen)[: rows * 5].view(rows, 5).to(torch.int32)
    meta = meta.to(DEVICE)
    tokens = torch.arange(100, 107, dtype=torch.int64, device=DEVICE)
    cols = dict(block_size=block_size, slot_col=0, position_col=1, blocks_col=6)
    got, want = TRITON.decode_inputs(meta, tokens, **cols), REF.decode_inputs(meta, tokens, **cols)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # With the embedding rows gathered in the same launch (over several programs: hidden past one slice).
    embed = randn(110, 1500, dtype=torch.bfloat16, gen=gen)
    got = TRITON.decode_inputs(meta, tokens, **cols, embed=embed)
    want = REF.decode_inputs(meta, tokens, **cols, embed=embed)
    assert len(got) == 5 and torch.equal(want[4], embed[want[0]])
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    weight = randn(50, 40, dtype=torch.float32, gen=gen)
    ids = torch.tensor([3, 49, 0, 3][: rows + 1], device=DEVICE)
    assert torch.equal(TRITON.embedding(weight, ids), REF.embedding(weight, ids))
    logits = randn(rows, 5000, dtype=torch.float32, gen=gen)
    logits[0, 4321] = logits[0, 77] = 100.0  # a tie across splits: the first index wins
    if rows > 1:
        logits[1, 2048] = logits[1, 2049] = 50.0  # a tie inside one block
    got = TRITON.argmax(logits)
    assert got.dtype == torch.int64 and torch.equal(got, REF.argmax(logits))
    assert got[0] == 77
    assert not split_merge.counters_for(logits.device, "argmax tickets", 1).any()
    # The same argmax storing a greedy step's bookkeeping: tokens[slot] and sampled, slots a strided column.
    slots = meta[:, 0]
    stores = []
    for ops in (TRITON, REF):
        tokens_buf = torch.full((8,), -1, dtype=torch.int64, device=DEVICE)
        sampled = torch.full((4,), -1, dtype=torch.int64, device=DEVICE)
        ops.greedy_store(logits, slots, tokens_buf, sampled)
        stores.append((tokens_buf, sampled))
    (tok, smp), (ref_tok, ref_smp) = stores
    want_ids = REF.argmax(logits)
    assert torch.equal(tok, ref_tok) and torch.equal(smp, ref_smp)
    assert torch.equal(smp[:rows], want_ids) and (smp[rows:] == -1).all()
    assert torch.equal(tok[slots.long()], want_ids) and (tok >= 0).sum() == rows
    assert not split_merge.counters_for(logits.device, "argmax tickets", 1).any()


@pytest.mark.parametrize("n", [5, 1024, 2051])
def test_host_copy(n):
    """The step's metadata / token copy kernel over one or several programs (masked tail), and copy_to: on
    CUDA through pinned host memory in both directions (the kernel where zero-copy works), elsewhere a plain
    copy."""
    from reference_engine.host_copy import copy_to
    from reference_engine.kernels.step_ops import launch_copy

    src = torch.arange(n, dtype=torch.int32, device=DEVICE) * 7 - 3
    dst = torch.full((n + 3,), -1, dtype=torch.int32, device=DEVICE)
    launch_copy(dst, src, n)
    assert torch.equal(dst[:n], src) and (dst[n:] == -1).all()
    pin = DEVICE == "cuda"
    host = (torch.arange(n, dtype=torch.int64) * 11).pin_memory() if pin else torch.arange(n) * 11
    dev = torch.zeros(n, dtype=torch.int64, device=DEVICE)
    back = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
    copy_to(dev, host)
    copy_to(back, dev)
    if pin:
        torch.cuda.synchronize()
    assert torch.equal(back, host) and torch.equal(dev.cpu(), host)


def _decode_setup(context: int, batch: int = 1):
    """The tiny model's weights and a random KV cache, and one decode step's metadata at `context` tokens
    (`batch` sequences over disjoint blocks)."""
    from reference_engine.config import Config
    from reference_engine.kv_cache import allocate_kv_cache
    from reference_engine.model import Qwen3Model

    cfg = Config(preset="tiny", device=DEVICE, kernels="triton", max_model_len=256, seed=3)
    model = Qwen3Model.random(cfg)
    caches = allocate_kv_cache(cfg, dtype=model.dtype)
    for k_cache, v_cache in caches:
        k_cache.normal_()
        v_cache.normal_()
    per_seq = cfg.max_blocks_per_seq
    blocks = torch.arange(batch * per_seq, dtype=torch.int32, device=DEVICE).reshape(batch, per_seq)
    last = context - 1
    slots = blocks[:, last // cfg.block_size].long() * cfg.block_size + last % cfg.block_size
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    x = model.ops.embedding(model.embed, torch.arange(5, 5 + batch, device=DEVICE))
    return model, caches, x, dict(slot_mapping=slots, block_tables=blocks, seq_lens=seq_lens)


@pytest.mark.parametrize("context", [37, 150])  # 150: several attention splits, merged by the last
def test_decode_layers_in_one_launch(context, monkeypatch):
    """decode_layers.py: every layer in one launch gives the per-layer launches' result (the same bits in
    the interpreter with the per-layer attention's tile), writes the same KV-cache slots, matches torch,
    and leaves its counters at zero for the next launch (graph replays reuse them)."""
    from reference_engine.kernels import decode_layers, split_merge
    from reference_engine.kernels.fused_mlp import MlpTiles
    from reference_engine.kernels.layer_stack import LayerStack, run_layers

    model, caches, x, meta = _decode_setup(context)
    cfg = model.config
    stack = LayerStack.of(model.layers, caches)
    args = (x, stack, meta["slot_mapping"], meta["block_tables"], meta["seq_lens"], model.cos, model.sin,
            model.scale)
    heads = dict(num_q_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, eps=cfg.rms_norm_eps)
    assert decode_layers.supports(x, stack, meta["block_tables"], num_q_heads=cfg.num_heads,
                                  num_kv_heads=cfg.num_kv_heads)
    launches, launch = [], decode_layers._launch
    monkeypatch.setattr(decode_layers, "_launch", lambda *a, **k: launches.append(1) or launch(*a, **k))
    per_layer = run_layers(TRITON, *args, **heads)
    per_layer_caches = [(k.clone(), v.clone()) for k, v in caches]
    assert not launches
    ref = REF.decode_layers(*args, **heads)
    # o_proj holding its whole weight tile across attention (the default), or walking its K chunks as
    # attention fills them (the per-layer launches' loop): at one K chunk (this model) the same sums.
    # A split a tile (solo 1), as the per-layer attention splits, gives its bits; up to _SOLO_TILES tiles
    # one split takes the whole context (37 tokens in 32-token tiles, 150 in 64-token tiles): no merge.
    solo = decode_layers._SOLO_TILES
    for tile, whole, solo_tiles in ((64, True, 1), (64, False, 1), (64, True, solo),
                                    (decode_layers._ATTENTION_TILE, True, solo)):
        monkeypatch.setattr(decode_layers, "_ATTENTION_TILE", tile)
        monkeypatch.setitem(decode_layers.OPTIONS, "o_proj_whole", whole)
        monkeypatch.setitem(decode_layers.OPTIONS, "solo_tiles", solo_tiles)
        for k, v in caches:  # the slot this step writes holds a stale value, as it would in a server
            k.view(-1, *k.shape[2:])[meta["slot_mapping"]] = 7.0
            v.view(-1, *v.shape[2:])[meta["slot_mapping"]] = -7.0
        for _ in range(2):  # the second launch finds the counters the first one reset
            one = TRITON.decode_layers(*args, **heads)
            assert not split_merge.counters_for(x.device, "decode layers", 0).any()
            assert not split_merge.tickets_for(x.device, 0).any()  # the merge tickets too
            assert_close(one, ref, model.dtype, atol=1e-4)
            if tile == 64 and solo_tiles == 1 and DEVICE == "cpu":
                assert torch.equal(one, per_layer)
            for (k, v), (k0, v0) in zip(caches, per_layer_caches, strict=True):
                assert_close(k, k0, model.dtype)
                assert_close(v, v0, model.dtype)
    assert len(launches) == 8
    assert_close(per_layer, ref, model.dtype, atol=1e-4)
    # The model stacks each weight kind in one allocation, so the launch computes each layer's offsets; from
    # the offset table it gives the same bits.
    k0, k1 = caches[0][0], caches[1][0]
    assert stack.uniform and stack.kv_layer_stride == (k1.data_ptr() - k0.data_ptr()) // k0.element_size()
    monkeypatch.setitem(decode_layers.OPTIONS, "uniform", False)
    assert torch.equal(TRITON.decode_layers(*args, **heads), one)
    monkeypatch.setitem(decode_layers.OPTIONS, "uniform", True)
    # o_proj programs of two tiles each (the second streamed after attention): the same sums, the same bits.
    monkeypatch.setitem(decode_layers.OPTIONS, "o_proj_whole", True)
    single = TRITON.decode_layers(*args, **heads)
    monkeypatch.setitem(decode_layers.OPTIONS, "o_proj_tiles", 2)
    assert torch.equal(TRITON.decode_layers(*args, **heads), single)
    assert not split_merge.counters_for(x.device, "decode layers", 0).any()
    monkeypatch.setitem(decode_layers.OPTIONS, "o_proj_tiles", 1)
    # o_proj K steps narrower than a KV head group: each group's attention counts on several chunks, and
    # o_proj waits for all of them (whole tile) or walks them.
    for whole in (True, False):
        monkeypatch.setitem(decode_layers.OPTIONS, "o_proj_whole", whole)
        narrow = decode_layers.decode_layers(*args, **heads, tiles=MlpTiles(o_k=32))
        assert_close(narrow, ref, model.dtype, atol=1e-4)
    # The split merge with its full-width load (more splits than half the chunk) and in two levels (runs of
    # two splits; at 150 tokens three splits hold tokens): this model's few splits take neither by default.
    for chunk, group in ((4, 8), (4, 2)):
        monkeypatch.setattr(decode_layers, "_MERGE_CHUNK", chunk)
        monkeypatch.setattr(decode_layers, "_MERGE_GROUP", group)
        merged = decode_layers.decode_layers(*args, **heads)
        assert not split_merge.counters_for(x.device, "attention run tickets", 0).any()
        assert not split_merge.tickets_for(x.device, 0).any()
        assert_close(merged, ref, model.dtype, atol=1e-4)


def test_decode_layers_trace(monkeypatch):
    """The launch's trace (benchmarks/engine/decode_layers.py --trace): the same output bits, every trace
    point of every layer stamped once per launch, and the stamps in the order the dependencies (or a program's
    own order) force on any device: o_proj's first wait ends after the last attention output is counted and
    after its weights arrived, which was after it drew its role; gate_up ends after o_proj, down after
    gate_up, and the next layer's qkv after down."""
    from reference_engine.kernels import decode_layers
    from reference_engine.kernels.layer_stack import LayerStack

    model, caches, x, meta = _decode_setup(40)
    cfg = model.config
    stack = LayerStack.of(model.layers, caches)
    args = (x, stack, meta["slot_mapping"], meta["block_tables"], meta["seq_lens"], model.cos, model.sin,
            model.scale)
    heads = dict(num_q_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, eps=cfg.rms_norm_eps)
    plain = TRITON.decode_layers(*args, **heads)
    trace, initial = decode_layers.new_trace(cfg.num_layers, x.device)
    monkeypatch.setitem(decode_layers.OPTIONS, "trace", trace)
    for _ in range(2):  # the caller re-arms the buffer before each launch
        trace.copy_(initial)
        assert torch.equal(TRITON.decode_layers(*args, **heads), plain)
        t = decode_layers.read_trace(trace, cfg.num_layers)
        names = [f"{kind} {name}" for name, kind in decode_layers.TRACE_EVENTS]
        stamped = (t > 0) & (t < torch.iinfo(torch.int64).max)
        assert stamped.all(), dict(zip(names, t.T.tolist(), strict=True))
        at = dict(zip(names, t.T, strict=True))
        counted = at["latest attention output counted for o_proj"]
        o_role = at["latest o_proj tile drew its role"]
        o_weights = at["latest o_proj tile's weights in registers"]
        o_first, o_last = at["earliest o_proj tile past its wait"], at["latest o_proj tile past its wait"]
        o_done = at["latest o_proj tile done"]
        gu_role_first = at["earliest gate_up tile drew its role"]
        gu_role = at["latest gate_up tile drew its role"]
        gu_first, gate_up = at["earliest gate_up tile done"], at["latest gate_up tile done"]
        down = at["latest down tile done"]
        assert (o_weights > o_role).all() and (o_last > o_weights).all()
        assert (o_first > counted).all() and (o_last >= o_first).all() and (o_done > o_last).all()
        assert (gu_role >= gu_role_first).all() and (gu_first > gu_role_first).all()
        assert (gu_first > o_first).all() and (gate_up >= gu_first).all() and (gate_up > o_done).all()
        assert (gate_up > gu_role).all() and (down > gate_up).all()
        assert (t[1:, 0] > down[:-1]).all()  # the next layer's last qkv tile


def test_decode_layers_fall_back_to_a_launch_per_layer():
    """Two sequences, or layers the stack cannot offset (no q/k norm), run layer by layer: same function."""
    from reference_engine.kernels import decode_layers
    from reference_engine.kernels.layer_stack import LayerStack

    model, caches, x, meta = _decode_setup(40, batch=2)
    cfg = model.config
    stack = LayerStack.of(model.layers, caches)
    assert stack.offsets is not None and stack.alignment >= 16
    assert not decode_layers.supports(x, stack, meta["block_tables"], num_q_heads=cfg.num_heads,
                                      num_kv_heads=cfg.num_kv_heads)
    args = (x, stack, meta["slot_mapping"], meta["block_tables"], meta["seq_lens"], model.cos, model.sin,
            model.scale)
    heads = dict(num_q_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, eps=cfg.rms_norm_eps)
    assert_close(TRITON.decode_layers(*args, **heads), REF.decode_layers(*args, **heads), model.dtype,
                 atol=1e-4)
    llama = [dataclasses.replace(layer, q_norm=None, k_norm=None) for layer in model.layers]
    assert LayerStack.of(llama, caches).offsets is None


def test_stack_weights_makes_a_uniform_stack():
    """Layers whose weights live in separate allocations: the stack falls back to its offset table (not
    uniform); stack_weights re-homes each kind into one allocation, values unchanged, and the stack is
    uniform; a second call copies nothing."""
    from reference_engine.kernels.layer_stack import WEIGHT_KINDS, LayerStack, stack_weights

    model, caches, _, _ = _decode_setup(40)
    apart = [dataclasses.replace(layer, **{kind: getattr(layer, kind).clone() for kind in WEIGHT_KINDS})
             for layer in model.layers]  # layer by layer: the other kinds lie between two layers' qkv
    assert LayerStack.of(model.layers, caches).uniform
    assert not LayerStack.of(apart, caches).uniform and LayerStack.of(apart, caches).offsets is not None
    values = [{kind: getattr(layer, kind).clone() for kind in WEIGHT_KINDS} for layer in apart]
    stack_weights(apart)
    assert LayerStack.of(apart, caches).uniform
    for layer, before in zip(apart, values, strict=True):
        assert all(torch.equal(getattr(layer, kind), t) for kind, t in before.items())
    pointers = [layer.qkv.data_ptr() for layer in apart]
    stack_weights(apart)
    assert [layer.qkv.data_ptr() for layer in apart] == pointers


def test_model_decode_step_takes_one_launch_unless_configured_per_layer(monkeypatch):
    """Qwen3Model.forward: a one-sequence decode step with Triton kernels runs every layer in one launch;
    Config(one_launch_layers=False) keeps a launch per layer (the case study's eager regime). Same result."""
    from reference_engine.kernels import decode_layers
    from reference_engine.model import AttentionMetadata

    model, caches, x, meta = _decode_setup(60)
    launches, launch = [], decode_layers._launch
    monkeypatch.setattr(decode_layers, "_launch", lambda *a, **k: launches.append(1) or launch(*a, **k))
    step = AttentionMetadata(**meta)
    ids, positions = torch.tensor([5], device=DEVICE), meta["seq_lens"] - 1
    one = model.forward(ids, positions, caches, step)
    assert len(launches) == 1
    per_layer_model = model.with_config(model.config.replace(one_launch_layers=False))
    per_layer = per_layer_model.forward(ids, positions, caches, step)
    assert len(launches) == 1
    assert_close(one, per_layer, model.dtype, atol=1e-4)
