"""Qwen3 model and sampler on the CPU (tiny preset): shapes, seeded weights, paged KV decode vs recompute."""

import pytest
import torch

from reference_engine.config import PRESETS, Config
from reference_engine.kv_cache import allocate_kv_cache
from reference_engine.model import AttentionMetadata, Qwen3Model
from reference_engine.sampler import sample, uniform_noise


def tiny(**changes) -> Config:
    return Config(preset="tiny", device="cpu", **changes)


def prefill_logits(model: Qwen3Model, ids: list[int], caches, table: list[int]) -> torch.Tensor:
    """Prefill one sequence into `caches` through its block table; logits of every position."""
    bs = model.config.block_size
    pos = torch.arange(len(ids))
    slots = torch.tensor(table)[pos // bs] * bs + pos % bs
    hidden = model.forward(torch.tensor(ids), pos, caches, AttentionMetadata(slots, cu_seqlens=[0, len(ids)]))
    return model.compute_logits(hidden)


def test_presets_and_validation():
    cfg = Config(preset="qwen3-4b", device="cpu")
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (2560, 36, 32, 8)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.vocab_size, cfg.tie_embeddings) == (
        128,
        9728,
        151936,
        True,
    )
    assert abs(cfg.num_params() - 4.02e9) < 0.01e9
    assert 64 <= PRESETS["tiny"]["hidden_size"] <= 128 and PRESETS["tiny"]["vocab_size"] == 512
    for changes, message in [
        (dict(preset="nope"), "unknown preset"),
        (dict(graph="cuda"), "graph must be one of"),
        (dict(num_heads=3), "multiple of num_kv_heads"),
        (dict(max_num_seqs=0), "max_num_seqs must be a positive integer"),
        (dict(kernels="cutlass"), "kernels must be one of"),
        (dict(eos_token_id=10_000), "outside the vocabulary"),
    ]:
        with pytest.raises(ValueError, match=message):
            Config(**{"preset": "tiny", "device": "cpu", **changes})
    assert tiny(max_num_seqs=4).replace(graph="step").graph == "step"


