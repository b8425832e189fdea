"""Speculative decoding inside the step (Config.drafter = "device", reference_engine/spec_device.py): the
device drafter proposes what the host drafter would, and every request gets the tokens of plain decoding."""

from __future__ import annotations

import os
import random

import pytest
import torch

from reference_engine import spec_device
from reference_engine.config import Config
from reference_engine.engine import Engine, SamplingParams
from reference_engine.model import Qwen3Model
from reference_engine.speculative import propose

PROMPTS = [list(range(5, 22)) + [5, 6, 7, 8] * 4, list(range(5, 14))]  # the first has a repetitive tail


@pytest.fixture(scope="module")
def model() -> Qwen3Model:
    return Qwen3Model.random(Config(preset="tiny", device="cpu"))


def make_engine(model, **changes) -> Engine:
    return Engine(Config(preset="tiny", device="cpu", max_model_len=96, **changes), model=model)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def test_device_drafts_are_the_host_drafts():
    """On random texts of small vocabularies (many repeats), with scratch tokens past each length: the same
    drafts as speculative.propose, one row at a time and batched."""
    rng = random.Random(0)
    k = 5
    width = spec_device.history_width(48, k)
    vocabularies = [rng.choice((2, 3, 5, 20)) for _ in range(300)]
    texts = [[rng.randrange(v) for _ in range(rng.randint(1, 40))] for v in vocabularies]
    history = torch.randint(0, 5, (len(texts), width))
    for row, text in enumerate(texts):
        history[row, : len(text)] = torch.tensor(text)
    lengths = torch.tensor([len(t) for t in texts])
    drafts, proposed = spec_device.propose(history, lengths, k)
    for row, text in enumerate(texts):
        expected = propose(text, k)
        assert drafts[row, : len(expected)].tolist() == expected
        assert (drafts[row, len(expected):] == -1).all() and proposed[row] == len(expected)
    assert any(proposed) and not all(proposed)
    # The longest tail wins ([5, 6, 7] occurred before), and its latest occurrence.
    one = torch.tensor([[9, 5, 6, 7, 8, 1, 5, 6, 7, 2, 5, 6, 7, 0, 0]])
    assert spec_device.propose(one, torch.tensor([13]), 3)[0].tolist() == [[2, 5, 6]]


def test_acceptance_and_results():
    """Drafts are kept while they equal the token sampled one row before, plus the token after them; never
    past max_model_len; the history and the lengths advance by the new tokens; the host reads them back."""
    sampled = torch.tensor([[5, 6, 9, 1], [1, 6, 7, 2], [5, 6, 7, 2], [5, 6, 7, 2]])
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [5, -1, -1]])
    lengths = torch.tensor([10, 10, 10, 47])
    new = spec_device.accept(sampled, drafts, lengths, max_model_len=48)
    assert new.tolist() == [3, 1, 4, 1]
    history = torch.zeros(5, spec_device.history_width(48, 3), dtype=torch.int64)
    lengths_buffer = torch.zeros(5, dtype=torch.int64)
    slots = torch.tensor([3, 0, 1, 2])
    spec_device.record(history, lengths_buffer, slots, sampled, new, lengths)
    assert lengths_buffer.tolist() == [11, 14, 48, 13, 0]
    assert history[3, 10:13].tolist() == [5, 6, 9] and history[2, 47].item() == 5
    out = torch.cat([sampled, new[:, None], torch.tensor([[3], [3], [3], [1]])], dim=1).tolist()
    per_seq, proposed, accepted = spec_device.read_results(out, [True] * 4)
    assert per_seq == [[5, 6, 9], [1], [5, 6, 7, 2], [5]]
    assert (proposed, accepted) == (10, 2 + 0 + 3 + 0)
    # A finished sequence's extra (async) step: its tokens are read, its drafts not counted.
    assert spec_device.read_results(out, [True, True, False, True])[1:] == (7, 2)


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
