"""Continuous batching: which sequences run this step and how many tokens each.

Each step first serves the running sequences in admission order (a decode is one token; a
sequence still in its prompt gets a chunk), then admits waiting ones, all under one token budget,
so a long prompt is split across steps while decodes keep flowing. When the pool cannot hold a
running sequence's next tokens, the most recently admitted sequence is preempted: its blocks are
released (they stay in the prefix cache) and it is recomputed later. The oldest running sequence
always makes progress, and a sequence only enters when it fits the pool alone (checked at
admission by the server), so this never deadlocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvfleet.engine.kv_cache_manager import KVCacheManager
from kvfleet.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # first token position computed this step
    num_tokens: int
    # After this chunk every known token is computed, so the step samples a next token.
    samples: bool


@dataclass(frozen=True)
class Preemption:
    request_id: str
    reason: str


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Preemption] = field(default_factory=list)
    # Prefix-cache counters of this step's admissions, in tokens (vLLM counts tokens).
    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def computed_prompt_tokens(self) -> int:
        """Prompt tokens this step runs through the model (prefix-cache hits are not among them)."""
        return sum(max(0, min(c.start + c.num_tokens, c.seq.num_prompt_tokens) - c.start) for c in self.chunks)


class Scheduler:
    """Which sequences run each step; their KV blocks only through ``kv_cache``."""

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:  # when memory is short, admitting more now would only thrash
            self._admit_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Running sequences in admission order, preempting the newest when blocks run out; the budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_pending_tokens and seq.num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens:
                # Its token in flight is its last (max_tokens; admission keeps that within the
                # context): a step after it would only be discarded.
                i += 1
                continue
            start = seq.num_computed_tokens
            n = min(seq.num_tokens - start, budget)
            while not self.kv_cache.allocate_slots(seq, n):
                victim = self.running[-1]
                need, free = self.kv_cache.blocks_needed(seq, n), self.kv_cache.num_free_blocks
                self._preempt(victim, f"KV pool full: {seq.request_id} needs {need} blocks, {free} free", out)
                if victim is seq:
                    return budget  # seq itself was the newest; nothing after it is left
            out.chunks.append(ScheduledChunk(seq, start, n, start + n == seq.num_tokens))
            budget -= n
            i += 1
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Waiting sequences in order, each starting after its cached prefix, while the budget, the
        running bound and the pool allow."""
        bs = self.kv_cache.block_size_tokens
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending_tokens:
                break  # preempted with a token in flight: its prefix is hashed once the id is known
            hits = self.kv_cache.get_computed_blocks(seq)
            start = len(hits) * bs
            n = min(seq.num_tokens - start, budget)
            if not self.kv_cache.allocate_slots(seq, n, computed_blocks=hits):
                break  # waits for running sequences to finish
            seq.num_computed_tokens = start
            seq.status = SequenceStatus.RUNNING
            if seq.num_preemptions == 0:
                out.prefix_queries_tokens += seq.num_tokens
                out.prefix_hits_tokens += start
                seq.num_cached_prompt_tokens = start
            self.waiting.popleft()
            self.running.append(seq)
            out.chunks.append(ScheduledChunk(seq, start, n, start + n == seq.num_tokens))
            budget -= n

    def _preempt(self, seq: Sequence, reason: str, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv_cache.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(Preemption(seq.request_id, reason))

    def after_step(self, chunks: list[ScheduledChunk]) -> None:
        """Advance computed counts and make newly full, computed blocks findable in the prefix cache."""
        for chunk in chunks:
            chunk.seq.num_computed_tokens = chunk.start + chunk.num_tokens
            self.kv_cache.cache_computed_blocks(chunk.seq)

    def token_known(self, seq: Sequence) -> None:
        """A sequence's token in flight reached the host: blocks it completes become findable."""
        self.kv_cache.cache_computed_blocks(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence (finished or aborted) and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv_cache.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
