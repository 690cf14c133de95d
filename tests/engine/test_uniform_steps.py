"""Uniform steps: bucketed shapes, attention through fixed-width block tables, one host copy per step.

What a GPU needs (each shape planned once, so it can be captured as a graph; one sync per step) is
checked here on CPU: the forward's op shapes over a long mixed workload are counted, and every
read of a tensor back into Python during a step is counted."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvfleet.engine.block_table_attention import (
    UniformBatch,
    UniformChunk,
    block_table_attention,
    causal_mask,
    flat_len,
    pack_uniform,
)
from kvfleet.engine.engine_core import EngineCore
from kvfleet.engine.paged_attention import ForwardBatch, decode_group, paged_attention, prefill_group, slot_table
from kvfleet.engine.request import EngineRequest
from kvfleet.engine.sampling import SamplingParams
from kvfleet.engine.step_shapes import StepShape, batch_bucket, uniform_shape, width_bucket

from .conftest import make_core


def test_buckets_are_powers_of_two_capped_by_what_the_engine_admits() -> None:
    assert [batch_bucket(n, 64) for n in (1, 2, 3, 5, 17, 64)] == [1, 2, 4, 8, 32, 64]
    assert batch_bucket(40, 48) == 48
    assert [width_bucket(n, 128) for n in (1, 3, 5, 9, 33, 37, 41, 128)] == [1, 3, 5, 10, 40, 40, 48, 128]
    assert width_bucket(100, 80) == 80
    assert len({width_bucket(n, 4096) for n in range(1, 4097)}) == 4 + 4 * 10, "four widths per doubling"
    # Decodes: query 1; a short chunk (a prefix hit's tail): query 16; a long chunk: variable length.
    assert uniform_shape([1, 1, 1], [2, 5, 3], max_num_seqs=64, max_blocks=128) == StepShape(4, 1, 5)
    assert uniform_shape([1, 16], [3, 64], max_num_seqs=64, max_blocks=128) == StepShape(2, 16, 64)
    assert uniform_shape([1, 17], [3, 64], max_num_seqs=64, max_blocks=128) is None
    assert uniform_shape([4] * 32, [1] * 32, max_num_seqs=64, max_blocks=128) is None  # 32 x 16 rows > 256
    assert uniform_shape([], [], max_num_seqs=64, max_blocks=128) is None


def test_pack_uniform_pads_into_the_scratch_block() -> None:
    shape = StepShape(batch=4, query=1, width_blocks=2)
    out = np.full(flat_len(shape) + 3, -7, dtype=np.int64)
    chunks = [UniformChunk([11], 5, [3, 9]), UniformChunk([12], 0, [4])]
    pack_uniform(shape, chunks, block_size=4, scratch_block=99, out=out)
    batch = UniformBatch.from_flat(shape, torch.from_numpy(out))
    assert batch.token_ids.tolist() == [11, 12, 0, 0]
    assert batch.positions.tolist() == [5, 0, 0, 0]
    # Position 5 is slot 1 of block 9: 9 * 4 + 1; padding rows write to the scratch block.
    assert batch.slot_mapping.tolist() == [37, 16, 396, 396]
    assert batch.block_tables.tolist() == [[3, 9], [4, 99], [99, 99], [99, 99]]
    assert batch.logits_rows.tolist() == [0, 1, 2, 3]
    assert out[flat_len(shape) :].tolist() == [-7, -7, -7], "nothing written past the step's inputs"

    shape = StepShape(batch=2, query=4, width_blocks=1)
    out = np.zeros(flat_len(shape), dtype=np.int64)
    pack_uniform(shape, [UniformChunk([1, 2, 3], 1, [6])], block_size=4, scratch_block=9, out=out)
    batch = UniformBatch.from_flat(shape, torch.from_numpy(out))
    assert batch.positions.tolist() == [1, 2, 3, 0, 0, 0, 0, 0]
    assert batch.slot_mapping.tolist() == [25, 26, 27, 36, 36, 36, 36, 36]
    assert batch.logits_rows.tolist() == [2, 4], "each sequence samples its last real row"


def test_block_table_attention_matches_the_variable_length_path() -> None:
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, bs, blocks = 8, 2, 16, 4, 40
    contexts = [(9, 1), (3, 1), (14, 3)]  # (tokens already cached, new tokens) per sequence
    rng = random.Random(3)
    free = list(range(blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(s + n) // bs))] for s, n in contexts]

    def pools() -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        shape = ((blocks + 1) * bs, kv_heads, dim)
        return torch.randn(shape, generator=g), torch.randn(shape, generator=g)

    rows = sum(n for _, n in contexts)
    q = torch.randn(rows, heads, dim, generator=gen)
    k = torch.randn(rows, kv_heads, dim, generator=gen)
    v = torch.randn(rows, kv_heads, dim, generator=gen)

    # The variable-length path: decodes as one group, then the 3-token chunk on its own.
    slots = slot_table(tables, bs)
    slot_rows = [slots[i, s : s + n] for i, (s, n) in enumerate(contexts)]
    varlen = ForwardBatch(
        token_ids=torch.zeros(rows, dtype=torch.long),
        positions=torch.zeros(rows, dtype=torch.long),
        slot_mapping=torch.cat(slot_rows),
        groups=(
            decode_group(slice(0, 2), slots[:2], [s + n for s, n in contexts[:2]], torch.device("cpu")),
            prefill_group(slice(2, 5), slots[2], contexts[2][0], torch.device("cpu")),
        ),
        logits_rows=torch.zeros(1, dtype=torch.long),
    )
    kp, vp = pools()
    expected = paged_attention(q, k, v, kp, vp, varlen)
    expected_pool = kp.clone()

    shape = StepShape(batch=4, query=4, width_blocks=8)
    flat = np.zeros(flat_len(shape), dtype=np.int64)
    chunks = [UniformChunk([0] * n, s, t) for (s, n), t in zip(contexts, tables, strict=True)]
    pack_uniform(shape, chunks, bs, blocks, flat)
    batch = UniformBatch.from_flat(shape, torch.from_numpy(flat))
    # The same rows laid out [sequence, query]: row i*4 + j is sequence i's j-th new token.
    order = [0, 4, 8, 9, 10]
    qu, ku, vu = (torch.zeros(shape.rows, *x.shape[1:]) for x in (q, k, v))
    qu[order], ku[order], vu[order] = q, k, v
    kp, vp = pools()
    got = block_table_attention(qu, ku, vu, kp, vp, batch, bs, causal_mask(batch, heads // kv_heads, bs))
    torch.testing.assert_close(got[order], expected, rtol=1e-5, atol=1e-5)
    real_slots = torch.cat(slot_rows)
    torch.testing.assert_close(kp[real_slots], expected_pool[real_slots])
    assert torch.equal(kp[: blocks * bs], expected_pool[: blocks * bs]), "padding wrote only the scratch block"


class ShapeRecorder(TorchDispatchMode):
    """Every aten op's name and input shapes while active: a forward's shape signature."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[Any, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        shapes = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args)
        self.ops.append((str(func), shapes))
        return func(*args, **(kwargs or {}))


