"""The model runner (vLLM v1's ``GPUModelRunner``, on CPU or CUDA): owns the model, its KV pools and
each request's sampling generator; turns a step's scheduled chunks into one flat batch of tensors,
runs one forward pass and samples the next token of every sequence whose prompt is done.

Two paths, chosen per step by ``step_shapes.uniform_shape``:

- **uniform** (decodes and short chunks, the steady state): inputs packed into one preallocated
  (pinned, on CUDA) buffer, one host-to-device copy, a forward of the bucket's fixed shape (a
  replayed CUDA graph on CUDA), attention through fixed-width block tables;
- **variable-length** (a step with a longer prefill chunk): the flat batch of
  ``paged_attention.py``, eager or compiled, as prefill work is compute-bound.

Either way sampling runs on the model's device and the sampled ids come back in one
device-to-host copy, the step's one host sync. :meth:`ModelRunner.launch` only enqueues the step
(forward, sampling, the copy into a pinned buffer) and :meth:`ModelRunner.collect` waits for its
ids, so the engine can launch step N+1 before it collects step N (overlapped scheduling,
``engine_core.py``). Then a sequence's token from step N is a placeholder ``-(row + 1)`` in step
N+1's inputs, replaced on the device by row ``row`` of step N's sampled ids (a fixed device buffer,
which a CUDA graph reads too).

It knows nothing of text, stop conditions or metrics, and never touches the block pool: it reads
each sequence's block table, which the KV-cache manager wrote.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfleet.engine.block_table_attention import (
    UniformBatch,
    UniformChunk,
    flat_len,
    pack_uniform,
    resolve_placeholders,
)
from kvfleet.engine.cuda_graphs import MAX_GRAPHS, UniformStepGraphs
from kvfleet.engine.model import LlamaModel
from kvfleet.engine.paged_attention import AttentionGroup, ForwardBatch, decode_group, prefill_group, slot_table
from kvfleet.engine.sampling import SamplingParams, sample_tokens
from kvfleet.engine.scheduler import ScheduledChunk
from kvfleet.engine.sequence import Sequence
from kvfleet.engine.step_shapes import MAX_UNIFORM_ROWS, StepShape, uniform_shape


def kv_bytes_per_token(model: LlamaModel) -> int:
    """KV-cache bytes one token takes in this model's dtype (the config counts float32)."""
    return model.config.kv_bytes_per_token // 4 * torch.tensor([], dtype=model.dtype).element_size()


