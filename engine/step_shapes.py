"""The fixed shapes a step runs in: pure functions of what the scheduler chose.

A step whose chunks are all short (decodes, and small prefill chunks such as the tail after a
prefix hit) runs as a uniform ``[batch, query, width]`` block: ``batch`` sequences, each with
``query`` new-token rows and a block table of ``width`` blocks, every dimension rounded up to a
bucket. Each bucket is planned (and on CUDA captured as a graph) once; a step only picks one.
Steps with a longer prefill chunk run the variable-length path (``paged_attention.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

# Query rows per sequence in a uniform step: 1 (decode) or up to one block of new tokens, so a
# prefix hit's recomputed tail (at most one block) also replays a graph. Longer chunks are
# prefill work, compute-bound, and run the variable-length path.
QUERY_BUCKETS = (1, 16)
# Uniform steps with more rows than this run the variable-length path: a graph for every batch
# bucket at 16 query rows would hold 16x the activations of the decode graphs.
MAX_UNIFORM_ROWS = 256


@dataclass(frozen=True, order=True)
class StepShape:
    """A uniform step's bucket: padded sequences, query rows per sequence, block-table width."""

    batch: int
    query: int
    width_blocks: int

    @property
    def rows(self) -> int:
        return self.batch * self.query


def pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def batch_bucket(num_seqs: int, max_num_seqs: int) -> int:
    """Powers of two, capped at ``max_num_seqs`` (the largest batch the scheduler can make)."""
    return min(pow2_at_least(num_seqs), max_num_seqs)


def width_bucket(blocks: int, max_blocks: int) -> int:
    """Four widths per doubling (1..4, 5, 6, 7, 8, 10, 12, 14, 16, 20, ...), capped at the blocks of
    the longest sequence the engine admits: the number of widths grows with log2 of the context, not
    with every step's context length, and attention reads at most a quarter more than it needs
    (powers of two alone measured up to 2x slower attention on CPU)."""
    if blocks <= 4:
        return min(max(blocks, 1), max_blocks)
    step = pow2_at_least(blocks) // 8  # a quarter of the octave below
    return min(-(-blocks // step) * step, max_blocks)


def query_bucket(max_chunk_tokens: int) -> int | None:
    for q in QUERY_BUCKETS:
        if max_chunk_tokens <= q:
            return q
    return None


def uniform_shape(
    chunk_tokens: list[int],
    table_blocks: list[int],
    *,
    max_num_seqs: int,
    max_blocks: int,
) -> StepShape | None:
    """The bucket a step runs in, or None when it needs the variable-length path (a chunk longer
    than the largest query bucket, or more rows than ``MAX_UNIFORM_ROWS``).

    ``chunk_tokens``: new tokens per sequence this step; ``table_blocks``: blocks each sequence's
    attention reads (its context after this step, in blocks).
    """
    if not chunk_tokens:
        return None
    query = query_bucket(max(chunk_tokens))
    if query is None:
        return None
    shape = StepShape(
        batch_bucket(len(chunk_tokens), max_num_seqs),
        query,
        width_bucket(max(table_blocks), max_blocks),
    )
    return shape if shape.rows <= MAX_UNIFORM_ROWS else None
