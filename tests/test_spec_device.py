"""Speculative decoding inside the step (Config.drafter = "device", reference_engine/spec_device.py): the
device drafter proposes what the host drafter would, and every request gets the tokens of plain decoding."""

from __future__ import annotations

import os
import random

import pytest
import torch

from reference_engine import spec_device
from reference_engine.config import Config
from reference_engine.drafts import MAX_NGRAM, propose
from reference_engine.engine import Engine, SamplingParams
from reference_engine.graphs import (
    META_BLOCKS,
    META_SEED,
    META_SLOT,
    META_TEMPERATURE,
    META_TOP_K,
    META_TOP_P,
    SPEC_PARAM_COLS,
    float_bits,
)
from reference_engine.kernels import get_kernels, torch_ref
from reference_engine.model import Qwen3Model

REF = get_kernels("torch")
TRITON = get_kernels("triton")  # under TRITON_INTERPRET=1 on a CPU (conftest.py)

PROMPTS = [list(range(5, 22)) + [5, 6, 7, 8] * 4, list(range(5, 14))]  # the first has a repetitive tail


@pytest.fixture(scope="module")
def model() -> Qwen3Model:
    return Qwen3Model.random(Config(preset="tiny", device="cpu"))


def make_engine(model, **changes) -> Engine:
    return Engine(Config(preset="tiny", device="cpu", max_model_len=96, **changes), model=model)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def _meta(slots: list[int], tables: torch.Tensor, params: list[tuple[int, ...]]) -> torch.Tensor:
    """Decode metadata rows (graphs.py's layout) for sequences in `slots` with their block tables."""
    meta = torch.zeros(len(slots), META_BLOCKS + tables.shape[1], dtype=torch.int32)
    for row, (slot, values) in enumerate(zip(slots, params, strict=True)):
        meta[row, META_SLOT] = slot
        meta[row, META_TOP_K], meta[row, META_SEED] = values[0], values[1]
        meta[row, META_TEMPERATURE] = float_bits(values[2])
        meta[row, META_TOP_P] = float_bits(0.9)
    meta[:, META_BLOCKS:] = tables
    return meta


def _rows(ops, meta, history, lengths, k, max_model_len=48):
    return ops.spec_rows(meta, history, lengths, k=k, block_size=16, max_model_len=max_model_len,
                         max_ngram=MAX_NGRAM, slot_col=META_SLOT, blocks_col=META_BLOCKS,
                         param_cols=SPEC_PARAM_COLS)


def test_device_drafts_are_the_host_drafts():
    """On random texts of small vocabularies (many repeats), with scratch tokens past each length: the drafts
    of speculative.propose, from the torch reference and the Triton kernel (interpreted on a CPU) alike."""
    rng = random.Random(0)
    k = 5
    width = spec_device.history_width(48, k)
    vocabularies = [rng.choice((2, 3, 5, 20)) for _ in range(300)]
    texts = [[rng.randrange(v) for _ in range(rng.randint(1, 40))] for v in vocabularies]
    history = torch.randint(0, 5, (len(texts), width))
    for row, text in enumerate(texts):
        history[row, : len(text)] = torch.tensor(text)
    lengths = torch.tensor([len(t) for t in texts])
    drafts, proposed = torch_ref.spec_propose(history, lengths, k, max_ngram=MAX_NGRAM)
    for row, text in enumerate(texts):
        expected = propose(text, k)
        assert drafts[row, : len(expected)].tolist() == expected
        assert (drafts[row, len(expected):] == -1).all() and proposed[row] == len(expected)
    assert any(proposed) and not all(proposed)
    # The longest tail wins ([5, 6, 7] occurred before), and its latest occurrence.
    one = torch.tensor([[9, 5, 6, 7, 8, 1, 5, 6, 7, 2, 5, 6, 7, 0, 0]])
    assert torch_ref.spec_propose(one, torch.tensor([13]), 3, max_ngram=MAX_NGRAM)[0].tolist() == [[2, 5, 6]]
    # The Triton kernel, 40 sequences at a time (its slots pick rows of the whole history).
    tables = torch.arange(1, 4, dtype=torch.int32).repeat(40, 1)
    for first in range(0, len(texts), 40):
        slots = list(range(first, min(first + 40, len(texts))))
        meta = _meta(slots, tables[: len(slots)], [(0, 1, 0.0)] * len(slots))
        got = _rows(TRITON, meta, history, lengths, k)
        assert torch.equal(got.drafts, drafts[slots]) and torch.equal(got.proposed, proposed[slots])