@dataclass
class LaunchedStep:
    """A step enqueued on the device: its sampled ids arrive in ``host`` once ``copied`` is reached."""

    seqs: list[Sequence]  # the sampled sequences, in the order of their ids
    host: torch.Tensor  # pinned host buffer the ids are copied into (on CPU: the ids)
    copied: torch.cuda.Event | None  # None on CPU: the ids are there already


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        num_blocks: int,
        block_size_tokens: int,
        seed: int,
        *,
        max_num_seqs: int = 64,
        max_model_len_tokens: int = 0,
        cuda_graphs: bool = True,
        overlap: bool = False,
    ) -> None:
        self.model = model
        self.block_size_tokens = block_size_tokens
        self.max_num_seqs = max_num_seqs
        max_len = max_model_len_tokens or model.config.max_position_embeddings
        # The widest block table a uniform step can need: the longest admitted sequence, or the pool.
        self.max_table_blocks = min(-(-max_len // block_size_tokens), num_blocks)
        # One block past the pool's own is scratch: padded rows of uniform steps write there.
        self.scratch_block = num_blocks
        self.k_pools, self.v_pools = model.allocate_kv_pools((num_blocks + 1) * block_size_tokens)
        device = model.device
        on_cuda = device.type == "cuda"
        # The largest packed input of any uniform bucket, preallocated once (pinned on CUDA, so the
        # step's host-to-device copy does not block the host). Two of each host buffer, used in
        # turn: with overlapped steps, step N+1 fills one while step N's copy may still read the other.
        widest = StepShape(min(MAX_UNIFORM_ROWS, max_num_seqs), 1, self.max_table_blocks)
        longest = StepShape(min(MAX_UNIFORM_ROWS // 16, max_num_seqs), 16, self.max_table_blocks)
        size = max(flat_len(widest), flat_len(longest))
        self._host_inputs = [torch.empty(size, dtype=torch.long, pin_memory=on_cuda) for _ in range(2)]
        self._host_inputs_np = [t.numpy() for t in self._host_inputs]
        self._host_tokens = [torch.empty(max_num_seqs + 1, dtype=torch.long, pin_memory=on_cuda) for _ in range(2)]
        self._inputs_copied = [torch.cuda.Event() for _ in range(2)] if on_cuda else None
        self._tokens_copied = [torch.cuda.Event() for _ in range(2)] if on_cuda else None
        self._input_turn = 0
        self._tokens_turn = 0
        # Overlapped scheduling: the last step's sampled ids stay on the device for the next step's
        # placeholder tokens (fixed address: captured graphs read it).
        self._sampled = torch.zeros(max_num_seqs + 1, dtype=torch.long, device=device) if overlap else None
        self.graphs = (
            UniformStepGraphs(model, self.k_pools, self.v_pools, block_size_tokens, MAX_GRAPHS, self._sampled)
            if on_cuda and cuda_graphs
            else None
        )
        # Observability for tests and benchmarks: device-to-host copies made, steps per path.
        self.host_copies = 0
        self.uniform_steps = 0
        self.varlen_steps = 0
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
        launched = self.launch(chunks)
        return [] if launched is None else self.collect(launched)

    def launch(self, chunks: list[ScheduledChunk]) -> LaunchedStep | None:
        """Enqueue the step's forward, its sampling and the copy of its sampled ids to the host,
        without waiting for the device (but for a first capture); None when nothing samples."""
        shape = self.uniform_shape(chunks)
        if shape is not None:
            # Sampled chunks first, so their logits are the leading rows.
            ordered = sorted(chunks, key=lambda c: not c.samples)
            sampled = [c for c in ordered if c.samples]
            logits = self.forward_uniform(shape, ordered)[: len(sampled)]
            self.uniform_steps += 1
        else:
            batch, sampled = self.build_batch(chunks)
            logits = self.forward(batch)
            self.varlen_steps += 1
        if not sampled:
            return None
        seqs = [c.seq for c in sampled]
        generators = [self._generators.get(s.request_id) for s in seqs]
        tokens = sample_tokens(logits, [s.params for s in seqs], generators)
        self.host_copies += 1
        if self._sampled is not None:
            self._sampled[: tokens.shape[0]].copy_(tokens)
        if self._tokens_copied is None:
            return LaunchedStep(seqs, tokens, None)
        turn = self._tokens_turn
        self._tokens_turn ^= 1
        host = self._host_tokens[turn][: tokens.shape[0]]
        host.copy_(tokens, non_blocking=True)
        copied = self._tokens_copied[turn]
        copied.record()
        return LaunchedStep(seqs, host, copied)

    @staticmethod
    def collect(launched: LaunchedStep) -> list[tuple[Sequence, int]]:
        """The step's sampled ids, waiting for their copy (the step's one wait for the device)."""
        if launched.copied is not None:
            launched.copied.synchronize()
        return list(zip(launched.seqs, launched.host.tolist(), strict=True))

    def uniform_shape(self, chunks: list[ScheduledChunk]) -> StepShape | None:
        bs = self.block_size_tokens
        return uniform_shape(
            [c.num_tokens for c in chunks],
            [-(-(c.start + c.num_tokens) // bs) for c in chunks],
            max_num_seqs=self.max_num_seqs,
            max_blocks=self.max_table_blocks,
        )

    def forward_uniform(self, shape: StepShape, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Logits of each chunk's last row (``[shape.batch, vocab]``, chunks' order, padding after)."""
        turn = self._input_turn
        self._input_turn ^= 1
        if self._inputs_copied is not None:
            self._inputs_copied[turn].synchronize()  # the copy of two steps ago has left this buffer
        pack_uniform(
            shape,
            [
                UniformChunk(c.seq.token_ids[c.start : c.start + c.num_tokens], c.start, c.seq.block_table)
                for c in chunks
            ],
            self.block_size_tokens,
            self.scratch_block,
            self._host_inputs_np[turn],
        )
        host = self._host_inputs[turn][: flat_len(shape)]
        if self.graphs is not None:
            logits = self.graphs.run(shape, host)
        else:
            inputs = host.to(self.model.device, non_blocking=True)
            batch = UniformBatch.from_flat(shape, inputs, self._sampled)
            logits = self.model.forward_uniform(batch, self.k_pools, self.v_pools, self.block_size_tokens)
        if self._inputs_copied is not None:
            self._inputs_copied[turn].record()
        return logits

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
        ids = torch.tensor(token_ids, dtype=torch.long).to(device)
        batch = ForwardBatch(
            token_ids=ids if self._sampled is None else resolve_placeholders(ids, self._sampled),
            positions=torch.tensor(positions, dtype=torch.long).to(device),
            slot_mapping=torch.cat(slot_rows).to(device),
            groups=tuple(groups),
            logits_rows=torch.tensor(logits_rows, dtype=torch.long).to(device),
        )
        return batch, sampled