class HostReads(TorchDispatchMode):
    """Counts reads of a tensor's value into Python (``.item()``, ``int(t)``, ``bool(t)``): each is a
    device-to-host sync on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _add(core: EngineCore, request_id: str, prompt: list[int], max_tokens: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    core.add_request(EngineRequest(request_id, prompt, params, time.monotonic()))


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_a_thousand_mixed_steps_meet_only_as_many_forward_shapes_as_buckets(
    tiny_model_dir: Path, async_scheduling: str
) -> None:
    # Requests arrive at random while others decode: steps mix decodes, prefix-hit tails and long
    # prefill chunks; batch sizes and context lengths change nearly every step. Overlapped, the
    # placeholder tokens are filled on the device inside the same fixed shapes.
    core = make_core(
        tiny_model_dir,
        max_num_batched_tokens=64,
        max_num_seqs=16,
        num_kv_blocks=512,
        torch_threads=1,
        async_scheduling=async_scheduling,
    )
    rng = random.Random(11)
    shared = [rng.randrange(3, 1000) for _ in range(48)]
    recorded: dict[StepShape, set[tuple[Any, ...]]] = {}
    original = core.runner.forward_uniform

    def observed(shape: StepShape, chunks: Any) -> torch.Tensor:
        with ShapeRecorder() as rec:
            logits = original(shape, chunks)
        recorded.setdefault(shape, set()).add(tuple(rec.ops))
        return logits

    core.runner.forward_uniform = observed  # type: ignore[method-assign]
    steps, n = 0, 0
    while steps < 1000:
        if rng.random() < 0.08 and core.num_requests < 16:
            prompt = shared + [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 20))]
            if rng.random() < 0.5:
                prompt = [rng.randrange(3, 1000) for _ in range(rng.randrange(2, 90))]
            _add(core, f"r{n}", prompt, rng.randrange(4, 60))
            n += 1
        if core.has_work():
            core.step()
        steps += 1
    runner = core.runner
    assert runner.uniform_steps > 700 and runner.varlen_steps > 20, (runner.uniform_steps, runner.varlen_steps)
    assert len(recorded) >= 8, f"the workload meets several buckets: {sorted(recorded)}"
    assert any(s.query == 16 for s in recorded), "prefix-hit tails ran as uniform steps"
    for shape, signatures in recorded.items():
        assert len(signatures) == 1, f"{shape}: {len(signatures)} distinct forward shapes, one expected"
    attention_shapes = {
        tuple(shapes) for sigs in recorded.values() for sig in sigs for name, shapes in sig if "scaled_dot" in name
    }
    assert len(attention_shapes) == len(recorded), "one attention shape per bucket met"


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_a_step_reads_back_only_its_sampled_ids_once(tiny_model_dir: Path, async_scheduling: str) -> None:
    core = make_core(tiny_model_dir, async_scheduling=async_scheduling)
    for i in range(6):
        _add(core, f"g{i}", list(range(10 + i, 30 + 2 * i)), 8)
    hot = SamplingParams(max_tokens=8, temperature=0.9, top_k=20, top_p=0.9, seed=5, ignore_eos=True)
    core.add_request(EngineRequest("hot", list(range(50, 60)), hot, time.monotonic()))
    uniform = 0
    while core.has_work():
        before = core.runner.host_copies
        uniform_before = core.runner.uniform_steps
        with HostReads() as reads:
            outputs = core.step()
        assert reads.count == 0, "nothing in a step reads a tensor's value back one element at a time"
        # Overlapped, a call collects the previous launch's ids and copies its own launch's.
        sampled_now = core.step_in_flight if core.overlap else bool(outputs)
        assert core.runner.host_copies - before == (1 if sampled_now else 0)
        uniform += core.runner.uniform_steps - uniform_before
    assert uniform >= 7, "the decodes ran as uniform steps"


def test_sampled_requests_stay_reproducible_on_the_uniform_path(tiny_model_dir: Path) -> None:
    hot = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95, seed=42, ignore_eos=True)
    runs = []
    for others in (0, 5):  # alone, and batched with greedy neighbours in other buckets
        core = make_core(tiny_model_dir)
        core.add_request(EngineRequest("hot", list(range(70, 90)), hot, 0.0))
        for i in range(others):
            _add(core, f"n{i}", list(range(5 + i, 25)), 10)
        got: list[int] = []
        while core.has_work():
            for out in core.step():
                if out.request_id == "hot":
                    got.extend(out.new_token_ids)
        runs.append(got)
    assert runs[0] == runs[1] and len(runs[0]) == 10
