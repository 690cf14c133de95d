"""Attention of a uniform step (``step_shapes.py``) through fixed-width block tables.

Every sequence of the step has ``query`` query rows and a block table of ``width_blocks`` blocks,
both padded to the step's bucket, so the whole step has one shape per bucket: planned once, and
on CUDA captured once as a graph (``cuda_graphs.py``). Attention reads each sequence's K/V from
the blocks its table names, one batched block lookup per layer, with no per-step index built on
the host and no Python loop over sequences.

Padding never touches real data: padded query rows and padded sequences write their K/V into a
scratch block no sequence owns, padded table columns name that scratch block, and a query at
position ``p`` attends keys ``0..p`` only, so padded columns (positions past every real query)
are always masked.

The inputs of a step travel as one flat ``int64`` buffer (:func:`pack_uniform`): one host-to-device
copy per step from a preallocated (pinned, on CUDA) host buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kvfleet.engine.step_shapes import StepShape


def flat_len(shape: StepShape) -> int:
    """int64 slots of a step's packed inputs: tokens, positions, slots (one per row), the block
    tables, and the row whose logits each sequence samples from."""
    return 3 * shape.rows + shape.batch * shape.width_blocks + shape.batch


@dataclass(frozen=True)
class UniformBatch:
    """Views into one packed input buffer, on the model's device."""

    shape: StepShape
    token_ids: torch.Tensor  # [rows]
    positions: torch.Tensor  # [rows]
    slot_mapping: torch.Tensor  # [rows]: the pool slot each row's K/V is written to
    block_tables: torch.Tensor  # [batch, width_blocks]
    logits_rows: torch.Tensor  # [batch]

    @classmethod
    def from_flat(cls, shape: StepShape, flat: torch.Tensor, sampled: torch.Tensor | None = None) -> UniformBatch:
        """``sampled``: the device buffer of the previous step's sampled ids, which placeholder
        token ids (:func:`resolve_placeholders`) read; None when no step is overlapped."""
        r, b, w = shape.rows, shape.batch, shape.width_blocks
        tokens = flat[0:r]
        return cls(
            shape=shape,
            token_ids=tokens if sampled is None else resolve_placeholders(tokens, sampled),
            positions=flat[r : 2 * r],
            slot_mapping=flat[2 * r : 3 * r],
            block_tables=flat[3 * r : 3 * r + b * w].view(b, w),
            logits_rows=flat[3 * r + b * w : 3 * r + b * w + b],
        )


def resolve_placeholders(token_ids: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """Token ids with each placeholder ``-(i + 1)`` replaced by ``sampled[i]``, on the device: a
    step launched before the previous one's ids reached the host feeds them in without waiting."""
    rows = (-1 - token_ids).clamp_(min=0)
    return torch.where(token_ids >= 0, token_ids, sampled.index_select(0, rows))


@dataclass(frozen=True)
class UniformChunk:
    """One sequence's share of a uniform step: ``token_ids`` at positions ``start..``."""

    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int]


def pack_uniform(
    shape: StepShape, chunks: Sequence[UniformChunk], block_size: int, scratch_block: int, out: np.ndarray
) -> None:
    """Write the step's inputs into ``out[: flat_len(shape)]`` (see :meth:`UniformBatch.from_flat`)."""
    q, w, r, b = shape.query, shape.width_blocks, shape.rows, shape.batch
    scratch_slot = scratch_block * block_size
    n_flat = flat_len(shape)
    view = out[:n_flat]
    tokens, positions, slots = view[0:r], view[r : 2 * r], view[2 * r : 3 * r]
    tables = view[3 * r : 3 * r + b * w].reshape(b, w)
    rows = view[3 * r + b * w :]
    # Padding first (whole buffer), then each real sequence over its part.
    tokens.fill(0)
    positions.fill(0)
    slots.fill(scratch_slot)
    tables.fill(scratch_block)
    rows[:] = np.arange(b, dtype=np.int64) * q
    for i, c in enumerate(chunks):
        n = len(c.token_ids)
        base = i * q
        table = c.block_table
        if n == 1:  # a decode: scalar arithmetic is cheaper than numpy for one row
            p = c.start
            tokens[base] = c.token_ids[0]
            positions[base] = p
            slots[base] = table[p // block_size] * block_size + p % block_size
        else:
            pos = np.arange(c.start, c.start + n, dtype=np.int64)
            tokens[base : base + n] = c.token_ids
            positions[base : base + n] = pos
            slots[base : base + n] = (
                np.asarray(table, dtype=np.int64)[pos // block_size] * block_size + pos % block_size
            )
        k = min(len(table), w)
        tables[i, :k] = table[:k]
        rows[i] = base + n - 1


def causal_mask(batch: UniformBatch, group: int, block_size: int) -> torch.Tensor:
    """``[B, 1, Q*G, ctx]``, True = attend: query row (i, g) sits at ``positions[i]`` and sees keys
    ``0..positions[i]``. Built once per step on the device, shared by every layer."""
    b, qn, w = batch.shape.batch, batch.shape.query, batch.shape.width_blocks
    ctx = w * block_size
    qpos = batch.positions.view(b, qn, 1).expand(b, qn, group).reshape(b, 1, qn * group, 1)
    keys = torch.arange(ctx, device=qpos.device).view(1, 1, 1, ctx)
    return keys <= qpos


def block_table_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    batch: UniformBatch,
    block_size: int,
    mask: torch.Tensor,
) -> torch.Tensor:
    """Write the step's K/V into the pool, then attend each sequence over its block table.

    q: ``[rows, H, D]``; k, v: ``[rows, KVH, D]``; pools: ``[slots, KVH, D]``. Returns
    ``[rows, H * D]``; ``mask`` is :func:`causal_mask`. Grouped-query heads are folded into the
    query axis (``[B, KVH, Q*G, D]``), so K/V are read once per KV head, never repeated per head.
    """
    k_pool.index_copy_(0, batch.slot_mapping, k)
    v_pool.index_copy_(0, batch.slot_mapping, v)
    b, qn, w = batch.shape.batch, batch.shape.query, batch.shape.width_blocks
    rows, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    ctx = w * block_size
    blocks_k = k_pool.view(-1, block_size, kv_heads, head_dim)[batch.block_tables]  # [B, W, bs, KVH, D]
    blocks_v = v_pool.view(-1, block_size, kv_heads, head_dim)[batch.block_tables]
    kt = blocks_k.view(b, ctx, kv_heads, head_dim).transpose(1, 2)  # [B, KVH, ctx, D]
    vt = blocks_v.view(b, ctx, kv_heads, head_dim).transpose(1, 2)
    qg = q.view(b, qn, kv_heads, group, head_dim).permute(0, 2, 1, 3, 4).reshape(b, kv_heads, qn * group, head_dim)
    out = F.scaled_dot_product_attention(qg, kt, vt, attn_mask=mask)  # [B, KVH, Q*G, D]
    return out.view(b, kv_heads, qn, group, head_dim).permute(0, 2, 1, 3, 4).reshape(rows, heads * head_dim)
