"""Device selection: auto takes CUDA when present; asking for CUDA without one is a clear error.
The CUDA run itself is a `gpu` test (skipped with its reason where no GPU is visible)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfleet.engine.device import resolve_device, resolve_dtype
from kvfleet.engine.errors import DeviceUnavailableError
from kvfleet.engine.request import EngineRequest
from kvfleet.engine.sampling import SamplingParams

from .conftest import make_core, run_to_completion


def test_auto_picks_cuda_only_when_present() -> None:
    assert resolve_device("auto", cuda_available=True) == torch.device("cuda", 0)
    assert resolve_device("auto", cuda_available=False) == torch.device("cpu")
    assert resolve_device("cpu", cuda_available=True) == torch.device("cpu")
    with pytest.raises(DeviceUnavailableError, match="no CUDA device"):
        resolve_device("cuda", cuda_available=False)


def test_dtype_defaults() -> None:
    assert resolve_dtype("auto", torch.device("cpu"), "bfloat16") is torch.float32
    assert resolve_dtype("auto", torch.device("cuda", 0), "float16") is torch.float16
    assert resolve_dtype("auto", torch.device("cuda", 0), "float32") is torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu"), "float32") is torch.float16


@pytest.mark.gpu
def test_cuda_engine_matches_cpu_engine(tiny_model_dir: Path) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = {f"r{i}": list(range(10 + i, 40 + 3 * i)) for i in range(4)}
    cpu = run_to_completion(make_core(tiny_model_dir, device="cpu"), prompts, params)
    gpu = run_to_completion(make_core(tiny_model_dir, device="cuda", dtype="float32"), prompts, params)
    assert gpu == cpu


@pytest.mark.gpu
def test_cuda_graphs_replay_the_uncaptured_outputs_and_a_decode_step_syncs_once(tiny_model_dir: Path) -> None:
    import warnings

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = {f"r{i}": list(range(10 + i, 40 + 5 * i)) for i in range(5)}
    eager = make_core(tiny_model_dir, device="cuda", dtype="bfloat16", compile="off", cuda_graphs=False)
    graphed = make_core(tiny_model_dir, device="cuda", dtype="bfloat16", compile="off")
    one_at_a_time = make_core(tiny_model_dir, device="cuda", dtype="bfloat16", compile="off", async_scheduling="off")
    assert graphed.overlap and not one_at_a_time.overlap, "overlapped steps are CUDA's default"
    expected = run_to_completion(eager, prompts, params)
    assert run_to_completion(graphed, prompts, params) == expected
    assert run_to_completion(one_at_a_time, prompts, params) == expected
    graphs = graphed.runner.graphs
    assert graphs is not None and graphs.shapes, "uniform steps were captured"
    captured = list(graphs.shapes)

    # Steady decodes of buckets already met: replays only, and no synchronizing call but the one
    # copy of the sampled ids (torch's sync debug mode warns on every implicit sync). Overlapped, a
    # call copies the ids of the step it launches and waits for those of the one before.
    # New prompts of the same lengths (no prefix hits): the same buckets as the first round.
    for i, prompt in enumerate(prompts.values()):
        graphed.add_request(EngineRequest(f"again-{i}", [t + 400 for t in prompt], params, 0.0))
    s = graphed.scheduler
    while s.waiting or any(seq.num_output_tokens == 0 for seq in s.running):
        graphed.step()  # prefills (variable-length steps) until every sequence decodes
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            copies = []
            while graphed.has_work():
                before = graphed.runner.host_copies
                graphed.step()
                copies.append((graphed.runner.host_copies - before, graphed.step_in_flight))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(copies) >= 10 and all(n == (1 if launched else 0) for n, launched in copies), copies
    assert [str(w.message) for w in caught if "synchroniz" in str(w.message)] == []
    assert graphs.shapes == captured, "the same buckets replayed; nothing new captured"


@pytest.mark.gpu
def test_triton_decode_kernel_on_cuda_matches_gather_and_captures(tiny_model_dir: Path) -> None:
    from kvfleet.engine.block_table_attention import block_table_attention, causal_mask
    from kvfleet.engine.model import _triton_decode

    from .test_paged_decode_triton import _decode_step

    for lengths, bucket, width, kv_heads, group, dim in [([37], 1, 5, 4, 2, 256), ([5, 577, 100], 4, 40, 2, 4, 128)]:
        step = _decode_step(lengths, bucket, width, kv_heads, group, dim, 16, torch.bfloat16)
        q, k, v, kp, vp = (t.cuda() for t in step[:5])
        batch = type(step[5])(step[5].shape, *(getattr(step[5], f).cuda() for f in _BATCH_FIELDS))
        expected = block_table_attention(q, k, v, kp.clone(), vp.clone(), batch, 16, causal_mask(batch, group, 16))
        got = _triton_decode(q, k, v, kp, vp, batch, 16)
        n = len(lengths)
        torch.testing.assert_close(got[:n].float(), expected[:n].float(), rtol=2e-2, atol=2e-2)

    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = {f"r{i}": list(range(10 + i, 40 + 5 * i)) for i in range(5)}
    kernel = make_core(tiny_model_dir, device="cuda", dtype="float32", compile="off")
    gather = make_core(tiny_model_dir, device="cuda", dtype="float32", compile="off", decode_attention="gather")
    assert kernel.runner.model.decode_attention_triton, "the kernel is CUDA's default where triton imports"
    assert run_to_completion(kernel, prompts, params) == run_to_completion(gather, prompts, params)
    graphs = kernel.runner.graphs
    assert graphs is not None and graphs.shapes and graphs.disabled_reason is None, "decode steps were captured"


_BATCH_FIELDS = ("token_ids", "positions", "slot_mapping", "block_tables", "logits_rows")
