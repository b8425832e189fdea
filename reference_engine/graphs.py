"""Fixed step buffers and CUDA graphs.

Decode inputs travel as one int32 metadata row per sequence:

    [slot, position, top_k, seed, temperature (f32 bits), top_p (f32 bits), block_table[max_blocks]]

The host fills a pinned slot (two slots, alternating, so filling step n+1 never races the copy of step n), and
`launch` copies it with one non-blocking copy into a *fixed* device buffer (a one-program kernel reading the
pinned slot, host_copy.py). Graphs only ever read the fixed device buffers: a graph that read the pinned slot
directly would read the wrong slot every other step.

Graph modes (Config.graph):
- eager: no graphs.
- model: the forward through the LM head is a graph per padded batch bucket (1, 2, 4, 8, ...); the metadata
  kernels and the sampler run eagerly around it, as in vLLM's default.
- step: the whole decode step is one graph per (batch size, greedy-only): input-metadata kernels (input ids
  gathered from the device token buffer, slot mapping, seq lens), forward, sampler, and the write-back of the
  sampled tokens into the token buffer that the next step reads.
Both capture a key on its second use: the first use runs eagerly, so one-time setup (cuBLAS handles, Triton
autotuning, allocator growth) never happens inside a capture.

Speculative decoding runs two ways. With the host drafter, eager verify steps with host-side drafts and
acceptance (Engine docstring, `StepRunner.verify`). With the device drafter (spec_device.py,
`StepRunner.spec_decode`), inside the step: the drafter reads each sequence's tokens and length from device
buffers (written by the prefill and by every speculative step), the target forward runs over the k + 1 rows
of each sequence, and acceptance, the history write and the length update follow on the device. In graph
"step" all of it is one graph per (batch size, greedy-only), as a plain decode step; the host still does one
copy in (the metadata rows, positions unused) and one copy out ([B, k + 3] results) per step, and the
scheduler reserves blocks for the k + 1 rows of every step the device may be ahead of it. Rejected drafts'
k/v need no cleanup: later steps overwrite them.

Measured on an H200 (qwen3-4b shape, triton kernels, 2026-11-30 and again 2026-12-01 with the fused
projections and PDL): greedy tokens of eager, model and step graphs (sync and async) were bit-identical at one
request, 200 of 200 tokens.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Hashable

import numpy as np
import torch

from reference_engine import spec_device
from reference_engine.config import Config
from reference_engine.drafts import MAX_NGRAM
from reference_engine.host_copy import copy_to
from reference_engine.kernels.torch_ref import spec_record
from reference_engine.model import AttentionMetadata
from reference_engine.sampler import sample

logger = logging.getLogger("reference_engine")

META_SLOT, META_POSITION, META_TOP_K, META_SEED, META_TEMPERATURE, META_TOP_P = range(6)
META_BLOCKS = 6
SPEC_PARAM_COLS = (META_TEMPERATURE, META_TOP_P, META_TOP_K, META_SEED)  # a speculative step's per-row params
# Benchmarks only: False gathers the embedding in its own launch after decode_inputs, as before the fold.
EMBED_WITH_INPUTS = {"on": True}
# Host arrays of a verify step (speculative.verify_rows), one row per sequence token checked.
VERIFY_ARRAYS = ("ids", "positions", "slot_mapping", "block_tables", "seq_lens", "temperature", "top_p",
                 "top_k", "seeds")


def float_bits(value: float) -> int:
    """The int32 bit pattern of a float32 (metadata rows carry floats in int32 columns)."""
    return int(np.array(value, dtype=np.float32).view(np.int32))


class StepBuffers:
    """Pinned host slots (double-buffered) and the fixed device buffers the step reads and writes."""

    def __init__(self, config: Config, device: torch.device) -> None:
        rows = config.max_num_seqs
        width = META_BLOCKS + config.max_blocks_per_seq
        pin = device.type == "cuda"
        self.host_meta = [torch.zeros(rows, width, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self.host_out = [torch.zeros(rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.host_meta_np = [t.numpy() for t in self.host_meta]
        self.decode_meta = torch.zeros(rows, width, dtype=torch.int32, device=device)
        self.prefill_meta = torch.zeros(rows, width, dtype=torch.int32, device=device)
        self.sampled = torch.zeros(rows, dtype=torch.int64, device=device)
        # Latest sampled token per sequence slot; the extra last row is the padding rows' slot.
        self.tokens = torch.zeros(rows + 1, dtype=torch.int64, device=device)
        self.padding_slot = rows
        # Verify steps (speculative decoding): every sequence's last token and drafts, one sampled token each.
        verify_rows = rows * (1 + config.spec_tokens) if config.spec_tokens else 0
        self.host_verify_out = [torch.zeros(verify_rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        # Speculative steps drafted on the device (spec_device.py): each slot's tokens and length, and a row
        # of results per sequence (k + 1 sampled tokens, how many are new, drafts proposed).
        self.spec_k = config.spec_tokens if config.drafter == "device" else 0
        width = spec_device.history_width(config.max_model_len, self.spec_k) if self.spec_k else 0
        self.history = torch.zeros(rows + 1, width, dtype=torch.int64, device=device)
        self.lengths = torch.zeros(rows + 1, dtype=torch.int64, device=device)
        out_width = self.spec_k + 3 if self.spec_k else 0
        self.spec_out = torch.zeros(rows, out_width, dtype=torch.int64, device=device)
        self.host_spec_out = [torch.zeros(rows, out_width, dtype=torch.int64, pin_memory=pin)
                              for _ in range(2)]
        self._next = 0

    def next_slot(self) -> int:
        slot, self._next = self._next, 1 - self._next
        return slot


def batch_buckets(max_num_seqs: int) -> list[int]:
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return sizes + [max_num_seqs]


class GraphCache:
    """CUDA graphs keyed by shape, each captured on its key's second use; counts captures and replays.

    `run(key, fn)` calls fn() eagerly, or replays fn's graph. fn must read and write only tensors whose
    addresses stay fixed (the step buffers, the KV cache, outputs it stores itself), since a replay repeats
    the same kernels on the same addresses.
    """

    def __init__(self, *, enabled: bool, stream: torch.cuda.Stream | None) -> None:
        self.enabled = enabled
        self.stream = stream
        self.pool = torch.cuda.graph_pool_handle() if enabled else None
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.uses: Counter = Counter()
        self.replays = 0

    @property
    def captured_keys(self) -> list:
        return sorted(self.graphs, key=str)

    def run(self, key: Hashable, fn: Callable[[], None]) -> bool:
        """Run fn once (eagerly or by replay). Returns True when a graph was replayed."""
        if not self.enabled:
            fn()
            return False
        graph = self.graphs.get(key)
        if graph is None:
            self.uses[key] += 1
            if self.uses[key] < 2:
                fn()
                return False
            graph = torch.cuda.CUDAGraph()
            # thread_local: other threads (the HTTP server, a recorder) may touch CUDA during the capture.
            with torch.cuda.graph(
                graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"
            ):
                fn()
            self.graphs[key] = graph
            logger.info("captured CUDA graph %s", key)
        graph.replay()
        self.replays += 1
        return True


class StepRunner:
    """The device side of a step: one function per phase, run eagerly or through the graph cache."""

    def __init__(
        self, model, kv_caches: list, buffers: StepBuffers, graphs: GraphCache, config: Config
    ) -> None:
        self.model, self.kv_caches, self.buffers, self.graphs, self.config = (
            model,
            kv_caches,
            buffers,
            graphs,
            config,
        )
        self.buckets = batch_buckets(config.max_num_seqs)
        self.mode = config.graph if graphs.enabled else "eager"
        device = buffers.tokens.device
        rows, width = config.max_num_seqs, config.max_blocks_per_seq
        # model mode: the forward graph's fixed inputs, filled by the eager metadata ops each step.
        self.static_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.static_positions = torch.zeros(rows, dtype=torch.int32, device=device)
        self.static_slots = torch.zeros(rows, dtype=torch.int64, device=device)
        self.static_tables = torch.zeros(rows, width, dtype=torch.int32, device=device)
        self.static_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.static_logits: dict[int, torch.Tensor] = {}

    def padded_size(self, num_seqs: int, phase: str) -> int:
        if phase == "decode" and self.mode == "model":
            return next(b for b in self.buckets if b >= num_seqs)
        return num_seqs

    def prefill(self, inputs: dict) -> None:
        device = self.buffers.tokens.device
        cu_seqlens = inputs["cu_seqlens"]
        count = len(cu_seqlens) - 1
        meta = self.buffers.prefill_meta[:count]
        copy_to(meta, self.buffers.host_meta[inputs["slot"]][:count])
        ids, positions, slots = (
            inputs[k].to(device, non_blocking=True) for k in ("ids", "positions", "slot_mapping")
        )
        last = torch.tensor(cu_seqlens[1:], dtype=torch.int64).sub_(1).to(device, non_blocking=True)
        hidden = self.model.forward(
            ids, positions, self.kv_caches, AttentionMetadata(slots, cu_seqlens=cu_seqlens)
        )
        self._sample_and_store(meta, self.model.compute_logits(hidden[last]), inputs["greedy_only"])
        if self.buffers.spec_k:  # the device drafter's copy of each prompt and its first token
            b = self.buffers
            token_slots = inputs["token_slots"].to(device, non_blocking=True)
            b.history[token_slots, positions.long()] = ids
            spec_record(b.history, b.lengths, meta[:, META_SLOT], b.sampled[:count, None],
                        positions[last].long() + 1, torch.ones_like(last))

    def decode(self, inputs: dict) -> bool:
        """Run one decode step over the padded batch. Returns True when a graph replay served it."""
        size, greedy_only = inputs["padded"], inputs["greedy_only"]
        copy_to(self.buffers.decode_meta[:size], self.buffers.host_meta[inputs["slot"]][:size])
        if self.mode == "step":
            return self.graphs.run(("step", size, greedy_only), lambda: self._decode(size, greedy_only))
        return self._decode(size, greedy_only)

    def _decode(self, size: int, greedy_only: bool) -> bool:
        meta = self.buffers.decode_meta[:size]
        tables = meta[:, META_BLOCKS:]
        # Input-metadata ops: each row's input token is its slot's latest sample, still on the device.
        # In the same launch the embedding rows, except in model mode (its graph starts from the ids).
        embed = self.model.embed if self.mode != "model" and EMBED_WITH_INPUTS["on"] else None
        ids, positions, slot_mapping, seq_lens, *embedded = self.model.ops.decode_inputs(
            meta, self.buffers.tokens, block_size=self.config.block_size, slot_col=META_SLOT,
            position_col=META_POSITION, blocks_col=META_BLOCKS, embed=embed,
        )
        replayed = False
        if self.mode == "model":
            for static, value in (
                (self.static_ids, ids),
                (self.static_positions, positions),
                (self.static_slots, slot_mapping),
                (self.static_tables, tables),
                (self.static_lens, seq_lens),
            ):
                static[:size].copy_(value)
            replayed = self.graphs.run(("model", size), lambda: self._static_forward(size))
            self._sample_and_store(meta, self.static_logits[size], greedy_only)
            return replayed
        attn = AttentionMetadata(slot_mapping, block_tables=tables, seq_lens=seq_lens)
        x = embedded[0] if embedded else None
        hidden = self.model.forward(ids, positions, self.kv_caches, attn, embedded=x)
        self._sample_and_store(meta, self.model.compute_logits(hidden), greedy_only)
        return replayed

    def spec_decode(self, inputs: dict) -> bool:
        """A speculative step drafted on the device (spec_device.py) over the batch; its results land in
        buffers.spec_out. Returns True when a graph replay served it."""
        size, greedy_only = inputs["padded"], inputs["greedy_only"]
        copy_to(self.buffers.decode_meta[:size], self.buffers.host_meta[inputs["slot"]][:size])
        if self.mode == "step":
            return self.graphs.run(("spec", size, greedy_only), lambda: self._spec_decode(size, greedy_only))
        self._spec_decode(size, greedy_only)
        return False

    def _spec_decode(self, size: int, greedy_only: bool) -> None:
        b, cfg, ops = self.buffers, self.config, self.model.ops
        k = b.spec_k
        meta = b.decode_meta[:size]
        rows = ops.spec_rows(meta, b.history, b.lengths, k=k, block_size=cfg.block_size,
                             max_model_len=cfg.max_model_len, max_ngram=MAX_NGRAM, slot_col=META_SLOT,
                             blocks_col=META_BLOCKS, param_cols=SPEC_PARAM_COLS)
        attn = AttentionMetadata(rows.slot_mapping, block_tables=rows.block_tables, seq_lens=rows.seq_lens,
                                 shared_rows=True)
        hidden = self.model.forward(rows.ids, rows.positions, self.kv_caches, attn)
        sampled = sample(
            self.model.compute_logits(hidden), temperature=rows.params[:, 0].view(torch.float32),
            top_p=rows.params[:, 1].view(torch.float32), top_k=rows.params[:, 2], seeds=rows.params[:, 3],
            positions=None if greedy_only else rows.positions + 1, greedy_only=greedy_only, argmax=ops.argmax,
        ).view(size, k + 1)
        ops.spec_accept(sampled, rows, meta[:, META_SLOT], b.history, b.lengths, b.spec_out[:size],
                        max_model_len=cfg.max_model_len)

    def verify(self, inputs: dict) -> torch.Tensor:
        """A speculative step, eagerly: the forward over every sequence's last token and drafts (rows built on
        the host), one token sampled per row. Returns the sampled tokens [rows] on the device."""
        device = self.buffers.tokens.device
        t = {key: inputs[key].to(device, non_blocking=True) for key in VERIFY_ARRAYS}
        attn = AttentionMetadata(t["slot_mapping"], block_tables=t["block_tables"], seq_lens=t["seq_lens"],
                                 shared_rows=True)
        logits = self.model.compute_logits(self.model.forward(t["ids"], t["positions"], self.kv_caches, attn))
        greedy_only = inputs["greedy_only"]
        return sample(
            logits, temperature=t["temperature"], top_p=t["top_p"], top_k=t["top_k"], seeds=t["seeds"],
            positions=None if greedy_only else t["positions"] + 1, greedy_only=greedy_only,
            argmax=self.model.ops.argmax,
        )

    def _static_forward(self, size: int) -> None:
        attn = AttentionMetadata(
            self.static_slots[:size], block_tables=self.static_tables[:size], seq_lens=self.static_lens[:size]
        )
        hidden = self.model.forward(
            self.static_ids[:size], self.static_positions[:size], self.kv_caches, attn
        )
        self.static_logits[size] = self.model.compute_logits(hidden)

    def _sample_and_store(self, meta: torch.Tensor, logits: torch.Tensor, greedy_only: bool) -> None:
        if greedy_only:  # argmax and bookkeeping in one launch (Triton): 3 fewer kernels a step
            self.model.ops.greedy_store(logits, meta[:, META_SLOT], self.buffers.tokens, self.buffers.sampled)
            return
        tokens = sample(
            logits,
            temperature=meta[:, META_TEMPERATURE].view(torch.float32),
            top_p=meta[:, META_TOP_P].view(torch.float32),
            top_k=meta[:, META_TOP_K],
            seeds=meta[:, META_SEED],
            # The noise position (sampling only: greedy steps skip the add kernel).
            positions=None if greedy_only else meta[:, META_POSITION] + 1,
            greedy_only=greedy_only,
            argmax=self.model.ops.argmax,
        )
        # Bookkeeping on the device: the next step reads each row's input id from its slot.
        self.buffers.tokens.index_copy_(0, meta[:, META_SLOT].long(), tokens)
        self.buffers.sampled[: tokens.shape[0]].copy_(tokens)
