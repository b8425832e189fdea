"""The engine on the CPU (tiny preset): batching, async, stops, abort, admission, graph fallback."""

import logging
import os
import threading

import pytest
import torch

from reference_engine.config import Config
from reference_engine.drafts import propose
from reference_engine.engine import Engine, SamplingParams, ScheduledBatch
from reference_engine.kv_cache import allocate_kv_cache
from reference_engine.model import AttentionMetadata, Qwen3Model
from reference_engine.speculative import accept

PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 40, 9)]
MAX_TOKENS = [12, 30, 7, 20]


@pytest.fixture(scope="module")
def model() -> Qwen3Model:
    return Qwen3Model.random(Config(preset="tiny", device="cpu"))


def make_engine(model, **changes) -> Engine:
    return Engine(Config(preset="tiny", device="cpu", **changes), model=model)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def alone(model) -> list[list[int]]:
    """Each prompt run on its own: the reference every batched run must reproduce."""
    engine = make_engine(model)
    return [engine.generate([p], greedy(m))[0] for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]


def test_generate_is_not_degenerate(alone):
    assert [len(out) for out in alone] == MAX_TOKENS
    assert all(len(set(out)) >= 3 for out in alone)  # greedy does not collapse onto one token


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_continuous_batching_matches_running_alone(model, alone, async_scheduling):
    """Requests join while others decode and leave at different lengths; each output equals its solo run."""
    engine = make_engine(model, async_scheduling=async_scheduling)
    engine.start()
    try:
        late_submitted = threading.Event()
        results: dict[int, list] = {}

        def collector(index):
            def on_output(tokens, finished, reason):
                results.setdefault(index, []).extend(tokens)
                if index == 0 and len(results[0]) == 4 and not late_submitted.is_set():
                    late_submitted.set()  # join mid-flight, from the engine thread itself
                    requests.append(engine.submit(PROMPTS[3], greedy(MAX_TOKENS[3]), on_output=collector(3)))

            return on_output

        requests = [
            engine.submit(PROMPTS[i], greedy(MAX_TOKENS[i]), on_output=collector(i)) for i in range(3)
        ]
        for request in requests[:3]:
            assert request.done.wait(30)
        assert late_submitted.wait(5) and requests[3].done.wait(30)
        assert [results[i] for i in range(4)] == alone
        assert [r.finish_reason for r in requests] == ["length"] * 4
        assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_usable
        assert threading.current_thread().name != "engine" and engine._thread.name == "engine"
    finally:
        engine.shutdown()


def test_async_equals_sync_and_sampling_is_batch_independent(model):
    params = [
        SamplingParams(max_tokens=15, temperature=0.8, top_p=0.9, seed=s, ignore_eos=True) for s in range(4)
    ]
    sync = make_engine(model).generate(PROMPTS, params)
    overlapped = make_engine(model, async_scheduling=True).generate(PROMPTS, params)
    assert sync == overlapped
    solo = make_engine(model).generate([PROMPTS[1]], params[1])[0]
    assert solo == sync[1]  # the sampler's noise depends on (seed, position), not on the batch
    other_seed = make_engine(model).generate(
        [PROMPTS[1]], SamplingParams(max_tokens=15, temperature=0.8, seed=99, ignore_eos=True)
    )[0]
    assert other_seed != solo


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_eos_stops_and_ignore_eos_continues(model, alone, async_scheduling):
    eos = alone[1][5]
    first = alone[1].index(eos)
    engine = make_engine(model, eos_token_id=eos, async_scheduling=async_scheduling)
    finished = []
    request = engine.submit(
        PROMPTS[1],
        SamplingParams(max_tokens=30),
        on_output=lambda tokens, done, reason: done and finished.append(reason),
    )
    while engine.has_work():  # drive the loop on this thread
        engine.step()
    assert request.output_ids == alone[1][: first + 1] and finished == ["stop"]
    assert engine.generate([PROMPTS[1]], greedy(30))[0] == alone[1]
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_usable


