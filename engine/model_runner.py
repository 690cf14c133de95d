"""The model runner (vLLM v1's ``GPUModelRunner``, on CPU or CUDA): owns the model, its KV pools and
each request's sampling generator; turns a step's scheduled chunks into one flat batch of tensors,
runs one forward pass and samples the next token of every sequence whose prompt is done.

It knows nothing of text, stop conditions or metrics, and never touches the block pool: it reads
each sequence's block table, which the KV-cache manager wrote.
"""

from __future__ import annotations

import torch

from kvfleet.engine.model import LlamaModel
from kvfleet.engine.paged_attention import AttentionGroup, ForwardBatch, decode_group, prefill_group, slot_table
from kvfleet.engine.sampling import SamplingParams, sample
from kvfleet.engine.scheduler import ScheduledChunk
from kvfleet.engine.sequence import Sequence


def kv_bytes_per_token(model: LlamaModel) -> int:
    """KV-cache bytes one token takes in this model's dtype (the config counts float32)."""
    return model.config.kv_bytes_per_token // 4 * torch.tensor([], dtype=model.dtype).element_size()


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size_tokens: int, seed: int) -> None:
        self.model = model
        self.block_size_tokens = block_size_tokens
        self.k_pools, self.v_pools = model.allocate_kv_pools(num_blocks * block_size_tokens)
        # Seeds for sampled requests that bring none: reproducible for a given engine seed.
        self._seed_rng = torch.Generator().manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def add_request(self, request_id: str, params: SamplingParams) -> None:
        """A sampled (non-greedy) request gets its own generator: its draws depend on nothing else."""
        if params.greedy:
            return
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng).item())
        self._generators[request_id] = torch.Generator(device=self.model.device).manual_seed(seed)

    def remove_request(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def execute(self, chunks: list[ScheduledChunk]) -> list[tuple[Sequence, int]]:
        """One forward over the chunks; each sequence whose chunk ends its known tokens with its next token."""
        batch, sampled = self.build_batch(chunks)
        logits = self.forward(batch)
        if not sampled:
            return []
        seqs = [c.seq for c in sampled]
        generators = [self._generators.get(s.request_id) for s in seqs]
        tokens = sample(logits, [s.params for s in seqs], generators)
        return list(zip(seqs, tokens, strict=True))

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Next-token logits of the batch's ``logits_rows``, writing the step's K/V into the pools."""
        return self.model.forward(batch, self.k_pools, self.v_pools)

    def build_batch(self, chunks: list[ScheduledChunk]) -> tuple[ForwardBatch, list[ScheduledChunk]]:
        """The flat batch (decodes first, attended as one group; then each prefill chunk on its own)
        and the chunks whose last row is sampled, in logits-row order."""
        device = self.model.device
        decodes = [c for c in chunks if c.num_tokens == 1]
        prefills = [c for c in chunks if c.num_tokens > 1]
        ordered = decodes + prefills
        slots = slot_table([c.seq.block_table for c in ordered], self.block_size_tokens)
        token_ids: list[int] = []
        positions: list[int] = []
        slot_rows: list[torch.Tensor] = []
        logits_rows: list[int] = []
        sampled: list[ScheduledChunk] = []
        groups: list[AttentionGroup] = []
        for i, c in enumerate(ordered):
            row = len(token_ids)
            token_ids.extend(c.seq.token_ids[c.start : c.start + c.num_tokens])
            positions.extend(range(c.start, c.start + c.num_tokens))
            slot_rows.append(slots[i, c.start : c.start + c.num_tokens])
            if c.samples:
                logits_rows.append(row + c.num_tokens - 1)
                sampled.append(c)
            if c.num_tokens > 1:
                groups.append(prefill_group(slice(row, row + c.num_tokens), slots[i], c.start, device))
        if decodes:
            ctx = [c.start + 1 for c in decodes]
            groups.insert(0, decode_group(slice(0, len(decodes)), slots[: len(decodes)], ctx, device))
        batch = ForwardBatch(
            token_ids=torch.tensor(token_ids, dtype=torch.long).to(device),
            positions=torch.tensor(positions, dtype=torch.long).to(device),
            slot_mapping=torch.cat(slot_rows).to(device),
            groups=tuple(groups),
            logits_rows=torch.tensor(logits_rows, dtype=torch.long).to(device),
        )
        return batch, sampled
