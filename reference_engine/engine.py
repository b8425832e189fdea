"""The engine: a thread that runs schedule -> prepare_inputs -> launch -> wait_for_results -> update_requests.

The phases are methods with fixed names so that engine_hooks/reference.py can time them without code changes
(docs/contracts.md section 6). One `step()` is one loop iteration (a step boundary).

Synchronous mode: each step waits for its own results. Async scheduling (mini-sglang's overlap): step n+1 is
scheduled, prepared and launched before step n's tokens reach the host. That works because a decode step never
needs the previous token on the host: each sequence's latest token lives in a device buffer row (its slot)
that the sampler writes and the next step reads. Sampled tokens are copied to a pinned host buffer with an
event, and consumed one step later. The cost: a sequence that hit EOS runs one extra step (its token is
dropped).

Speculative decoding (Config.spec_tokens), host drafter (eager and sync only): the scheduler attaches
prompt-lookup drafts to greedy sequences; prepare_inputs builds one row per sequence token to check (its last
token, then its drafts, at consecutive positions); launch runs them as one eager forward
(`StepRunner.verify`); update_requests keeps the drafts that equal the target's tokens plus the target's next
token. All of it runs on the host around the step, the CPU work a general engine pays (the case study's
baseline). Device drafter (Config.drafter = "device"): drafts, verification and acceptance run inside the
step (spec_device.py; one CUDA graph in graph "step", with or without async scheduling), and
update_requests only appends each sequence's new tokens from its row of results.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
from dataclasses import asdict, dataclass

import numpy as np
import torch

from reference_engine import spec_device
from reference_engine.config import Config
from reference_engine.graphs import (
    META_BLOCKS,
    GraphCache,
    StepBuffers,
    StepRunner,
    batch_buckets,
    float_bits,
)
from reference_engine.host_copy import copy_to
from reference_engine.kv_cache import allocate_kv_cache
from reference_engine.model import Qwen3Model
from reference_engine.sampler import SamplingParams
from reference_engine.scheduler import OutputCallback, ScheduledBatch, Scheduler, Sequence
from reference_engine.speculative import accept, verify_rows
from reference_engine.tokenizer import load_tokenizer

__all__ = ["Engine", "EngineStats", "SamplingParams", "ScheduledBatch", "Sequence"]

logger = logging.getLogger("reference_engine")


@dataclass
class EngineStats:
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    graph_replays: int = 0  # decode steps (step mode) or forwards (model mode) served by a CUDA graph
    graph_captures: int = 0
    preemptions: int = 0
    tokens_generated: int = 0
    draft_tokens: int = 0  # speculative decoding: drafts verified, and how many of them were accepted
    accepted_tokens: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class InFlight:
    """A launched step whose sampled tokens are on their way to the host."""

    batch: ScheduledBatch
    host_tokens: torch.Tensor  # pinned view [rows], valid once `ready` has completed
    ready: torch.cuda.Event | None  # None on CPU: the copy was synchronous
    rows: list[int] | None = None  # verify steps: rows per sequence (its last token + its drafts)
    spec: bool = False  # a step drafted on the device: a row of results per sequence (spec_device.py)


class Engine:
    def __init__(self, config: Config, *, model: Qwen3Model | None = None) -> None:
        self.config = config
        self.device = torch.device(config.device)
        if model is None:
            from reference_engine.loader import load_model

            model = load_model(config)
        if model.config is not config:  # a shared model: bind its kernels and tables to this config
            model = model.with_config(config)
        self.model = model
        self.tokenizer = load_tokenizer(config.model, vocab_size=config.vocab_size)
        self.bos_token_id = (
            config.bos_token_id if config.bos_token_id is not None else self.tokenizer.bos_token_id
        )
        self.eos_token_id = (
            config.eos_token_id if config.eos_token_id is not None else self.tokenizer.eos_token_id
        )
        cuda = self.device.type == "cuda"
        self.stream: torch.cuda.Stream | None = torch.cuda.Stream(self.device) if cuda else None
        self.kv_caches = allocate_kv_cache(config, dtype=model.dtype)
        self.scheduler = Scheduler(config)
        self.buffers = StepBuffers(config, self.device)
        if config.graph != "eager" and not cuda:
            # Accepted rather than refused (the case-study script runs every configuration on CPU machines
            # too), but said once at start-up: no graph is captured here.
            logger.warning("--graph %s needs CUDA: on %s every step runs eager and no CUDA graph is captured",
                           config.graph, self.device)
        self.graphs = GraphCache(enabled=cuda and config.graph != "eager", stream=self.stream)
        self.runner = StepRunner(model, self.kv_caches, self.buffers, self.graphs, config)
        self.stats = EngineStats()
        if cuda:
            torch.cuda.synchronize(self.device)  # weights and cache were made on the default stream
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: dict[str, Sequence] = {}
        self._inflight: InFlight | None = None
        self._counter = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._failed: Exception | None = None
        self._lock = threading.Lock()

    # --- public API (any thread)
    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        *,
        on_output: OutputCallback | None = None,
        request_id: str | None = None,
    ) -> Sequence:
        """Queue a request; raises ValueError for a prompt the engine can never serve."""
        if self._failed is not None:
            raise RuntimeError(f"engine stopped after an error: {self._failed!r}")
        params = params or SamplingParams()
        prompt_ids = [int(t) for t in prompt_ids]
        cfg = self.config
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if len(prompt_ids) >= cfg.max_model_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; max_model_len is {cfg.max_model_len}")
        if min(prompt_ids) < 0 or max(prompt_ids) >= cfg.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {cfg.vocab_size})")
        longest = min(len(prompt_ids) + params.max_tokens, cfg.max_model_len)
        if self.scheduler.blocks.blocks_for(longest) > self.scheduler.blocks.num_usable:
            raise ValueError(f"request needs more KV blocks than the cache has ({cfg.total_blocks - 1})")
        number = next(self._counter)
        seed = params.seed if params.seed is not None else cfg.seed * 1_000_003 + number
        seq = Sequence(request_id or f"req-{number}", prompt_ids, params, seed & 0x7FFFFFFF, on_output)
        self._inbox.put(("add", seq))
        return seq

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks (done by the engine thread at its next step)."""
        self._inbox.put(("abort", request_id))

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[list[int]]:
        """Blocking helper: run prompts to completion (on the engine thread if started, else on this one)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.submit(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        if self._thread is None:
            while not all(s.done.is_set() for s in seqs):
                if not self.has_work():
                    raise RuntimeError("engine has no work but requests are unfinished")
                self.step()
        for seq in seqs:
            seq.done.wait()
        return [list(s.output_ids) for s in seqs]

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        """Stop the engine thread; unfinished requests end with finish_reason "abort"."""
        self._stopping = True
        self._inbox.put(("stop", None))
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._end_all("abort")

    def _end_all(self, reason: str) -> None:
        while not self._inbox.empty():  # requests submitted but never seen by the loop
            kind, value = self._inbox.get()
            if kind == "add":
                self._requests[value.request_id] = value
        for seq in list(self._requests.values()):
            self._finish(seq, reason)

    # --- the loop
    def _run(self) -> None:
        try:
            while not self._stopping:
                if not self.has_work():
                    self.wait_for_work()
                    continue
                self.step()
        except Exception as exc:
            # Fail loudly but leave no caller waiting: every request ends, later submits raise.
            logger.exception("engine thread failed; ending all requests with finish_reason 'error'")
            self._failed = exc
            self._end_all("error")

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None or not self._inbox.empty()

    def step(self) -> None:
        """One loop iteration: launch the next batch (if any) and process the results of one batch."""
        batch = self.schedule()
        launched = self.launch(batch, self.prepare_inputs(batch)) if batch is not None else None
        finished = self._inflight if self.config.async_scheduling else launched
        self._inflight = launched if self.config.async_scheduling else None
        if finished is not None:
            self.update_requests(finished, self.wait_for_results(finished))
        self.stats.steps += 1

    def wait_for_work(self) -> None:
        """Block until a request (or a stop) arrives: the engine is idle."""
        self._handle(self._inbox.get())

    def schedule(self) -> ScheduledBatch | None:
        while not self._inbox.empty():
            self._handle(self._inbox.get())
        batch = self.scheduler.schedule()
        self.stats.preemptions = self.scheduler.num_preemptions
        return batch

    def prepare_inputs(self, batch: ScheduledBatch) -> dict:
        """Fill a pinned host slot with the step's metadata rows (CPU work only; copies happen in launch).
        Verify steps (speculative decoding) build their own per-token rows instead."""
        slot = self.buffers.next_slot()
        greedy_only = all(s.params.greedy for s in batch.seqs)
        if batch.phase == "decode" and self.config.spec_tokens and not self.buffers.spec_k:
            return {"slot": slot, "greedy_only": greedy_only, **verify_rows(batch, self.config)}
        rows = self.buffers.host_meta_np[slot]
        padded = self.runner.padded_size(batch.num_seqs, batch.phase)
        for i, seq in enumerate(batch.seqs):
            row = rows[i]
            table = seq.block_table
            row[:META_BLOCKS] = (
                seq.slot,
                seq.num_cached if batch.phase == "decode" else seq.num_tokens - 1,
                seq.params.top_k,
                seq.seed,
                float_bits(seq.params.temperature),
                float_bits(seq.params.top_p),
            )
            row[META_BLOCKS : META_BLOCKS + len(table)] = table
            row[META_BLOCKS + len(table) :] = 0
        rows[batch.num_seqs : padded] = 0
        rows[batch.num_seqs : padded, 0] = self.buffers.padding_slot
        inputs = {"slot": slot, "padded": padded, "greedy_only": greedy_only}
        if batch.phase == "prefill":
            inputs.update(self._prefill_arrays(batch))
        return inputs

    def _prefill_arrays(self, batch: ScheduledBatch) -> dict:
        ids, positions, slots, cu_seqlens = [], [], [], [0]
        block_size = self.config.block_size
        for seq in batch.seqs:
            known = seq.known_ids
            pos = np.arange(len(known))
            table = np.asarray(seq.block_table)
            ids.extend(known)
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            cu_seqlens.append(cu_seqlens[-1] + len(known))
        lengths = np.diff(cu_seqlens)
        return {
            "ids": torch.tensor(ids, dtype=torch.int64),
            "positions": torch.from_numpy(np.concatenate(positions)),
            "slot_mapping": torch.from_numpy(np.concatenate(slots)),
            "cu_seqlens": cu_seqlens,
            # Each token's sequence slot: the device drafter keeps a copy of every prompt.
            "token_slots": torch.from_numpy(np.repeat([seq.slot for seq in batch.seqs], lengths)),
        }

    def launch(self, batch: ScheduledBatch, inputs: dict) -> InFlight:
        """Queue all of the step's device work on `self.stream`: copies in, compute, copy of tokens out."""
        rows = inputs.get("verify")
        spec = batch.phase == "decode" and bool(self.buffers.spec_k)
        if rows is not None:
            out = self.buffers.host_verify_out[inputs["slot"]][: sum(rows)]
        elif spec:
            out = self.buffers.host_spec_out[inputs["slot"]][: batch.num_seqs]
        else:
            out = self.buffers.host_out[inputs["slot"]][: batch.num_seqs]
        context = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with context:
            if batch.phase == "prefill":
                self.runner.prefill(inputs)
                self.stats.prefill_steps += 1
                sampled = self.buffers.sampled[: batch.num_seqs]
            elif rows is not None:
                sampled = self.runner.verify(inputs)
                self.stats.decode_steps += 1
            elif spec:
                if self.runner.spec_decode(inputs):
                    self.stats.graph_replays += 1
                self.stats.decode_steps += 1
                sampled = self.buffers.spec_out[: batch.num_seqs]
            else:
                if self.runner.decode(inputs):
                    self.stats.graph_replays += 1
                self.stats.decode_steps += 1
                sampled = self.buffers.sampled[: batch.num_seqs]
            copy_to(out, sampled)
            ready = None
            if self.stream is not None:
                ready = torch.cuda.Event()
                ready.record(self.stream)
        self.stats.graph_captures = len(self.graphs.graphs)
        for seq in batch.seqs:
            seq.num_cached = seq.num_tokens  # verify steps: set again once the accepted count is known
            seq.num_pending += 1
        return InFlight(batch, out, ready, rows, spec)

    def wait_for_results(self, inflight: InFlight) -> list[int]:
        """Block until the step's sampled tokens are on the host."""
        if inflight.ready is not None:
            inflight.ready.synchronize()
        return inflight.host_tokens.tolist()

    def update_requests(self, inflight: InFlight, tokens: list[int]) -> int | None:
        """Append each sequence's new tokens, stop finished ones (EOS, max_tokens, max_model_len). Returns the
        drafts accepted in a verify step (None after other steps), for the hooks' accepted_tokens fact."""
        accepted = None
        if inflight.rows is not None:
            per_seq, drafted, accepted = accept(inflight.batch, inflight.rows, tokens)
        elif inflight.spec:
            live = [not seq.finished for seq in inflight.batch.seqs]
            per_seq, drafted, accepted = spec_device.read_results(tokens, live)
        else:
            per_seq = [[token] for token in tokens]
        if accepted is not None:
            self.stats.draft_tokens += drafted
            self.stats.accepted_tokens += accepted
        for seq, new in zip(inflight.batch.seqs, per_seq, strict=True):
            if seq.finished:
                continue  # aborted, or the extra async step after its last token
            seq.num_pending -= 1
            emitted, reason = [], None
            for token in new:
                seq.output_ids.append(token)
                emitted.append(token)
                self.stats.tokens_generated += 1
                if token == self.eos_token_id and not seq.params.ignore_eos:
                    reason = "stop"
                elif len(seq.output_ids) >= seq.params.max_tokens:
                    reason = "length"
                elif len(seq.prompt_ids) + len(seq.output_ids) >= self.config.max_model_len:
                    reason = "length"
                if reason is not None:
                    break
            if inflight.rows is not None or inflight.spec:
                # The k/v of the last token and the accepted drafts are valid; the newest token has none yet.
                seq.num_cached = len(seq.prompt_ids) + len(seq.output_ids) - 1
            if reason is not None:
                self._finish(seq, reason, new_tokens=emitted)
            else:
                self._emit(seq, emitted, False, None)
        return accepted

    # --- helpers
    def _handle(self, item: tuple) -> None:
        kind, value = item
        if kind == "add":
            self._requests[value.request_id] = value
            self.scheduler.add(value)
        elif kind == "abort":
            seq = self._requests.get(value)
            if seq is not None:
                self._finish(seq, "abort")

    def _finish(self, seq: Sequence, reason: str, *, new_tokens: list[int] | None = None) -> None:
        with self._lock:
            if seq.finished:
                return
            self.scheduler.finish(seq, reason)
            self._requests.pop(seq.request_id, None)
        try:
            self._emit(seq, new_tokens or [], True, reason)
        finally:
            seq.done.set()

    def _emit(self, seq: Sequence, tokens: list[int], finished: bool, reason: str | None) -> None:
        """Call the request's callback; a callback that raises ends its own request, not the engine."""
        if seq.on_output is None:
            return
        try:
            seq.on_output(tokens, finished, reason)
        except Exception:
            logger.exception("on_output of %s raised; ending that request", seq.request_id)
            if not finished:
                self._finish(seq, "error")

    def describe(self) -> str:
        cfg = self.config
        sizes = batch_buckets(cfg.max_num_seqs) if cfg.graph == "model" else "captured on second use"
        return (
            f"{cfg.model or cfg.preset} on {cfg.device} ({self.model.dtype}), graph={cfg.graph} "
            f"kernels={cfg.kernels} async={cfg.async_scheduling} max_num_seqs={cfg.max_num_seqs} "
            f"blocks={cfg.total_blocks}x{cfg.block_size} graph sizes={sizes}"
        )