def test_max_model_len_stops_generation(model):
    engine = make_engine(model, max_model_len=48)
    request = engine.submit(PROMPTS[2], greedy(100))
    while engine.has_work():
        engine.step()
    assert request.done.is_set() and len(PROMPTS[2]) + len(request.output_ids) == 48
    assert request.finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        engine.submit(list(range(48)), greedy(1))
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.submit([], greedy(1))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_abort_frees_blocks(model):
    engine = make_engine(model)
    engine.start()
    try:
        got_tokens = threading.Event()
        reasons = []

        def on_output(tokens, finished, reason):
            if len(request.output_ids) >= 3:
                got_tokens.set()
            if finished:
                reasons.append(reason)

        request = engine.submit(PROMPTS[2], greedy(200), on_output=on_output)
        assert got_tokens.wait(30)
        assert engine.scheduler.blocks.num_free < engine.scheduler.blocks.num_usable
        engine.abort(request.request_id)
        assert request.done.wait(10)
        assert reasons == ["abort"] and len(request.output_ids) < 200
        assert engine.generate([PROMPTS[0]], greedy(2))  # the loop is still alive after the abort
        assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_usable
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_admission_control_and_preemption_when_blocks_run_out(model, alone, async_scheduling):
    # 5 usable blocks of 16 tokens; the prompts need 1 + 2 + 3 + 1 blocks, the full requests 1 + 3 + 3 + 2.
    engine = make_engine(model, num_blocks=6, async_scheduling=async_scheduling)
    requests = [engine.submit(p, greedy(m)) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]
    first = engine.schedule()
    assert first.num_seqs == 2  # the third prompt waits: admission is FIFO and its 3 blocks are not free
    inflight = engine.launch(first, engine.prepare_inputs(first))
    engine.update_requests(inflight, engine.wait_for_results(inflight))
    while engine.has_work():
        engine.step()
    outputs = [r.output_ids for r in requests]
    assert outputs == alone  # preempted requests recompute and continue exactly where they were
    assert engine.stats.preemptions >= 1
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_usable
    with pytest.raises(ValueError, match="more KV blocks"):
        engine.submit(list(range(100)), greedy(100))


@pytest.mark.parametrize("graph", ["model", "step"])
def test_graph_modes_fall_back_on_cpu(model, alone, graph, caplog):
    with caplog.at_level(logging.WARNING, logger="reference_engine"):
        engine = make_engine(model, graph=graph, async_scheduling=graph == "step")
    assert any("needs CUDA" in r.getMessage() for r in caplog.records)
    assert engine.generate(PROMPTS, [greedy(m) for m in MAX_TOKENS]) == alone
    assert engine.stats.graph_replays == 0 and engine.stats.decode_steps > 0 and engine.stream is None