def test_shapes_and_seeded_weights():
    cfg = tiny()
    model = Qwen3Model.random(cfg)
    assert model.dtype == torch.float32
    assert model.layers[0].qkv.shape == (cfg.qkv_size, cfg.hidden_size)
    assert model.layers[0].gate_up.shape == (2 * cfg.intermediate_size, cfg.hidden_size)
    caches = allocate_kv_cache(cfg, dtype=model.dtype)
    assert caches[0][0].shape == (cfg.total_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
    logits = prefill_logits(model, list(range(1, 21)), caches, [1, 2])
    assert logits.shape == (20, cfg.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    # Not degenerate: logits spread, and positions do not all pick the same token.
    assert logits.std() > 0.1 and len(set(logits.argmax(-1).tolist())) > 5
    again = Qwen3Model.random(cfg)
    assert torch.equal(again.layers[1].gate_up, model.layers[1].gate_up)
    assert not torch.equal(Qwen3Model.random(tiny(seed=1)).layers[1].gate_up, model.layers[1].gate_up)


@pytest.mark.parametrize("qk_norm", [True, False])
def test_paged_decode_matches_full_recompute(qk_norm):
    cfg = tiny(qk_norm=qk_norm, block_size=4)
    model = Qwen3Model.random(cfg)
    caches = allocate_kv_cache(cfg, dtype=model.dtype)
    ids = [(7 * i + 3) % 256 for i in range(23)]
    table = [5, 2, 9, 7, 11, 3, 4]  # scattered blocks: the block table, not contiguity, must matter
    prefill_logits(model, ids[:13], caches, table)
    for position in range(13, 23):  # decode one token at a time, reading earlier k/v from the cache
        tables = torch.tensor([table], dtype=torch.int32)
        slot = torch.tensor([table[position // 4] * 4 + position % 4])
        meta = AttentionMetadata(
            slot, block_tables=tables, seq_lens=torch.tensor([position + 1], dtype=torch.int32)
        )
        decoded = model.compute_logits(
            model.forward(torch.tensor([ids[position]]), torch.tensor([position]), caches, meta)
        )
    fresh = allocate_kv_cache(cfg, dtype=model.dtype)
    full = prefill_logits(model, ids, fresh, [1, 2, 3, 4, 5, 6])
    torch.testing.assert_close(decoded[0], full[-1], rtol=1e-4, atol=1e-4)


def test_batched_decode_rows_are_independent():
    cfg = tiny()
    model = Qwen3Model.random(cfg)
    caches = allocate_kv_cache(cfg, dtype=model.dtype)
    prompts = {1: list(range(10, 30)), 2: list(range(40, 45))}  # block table id -> prompt
    singles = []
    for block, prompt in prompts.items():
        prefill_logits(model, prompt, caches, [block, block + 10])
        singles.append(
            prefill_logits(model, prompt + [99], allocate_kv_cache(cfg, dtype=model.dtype), [1, 2])[-1]
        )
    positions = torch.tensor([20, 5])
    tables = torch.tensor([[1, 11], [2, 12]], dtype=torch.int32)
    slots = torch.tensor([11 * 16 + 4, 2 * 16 + 5])
    meta = AttentionMetadata(slots, block_tables=tables, seq_lens=(positions + 1).int())
    batched = model.compute_logits(model.forward(torch.tensor([99, 99]), positions, caches, meta))
    torch.testing.assert_close(batched, torch.stack(singles), rtol=1e-4, atol=1e-4)


def sample_one(logits, *, temperature=1.0, top_p=1.0, top_k=0, seed=0, position=0, greedy_only=False):
    n = logits.shape[0]
    return sample(
        logits,
        temperature=torch.full((n,), temperature),
        top_p=torch.full((n,), top_p),
        top_k=torch.full((n,), top_k, dtype=torch.int32),
        seeds=torch.full((n,), seed),
        positions=torch.full((n,), position),
        greedy_only=greedy_only,
    )


def test_sampler_greedy_limits_and_reproducibility():
    logits = torch.randn(6, 512, generator=torch.Generator().manual_seed(0)) * 3
    greedy = logits.argmax(-1)
    assert torch.equal(sample_one(logits, temperature=0.0), greedy)
    assert torch.equal(sample_one(logits, greedy_only=True), greedy)
    for seed in range(5):
        assert torch.equal(sample_one(logits, top_k=1, seed=seed), greedy)
        assert torch.equal(sample_one(logits, top_p=1e-6, seed=seed), greedy)
    a, b = sample_one(logits, seed=3, position=7), sample_one(logits, seed=3, position=7)
    assert torch.equal(a, b)
    draws = torch.stack([sample_one(logits, seed=s) for s in range(8)])
    assert not (draws == greedy).all()
    # top-k keeps only the k most likely tokens.
    top3 = logits.topk(3, dim=-1).indices
    for seed in range(20):
        picked = sample_one(logits, top_k=3, seed=seed)
        assert (top3 == picked[:, None]).any(-1).all()


def test_sampler_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    n = logits.shape[0]
    picks = sample(
        logits,
        temperature=torch.ones(n),
        top_p=torch.ones(n),
        top_k=torch.zeros(n, dtype=torch.int32),
        seeds=torch.arange(n),
        positions=torch.zeros(n),
        greedy_only=False,
    )
    freq = torch.bincount(picks, minlength=4).float() / n
    torch.testing.assert_close(freq, torch.softmax(logits[0], -1), atol=0.03, rtol=0)
    # top_p=0.7: token 0 (p=0.64) is always kept, token 1 (mass before it 0.64 < 0.7) too, token 2 never.
    picks = sample(
        logits,
        temperature=torch.ones(n),
        top_p=torch.full((n,), 0.7),
        top_k=torch.zeros(n, dtype=torch.int32),
        seeds=torch.arange(n),
        positions=torch.zeros(n),
        greedy_only=False,
    )
    assert set(picks.tolist()) == {0, 1}


def test_uniform_noise_range_and_independence():
    u = uniform_noise(torch.tensor([1, 1, 2]), torch.tensor([0, 1, 0]), 50_000)
    assert (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 0.01
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
