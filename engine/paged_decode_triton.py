"""Decode attention that reads the paged KV pool where it lies: a Triton kernel (split-K).

A uniform decode step (one query row per sequence, ``block_table_attention.py``) otherwise gathers
every sequence's whole context out of the pool by block table before one SDPA call: a copy of the
context per layer per step. This kernel instead walks each sequence's block table and reads each
K/V block in place, with an online softmax (FlashAttention's running max and sum), as vLLM's and
SGLang's paged decode kernels do.

Grid: one program per (sequence, KV head, split). A program computes the ``group`` query heads
that share its KV head (grouped-query attention: each K/V block is read once for all of them)
over its split's share of the table's blocks, and writes a partial (running max, sum, weighted
values); a few torch ops merge the splits. Splits keep a small batch from running on a handful of
the GPU's SMs. The grid and every shape follow from the step's bucket alone, and nothing is read
back to the host, so the call is captured in the step's CUDA graph.

Tests run the kernel on CPU through Triton's interpreter (``TRITON_INTERPRET=1``); the kernel is
jitted on first use, so the variable is read then, not at import.
"""

import functools
import math
from typing import Any

import torch

try:  # triton ships with CUDA torch wheels; the engine runs without it (CPU-only installs)
    import triton
    import triton.language as tl

    TRITON_IMPORT_ERROR: str | None = None
except ImportError as e:  # pragma: no cover - depends on the install
    triton = None
    tl = None
    TRITON_IMPORT_ERROR = str(e)

# Work per program: at least this many KV blocks per split, and enough programs to fill the GPU.
MIN_BLOCKS_PER_SPLIT = 4
TARGET_PROGRAMS = 264  # about two per SM of an H100/H200 (132 SMs)
MAX_SPLITS = 16


def available() -> bool:
    return triton is not None


def num_splits(batch: int, kv_heads: int, width_blocks: int) -> int:
    """Splits of each sequence's block table: a pure function of the bucket, so fixed per graph."""
    want = -(-TARGET_PROGRAMS // (batch * kv_heads))
    by_work = max(1, width_blocks // MIN_BLOCKS_PER_SPLIT)
    return max(1, min(want, by_work, MAX_SPLITS))


if triton is not None:
    # Defined only where triton imports (its annotations name tl.constexpr).
    def _kernel_source(  # type: ignore[no-untyped-def]  # triton reads annotations: constexpr only
        q_ptr,  # [B, H, D]
        k_pool_ptr,  # [slots, KVH, D]
        v_pool_ptr,
        tables_ptr,  # [B, W] int64
        positions_ptr,  # [B] int64: the query's position; it attends keys 0..position
        m_ptr,  # [B, H, S] float32
        l_ptr,  # [B, H, S] float32
        acc_ptr,  # [B, H, S, D] float32
        scale_log2,  # softmax scale times log2(e)
        width_blocks,
        blocks_per_split,
        KV_HEADS: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_PAD: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        s = tl.program_id(2)
        heads = KV_HEADS * GROUP
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM_PAD)
        t = tl.arange(0, BLOCK_PAD)
        t_ok = t < BLOCK_SIZE
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        head = kvh * GROUP + g  # [G]
        q = tl.load(
            q_ptr + (b * heads + head)[:, None] * HEAD_DIM + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0
        ).to(tl.float32)  # [G, D]
        length = tl.load(positions_ptr + b) + 1
        n_blocks = tl.minimum((length + BLOCK_SIZE - 1) // BLOCK_SIZE, width_blocks)
        start = s * blocks_per_split
        end = tl.minimum(start + blocks_per_split, n_blocks)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
        for j in range(start, end):
            block = tl.load(tables_ptr + b * width_blocks + j)
            key_pos = j * BLOCK_SIZE + t  # [T]
            rows = (block * BLOCK_SIZE + t) * (KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM  # [T]
            visible = t_ok & (key_pos < length)
            kv_mask = visible[:, None] & d_ok[None, :]
            k = tl.load(k_pool_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)  # [T, D]
            v = tl.load(v_pool_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale_log2  # [G, T], log2 units
            scores = tl.where(visible[None, :], scores, float("-inf"))
            # Block j < n_blocks holds at least one visible key, so m_new is finite.
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])  # [G, T]
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        part = (b * heads + head) * SPLITS + s  # [G]
        tl.store(m_ptr + part, m_i, mask=g_ok)
        tl.store(l_ptr + part, l_i, mask=g_ok)
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])


@functools.cache
def _kernel(interpret: bool) -> Any:
    # Keyed by the interpreter switch: triton.jit picks the interpreter when it decorates.
    del interpret
    assert triton is not None
    return triton.jit(_kernel_source)


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Attention of one query row per sequence over its block table, read in place.

    q: ``[B, H, D]``; pools: ``[slots, KVH, D]`` (contiguous); block_tables: ``[B, W]`` int64;
    positions: ``[B]`` int64, the query's position (keys ``0..position`` are visible). Returns
    ``[B, H * D]`` in q's dtype, as SDPA over the gathered context with a causal mask does.
    """
    if triton is None:
        raise RuntimeError(f"triton is not importable: {TRITON_IMPORT_ERROR}")
    from triton import knobs

    batch, heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    width = block_tables.shape[1]
    splits = num_splits(batch, kv_heads, width)
    per_split = -(-width // splits)
    dev = q.device
    m = torch.empty(batch, heads, splits, dtype=torch.float32, device=dev)
    lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=dev)
    acc = torch.empty(batch, heads, splits, head_dim, dtype=torch.float32, device=dev)
    _kernel(bool(knobs.runtime.interpret))[(batch, kv_heads, splits)](
        q.contiguous(),
        k_pool,
        v_pool,
        block_tables,
        positions,
        m,
        lse,
        acc,
        (1.0 / math.sqrt(head_dim)) * 1.4426950408889634,
        width,
        per_split,
        KV_HEADS=kv_heads,
        GROUP=group,
        GROUP_PAD=max(2, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_PAD=max(2, triton.next_power_of_2(block_size)),
        SPLITS=splits,
    )
    if splits == 1:
        out = acc[:, :, 0] / lse
    else:
        # Merge the splits (log2 units): a split with no visible key has m = -inf, weight 0;
        # split 0 always holds key 0, so the max is finite.
        top = m.amax(dim=2, keepdim=True)
        w = torch.exp2(m - top)  # [B, H, S]
        out = (acc * w.unsqueeze(-1)).sum(dim=2) / (lse * w).sum(dim=2, keepdim=True)
    return out.to(q.dtype).reshape(batch, heads * head_dim)