def test_phase_methods_and_batches(model):
    engine = make_engine(model)
    engine.submit(PROMPTS[0], greedy(3))
    engine.submit(PROMPTS[1], greedy(3))
    batch = engine.schedule()
    assert (batch.phase, batch.num_seqs, batch.num_tokens, batch.spec_tokens) == ("prefill", 2, 20, 0)
    inflight = engine.launch(batch, engine.prepare_inputs(batch))
    tokens = engine.wait_for_results(inflight)
    engine.update_requests(inflight, tokens)
    batch = engine.schedule()
    assert (batch.phase, batch.num_seqs, batch.num_tokens) == ("decode", 2, 2)
    assert all(callable(getattr(Engine, name)) for name in ("step", "wait_for_work"))
    assert torch.equal(engine.buffers.tokens[[s.slot for s in batch.seqs]], torch.tensor(tokens))


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU check through Triton's interpreter"
)
def test_triton_kernels_match_torch_kernels(model):
    """Same weights, kernels swapped: fp32 logits within 1e-4 and identical greedy tokens (tiny, CPU)."""
    prompts = [list(range(5, 25)), list(range(40, 47))]
    params = greedy(6)
    engines = {k: make_engine(model, kernels=k, max_model_len=64) for k in ("torch", "triton")}
    assert [e.model.ops.name for e in engines.values()] == ["torch", "triton"]
    outputs = {k: e.generate(prompts, params) for k, e in engines.items()}
    assert outputs["triton"] == outputs["torch"]
    # Logits of one decode step through each kernel set, from the same cache contents.
    cfg = engines["torch"].config
    caches = allocate_kv_cache(cfg, dtype=torch.float32)
    ids, pos = torch.tensor(prompts[0]), torch.arange(20)
    slots = torch.tensor([1, 2])[pos // 16] * 16 + pos % 16
    model.forward(ids, pos, caches, AttentionMetadata(slots, cu_seqlens=[0, 20]))
    meta = AttentionMetadata(
        torch.tensor([36]),
        block_tables=torch.tensor([[1, 2, 0, 0]], dtype=torch.int32),
        seq_lens=torch.tensor([21], dtype=torch.int32),
    )
    logits = {}
    for name, engine in engines.items():
        step_caches = [(k.clone(), v.clone()) for k, v in caches]
        hidden = engine.model.forward(torch.tensor([7]), torch.tensor([20]), step_caches, meta)
        logits[name] = engine.model.compute_logits(hidden)
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=1e-4, atol=1e-4)


def test_raising_callback_ends_only_its_request_and_shutdown_ends_the_rest(model, alone):
    engine = make_engine(model)
    engine.start()
    try:

        def broken(tokens, finished, reason):
            raise RuntimeError("client went away")

        bad = engine.submit(PROMPTS[0], greedy(50), on_output=broken)
        assert bad.done.wait(30) and bad.finish_reason == "error"
        assert engine.generate([PROMPTS[1]], greedy(30)) == [alone[1]]  # the loop lives on
        long = engine.submit(PROMPTS[2], greedy(200))
    finally:
        engine.shutdown()
    assert long.done.is_set() and long.finish_reason == "abort"
    idle = make_engine(model)
    never_run = idle.submit(PROMPTS[3], greedy(5))
    idle.shutdown()
    assert never_run.done.is_set() and never_run.finish_reason == "abort"


# --- speculative decoding (prompt-lookup drafts, verified in one eager step)

# A repetitive tail: the drafter finds earlier occurrences, so most steps verify drafts.
SPEC_PROMPTS = [PROMPTS[1] + [5, 6, 7, 8] * 4, PROMPTS[3]]


def test_spec_decoding_gives_the_greedy_tokens_of_plain_decoding(model):
    """Drafts change how many steps run, never the greedy tokens: solo and batched, with max_tokens landing
    inside a verified run."""
    params = [greedy(23), greedy(17)]
    plain = make_engine(model, max_model_len=96)
    expected = [plain.generate([p], sp)[0] for p, sp in zip(SPEC_PROMPTS, params, strict=True)]
    spec = make_engine(model, max_model_len=96, spec_tokens=4)
    solo = [spec.generate([p], sp)[0] for p, sp in zip(SPEC_PROMPTS, params, strict=True)]
    assert solo == expected
    stats = spec.stats
    assert stats.draft_tokens > 0 and 0 <= stats.accepted_tokens <= stats.draft_tokens
    # Alone, each accepted draft saves one decode step (the first token comes from the prefill).
    assert plain.stats.decode_steps == (23 - 1) + (17 - 1)
    assert stats.decode_steps == plain.stats.decode_steps - stats.accepted_tokens
    assert spec.generate(SPEC_PROMPTS, params) == expected
    assert spec.stats.tokens_generated == 2 * (23 + 17)
    # Sampled requests get no drafts, and the same samples as without speculation (same noise positions).
    sampled = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    assert spec.generate([SPEC_PROMPTS[0]], sampled) == plain.generate([SPEC_PROMPTS[0]], sampled)
    assert spec.scheduler.blocks.num_free == spec.scheduler.blocks.num_usable


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU check through Triton's interpreter"
)
def test_spec_decoding_with_triton_kernels(model):
    """The Triton set verifies through its unfused prologue (every row's k/v cached before any row attends)
    and row-major block tables; drafts are proposed and accepted from the third decode step on."""
    plain = make_engine(model, kernels="triton", max_model_len=96)
    spec = make_engine(model, kernels="triton", max_model_len=96, spec_tokens=4)
    expected = plain.generate([SPEC_PROMPTS[0]], greedy(8))
    assert spec.generate([SPEC_PROMPTS[0]], greedy(8)) == expected
    assert spec.stats.accepted_tokens > 0 and spec.stats.decode_steps < plain.stats.decode_steps