def test_verify_rows_and_acceptance_of_both_kernel_sets():
    """spec_rows: each sequence's last token then its drafts at consecutive positions, its block table and
    params on each row, rows past max_model_len clamped and sent to block 0; spec_accept: drafts kept while
    they equal the token sampled one row before, plus the token after them, never past max_model_len; the
    history and lengths advance; the host reads its rows back. Torch and Triton give the same integers."""
    k, max_model_len = 3, 48
    history = torch.zeros(5, spec_device.history_width(max_model_len, k), dtype=torch.int64)
    text = [9, 5, 6, 7, 8, 1, 5, 6, 7]
    history[3, : len(text)] = torch.tensor(text)
    history[0, :46] = torch.arange(46) % 4  # 46 tokens: the row at position 48 lies past max_model_len
    history[1, :2] = torch.tensor([4, 5])  # no earlier 5: no drafts
    lengths = torch.tensor([46, 2, 0, len(text), 0])
    tables = torch.tensor([[7, 8, 9], [5, 6, 9], [4, 6, 0]], dtype=torch.int32)
    meta = _meta([3, 0, 1], tables, [(0, 11, 0.0), (50, 12, 0.7), (0, 13, 0.0)])
    ref = _rows(REF, meta, history, lengths, k, max_model_len)
    assert ref.drafts.tolist() == [[8, 1, 5], [2, 3, 0], [-1, -1, -1]]  # tails [5, 6, 7], [3, 0, 1], none
    assert ref.proposed.tolist() == [3, 3, 0] and ref.lengths.tolist() == [9, 46, 2]
    assert ref.ids.tolist() == [7, 8, 1, 5, 1, 2, 3, 0, 5, 0, 0, 0]
    assert ref.positions.tolist() == [8, 9, 10, 11, 45, 46, 47, 47, 1, 2, 3, 4]
    assert ref.slot_mapping.tolist()[:8] == [7 * 16 + 8, 7 * 16 + 9, 7 * 16 + 10, 7 * 16 + 11,
                                             9 * 16 + 13, 9 * 16 + 14, 9 * 16 + 15, 0]
    assert ref.seq_lens.tolist()[4:8] == [46, 47, 48, 48]
    assert torch.equal(ref.block_tables, tables.repeat_interleave(k + 1, dim=0))
    assert ref.params[4:8, 2].tolist() == [50] * 4  # top_k
    assert ref.params[:, 3].tolist() == [11] * 4 + [12] * 4 + [13] * 4  # seeds
    assert ref.params[4:8, 0].view(torch.float32).tolist() == pytest.approx([0.7] * 4)
    got = _rows(TRITON, meta, history, lengths, k, max_model_len)
    for name, value in ref._asdict().items():
        assert torch.equal(getattr(got, name), value), name
    sampled = torch.tensor([[8, 1, 9, 4], [2, 3, 0, 1], [4, 4, 4, 4]])
    outputs = []
    for ops in (REF, TRITON):
        hist, lens = history.clone(), lengths.clone()
        out = torch.zeros(3, k + 3, dtype=torch.int64)
        ops.spec_accept(sampled, ref, meta[:, META_SLOT], hist, lens, out, max_model_len=max_model_len)
        outputs.append((hist, lens, out))
    (hist, lens, out), triton_out = outputs
    assert all(torch.equal(a, b) for a, b in zip(outputs[0], triton_out, strict=True))
    assert out[:, k + 1].tolist() == [3, 2, 1]  # 2 drafts kept; 3 kept but capped at max_model_len; none
    assert lens.tolist() == [48, 3, 0, 12, 0]
    assert hist[3, 9:13].tolist() == [8, 1, 9, 4] and hist[0, 46:48].tolist() == [2, 3]
    per_seq, proposed, accepted = spec_device.read_results(out.tolist(), [True] * 3)
    assert per_seq == [[8, 1, 9], [2, 3], [4]] and (proposed, accepted) == (6, 3)
    # A finished sequence's extra (async) step: its tokens are read, its drafts not counted.
    assert spec_device.read_results(out.tolist(), [True, False, True])[1:] == (3, 2)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_device_drafter_gives_the_tokens_of_plain_decoding(model, async_scheduling):
    """Greedy and sampled, alone and batched, sync and async: the tokens of plain decoding. Greedy drafts are
    accepted, each saving a step; every step verifies k rows a sequence; no block is left behind."""
    plain = make_engine(model)
    params = [greedy(23), greedy(17)]
    expected = [plain.generate([p], sp)[0] for p, sp in zip(PROMPTS, params, strict=True)]
    sampled = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    expected_sampled = plain.generate(PROMPTS, [sampled, sampled])
    engine = make_engine(model, spec_tokens=4, drafter="device", async_scheduling=async_scheduling)
    solo = engine.generate([PROMPTS[0]], params[0])[0]
    assert solo == expected[0]
    stats = engine.stats
    assert stats.accepted_tokens > 0 and stats.draft_tokens >= stats.accepted_tokens
    if not async_scheduling:  # alone, each accepted draft saves a decode step (the first token is prefill's)
        assert stats.decode_steps == 23 - 1 - stats.accepted_tokens
    assert engine.generate(PROMPTS, params) == expected
    assert engine.generate(PROMPTS, [sampled, sampled]) == expected_sampled
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_usable


