"""Continuous batching: which sequences run in the next step.

Prefill and decode are separate steps (no chunked prefill): a step either prefills newly admitted sequences
(whole prompts, up to the token budget) or decodes one token for every running sequence. Prefill goes first,
so a new request waits at most one step to join. With speculative decoding (Config.spec_tokens) a decode
step also carries each greedy sequence's prompt-lookup drafts (speculative.py), which take only free blocks;
with the device drafter (spec_device.py) the device drafts, and each step reserves blocks for the k + 1 rows
of every step it may run ahead of the host.

Admission control: a waiting sequence is admitted (FIFO, no overtaking) only when a sequence slot is free and
the blocks for its whole known text are free now. Preemption: when a decode step needs a new block and none is
free, the most recently admitted running sequence is preempted by recompute: its blocks are freed and it goes
back to the front of the waiting queue, to be prefilled again over prompt + output so far.

Async scheduling: a sequence may have one token "pending" (launched, value not on the host yet). The host
still knows its length, so it can be scheduled again; its input id is read on the device. A preempted sequence
with a pending token waits until that token arrives before it is re-admitted.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from reference_engine.config import Config
from reference_engine.drafts import propose
from reference_engine.kv_cache import BlockManager
from reference_engine.sampler import SamplingParams

OutputCallback = Callable[[list[int], bool, "str | None"], None]


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    on_output: OutputCallback | None = None
    output_ids: list[int] = field(default_factory=list)
    status: str = "waiting"  # waiting | running | finished
    finish_reason: str | None = None
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose k/v are in the cache
    num_pending: int = 0  # tokens launched whose values have not reached the host
    slot: int = -1  # row of the device token buffer holding this sequence's latest sampled token
    draft: list[int] = field(default_factory=list)  # draft tokens scheduled for verification this step
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def known_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """Length including pending tokens."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def finished(self) -> bool:
        return self.status == "finished"


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    phase: str  # prefill | decode
    num_tokens: int
    spec_tokens: int = 0  # draft tokens verified in this step (each sequence's in Sequence.draft)
    # A plain attribute, not a property: the hooks read it every step in C, and a property runs Python there.
    num_seqs: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_seqs = len(self.seqs)  # (seqs is never changed after scheduling)


class Scheduler:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.blocks = BlockManager(config.total_blocks, config.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        return self._schedule_prefill() or self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch | None:
        admitted: list[Sequence] = []
        num_tokens = 0
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            length = len(seq.prompt_ids) + len(seq.output_ids)
            if seq.num_pending or num_tokens + length > self.config.batched_token_budget:
                break
            if not self.blocks.can_allocate(self.blocks.blocks_for(length)):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq.block_table, length)
            seq.slot = self._free_slots.pop()
            seq.status = "running"
            self.running.append(seq)
            admitted.append(seq)
            num_tokens += length
        return ScheduledBatch(admitted, "prefill", num_tokens) if admitted else None

    def can_decode(self, seq: Sequence) -> bool:
        generated = len(seq.output_ids) + seq.num_pending
        return generated < seq.params.max_tokens and seq.num_tokens < self.config.max_model_len

    def _schedule_decode(self) -> ScheduledBatch | None:
        scheduled: list[Sequence] = []
        for seq in list(self.running):
            if seq.status != "running" or not self.can_decode(seq):
                continue
            needed = self._decode_reach(seq)
            while self.blocks.blocks_for(needed) - len(seq.block_table) > self.blocks.num_free:
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status != "running":
                continue
            self.blocks.allocate(seq.block_table, needed)
            scheduled.append(seq)
        if not scheduled:
            return None
        if self.device_drafts:  # drafted on the device: k rows a sequence, whatever the drafter finds
            k, count = self.config.spec_tokens, len(scheduled)
            return ScheduledBatch(scheduled, "decode", count * (k + 1), spec_tokens=count * k)
        for seq in scheduled:
            # Drafts write k/v after the step's token, once every scheduled sequence has its block: they take
            # the room left in the table and the free blocks, and never cause a preemption.
            needed = seq.num_cached + 1
            room = (len(seq.block_table) + self.blocks.num_free) * self.blocks.block_size - needed
            seq.draft = self._draft(seq)[: max(room, 0)]
            self.blocks.allocate(seq.block_table, needed + len(seq.draft))
        drafts = sum(len(seq.draft) for seq in scheduled)
        return ScheduledBatch(scheduled, "decode", len(scheduled) + drafts, spec_tokens=drafts)

    @property
    def device_drafts(self) -> bool:
        return bool(self.config.spec_tokens) and self.config.drafter == "device"

    def _decode_reach(self, seq: Sequence) -> int:
        """Tokens the step's k/v writes may reach. A plain step writes position num_cached. A device-drafted
        step writes k + 1 rows from the device's length, which each launched step whose tokens have not
        reached the host may have advanced by up to k + 1 (spec_device.py). Never past the request's last
        token (prompt + max_tokens, which submit checked fits the cache) or max_model_len: rows beyond the
        table write into the reserved block 0, and their tokens are dropped by the host."""
        if not self.device_drafts:
            return seq.num_cached + 1
        k = self.config.spec_tokens
        known = len(seq.prompt_ids) + len(seq.output_ids)
        last = len(seq.prompt_ids) + seq.params.max_tokens
        return min(known + (seq.num_pending + 1) * (k + 1), last, self.config.max_model_len)

    def _draft(self, seq: Sequence) -> list[int]:
        """Prompt-lookup drafts for a greedy sequence, never past its max_tokens or max_model_len (the verify
        step yields up to len(draft) + 1 tokens). Sampled sequences get none: verifying them needs rejection
        sampling, which this engine does not do yet."""
        k = self.config.spec_tokens
        if not k or not seq.params.greedy or self.device_drafts:
            return []
        room = min(seq.params.max_tokens - len(seq.output_ids) - seq.num_pending,
                   self.config.max_model_len - seq.num_tokens) - 1
        return propose(seq.known_ids, min(k, room)) if room > 0 else []

    def preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = "waiting"
        seq.num_cached = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status == "waiting" and seq in self.waiting:  # not in it when never scheduled at all
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = "finished"
        seq.finish_reason = reason

    def _release(self, seq: Sequence) -> None:
        if seq.status == "running":
            self.running.remove(seq)
            self._free_slots.append(seq.slot)
            seq.slot = -1
        self.blocks.free(seq.block_table)