def test_spec_batches_report_drafts_and_accept_the_matching_prefix(model):
    engine = make_engine(model, spec_tokens=3)
    request = engine.submit(SPEC_PROMPTS[0], greedy(20))
    engine.step()  # prefill
    for _ in range(10):  # decode until the tail of prompt + output occurred before (the 3rd step here)
        batch = engine.schedule()
        if batch.spec_tokens:
            break
        inflight = engine.launch(batch, engine.prepare_inputs(batch))
        engine.update_requests(inflight, engine.wait_for_results(inflight))
    assert batch.phase == "decode" and request.draft
    assert request.draft == propose(request.known_ids, 3)
    assert (batch.spec_tokens, batch.num_tokens) == (len(request.draft), 1 + len(request.draft))
    assert propose([9, 5, 6, 7, 8, 1, 5, 6, 7], 3) == [8, 1, 5]  # the longest tail [5, 6, 7] occurred before
    # Verification: drafts are taken while they equal the target's tokens, plus the target's next token.
    drafted = ScheduledBatch([request], "decode", 4, spec_tokens=3)
    request.draft = [5, 6, 7]
    assert accept(drafted, [4], [5, 6, 9, 1]) == ([[5, 6, 9]], 3, 2)
    assert accept(drafted, [4], [1, 6, 7, 2]) == ([[1]], 3, 0)
    assert accept(drafted, [4], [5, 6, 7, 2]) == ([[5, 6, 7, 2]], 3, 3)
    # Drafts never run past max_tokens: one token left -> no drafts.
    near_end = engine.submit(SPEC_PROMPTS[0], greedy(1))
    assert engine.scheduler._draft(near_end) == []
    sampled = engine.submit(SPEC_PROMPTS[0], SamplingParams(max_tokens=20, temperature=0.8))
    assert engine.scheduler._draft(sampled) == []  # sampling would need rejection sampling


def test_spec_decoding_under_block_pressure(model):
    """Drafts take only free room: they never preempt, and preempted requests still give the solo tokens."""
    plain = make_engine(model)
    expected = [plain.generate([p], greedy(m))[0] for p, m in zip(SPEC_PROMPTS, (40, 30), strict=True)]
    engine = make_engine(model, num_blocks=7, spec_tokens=6)
    got = engine.generate(SPEC_PROMPTS, [greedy(40), greedy(30)])
    assert got == expected
    assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_usable


def test_spec_tokens_config_errors():
    for changes, message in [
        (dict(spec_tokens=-1), "spec_tokens must be 0..32"),
        (dict(spec_tokens=4, graph="step"), "host drafter needs graph 'eager' and sync scheduling"),
        (dict(spec_tokens=4, async_scheduling=True), "host drafter needs graph 'eager' and sync scheduling"),
        (dict(spec_tokens=4, drafter="gpu"), "drafter must be one of host, device"),
        (dict(spec_tokens=4, drafter="device", graph="model"), "drafter 'device' runs with graph 'eager' or"),
    ]:
        with pytest.raises(ValueError, match=message):
            Config(preset="tiny", device="cpu", **changes)


def test_triton_kernels_on_the_cpu_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs TRITON_INTERPRET=1"):
        Config(preset="tiny", device="cpu", kernels="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert Config(preset="tiny", device="cpu", kernels="triton").kernels == "triton"
