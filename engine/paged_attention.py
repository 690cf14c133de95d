"""Attention over a paged KV cache: the variable-length path (steps with a long prefill chunk).

The cache is one preallocated pool per layer of ``num_blocks * block_size`` slots (plus one scratch
block, see ``block_table_attention.py``). A sequence's K/V live in the slots its block table names;
attention gathers them with ``index_select`` and never keeps a per-sequence contiguous copy. A
step's tokens are laid out flat: the decodes first (one token each, attended as one batch), then
each prefill chunk (attended on its own). Decodes and short chunks alone take the uniform path
(``block_table_attention.py``), whose shapes do not change every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionGroup:
    """Queries ``rows`` of the flat batch, shaped ``[batch, q_len]``, attending ``context_slots``
    (``[batch * ctx_len]`` pool slots) under ``mask`` (``[batch, 1, q_len, ctx_len]``, True =
    attend; None when no masking is needed)."""

    rows: slice
    batch: int
    q_len: int
    ctx_len: int
    context_slots: torch.Tensor
    mask: torch.Tensor | None
    is_causal: bool


@dataclass(frozen=True)
class ForwardBatch:
    """Everything one model forward needs, already on the model's device."""

    token_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long: the pool slot each token's K/V is written to
    groups: tuple[AttentionGroup, ...]
    logits_rows: torch.Tensor  # [S] long: rows whose next-token logits are wanted


def slot_table(block_tables: list[list[int]], block_size: int) -> torch.Tensor:
    """``[batch, max_blocks * block_size]`` pool slots of every position of each block table
    (short tables are padded with block 0; callers mask or slice the padding away)."""
    width = max(len(t) for t in block_tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long)
    return (padded[:, :, None] * block_size + torch.arange(block_size)).view(len(block_tables), -1)


def decode_group(rows: slice, slots: torch.Tensor, ctx_lens: list[int], device: torch.device) -> AttentionGroup:
    """One query per sequence, each attending its whole context (right-padded to the longest).
    ``slots`` is :func:`slot_table` of the sequences' block tables."""
    ctx_len = max(ctx_lens)
    mask = None
    if min(ctx_lens) != ctx_len:
        keys = torch.arange(ctx_len)[None, :]
        mask = (keys < torch.tensor(ctx_lens)[:, None]).view(len(ctx_lens), 1, 1, ctx_len).to(device)
    return AttentionGroup(
        rows=rows,
        batch=len(ctx_lens),
        q_len=1,
        ctx_len=ctx_len,
        context_slots=slots[:, :ctx_len].reshape(-1).to(device),
        mask=mask,
        is_causal=False,
    )


def prefill_group(rows: slice, slots: torch.Tensor, num_cached: int, device: torch.device) -> AttentionGroup:
    """A chunk of new tokens after ``num_cached`` tokens already in the pool; ``slots`` are the
    sequence's pool slots by position (one row of :func:`slot_table`)."""
    q_len = rows.stop - rows.start
    ctx_len = num_cached + q_len
    mask = None
    if num_cached:
        # Query i sits at position num_cached + i and sees keys 0 .. num_cached + i.
        keys = torch.arange(ctx_len)[None, :]
        queries = torch.arange(q_len)[:, None] + num_cached
        mask = (keys <= queries).view(1, 1, q_len, ctx_len).to(device)
    return AttentionGroup(
        rows=rows,
        batch=1,
        q_len=q_len,
        ctx_len=ctx_len,
        context_slots=slots[:ctx_len].to(device),
        mask=mask,
        is_causal=num_cached == 0 and q_len > 1,
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    batch: ForwardBatch,
) -> torch.Tensor:
    """Write this step's K/V into the pool, then attend every group through its slots.

    q: ``[T, H, D]``; k, v: ``[T, KVH, D]``; pools: ``[slots, KVH, D]``. Returns ``[T, H * D]``.
    """
    k_pool.index_copy_(0, batch.slot_mapping, k)
    v_pool.index_copy_(0, batch.slot_mapping, v)
    num_tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    out = torch.empty(num_tokens, heads * head_dim, dtype=q.dtype, device=q.device)
    for g in batch.groups:
        qg = q[g.rows].view(g.batch, g.q_len, heads, head_dim).transpose(1, 2)
        kg = k_pool.index_select(0, g.context_slots).view(g.batch, g.ctx_len, kv_heads, head_dim).transpose(1, 2)
        vg = v_pool.index_select(0, g.context_slots).view(g.batch, g.ctx_len, kv_heads, head_dim).transpose(1, 2)
        og = F.scaled_dot_product_attention(
            qg, kg, vg, attn_mask=g.mask, is_causal=g.is_causal, enable_gqa=heads != kv_heads
        )
        out[g.rows] = og.transpose(1, 2).reshape(g.batch * g.q_len, heads * head_dim)
    return out
