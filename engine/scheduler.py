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

from kvfleet.engine.block_pool import BlockPool, blocks_for_tokens, chain_block_hashes
from kvfleet.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    block_size_tokens: int
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


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, hash_seed: bytes) -> None:
        self.config = config
        self.pool = pool
        self.hash_seed = hash_seed
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _update_hashes(self, seq: Sequence) -> None:
        bs = self.config.block_size_tokens
        known = len(seq.block_hashes)
        if seq.num_tokens // bs > known:
            parent = seq.block_hashes[-1] if seq.block_hashes else self.hash_seed
            seq.block_hashes.extend(chain_block_hashes(parent, seq.token_ids[known * bs :], bs))

    def _preempt(self, seq: Sequence, reason: str, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(Preemption(seq.request_id, reason))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        bs = self.config.block_size_tokens
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            start = seq.num_computed_tokens
            n = min(seq.num_tokens - start, budget)
            need = blocks_for_tokens(start + n, bs) - len(seq.block_table)
            while need > self.pool.num_free and seq in self.running:
                victim = self.running[-1]
                self._preempt(
                    victim, f"KV pool full: {seq.request_id} needs {need} blocks, {self.pool.num_free} free", out
                )
            if seq not in self.running:
                break  # seq itself was the newest and got preempted; nothing after it is left
            if need > 0:
                seq.block_table.extend(self.pool.allocate(need))
            out.chunks.append(ScheduledChunk(seq, start, n, start + n == seq.num_tokens))
            budget -= n
            i += 1
        if out.preempted:
            return out  # memory is short: admitting more now would only thrash
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            self._update_hashes(seq)
            # Always compute at least the last token: its logits give the first new token.
            max_hit_blocks = (seq.num_tokens - 1) // bs
            hits = self.pool.match_prefix(seq.block_hashes[:max_hit_blocks])
            start = len(hits) * bs
            n = min(seq.num_tokens - start, budget)
            need = blocks_for_tokens(start + n, bs) - len(hits)
            if need + self.pool.free_needed_to_share(hits) > self.pool.num_free:
                break  # waits for running sequences to finish
            self.pool.share(hits)
            seq.block_table = hits + self.pool.allocate(need)
            seq.num_computed_tokens = start
            seq.num_registered_blocks = len(hits)
            seq.status = SequenceStatus.RUNNING
            if seq.num_preemptions == 0:
                out.prefix_queries_tokens += seq.num_tokens
                out.prefix_hits_tokens += start
                seq.num_cached_prompt_tokens = start
            self.waiting.popleft()
            self.running.append(seq)
            out.chunks.append(ScheduledChunk(seq, start, n, start + n == seq.num_tokens))
            budget -= n
        return out

    def after_step(self, chunks: list[ScheduledChunk]) -> None:
        """Advance computed counts and make newly full, computed blocks findable in the prefix cache."""
        bs = self.config.block_size_tokens
        for chunk in chunks:
            seq = chunk.seq
            seq.num_computed_tokens = chunk.start + chunk.num_tokens
            full = seq.num_computed_tokens // bs
            if full > seq.num_registered_blocks:
                self._update_hashes(seq)
                hashes = seq.block_hashes
                for b in range(seq.num_registered_blocks, full):
                    parent = hashes[b - 1] if b else None
                    self.pool.register(seq.block_table[b], hashes[b], parent, seq.token_ids[b * bs : (b + 1) * bs])
                seq.num_registered_blocks = full

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence (finished or aborted) and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