def test_device_drafter_facts_and_reach(model):
    """A decode step verifies k draft rows a sequence (the hooks' spec_tokens), and reserves blocks for every
    row the device may write: k + 1 a step it may be ahead of the host, never past the request's end."""
    engine = make_engine(model, spec_tokens=4, drafter="device", async_scheduling=True)
    request = engine.submit(PROMPTS[0], greedy(30))
    engine.step()  # prefill launched
    batch = engine.schedule()
    assert (batch.phase, batch.num_tokens, batch.spec_tokens) == ("decode", 5, 4)
    length = len(PROMPTS[0])
    assert len(request.block_table) * 16 >= length + 2 * 5  # the prefill's token pending, then this step
    near_end = engine.submit(PROMPTS[1], greedy(2))
    assert engine.scheduler._decode_reach(near_end) == len(PROMPTS[1]) + 2
    while engine.has_work():
        engine.step()
    assert request.finish_reason == "length" and len(request.output_ids) == 30


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_device_drafter_at_max_model_len_and_under_block_pressure(model, async_scheduling):
    """Up to max_model_len (rows past it write into the reserved block 0 and are never accepted), and with so
    few blocks that requests are preempted and recomputed: the tokens of plain decoding."""
    prompt = PROMPTS[0] + [5, 6, 7, 8] * 2  # 45 tokens
    plain = Engine(Config(preset="tiny", device="cpu", max_model_len=56), model=model)
    expected = plain.generate([prompt], greedy(100))[0]
    engine = Engine(Config(preset="tiny", device="cpu", max_model_len=56, spec_tokens=6, drafter="device",
                           async_scheduling=async_scheduling), model=model)
    request = engine.submit(prompt, greedy(100))
    while engine.has_work():
        engine.step()
    assert request.output_ids == expected and len(prompt) + len(expected) == 56
    assert request.finish_reason == "length"
    plain = make_engine(model)
    params = [greedy(40), greedy(30)]
    expected = [plain.generate([p], sp)[0] for p, sp in zip(PROMPTS, params, strict=True)]
    engine = make_engine(model, num_blocks=8, spec_tokens=6, drafter="device",
                         async_scheduling=async_scheduling)
    assert engine.generate(PROMPTS, params) == expected
    assert engine.stats.preemptions >= 1
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_usable


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU check through Triton's interpreter")
def test_device_drafter_with_triton_kernels(model):
    """The Triton set runs the verify rows through its unfused prologue, with the device drafter's row
    tables."""
    plain = make_engine(model, kernels="triton")
    engine = make_engine(model, kernels="triton", spec_tokens=4, drafter="device", async_scheduling=True)
    expected = plain.generate([PROMPTS[0]], greedy(10))
    assert engine.generate([PROMPTS[0]], greedy(10)) == expected
    assert engine.stats.accepted_tokens > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_device_drafter_mixed_batches_aborts_and_reused_slots(model, async_scheduling):
    """A greedy and a sampled request in one batch; a request aborted mid-run frees its blocks, and the next
    request takes its slot: the prefill rewrites the slot's device history, so its tokens are plain
    decoding's."""
    plain = make_engine(model)
    sampled = SamplingParams(max_tokens=14, temperature=0.8, top_k=50, seed=3, ignore_eos=True)
    params = [greedy(20), sampled]
    expected = plain.generate(PROMPTS, params)
    engine = make_engine(model, spec_tokens=3, drafter="device", async_scheduling=async_scheduling)
    assert engine.generate(PROMPTS, params) == expected
    doomed = engine.submit(PROMPTS[0], greedy(60))
    for _ in range(4):
        engine.step()
    assert doomed.output_ids and not doomed.done.is_set()
    slot = doomed.slot
    engine.abort(doomed.request_id)
    while engine.has_work():
        engine.step()
    assert doomed.finish_reason == "abort"
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_usable
    successor = engine.submit(PROMPTS[1], greedy(15))
    engine.step()
    assert successor.slot == slot
    while engine.has_work():
        engine.step()
    assert successor.output_ids == plain.generate([PROMPTS[1]], greedy(15))[0]
