"""Loading a local Hugging Face directory (written here with safetensors + tokenizers) and the tokenizers."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from reference_engine.config import Config
from reference_engine.engine import Engine, SamplingParams
from reference_engine.kv_cache import allocate_kv_cache
from reference_engine.loader import hf_state_dict, load_model, save_hf_dir
from reference_engine.model import AttentionMetadata, Qwen3Model
from reference_engine.tokenizer import HFTokenizer, SyntheticTokenizer, load_tokenizer

CORPUS = ["the engine decodes one token per step", "a step is busy, waiting or idle", "hello world"] * 20


def logits_of(model: Qwen3Model, ids: list[int]) -> torch.Tensor:
    caches = allocate_kv_cache(model.config, dtype=model.dtype)
    pos = torch.arange(len(ids))
    slots = torch.tensor([1, 2, 3])[pos // 16] * 16 + pos % 16
    hidden = model.forward(torch.tensor(ids), pos, caches, AttentionMetadata(slots, cu_seqlens=[0, len(ids)]))
    return model.compute_logits(hidden)


def write_tokenizer(directory) -> None:
    """A small byte-level BPE trained here on a few sentences, plus the config naming its specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


@pytest.mark.parametrize("changes", [{}, {"tie_embeddings": True}, {"qk_norm": False}])
def test_round_trip_gives_the_same_logits(tmp_path, changes):
    source = Qwen3Model.random(Config(preset="tiny", device="cpu", seed=3, **changes))
    save_hf_dir(source, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert ("lm_head.weight" in tensors) == (not source.config.tie_embeddings)
    assert ("model.layers.0.self_attn.q_norm.weight" in tensors) == source.config.qk_norm
    cfg = Config(model=str(tmp_path), device="cpu")
    for field in (
        "hidden_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
        "tie_embeddings",
        "qk_norm",
        "rope_theta",
    ):
        assert getattr(cfg, field) == getattr(source.config, field), field
    loaded = load_model(cfg)
    # HF names map onto the fused layout: q, k, v stacked into qkv; gate, up into gate_up.
    q_rows = cfg.num_heads * cfg.head_dim
    assert torch.equal(loaded.layers[1].qkv[:q_rows], tensors["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(
        loaded.layers[1].gate_up[cfg.intermediate_size :], tensors["model.layers.1.mlp.up_proj.weight"]
    )
    # Each weight kind in one allocation, layer after layer (the one-launch decode computes layer offsets).
    qkv = [layer.qkv for layer in loaded.layers]
    assert all(t.data_ptr() == qkv[0].data_ptr() + i * qkv[0].nbytes for i, t in enumerate(qkv))
    ids = [5, 99, 17, 300, 2, 41, 41, 7, 250, 128, 64, 3, 9, 200, 11, 12, 13, 14, 15, 16, 80]
    torch.testing.assert_close(logits_of(loaded, ids), logits_of(source, ids), rtol=0, atol=0)


def test_directory_with_tokenizer_serves_text(tmp_path):
    write_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size <= 300
    text = "hello world, the engine decodes"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("hello", add_bos=True)[0] == tok.bos_token_id
    save_hf_dir(Qwen3Model.random(Config(preset="tiny", device="cpu")), tmp_path)
    engine = Engine(Config(model=str(tmp_path), device="cpu"))
    assert engine.eos_token_id == tok.eos_token_id and engine.bos_token_id == tok.bos_token_id
    out = engine.generate([tok.encode("hello world")], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(out) == 5 and isinstance(engine.tokenizer.decode(out), str)


def test_bad_directories_fail_with_clear_messages(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        Config(model=str(tmp_path), device="cpu")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Config(model=str(tmp_path), device="cpu")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="not supported"):
        Config(model=str(tmp_path), device="cpu")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 64}))
    with pytest.raises(ValueError, match="lacks 'num_attention_heads'"):
        Config(model=str(tmp_path), device="cpu")
    source = Qwen3Model.random(Config(preset="tiny", device="cpu"))
    save_hf_dir(source, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(Config(model=str(tmp_path), device="cpu"))
    tensors = hf_state_dict(source)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.weight missing"):
        load_model(Config(model=str(tmp_path), device="cpu"))
    with pytest.raises(ValueError, match="either preset or model"):
        Config(preset="tiny", model=str(tmp_path))


def test_synthetic_tokenizer_round_trip_and_specials():
    tok = SyntheticTokenizer(512)
    text = "héllo, wörld ✓ 123\n"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and tok.decode(ids) == text
    assert tok.encode("a", add_bos=True) == [tok.bos_token_id, 97]
    assert tok.decode([tok.bos_token_id, 104, 105, tok.eos_token_id, tok.pad_token_id]) == "hi"  # specials
    assert {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id} == {256, 257, 258}
    assert isinstance(load_tokenizer(None), SyntheticTokenizer)
    assert load_tokenizer(None, vocab_size=151936).vocab_size == 151936
    assert Config(preset="tiny", device="cpu").vocab_size >= tok.vocab_size


@pytest.mark.parametrize("preset", ["tiny", "qwen3-4b"])
def test_synthetic_tokenizer_covers_the_whole_vocabulary(preset):
    """A random model samples any id of its vocabulary: each one but the three specials decodes to visible
    text (word pieces are printable; a lone byte is itself, U+FFFD, or a control picture)."""
    vocab = Config(preset=preset, device="cpu").vocab_size
    tok = load_tokenizer(None, vocab_size=vocab)
    specials = {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}
    pieces = {i: tok.decode([i]) for i in range(vocab) if i not in specials}
    whitespace = {ord(c): c for c in "\t\n\r "}  # these bytes stay what they are
    assert all(pieces[i] == c for i, c in whitespace.items())
    invisible = [i for i, p in pieces.items() if i not in whitespace and not (p.strip() and p.isprintable())]
    assert invisible == []
    words = [pieces[i] for i in range(tok.first_word_id, vocab)]
    assert all(w.startswith(" ") and w[1:].isalpha() for w in words) and len(set(words)) == len(words)
    assert tok.decode(list(range(tok.first_word_id, tok.first_word_id + 3))) == "".join(words[:3])
