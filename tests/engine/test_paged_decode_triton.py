"""The Triton paged-decode kernel against the gather + SDPA path, on CPU through Triton's interpreter.

Triton picks its interpreter when its own library functions are jitted, at import, so the kernel
tests run in a child pytest with ``TRITON_INTERPRET=1`` set before anything imports triton
(:func:`test_kernel_tests_under_the_interpreter`); in this process they are skipped.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvfleet.engine import paged_decode_triton
from kvfleet.engine.block_table_attention import (
    UniformBatch,
    UniformChunk,
    block_table_attention,
    causal_mask,
    flat_len,
    pack_uniform,
)
from kvfleet.engine.model import _triton_decode
from kvfleet.engine.sampling import SamplingParams
from kvfleet.engine.settings import EngineSettings
from kvfleet.engine.step_shapes import StepShape

from .conftest import make_core, run_to_completion

pytestmark = pytest.mark.skipif(
    not paged_decode_triton.available(), reason=f"triton not importable: {paged_decode_triton.TRITON_IMPORT_ERROR}"
)


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_TESTS = 8  # the tests below that need the interpreter (6 cases, bfloat16, the engine)


@pytest.fixture
def interpreter() -> None:
    if not INTERPRETED:
        pytest.skip("runs in the child started by test_kernel_tests_under_the_interpreter")


@pytest.mark.skipif(INTERPRETED, reason="this is the child")
def test_kernel_tests_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", __file__, "-k", "not the_interpreter"]
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    summary = run.stdout.strip().splitlines()[-1]
    assert f"{KERNEL_TESTS + 2} passed" in summary and "skipped" not in summary, summary


def _decode_step(
    lengths: list[int], bucket: int, width: int, kv_heads: int, group: int, dim: int, bs: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, UniformBatch]:
    """A decode step of ``len(lengths)`` sequences (each with ``length - 1`` tokens cached) padded to
    ``bucket`` sequences and ``width`` table columns, over a pool with random K/V and shuffled blocks."""
    gen = torch.Generator().manual_seed(sum(lengths) + bucket + dim)
    blocks = bucket * width + 2
    free = list(range(blocks))
    random.Random(len(lengths)).shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lengths]
    shape = StepShape(batch=bucket, query=1, width_blocks=width)
    flat = np.zeros(flat_len(shape), dtype=np.int64)
    chunks = [UniformChunk([0], n - 1, t) for n, t in zip(lengths, tables, strict=True)]
    pack_uniform(shape, chunks, bs, blocks, flat)
    batch = UniformBatch.from_flat(shape, torch.from_numpy(flat))
    pool_shape = ((blocks + 1) * bs, kv_heads, dim)
    kp = torch.randn(pool_shape, generator=gen).to(dtype)
    vp = torch.randn(pool_shape, generator=gen).to(dtype)
    heads = kv_heads * group
    q, k, v = (torch.randn(bucket, h, dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
    return q, k, v, kp, vp, batch


@pytest.mark.parametrize(
    ("lengths", "bucket", "width", "kv_heads", "group", "dim", "bs"),
    [
        ([1], 1, 1, 1, 1, 16, 16),  # the first decode: one key
        ([37], 1, 5, 2, 2, 32, 16),  # batch 1, 3 blocks of a 5-wide bucket, split-K over the table
        ([5, 64, 100, 17], 4, 8, 2, 4, 32, 16),  # a full block (64), GQA 4
        ([9, 3, 40], 4, 12, 4, 1, 24, 4),  # no GQA, head_dim not a power of two, a padded sequence
        ([33, 70, 2, 129, 81], 8, 10, 1, 8, 16, 16),  # multi-query (one KV head), three padded rows
        ([23, 6], 2, 4, 2, 2, 16, 6),  # block size not a power of two
    ],
)
def test_kernel_matches_gather_and_sdpa(
    interpreter: None,
    lengths: list[int],
    bucket: int,
    width: int,
    kv_heads: int,
    group: int,
    dim: int,
    bs: int,
) -> None:
    q, k, v, kp, vp, batch = _decode_step(lengths, bucket, width, kv_heads, group, dim, bs, torch.float32)
    kp2, vp2 = kp.clone(), vp.clone()
    expected = block_table_attention(q, k, v, kp, vp, batch, bs, causal_mask(batch, group, bs))
    got = _triton_decode(q, k, v, kp2, vp2, batch, bs)
    n = len(lengths)
    torch.testing.assert_close(got[:n], expected[:n], rtol=1e-5, atol=1e-5)
    assert torch.equal(kp2, kp) and torch.equal(vp2, vp), "both write the step's K/V to the same slots"
    assert torch.isfinite(got).all(), "padded sequences stay finite too"


def test_kernel_in_bfloat16(interpreter: None) -> None:
    q, k, v, kp, vp, batch = _decode_step([50, 7], 2, 6, 2, 2, 32, 16, torch.bfloat16)
    kp2, vp2 = kp.clone(), vp.clone()
    expected = block_table_attention(q, k, v, kp, vp, batch, 16, causal_mask(batch, 2, 16))
    got = _triton_decode(q, k, v, kp2, vp2, batch, 16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_splits_follow_the_bucket_only() -> None:
    assert paged_decode_triton.num_splits(1, 4, 36) == 9  # small batch: the table split across programs
    assert paged_decode_triton.num_splits(1, 4, 128) == paged_decode_triton.MAX_SPLITS
    assert paged_decode_triton.num_splits(32, 4, 36) == 3
    assert paged_decode_triton.num_splits(64, 8, 128) == 1  # enough programs already
    assert paged_decode_triton.num_splits(1, 1, 2) == 1  # too little work to split


def test_decode_attention_setting() -> None:
    assert EngineSettings().decode_attention_triton("cuda", triton_available=True)
    assert not EngineSettings().decode_attention_triton("cuda", triton_available=False)
    assert not EngineSettings().decode_attention_triton("cpu", triton_available=True)
    assert not EngineSettings(decode_attention="gather").decode_attention_triton("cuda", triton_available=True)
    with pytest.raises(ValueError, match="decode_attention"):
        EngineSettings(decode_attention="triton").decode_attention_triton("cuda", triton_available=False)
    with pytest.raises(ValueError, match="decode_attention"):
        EngineSettings(decode_attention="flash")  # type: ignore[arg-type]


def test_an_engine_on_the_kernel_generates_what_the_gather_engine_does(interpreter: None, tiny_model_dir: Path) -> None:
    prompts = {"a": [5, 9, 33, 2, 7, 61, 8, 19, 40, 3, 77, 12, 6, 90, 4, 21, 15], "b": [11, 300, 4]}
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    gather = make_core(tiny_model_dir, decode_attention="gather")
    kernel = make_core(tiny_model_dir, decode_attention="triton")
    assert kernel.runner.model.decode_attention_triton and not gather.runner.model.decode_attention_triton
    assert run_to_completion(kernel, prompts, greedy) == run_to_completion(gather, prompts, greedy)
    assert kernel.runner.uniform_steps >= 4
